"""deploy/: every Kubernetes manifest validates against the Kubernetes schemas,
and the numbers that must agree across files do.

kustomize is not needed: `render()` below applies what our kustomizations use
(resources, images, labels, strategic-merge patches that merge lists of
objects by `name`, JSON 6902 add/replace, configMapGenerator from files). `kubectl kustomize deploy/overlays/<x>`
gives the same objects where kubectl is installed.

ServiceMonitor, PrometheusRule, ServingRuntime and InferenceService are CRDs: their schemas
are not in kubernetes-validate's core set, so they get a structural check
(apiVersion, kind, name, the fields the controllers need) instead.
"""

import copy
import json
import pathlib
import re

import kubernetes_validate
import pytest
import yaml
from tritonclient.grpc import model_config_pb2

from scripts import make_gpu_config
from tools import model_config

REPO = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes we claim to support, and the newest schema bundled.
K8S_VERSIONS = ("1.29.0", "1.33.0")
DEPLOYMENT = "classify-describe"
CONTAINER = "tritonserver"
KEY_SECRET = "classify-describe-llm-key"
ADMIN_KEY_SECRET = "classify-describe-admin-key"
OPENAI_KEY_SECRET = "classify-describe-openai-key"
PROBE_PATHS = {"live": "/v2/health/live", "ready": "/v2/health/ready"}
FRONT_READY_PATH = "/health/ready"  # openai_front: ready when Triton answers it over gRPC


# -- a small kustomize ---------------------------------------------------------

def load_docs(path):
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def strategic_merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if (isinstance(base, list) and isinstance(patch, list)
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        merged = [copy.deepcopy(x) for x in base]
        for item in patch:
            for index, existing in enumerate(merged):
                if existing["name"] == item["name"]:
                    merged[index] = strategic_merge(existing, item)
                    break
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def json6902(doc, operations):
    doc = copy.deepcopy(doc)
    for operation in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if operation["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), operation["value"])
        elif operation["op"] in ("add", "replace"):
            node[int(last) if isinstance(node, list) else last] = operation["value"]
        else:
            raise AssertionError(f"render() does not know op {operation['op']!r}")
    return doc


def matches(doc, target):
    group, _, version = doc["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(wanted[key] == value for key, value in target.items())


def render(directory):
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else load_docs(path)
    for patch in kustomization.get("patches", []):
        body = yaml.safe_load((directory / patch["path"]).read_text())
        if isinstance(body, list):  # JSON 6902
            docs = [json6902(d, body) if matches(d, patch["target"]) else d for d in docs]
        else:
            docs = [strategic_merge(d, body)
                    if (d["kind"], d["metadata"]["name"]) == (body["kind"], body["metadata"]["name"]) else d
                    for d in docs]
    for generator in kustomization.get("configMapGenerator", []):
        options = generator.get("options", {})
        assert options.get("disableNameSuffixHash"), "render() does not compute kustomize's name hash"
        data = {pathlib.Path(f).name: (directory / f).read_text() for f in generator.get("files", [])}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": generator["name"], "labels": dict(options.get("labels", {}))},
                     "data": data})
    for label in kustomization.get("labels", []):
        assert not label.get("includeSelectors") and not label.get("includeTemplates"), \
            "render() only knows metadata labels"
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in pod_spec(doc).get("containers", []) if doc["kind"] == "Deployment" else []:
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return docs


def pod_spec(doc):
    return doc["spec"]["template"]["spec"]


def by_kind(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def server_container(docs):
    containers = {c["name"]: c for c in pod_spec(by_kind(docs, "Deployment"))["containers"]}
    return containers[CONTAINER]


def flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"expected one --{name}=... in {args}"
    return values[0]


def quantity_bytes(text):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text))
    assert match, f"unreadable quantity {text!r}"
    return int(match.group(1)) * units.get(match.group(2), 1)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(DEPLOY / "overlays" / request.param)


# -- schema validation ---------------------------------------------------------

CORE_FILES = sorted(p for p in DEPLOY.rglob("*.yaml")
                    if p.name != "kustomization.yaml" and "kserve" not in p.parts
                    and "monitoring" not in p.parts)


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_rendered_overlays_validate_strictly(overlay, k8s_version):
    name, docs = overlay
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap",
                                         "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"overlay {name}: {doc['kind']}/{doc['metadata']['name']} "
                        f"is invalid for Kubernetes {k8s_version}: {error.message}")


def test_every_plain_manifest_validates_on_its_own():
    """Base files and the Secret example (not in any kustomization) too; patch files
    are partial objects and are checked through the rendered overlays instead."""
    checked = 0
    for path in CORE_FILES:
        for doc in load_docs(path):
            if isinstance(doc, list) or "overlays" in path.parts:
                continue
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
            checked += 1
    assert checked >= 6


