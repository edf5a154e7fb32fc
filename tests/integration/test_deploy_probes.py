"""The probes and scrape settings in deploy/ ask the real server what it answers.

Paths come from the rendered manifests (every overlay and the KServe runtime),
the ports are mapped by role: a probe on the container's HTTP port is sent to
this server's HTTP port, one on the openai port to the OpenAI front the
supervisor started beside it, the Prometheus scrape to its metrics port.
"""

import json
import urllib.request

import pytest

from tests.test_deploy_manifests import DEPLOY, OVERLAYS, load_docs, render, server_container

PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def manifest_probes():
    """(where, probe, path, port role) for every probe in deploy/."""
    found = []
    for overlay in OVERLAYS:
        docs = render(DEPLOY / "overlays" / overlay)
        container = server_container(docs)
        roles = {p["name"]: p["name"] for p in container["ports"]}
        roles.update({p["containerPort"]: p["name"] for p in container["ports"]})
        for probe in PROBES:
            get = container[probe]["httpGet"]
            found.append((overlay, probe, get["path"], roles[get["port"]]))
    runtime = load_docs(DEPLOY / "kserve/servingruntime.yaml")[0]["spec"]["containers"][0]
    http_port = next(int(a.split("=", 1)[1]) for a in runtime["args"] if a.startswith("--http-port="))
    for probe in PROBES:
        get = runtime[probe]["httpGet"]
        found.append(("kserve", probe, get["path"], "http" if get["port"] == http_port else get["port"]))
    return found


def get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode(errors="replace")


@pytest.mark.parametrize("where, probe, path, role", manifest_probes(),
                         ids=lambda value: str(value))
def test_manifest_probe_is_answered_200_by_the_server(triton, where, probe, path, role):
    address = {"http": triton.http_url, "openai": f"127.0.0.1:{triton.openai_port}"}
    assert role in address, f"{where} {probe} probes port {role}, which has no health API"
    status, body = get(f"http://{address[role]}{path}")
    assert status == 200
    if role == "openai":
        assert json.loads(body) == {"status": "ready"}  # the front's readiness is Triton's, asked over gRPC


def test_prometheus_scrape_target_serves_the_series_the_autoscaler_uses(triton):
    deployment = next(d for d in render(DEPLOY / "overlays/cpu") if d["kind"] == "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    container = server_container([deployment])
    metrics_port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    assert int(annotations["prometheus.io/port"]) == metrics_port
    status, text = get(f"http://{triton.metrics_url}{annotations['prometheus.io/path']}")
    assert status == 200
    # deploy/monitoring/prometheus-adapter-values.yaml reads these per model.
    for series in ('nv_inference_queue_duration_us{model="classify_with_view"',
                   'nv_inference_queue_duration_us{model="classifier"',
                   'nv_inference_queue_duration_us{model="preprocess"',
                   'nv_inference_request_success{model="classify_with_view"',
                   'nv_inference_request_success{model="classifier"'):
        assert series in text, f"{series} is not exported; the HPA's custom metric would be empty"
