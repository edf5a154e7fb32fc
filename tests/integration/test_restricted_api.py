"""The control APIs of a server started the default way, WITHOUT TRITON_ADMIN_KEY
(scripts/serve.sh; the supervisor generates the key into a 0600 file): model
control, the repository index, shared-memory registration, log and trace
settings need header `admin-key`, over HTTP and gRPC; inference, health,
metadata, config and statistics do not; the key is never logged. The same
server shows the stub watchdog at work: a Python stub SIGKILLed under traffic,
Triton still reporting the model ready, the watchdog reloading it (with the
generated key). The arguments each shipped path gives the server are checked
without a server in tests/test_control_api_policy.py."""

import json
import os
import signal
import stat
import threading
import time
import urllib.error
import urllib.request
import uuid
from multiprocessing import shared_memory

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from serving.procfs import stub_pid, tritonserver_pid

from .conftest import running_triton


@pytest.fixture(scope="module")
def server(fake_llm, tmp_path_factory):
    # TRITON_ADMIN_KEY=None: none in the environment, as a plain `make run`.
    with running_triton(tmp_path_factory.mktemp("restricted"), fake_llm,
                        extra_env={"TRITON_ADMIN_KEY": None, "STUB_WATCHDOG_INTERVAL_S": "0.5"}) as s:
        yield s


@pytest.fixture(scope="module")
def admin_key(server):
    return server.admin_key


def post(server, path, headers=None, method="POST"):
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=b"{}" if method == "POST" else None,
                                     method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def classify(url, image, module=httpclient):
    # Closed after each call: an idle keep-alive connection holds the server's
    # shutdown for its whole exit timeout (docs/scaling.md).
    client = module.InferenceServerClient(url)
    try:
        tensor = module.InferInput("IMAGE", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image]], dtype=object))
        return client.infer("classify", [tensor]).as_numpy("LABELS")[0, 0].decode()
    finally:
        client.close()


def test_without_a_key_one_is_generated_into_a_private_file(server, admin_key):
    key_file = server.workdir / "admin-key"  # TRITON_ADMIN_KEY_GENERATED_FILE (make run: build/admin-key-<HTTP_PORT>)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(admin_key) == 64
    log = server.log()
    assert f"generated, in {key_file} (mode 0600)" in log and admin_key not in log


# (method, path) of the HTTP control endpoints, one or more per restricted category.
HTTP_CONTROL = [
    ("POST", "/v2/repository/index"),                      # model-repository
    ("POST", "/v2/repository/models/describe/load"),
    ("POST", "/v2/repository/models/describe/unload"),
    ("GET", "/v2/systemsharedmemory/status"),              # shared-memory
    ("GET", "/v2/logging"), ("POST", "/v2/logging"),        # logging
    ("GET", "/v2/trace/setting"), ("POST", "/v2/trace/setting"),  # trace
]


def test_http_control_apis_need_the_admin_key(server, admin_key, photos):
    for method, path in HTTP_CONTROL:
        status, body = post(server, path, method=method)
        assert status == 403 and "restricted" in body and "admin-key" in body, (method, path, body)
        status, _ = post(server, path, {"admin-key": "wrong"}, method=method)
        assert status == 403, (method, path)
    with_key = {"admin-key": admin_key}
    status, body = post(server, "/v2/repository/index", with_key)
    assert status == 200 and "classify_and_describe" in body
    status, _ = post(server, "/v2/repository/models/describe/load", with_key)
    assert status == 200
    # An empty update changes nothing and answers the current settings.
    status, body = post(server, "/v2/logging", with_key)
    assert status == 200 and "log_verbose_level" in json.loads(body)
    status, body = post(server, "/v2/trace/setting", with_key)
    assert status == 200 and "trace_level" in json.loads(body)
    # Inference, health, metadata, config and statistics stay open.
    assert classify(server.http_url, photos["coffee"]) == "espresso"
    assert server.is_ready()
    for path in ("/v2", "/v2/models/classify", "/v2/models/classify/config", "/v2/models/classify/stats"):
        assert post(server, path, method="GET")[0] == 200, path