def test_kserve_resources_are_well_formed():
    runtime = load_docs(DEPLOY / "kserve/servingruntime.yaml")[0]
    service = load_docs(DEPLOY / "kserve/inferenceservice.yaml")[0]
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] == "v2" and "v2" in runtime["spec"]["protocolVersions"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}

    # The pieces that are plain Kubernetes objects inside the CRDs validate as such:
    # the runtime's container merged with the predictor's model (lists by name, as
    # KServe merges them) and both volume lists, in a throwaway Pod.
    container = dict(runtime["spec"]["containers"][0])
    for key in ("env", "envFrom", "volumeMounts"):
        container[key] = container.get(key, []) + model.get(key, [])
    volumes = runtime["spec"].get("volumes", []) + service["spec"]["predictor"]["volumes"]
    for items in (container["env"], container["volumeMounts"], volumes):
        names = [i["name"] for i in items]
        assert len(names) == len(set(names)), f"the runtime and the predictor both set {names}"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kserve-check"},
           "spec": {"containers": [container], "volumes": volumes,
                    "securityContext": service["spec"]["predictor"]["securityContext"],
                    "terminationGracePeriodSeconds": service["spec"]["predictor"]["terminationGracePeriodSeconds"]}}
    kubernetes_validate.validate(pod, K8S_VERSIONS[-1], strict=True)
    check_probes(container, {8080: "http"})
    assert container["args"][:2] == dockerfile_cmd()[:2], "the runtime runs the Dockerfile's supervisor"
    check_graceful_shutdown(container, pod["spec"])
    check_api_key_is_a_file(container, pod["spec"])
    check_admin_key_is_an_optional_secret_file(container, pod["spec"])
    # The admin key is the server's, so the runtime itself carries it (not every
    # InferenceService that uses the runtime has to remember it).
    assert "TRITON_ADMIN_KEY_FILE" in {e["name"] for e in runtime["spec"]["containers"][0]["env"]}
    check_inference_key_is_an_optional_secret_file(container, pod["spec"])


def test_kserve_runtime_declares_both_ports_and_runs_as_the_base_deployment_does():
    runtime = load_docs(DEPLOY / "kserve/servingruntime.yaml")[0]
    predictor = load_docs(DEPLOY / "kserve/inferenceservice.yaml")[0]["spec"]["predictor"]
    container = runtime["spec"]["containers"][0]
    # KServe exposes the ports the runtime declares: HTTP and gRPC, the gRPC one named h2c.
    ports = {p["containerPort"]: p.get("name") for p in container["ports"]}
    http, grpc = int(flag(container["args"], "http-port")), int(flag(container["args"], "grpc-port"))
    assert set(ports) == {http, grpc} and ports[grpc] == "h2c"
    # The same user and restrictions as deploy/base: the container's part in the runtime,
    # the pod's (fsGroup: the key files readable by that user) in the InferenceService.
    base = load_docs(DEPLOY / "base/deployment.yaml")[0]
    base_pod = pod_spec(base)["securityContext"]
    base_container = server_container([base])["securityContext"]
    runs_as = container["securityContext"]
    assert runs_as["allowPrivilegeEscalation"] is base_container["allowPrivilegeEscalation"] is False
    assert runs_as["capabilities"] == base_container["capabilities"] == {"drop": ["ALL"]}
    for key in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"):
        assert runs_as[key] == predictor["securityContext"][key] == base_pod[key], key
    assert predictor["securityContext"]["fsGroup"] == base_pod["fsGroup"]
    assert runs_as["runAsNonRoot"] is True and runs_as["seccompProfile"] == {"type": "RuntimeDefault"}


