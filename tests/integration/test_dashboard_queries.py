"""The Grafana dashboard and the alert rules against a real Prometheus
scraping the session's real server: after traffic through the OpenAI front
(answers, streams, a refused request, an LLM fallback), every query of every
panel in deploy/monitoring/grafana/classify-describe.json returns series,
its variables list values, and every rule of
deploy/monitoring/prometheusrule.yaml evaluates without error.

Prometheus is Debian's (versions.env PROMETHEUS_DEB_VERSION), unpacked into
build/ on first use, started on a free loopback port with a 1 s scrape
interval and stopped by its PID (tools/local_prometheus.py)."""

import base64
import json
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tools import local_prometheus, prometheus_rules
from tools.debian_package import PackageUnavailable
from tools.local_prometheus import DASHBOARD, Prometheus, dashboard_panels
from tools.local_stack import NotReady

MODEL = "classify_and_describe"
# What Grafana puts in place of the dashboard's variables: every namespace and
# model ("All"), and a rate window that holds several 1 s scrapes.
VARIABLES = {"$namespace": ".*", "$model": ".*", "$__rate_interval": "1m"}
# Generous on purpose: on a loaded 2-core machine a scrape, or the stubs'
# metric flush (every 0.25 s), can be late by seconds. Each wait ends as soon
# as its condition holds.
SERIES_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def prometheus(triton, tmp_path_factory):
    try:
        server = Prometheus(tmp_path_factory.mktemp("prometheus"),
                            {"triton": triton.metrics_url, "openai-front": f"127.0.0.1:{triton.openai_port}"})
    except (NotReady, PackageUnavailable) as error:
        pytest.fail(str(error))
    try:
        yield server
    finally:
        server.stop()


def chat(triton, image, stream=False, body=None):
    body = body or {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "text", "text": f"What is it? ({uuid.uuid4().hex[:8]})"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}]}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(f"{triton.openai_base_url}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_for_series(prometheus, expr, timeout_s=SERIES_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not (result := prometheus.query(expr)) and time.monotonic() < deadline:
        time.sleep(1)
    return result


@pytest.fixture(scope="module")
def traffic(prometheus, triton, fake_llm, photos):
    """Answers and streams, a request the front refuses (400), and a
    description the LLM refuses (401: a fallback that leaves the circuit closed,
    so the session's later tests see a healthy upstream); sent twice, the
    second time after Prometheus has scraped the first: a counter that first
    shows up at 3 has no rate yet (Prometheus does not assume it began at 0)."""
    def send():
        assert [chat(triton, photos["coffee"]) for _ in range(2)] == [200] * 2
        assert [chat(triton, photos["chelsea"], stream=True) for _ in range(2)] == [200] * 2
        assert chat(triton, None, body={"model": MODEL, "messages": []}) == 400
        fake_llm.admin("mode", {"mode": "401", "count": 1})
        assert chat(triton, photos["coffee"]) == 200

    fake_llm.admin("reset", {})
    try:
        send()
        assert wait_for_series(prometheus, 'openai_front_errors_total{status="400"}')
        assert wait_for_series(prometheus, "describe_fallbacks_total")
        send()
    finally:
        fake_llm.admin("reset", {})


def dashboard_targets():
    """(panel title, expr) of every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard_panels() for target in panel["targets"]]


def substituted(expr):
    return local_prometheus.substituted(expr, VARIABLES)


def test_every_panel_query_returns_series_after_traffic(prometheus, traffic):
    targets = dashboard_targets()
    assert len(targets) >= 30
    pending = {expr: title for title, expr in targets}
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        pending = {expr: title for expr, title in pending.items() if not prometheus.query(substituted(expr))}
        if pending:
            time.sleep(1)
    assert not pending, ("panels whose query returned no series "
                         f"{SERIES_TIMEOUT_S} s after the traffic:\n" +
                         "\n".join(f"  {title}: {expr}" for expr, title in pending.items()))


def test_the_traffic_shows_where_the_dashboard_says(prometheus, traffic):
    """Values, not only series: the panels read what was sent (the second
    round of traffic, within the last minutes)."""
    exprs = {title: expr for title, expr in dashboard_targets()}

    def peak(title, label, value):
        """The highest value over the last 2 minutes of that panel's series whose `label` is
        `value`, waited for until it is above 0. Only that series: waiting for every one (a
        reason an earlier test left at rate 0 never rises) pushed the next panel's query
        past the window that holds the traffic."""
        expr = f"max_over_time(({substituted(exprs[title])})[2m:1s])"
        deadline = time.monotonic() + SERIES_TIMEOUT_S
        while True:
            found = max((float(s["value"][1]) for s in prometheus.query(expr) if s["metric"].get(label) == value),
                        default=0.0)
            if found > 0 or time.monotonic() > deadline:
                return found
            time.sleep(1)

    assert peak("Front requests by status", "status", "200") > 0
    assert peak("Front requests by status", "status", "400") > 0
    assert peak("Fallbacks by reason", "reason", "authentication_failed_http_401") > 0
    assert peak("Time to first token", "model", "classify_and_describe_stream") > 0


def test_the_dashboard_variables_list_values(prometheus, traffic):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
    assert queries["model"] == "label_values(nv_inference_request_success, model)"
    models = prometheus.api("label/model/values", **{"match[]": "nv_inference_request_success"})
    assert {"classifier", "preprocess", "describe", MODEL} <= set(models)
    # namespace is a label the Kubernetes scrape adds: none here, and "All" (.*) matches its absence.
    assert queries["namespace"] == "label_values(nv_inference_request_success, namespace)"


def test_every_alert_rule_evaluates_against_the_live_series(prometheus, traffic):
    expected = {rule["alert"] for group in prometheus_rules.rule_groups()["groups"] for rule in group["rules"]}
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while True:
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        evaluated = {r["name"]: r for r in rules if r.get("lastEvaluation", "").startswith("20")}
        if set(evaluated) >= expected or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(evaluated) == expected, f"not loaded or never evaluated: {expected - set(evaluated)}"
    broken = {name: rule.get("lastError") for name, rule in evaluated.items() if rule["health"] != "ok"}
    assert not broken, broken
