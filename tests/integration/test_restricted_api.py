"""A server started with TRITON_ADMIN_KEY (scripts/serve.sh): model control, the
repository index and shared memory need header `admin-key`, over HTTP and
gRPC; inference does not; the key is never logged. The same server shows the
stub watchdog at work: a Python stub SIGKILLed under traffic, Triton still
reporting the model ready, the watchdog reloading it (with the admin key)."""

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from scripts.local_stack import stub_pid, tritonserver_pid

from .conftest import running_triton

ADMIN_KEY = "adm-test-DO-NOT-LEAK-4c1d"


@pytest.fixture(scope="module")
def server(fake_llm, tmp_path_factory):
    with running_triton(tmp_path_factory.mktemp("restricted"), fake_llm,
                        extra_env={"TRITON_ADMIN_KEY": ADMIN_KEY, "STUB_WATCHDOG_INTERVAL_S": "0.5"}) as s:
        yield s


def post(server, path, headers=None):
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=b"{}", method="POST",
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


def test_http_model_control_needs_the_admin_key(server, photos):
    for path in ("/v2/repository/index", "/v2/repository/models/describe/load",
                 "/v2/repository/models/describe/unload"):
        status, body = post(server, path)
        assert status == 403 and "restricted" in body and "admin-key" in body, (path, body)
        status, _ = post(server, path, {"admin-key": "wrong"})
        assert status == 403
    status, body = post(server, "/v2/repository/index", {"admin-key": ADMIN_KEY})
    assert status == 200 and "classify_and_describe" in body
    status, _ = post(server, "/v2/repository/models/describe/load", {"admin-key": ADMIN_KEY})
    assert status == 200
    # Inference, health and metadata stay open.
    assert classify(server.http_url, photos["coffee"]) == "espresso"
    assert server.is_ready()


def test_grpc_model_control_needs_the_admin_key(server, photos):
    """Over gRPC, Triton 2.51 expects the header with a prefix:
    `triton-grpc-protocol-admin-key` (it says so in the refusal)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(grpcclient.InferenceServerException) as error:
        client.get_model_repository_index()
    assert "restricted" in str(error.value) and "triton-grpc-protocol-admin-key" in str(error.value)
    with pytest.raises(grpcclient.InferenceServerException):
        client.load_model("describe", headers={"admin-key": ADMIN_KEY})  # the HTTP spelling is not enough
    headers = {"triton-grpc-protocol-admin-key": ADMIN_KEY}
    index = client.get_model_repository_index(headers=headers)
    assert {m.name for m in index.models} >= {"classify", "describe"}
    client.load_model("describe", headers=headers)
    assert classify(server.grpc_url, photos["coffee"], grpcclient) == "espresso"


def preprocess_stub(server):
    triton = tritonserver_pid(server.process.pid)
    assert triton is not None, "no tritonserver under serve.sh"
    return stub_pid(triton, "preprocess_0_0")


def test_killed_stub_is_detected_and_reloaded_by_the_watchdog(server, photos):
    """Triton 2.51 does not restart a dead stub and keeps saying ready; the watchdog
    in serve.sh notices the process is gone and reloads the model."""
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
    assert ADMIN_KEY not in log