def test_servicemonitor_and_adapter_rule_match_the_deployment():
    docs = render(DEPLOY / "overlays/cpu")
    monitor = load_docs(DEPLOY / "monitoring/servicemonitor.yaml")[0]
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    service = by_kind(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}

    rules = yaml.safe_load((DEPLOY / "monitoring/prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    adapter_metrics = {rule["name"]["as"] for rule in rules}
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    hpa_metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert hpa_metrics and hpa_metrics <= adapter_metrics, "the HPA scales on a metric no adapter rule makes"
    for rule in rules:  # every Triton series the rule reads is one the server exports
        for series in re.findall(r"\b(nv_\w+)\{", rule["seriesQuery"] + rule["metricsQuery"]):
            assert series in {"nv_inference_queue_duration_us", "nv_inference_request_success",
                              "nv_inference_pending_request_count"}, series


def test_the_dashboard_configmap_is_what_grafanas_sidecar_loads():
    """deploy/monitoring/grafana: the dashboard JSON as a ConfigMap labelled for
    the sidecar (kube-prometheus-stack's default label), generated from the
    one JSON file; its queries are checked against a live Prometheus in
    tests/integration/test_dashboard_queries.py."""
    source = DEPLOY / "monitoring/grafana/classify-describe.json"
    (configmap,) = render(DEPLOY / "monitoring/grafana")
    kubernetes_validate.validate(configmap, K8S_VERSIONS[-1], strict=True)
    assert configmap["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert configmap["data"] == {source.name: source.read_text()}
    # `kubectl apply` keeps the whole object in an annotation limited to 256 KiB.
    assert len(source.read_bytes()) < 200 * 1024
    dashboard = json.loads(source.read_text())
    assert dashboard["uid"] == "classify-describe"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])] if p["type"] != "row"]
    for panel in panels:  # no data source name baked in: the importer's own Prometheus
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    provisioning = yaml.safe_load((DEPLOY / "monitoring/grafana/provisioning-dashboards.yaml").read_text())
    assert provisioning["providers"][0]["type"] == "file"


def test_the_prometheusrule_is_picked_by_the_same_selector_as_the_servicemonitor():
    """Its alerts are tested with promtool (tests/test_alert_rules.py); here the
    CRD's shape: kube-prometheus-stack selects rules and monitors by the same
    release label, so both carry the same labels."""
    rule = load_docs(DEPLOY / "monitoring/prometheusrule.yaml")[0]
    monitor = load_docs(DEPLOY / "monitoring/servicemonitor.yaml")[0]
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"]["labels"] == monitor["metadata"]["labels"]
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        for alert in group["rules"]:
            assert {"alert", "expr", "for", "labels", "annotations"} <= alert.keys(), alert.get("alert")


def test_every_repository_path_named_in_deploy_exists():
    """Comments send the reader to other files; a renamed file must not leave
    them pointing at nothing."""
    pattern = re.compile(r"\b(?:deploy|docs|tools|tests|serving|scripts|backends|openai_front)/[\w./-]+"
                         r"\.(?:yaml|yml|md|py|json|sh|txt)\b")
    named = {(path.relative_to(REPO), name) for path in DEPLOY.rglob("*") if path.is_file()
             for name in pattern.findall(path.read_text())}
    assert len(named) >= 10
    missing = sorted(f"{path}: {name}" for path, name in named if not (REPO / name).exists())
    assert not missing, missing


# -- what must agree across files ---------------------------------------------

SUPERVISOR = "/opt/classify_describe/serving/supervise_tritonserver.sh"


def test_the_image_holds_the_supervisor_and_what_it_runs():
    """The Dockerfile copies serving/ (the supervisor, the watchdog and the one
    module it imports) to where CMD and deploy/ call it (WORKDIR
    /opt/classify_describe); tests/test_layout.py keeps serving/ free of
    imports from the rest of the repository."""
    text = (REPO / "Dockerfile").read_text()
    assert "WORKDIR /opt/classify_describe" in text
    assert "COPY serving/ serving/" in text.splitlines()
    for name in ("supervise_tritonserver.sh", "stub_watchdog.py", "procfs.py", "__init__.py"):
        assert (REPO / "serving" / name).exists(), f"serving/{name} is missing"


def dockerfile_cmd():
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("CMD "):
            return json.loads(line[4:])
    raise AssertionError("Dockerfile has no exec-form CMD")


def check_probes(container, port_names):
    """Startup and liveness ask Triton's HTTP port. Readiness asks the OpenAI front
    when the supervisor starts one (OPENAI_FRONT is not "0"): a dead or broken
    front must take the pod out of the Service, and the front's /health/ready is
    Triton's readiness over gRPC, so it covers both. Without the front, Triton's."""
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    ports.update({p["containerPort"]: p["containerPort"] for p in container["ports"]})
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    front = env.get("OPENAI_FRONT", "1") != "0"
    ready = ((FRONT_READY_PATH, "openai", env.get("OPENAI_PORT", "8003")) if front
             else (PROBE_PATHS["ready"], "http", flag(container["args"], "http-port")))
    for probe, (path, role, number) in (
            ("startupProbe", (PROBE_PATHS["ready"], "http", flag(container["args"], "http-port"))),
            ("livenessProbe", (PROBE_PATHS["live"], "http", flag(container["args"], "http-port"))),
            ("readinessProbe", ready)):
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} must GET {path}"
        port = ports[get["port"]]
        assert port_names.get(port) == role, f"{probe} must probe the {role} port, not {port}"
        assert str(port) == number, f"{probe} probes {port}, where nothing listens ({role} is on {number})"