def test_grpc_control_apis_need_the_admin_key(server, admin_key, photos):
    """Over gRPC, Triton 2.51 expects the header with a prefix:
    `triton-grpc-protocol-admin-key` (it says so in the refusal)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    calls = {
        "repository index": lambda **h: client.get_model_repository_index(**h),
        "load": lambda **h: client.load_model("describe", **h),
        "log settings": lambda **h: client.update_log_settings({}, **h),
        "trace settings": lambda **h: client.update_trace_settings(settings={}, **h),
        "shared-memory status": lambda **h: client.get_system_shared_memory_status(**h),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(grpcclient.InferenceServerException) as error:
                call()
            assert "restricted" in str(error.value) and "triton-grpc-protocol-admin-key" in str(error.value), name
            with pytest.raises(grpcclient.InferenceServerException):
                call(headers={"admin-key": admin_key})  # the HTTP spelling is not enough
        headers = {"triton-grpc-protocol-admin-key": admin_key}
        for call in calls.values():
            call(headers=headers)
        index = client.get_model_repository_index(headers=headers)
        assert {m.name for m in index.models} >= {"classify", "describe"}
        assert classify(server.grpc_url, photos["coffee"], grpcclient) == "espresso"
        assert client.is_server_ready() and client.get_model_config("classify")
        assert client.get_inference_statistics("classify")
    finally:
        client.close()


@pytest.fixture
def shm_region():
    """A small POSIX shared-memory region a client could hand to the server."""
    region = shared_memory.SharedMemory(name=f"restricted-{uuid.uuid4().hex[:8]}", create=True, size=64)
    try:
        yield f"/{region.name}", region.size
    finally:
        region.close()
        region.unlink()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_registering_system_shared_memory_needs_the_admin_key(server, shm_region, module):
    """Registration makes the server read and write a region the caller names."""
    key, size = shm_region
    url = server.http_url if module is httpclient else server.grpc_url
    headers = server.admin_headers if module is httpclient else server.grpc_admin_headers
    name = f"region-{module.__name__.rsplit('.', 1)[-1]}"
    client = module.InferenceServerClient(url)
    try:
        with pytest.raises(module.InferenceServerException) as error:
            client.register_system_shared_memory(name, key, size)
        assert "restricted" in str(error.value)
        client.register_system_shared_memory(name, key, size, headers=headers)
        try:
            status = client.get_system_shared_memory_status(name, headers=headers)
            assert name in str(status)
            with pytest.raises(module.InferenceServerException):
                client.unregister_system_shared_memory(name)
        finally:
            client.unregister_system_shared_memory(name, headers=headers)
    finally:
        client.close()


def preprocess_stub(server):
    triton = tritonserver_pid(server.process.pid)
    assert triton is not None, "no tritonserver under serve.sh"
    return stub_pid(triton, "preprocess_0_0")


def test_killed_stub_is_detected_and_reloaded_by_the_watchdog(server, admin_key, photos):
    """Triton 2.51 does not restart a dead stub and keeps saying ready; the watchdog
    the supervisor runs notices the process is gone and reloads the model, with
    the key the supervisor generated."""
    outcomes = []
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            try:
                outcomes.append((time.monotonic(), classify(server.http_url, photos["coffee"])))
            except Exception as error:  # noqa: BLE001
                outcomes.append((time.monotonic(), f"error: {error}"))
                time.sleep(0.05)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)
        stub = preprocess_stub(server)
        killed_at = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        deadline = killed_at + 60
        while time.monotonic() < deadline:
            new = preprocess_stub(server)
            served = [t for t, o in outcomes if t > killed_at and o == "espresso"]
            if new not in (None, stub) and served and served[-1] > killed_at + 0.5:
                break
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        stop.set()
        thread.join(30)
    after = [(t - killed_at, o) for t, o in outcomes if t > killed_at]
    errors = [o for _, o in after if o != "espresso"]
    recovered = [t for t, o in after if o == "espresso"]
    print(json.dumps({"errors_after_kill": len(errors), "first_answer_after_kill_s":
                      round(recovered[0], 2) if recovered else None, "sample": errors[:1]}))
    assert preprocess_stub(server) not in (None, stub)
    assert recovered and after[-1][1] == "espresso"
    assert all("not healthy" in e or "preprocess" in e for e in errors)  # a clear error while it was down
    log = server.log()
    assert "watchdog: stub process(es)" in log and "model 'preprocess' reloaded" in log
    assert admin_key not in log