def env_value(container, name, default):
    return next((e["value"] for e in container.get("env", []) if e["name"] == name and "value" in e), default)


def check_graceful_shutdown(container, spec):
    """preStop sleep + the front's bounded stop (its drain, then the supervisor's
    kill grace) + Triton's exit timeout fit in the grace period; the LLM step gives
    up before Triton's exit timeout, so in-flight requests do get answered. And the
    pod keeps its own PID namespace: the admin key is in tritonserver's arguments."""
    exit_timeout = int(flag(container["args"], "exit-timeout-secs"))
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", "preStop should only wait for the endpoint removal to spread"
    pre_stop = int(command[1])
    assert 5 <= pre_stop <= 30
    # serving/supervise_tritonserver.sh: TERM to the front, wait drain + grace, then TERM to Triton.
    front_stop = float(env_value(container, "OPENAI_FRONT_DRAIN_S", 5)) + float(
        env_value(container, "FRONT_STOP_GRACE_S", 3))
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + front_stop + exit_timeout + 5, (
        f"terminationGracePeriodSeconds {grace} < preStop {pre_stop} + the front's stop {front_stop:g} + "
        f"--exit-timeout-secs {exit_timeout} + 5: the kubelet would SIGKILL requests Triton is still finishing")
    assert not spec.get("hostPID") and not spec.get("shareProcessNamespace"), \
        "another container (or the host) would read the admin key in tritonserver's arguments"


def secret_file_mounts(container, spec):
    """{path of each file a mounted Secret provides: (volume, read-only mount)}."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    files = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        for item in (secret or {}).get("items", []):
            files[pathlib.PurePosixPath(mount["mountPath"]) / item["path"]] = (volumes[mount["name"]], mount)
    return files


def check_api_key_is_a_file(container, spec):
    env = {e["name"]: e for e in container.get("env", [])}
    for name, entry in env.items():
        assert not (name.endswith("_KEY") or "secretKeyRef" in entry.get("valueFrom", {})), \
            f"{name}: a key must come from a mounted file, never an env var (kubectl describe shows it)"
    key_path = pathlib.PurePosixPath(env["LLM_API_KEY_FILE"]["value"])
    volume, mount = secret_file_mounts(container, spec).get(key_path, ({}, {}))
    assert mount.get("readOnly") and volume["secret"]["secretName"] == KEY_SECRET, \
        f"LLM_API_KEY_FILE={key_path} is not a file of the mounted Secret {KEY_SECRET}"


def check_admin_key_is_an_optional_secret_file(container, spec):
    """TRITON_ADMIN_KEY_FILE names the file of the admin-key Secret, which is
    optional: without it the pod still starts, the file is absent and the
    supervisor generates a key (tests/test_control_api_policy.py)."""
    env = {e["name"]: e for e in container.get("env", [])}
    assert "TRITON_ADMIN_KEY" not in env
    key_path = pathlib.PurePosixPath(env["TRITON_ADMIN_KEY_FILE"]["value"])
    volume, mount = secret_file_mounts(container, spec).get(key_path, ({}, {}))
    assert mount.get("readOnly") and volume["secret"]["secretName"] == ADMIN_KEY_SECRET, \
        f"TRITON_ADMIN_KEY_FILE={key_path} is not a file of the mounted Secret {ADMIN_KEY_SECRET}"
    assert volume["secret"].get("optional") is True, "a missing admin-key Secret must not keep the pod from starting"
    example = load_docs(DEPLOY / "base/admin-key.secret.example.yaml")[0]
    assert example["metadata"]["name"] == ADMIN_KEY_SECRET
    assert {i["key"] for i in volume["secret"]["items"]} <= example["stringData"].keys()


def test_probes_point_at_tritons_health_endpoints(overlay):
    _, docs = overlay
    container = server_container(docs)
    check_probes(container, {8000: "http", 8001: "grpc", 8002: "metrics", 8003: "openai"})
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == \
        {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 8003}
    startup = container["startupProbe"]
    # Model loading (torch import, TorchScript load, the load-time check) must fit.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_deployment_runs_the_dockerfiles_server_command(overlay):
    name, docs = overlay
    args = server_container(docs)["args"]
    cmd = dockerfile_cmd()
    missing = [a for a in cmd if a not in args]
    assert not missing, f"overlay {name}: the Deployment's args dropped {missing} from the Dockerfile CMD"
    assert args[:2] == cmd[:2] == [SUPERVISOR, "tritonserver"], "tritonserver runs under the supervisor"
    assert ("--model-config-name=gpu" in args) == (name == "gpu")


def test_graceful_shutdown_numbers_agree(overlay):
    _, docs = overlay
    deployment = by_kind(docs, "Deployment")
    container = server_container(docs)
    check_graceful_shutdown(container, pod_spec(deployment))
    llm = by_kind(docs, "ConfigMap")["data"]
    assert float(llm["LLM_TOTAL_TIMEOUT_S"]) < int(flag(container["args"], "exit-timeout-secs")), \
        "an LLM call may outlast --exit-timeout-secs and be cut at shutdown"


def test_llm_settings_from_configmap_and_key_from_a_secret_file(overlay):
    _, docs = overlay
    container = server_container(docs)
    configmap = by_kind(docs, "ConfigMap")
    assert {"configMapRef": {"name": configmap["metadata"]["name"]}} in container["envFrom"]
    assert {"LLM_BASE_URL", "LLM_MODEL"} <= configmap["data"].keys()
    assert not any("KEY" in key and not key.endswith("_FILE") for key in configmap["data"])
    check_api_key_is_a_file(container, pod_spec(by_kind(docs, "Deployment")))
    secret = load_docs(DEPLOY / "base/llm-api-key.secret.example.yaml")[0]
    assert secret["metadata"]["name"] == KEY_SECRET and "Secret" not in {d["kind"] for d in docs}


def test_admin_key_from_an_optional_secret_file(overlay):
    _, docs = overlay
    check_admin_key_is_an_optional_secret_file(server_container(docs), pod_spec(by_kind(docs, "Deployment")))


def test_the_openai_front_has_its_port_and_its_key_from_an_optional_secret_file(overlay):
    """The supervisor starts the front on OPENAI_PORT (default 8003) beside the
    server: the container names that port, the Service and the ServiceMonitor
    reach it, and the clients' key is a file of an optional Secret (without it
    the front is open, as documented)."""
    _, docs = overlay
    container = server_container(docs)
    env = {e["name"]: e for e in container.get("env", [])}
    assert env.get("OPENAI_PORT", {}).get("value", "8003") == "8003" and env.get("OPENAI_FRONT", {}).get("value") != "0"
    assert "OPENAI_FRONT_API_KEY" not in env
    key_path = pathlib.PurePosixPath(env["OPENAI_FRONT_API_KEY_FILE"]["value"])
    volume, mount = secret_file_mounts(container, pod_spec(by_kind(docs, "Deployment"))).get(key_path, ({}, {}))
    assert mount.get("readOnly") and volume["secret"]["secretName"] == OPENAI_KEY_SECRET
    assert volume["secret"].get("optional") is True
    example = load_docs(DEPLOY / "base/openai-front-key.secret.example.yaml")[0]
    assert example["metadata"]["name"] == OPENAI_KEY_SECRET
    assert {i["key"] for i in volume["secret"]["items"]} <= example["stringData"].keys()
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in by_kind(docs, "Service")["spec"]["ports"]}
    assert service_ports["openai"] == (8003, "openai")
    monitor = load_docs(DEPLOY / "monitoring/servicemonitor.yaml")[0]
    assert {"port": "openai", "path": "/metrics"}.items() <= next(
        e for e in monitor["spec"]["endpoints"] if e["port"] == "openai").items()
    assert "EXPOSE 8000 8001 8002 8003" in (REPO / "Dockerfile").read_text()
    assert "COPY openai_front/ openai_front/" in (REPO / "Dockerfile").read_text().splitlines()


def test_shared_memory_is_memory_backed_and_fits_the_limit(overlay):
    _, docs = overlay
    container = server_container(docs)
    volumes = {v["name"]: v for v in pod_spec(by_kind(docs, "Deployment"))["volumes"]}
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    empty_dir = volumes[shm["name"]]["emptyDir"]
    assert empty_dir["medium"] == "Memory"
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    # A memory-backed emptyDir is charged to the container's memory.
    assert quantity_bytes(limits["memory"]) >= quantity_bytes(empty_dir["sizeLimit"]) + 2 * 2**30
    assert quantity_bytes(requests["memory"]) <= quantity_bytes(limits["memory"])


def test_service_pdb_hpa_and_scrape_annotations_select_the_pods(overlay):
    _, docs = overlay
    deployment = by_kind(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    container = server_container(docs)
    port_names = {p["name"] for p in container["ports"]}

    service = by_kind(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == port_names

    pdb = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2, "one replica could not survive a restart or a drain"
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Pods", "Resource"}

    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == flag_int(container["args"], "metrics-port")


def flag_int(args, name):
    return int(flag(args, name))


def test_gpu_overlay_requests_a_gpu_and_the_classifier_has_a_gpu_config(tmp_path):
    docs = render(DEPLOY / "overlays/gpu")
    container = server_container(docs)
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert flag(container["args"], "model-config-name") == "gpu"
    cpu = server_container(render(DEPLOY / "overlays/cpu"))
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]

    # The image generates configs/gpu.pbtxt, where --model-config-name=gpu finds it,
    # after the model repository is in place.
    dockerfile = (REPO / "Dockerfile").read_text()
    generate = dockerfile.index("scripts/make_gpu_config.py /models/classifier/config.pbtxt")
    assert dockerfile.index("COPY model_repository/ /models/") < generate

    # The generated config is the CPU one served by Triton's onnxruntime backend
    # from the same ONNX file, with TensorRT, one KIND_GPU instance without a rate
    # limiter (on GPU the classifier takes no "cpu" slot) and no Python-backend
    # parameters; Triton's text format reads it back.
    source = REPO / "model_repository/classifier/config.pbtxt"
    output = make_gpu_config.write_gpu_config(source, tmp_path / "configs/gpu.pbtxt")
    assert output.read_text().startswith("# GENERATED")
    gpu, expected = model_config.read(output), model_config.read(source)
    assert [g.kind for g in expected.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    assert gpu.platform == "onnxruntime_onnx" and not gpu.backend and not gpu.parameters
    assert gpu.default_model_filename == "model.onnx"
    assert [g.kind for g in gpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    assert not gpu.instance_group[0].HasField("rate_limiter")
    (tensorrt,) = gpu.optimization.execution_accelerators.gpu_execution_accelerator
    assert tensorrt.name == "tensorrt" and tensorrt.parameters["precision_mode"] == "FP16"
    for field in ("name", "max_batch_size", "input", "output", "dynamic_batching"):
        assert getattr(gpu, field) == getattr(expected, field), field

    # TensorRT builds its engine for one optimization profile: it must span every batch
    # the dynamic batcher can form (1..max_batch_size), or a larger batch rebuilds the
    # engine inside a request; the warmup runs max_batch_size so the build happens at load.
    (pixels,) = expected.input
    item = "x".join(str(d) for d in pixels.dims)
    assert tensorrt.parameters["trt_profile_min_shapes"] == f"PIXELS:1x{item}"
    assert tensorrt.parameters["trt_profile_max_shapes"] == f"PIXELS:{expected.max_batch_size}x{item}"
    opt = int(tensorrt.parameters["trt_profile_opt_shapes"].removeprefix("PIXELS:").split("x")[0])
    assert 1 <= opt <= expected.max_batch_size
    assert list(gpu.model_warmup[:len(expected.model_warmup)]) == list(expected.model_warmup)
    assert expected.max_batch_size in [w.batch_size for w in gpu.model_warmup]
    assert {w.batch_size for w in gpu.model_warmup} == (
        {w.batch_size for w in expected.model_warmup} | {expected.max_batch_size})
    largest = max(gpu.model_warmup, key=lambda w: w.batch_size)
    assert dict(largest.inputs) == dict(expected.model_warmup[0].inputs)
    assert make_gpu_config.default_output(source) == source.parent / "configs/gpu.pbtxt"


def test_a_torchscript_classifier_keeps_its_backend_on_the_gpu():
    """The bring-your-own switch (README): the torchscript runtime moves its model to
    cuda:<device> itself, so its GPU config is its CPU config with one KIND_GPU instance."""
    cpu = model_config.read(REPO / "model_repository/classifier/config.pbtxt")
    assert cpu.backend == "image"
    cpu.parameters.clear()
    cpu.parameters["runtime"].string_value = "torchscript"
    cpu.parameters["model_file"].string_value = "model.pt"
    gpu = make_gpu_config.gpu_config(model_config.render(cpu))
    assert gpu.backend == "image" and not gpu.platform and not gpu.HasField("optimization")
    assert gpu.parameters == cpu.parameters
    del cpu.instance_group[:]
    cpu.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.KIND_GPU)
    assert gpu == cpu


def test_the_gpu_config_names_the_tensors_of_its_onnx_file():
    """Triton's onnxruntime backend binds config tensors to the graph's by name and
    type: check them against the exported file (onnxruntime on the CPU reads the
    same graph the GPU would)."""
    import onnxruntime

    source = REPO / "model_repository/classifier/config.pbtxt"
    gpu = make_gpu_config.gpu_config(source.read_text())
    path = source.parent / "1" / gpu.default_model_filename
    assert path.is_file(), f"{path} missing: run `make build`"
    graph = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    onnx_type = {model_config_pb2.TYPE_UINT8: "tensor(uint8)", model_config_pb2.TYPE_FP32: "tensor(float)",
                 model_config_pb2.TYPE_STRING: "tensor(string)"}
    for declared, actual in ((gpu.input, graph.get_inputs()), (gpu.output, graph.get_outputs())):
        assert {t.name: onnx_type[t.data_type] for t in declared} == {t.name: t.type for t in actual}
        for tensor in declared:
            shape = next(t.shape for t in actual if t.name == tensor.name)
            assert isinstance(shape[0], str) and shape[1:] == list(tensor.dims), (tensor.name, shape)


def test_the_cpu_layout_follows_the_containers_cpu_limit():
    """On CPU the supervisor sizes instances and the rate limiter's "cpu" slots from CPU_CORES
    (serving/layout.py): every CPU container passes its own CPU limit there, and no fixed
    --rate-limit flag that would stop following it. The GPU overlay names its configs
    (--model-config-name=gpu), which the supervisor leaves as written."""
    runtime = by_kind(load_docs(DEPLOY / "kserve/servingruntime.yaml"), "ServingRuntime")["spec"]["containers"][0]
    for container in (server_container(render(DEPLOY / "overlays" / "cpu")), runtime):
        env = {e["name"]: e for e in container.get("env", [])}
        field = env["CPU_CORES"]["valueFrom"]["resourceFieldRef"]
        assert field == {"containerName": container["name"], "resource": "limits.cpu", "divisor": "1"}
        assert container["resources"]["limits"]["cpu"] == container["resources"]["requests"]["cpu"]
        assert not any(a.startswith("--rate-limit") for a in container["args"]), container["name"]
        assert not any(a.startswith("--model-config-name") for a in container["args"])
    gpu = server_container(render(DEPLOY / "overlays" / "gpu"))
    assert flag(gpu["args"], "model-config-name") == "gpu"
    assert not any(a.startswith("--rate-limit") for a in gpu["args"])


# -- inference key and NetworkPolicy ---------------------------------------------

INFERENCE_KEY_SECRET = "classify-describe-inference-key"
NETWORK_POLICY = DEPLOY / "base/networkpolicy.yaml"


def check_inference_key_is_an_optional_secret_file(container, spec):
    """TRITON_INFERENCE_KEY_FILE names the file of an optional Secret: without
    it the pod starts with inference open (the supervisor's default), with it
    inference needs the key (tests/integration/test_inference_key.py)."""
    env = {e["name"]: e for e in container.get("env", [])}
    assert "TRITON_INFERENCE_KEY" not in env
    key_path = pathlib.PurePosixPath(env["TRITON_INFERENCE_KEY_FILE"]["value"])
    volume, mount = secret_file_mounts(container, spec).get(key_path, ({}, {}))
    assert mount.get("readOnly") and volume["secret"]["secretName"] == INFERENCE_KEY_SECRET
    assert volume["secret"].get("optional") is True
    example = load_docs(DEPLOY / "base/inference-key.secret.example.yaml")[0]
    assert example["metadata"]["name"] == INFERENCE_KEY_SECRET
    assert {i["key"] for i in volume["secret"]["items"]} <= example["stringData"].keys()


def test_inference_key_from_an_optional_secret_file(overlay):
    _, docs = overlay
    check_inference_key_is_an_optional_secret_file(server_container(docs), pod_spec(by_kind(docs, "Deployment")))


def allowed_ports(policy, container):
    """{container port number: [the `from` peers of each rule that opens it]}
    ([] for a rule without `from`: anyone)."""
    numbers = {p["name"]: p["containerPort"] for p in container["ports"]}
    allowed = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            number = numbers[port["port"]] if isinstance(port["port"], str) else port["port"]
            allowed.setdefault(number, []).append(rule.get("from", []))
    return allowed


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_the_network_policy_opens_the_front_to_all_metrics_to_monitoring_and_triton_to_the_namespace(k8s_version):
    (policy,) = load_docs(NETWORK_POLICY)
    kubernetes_validate.validate(policy, k8s_version, strict=True)
    docs = render(DEPLOY / "overlays/cpu")
    deployment = by_kind(docs, "Deployment")
    container = server_container(docs)
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items(), "the policy selects no pod of ours"
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    allowed = allowed_ports(policy, container)
    # Every named port exists on the container (a typo would open nothing and close everything).
    named = [p["port"] for r in policy["spec"]["ingress"] for p in r["ports"] if isinstance(p["port"], str)]
    assert set(named) <= {p["name"] for p in container["ports"]}
    assert set(allowed) == {8000, 8001, 8002, 8003}
    assert allowed[8003] == [[]], "the front is for clients anywhere (it has its own key)"
    (metrics_from,) = allowed[8002]
    assert metrics_from == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    for port in (8000, 8001):  # pods of this namespace only: a podSelector alone, no namespace, no ipBlock
        (peers,) = allowed[port]
        assert peers and all(set(peer) == {"podSelector"} for peer in peers), (port, peers)


def test_every_overlay_applies_the_network_policy(overlay):
    """As applied (`kubectl apply -k`), not an example to remember: each overlay renders it."""
    _, docs = overlay
    (policy,) = load_docs(NETWORK_POLICY)
    assert by_kind(docs, "NetworkPolicy")["spec"] == policy["spec"]


def test_egress_goes_to_dns_the_gateway_and_https_outside_the_cluster_only():
    (policy,) = load_docs(NETWORK_POLICY)
    rules = policy["spec"]["egress"]
    ports = [sorted((p["port"], p["protocol"]) for p in rule["ports"]) for rule in rules]
    assert ports == [[(53, "TCP"), (53, "UDP")], [(4000, "TCP")], [(443, "TCP")]]
    assert all(rule.get("to") for rule in rules), "a rule without `to` lets the pods reach anything"
    (dns,), (gateway,), (https,) = (rule["to"] for rule in rules)
    assert dns == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                   "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    gateway_pods = [d for d in load_docs(DEPLOY / "llm-gateway/deployment.yaml") if d["kind"] == "Deployment"][0]
    assert gateway["podSelector"]["matchLabels"].items() <= gateway_pods["spec"]["template"]["metadata"]["labels"].items()
    gateway_port = gateway_pods["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert gateway_port == 4000
    assert https["ipBlock"]["cidr"] == "0.0.0.0/0"
    assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"} <= set(https["ipBlock"]["except"])


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_the_gateway_is_reached_by_our_pods_only_and_shares_no_cache_across_tenants(k8s_version):
    (policy,) = load_docs(DEPLOY / "llm-gateway/networkpolicy.yaml")
    kubernetes_validate.validate(policy, k8s_version, strict=True)
    gateway = by_kind(load_docs(DEPLOY / "llm-gateway/deployment.yaml"), "Deployment")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    ours = render(DEPLOY / "overlays/cpu")
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "classify-describe"}}}]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= \
        by_kind(ours, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in rule["ports"]] == ["http"]
    assert all(r.get("to") for r in policy["spec"]["egress"]), "a rule without `to` lets it reach anything"
    (configmap,) = [d for d in load_docs(DEPLOY / "llm-gateway/configmap.yaml") if d]
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["litellm_settings"]["cache"] is False


def test_the_pod_has_no_service_account_token_and_a_read_only_root(overlay):
    """It writes only to /tmp and /dev/shm, both volumes of its own."""
    _, docs = overlay
    spec = pod_spec(by_kind(docs, "Deployment"))
    assert spec["automountServiceAccountToken"] is False
    container = server_container(docs)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert "emptyDir" in mounts["/tmp"] and mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    # What the supervisor writes outside /dev/shm goes under TMPDIR or /tmp.
    supervisor = (REPO / "serving/supervise_tritonserver.sh").read_text()
    assert "${TMPDIR:-/tmp}/triton-admin-key" in supervisor and "${TMPDIR:-/tmp}/triton-stopping" in supervisor
    assert all(not mount.startswith("/tmp/") for mount in mounts)


def versions_env():
    pairs = (line.split("=", 1) for line in (REPO / "versions.env").read_text().splitlines()
             if "=" in line and not line.lstrip().startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


def test_image_tags_in_deploy_are_the_pins_of_versions_env():
    """Manifests cannot read versions.env, so each copy of a pin is checked against it: a bump
    there fails here until the manifests follow."""
    versions = versions_env()
    for overlay_name in OVERLAYS:
        kustomization = load_docs(DEPLOY / "overlays" / overlay_name / "kustomization.yaml")[0]
        tags = [image["newTag"] for image in kustomization["images"] if "newTag" in image]
        assert tags == [versions["TRITON_VERSION"]], overlay_name
    runtime_image = load_docs(DEPLOY / "kserve/servingruntime.yaml")[0]["spec"]["containers"][0]["image"]
    assert runtime_image.rsplit(":", 1)[1] == versions["TRITON_VERSION"]
    gateway = by_kind(load_docs(DEPLOY / "llm-gateway/deployment.yaml"), "Deployment")
    (litellm,) = [c["image"] for c in pod_spec(gateway)["containers"] if "litellm" in c["image"]]
    assert litellm.rsplit(":", 1)[1] == f"main-v{versions['LITELLM_VERSION']}"
