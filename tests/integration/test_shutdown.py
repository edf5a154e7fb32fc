"""Stopping the way a container runtime and Kubernetes stop it: TERM to the
supervisor alone (PID 1 in the container), never to the process group. With a
stream open through the OpenAI front, or on Triton's own gRPC port (the upstream
sends one word a second), the stop is ordered and bounded: the front ends its
stream with an error event, the streaming model ends Triton's with UNAVAILABLE,
then Triton unloads every model and exits cleanly, all within STOP_BUDGET_S; and
a Triton that cannot stop cleanly makes the supervisor exit non-zero.

Each test runs its own server (the session's must stay up) and its own fake
upstream (its chunk pacing would slow every other test)."""

import base64
import http.client
import json
import queue
import re
import signal
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tools.local_stack import REPO, FakeLLM, NotReady, TritonServer

from .conftest import STARTS_ITS_OWN_SERVER

pytestmark = STARTS_ITS_OWN_SERVER  # each test starts its own server

# docs/reliability.md#shutdown: at most 10 s with streams open.
STOP_BUDGET_S = 10
PHOTO = (REPO / "docs/sample/coffee.png").read_bytes()


@pytest.fixture
def slow_llm(tmp_path):
    llm = FakeLLM(tmp_path / "fake_llm.log", chunk_ms=1000)
    llm.admin("mode", {"mode": "ok", "chunk_ms": 1000, "answer_words": 300})
    yield llm
    llm.stop()


def start_server(tmp_path, llm, extra_args=""):
    server = TritonServer(tmp_path, {"LLM_BASE_URL": llm.base_url, "LLM_API_KEY": "sk-shutdown-test",
                                     "TRITON_EXTRA_ARGS": extra_args})
    try:
        server.start(timeout_s=300)
    except NotReady as error:
        pytest.fail(str(error))
    return server


class FrontStream(threading.Thread):
    """One streamed chat completion through the front, read event by event."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.port = server.openai_port
        self.events, self.first_text, self.done = [], threading.Event(), threading.Event()

    def run(self):
        body = {"model": "classify_and_describe", "stream": True, "max_tokens": 512, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": f"Describe it slowly ({time.monotonic_ns()})"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PHOTO).decode()}},
            ]}]}
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200, response.read()
            for line in response:
                if line.startswith(b"data: "):
                    self.events.append(line[6:].strip())
                    if len(self.events) >= 3:  # the labels chunk, then words from the upstream
                        self.first_text.set()
        except (OSError, http.client.HTTPException) as error:
            self.events.append(f"connection ended: {error}".encode())
        finally:
            self.first_text.set()
            self.done.set()


def term_supervisor_alone(server):
    """What a container runtime does: TERM to PID 1 only; returns (seconds to exit, status)."""
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    status = server.process.wait(timeout=120)
    return time.monotonic() - started, status


def test_term_with_a_stream_open_through_the_front_stops_in_order_within_the_budget(tmp_path, slow_llm):
    server = start_server(tmp_path, slow_llm)
    try:
        stream = FrontStream(server)
        stream.start()
        assert stream.first_text.wait(60) and not stream.done.is_set(), stream.events
        took, status = term_supervisor_alone(server)
    finally:
        server.stop()
    stream.done.wait(10)
    log = server.log()
    assert status == 0, log[-3000:]
    assert took <= STOP_BUDGET_S, f"stopped after {took:.1f} s (budget {STOP_BUDGET_S} s)"
    # The client is told, in the stream's own format, and the stream ends.
    assert stream.done.is_set()
    last = json.loads(stream.events[-1])
    assert last["error"]["code"] == "service_unavailable" and "shutting down" in last["error"]["message"]
    # Every model that was loaded was unloaded; nothing timed out.
    assert_every_model_unloaded(log)
    # The LLM call of the stream was stopped, not left to run out.
    assert slow_llm.admin("stats")["disconnected"] >= 1


def assert_every_model_unloaded(log):
    loaded = set(re.findall(r"successfully loaded '([\w-]+)'", log))
    unloaded = set(re.findall(r"successfully unloaded '([\w-]+)'", log))
    assert loaded and loaded <= unloaded, (loaded, unloaded)
    assert "Exit timeout expired" not in log


def test_term_with_a_stream_open_on_tritons_grpc_port_ends_it_and_stops_within_the_budget(tmp_path, slow_llm):
    """No front in between: the supervisor's stopping file tells the streaming
    model, which ends the stream with UNAVAILABLE instead of holding Triton's
    unload for its whole --exit-timeout-secs (30 s)."""
    server = start_server(tmp_path, slow_llm)
    answers = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        image = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
        image.set_data_from_numpy(np.array([[PHOTO]], dtype=object))
        prompt = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[f"Slowly ({time.monotonic_ns()})".encode()]], dtype=object))
        client.async_stream_infer("classify_and_describe_stream", [image, prompt], enable_empty_final_response=True)
        texts = 0
        while texts < 2:  # the labels, then words from the upstream: the LLM call is under way
            result, error = answers.get(timeout=60)
            assert error is None, error
            texts += 1
        stopped = {}
        stopper = threading.Thread(target=lambda: stopped.update(zip(("took", "status"), term_supervisor_alone(server))))
        stopper.start()
        ending = []
        while not ending or ending[-1][1] is None:
            ending.append(answers.get(timeout=STOP_BUDGET_S))
        # As the front does, and any client should: a stream the server ended is closed.
        # (One left open idle holds the model in Triton 2.51 until --exit-timeout-secs.)
        client.stop_stream()
        stopper.join(120)
        took, status = stopped["took"], stopped["status"]
    finally:
        client.close()
        server.stop()
    log = server.log()
    assert status == 0, log[-3000:]
    assert took <= STOP_BUDGET_S, f"stopped after {took:.1f} s (budget {STOP_BUDGET_S} s)"
    errors = [error for _, error in ending if error is not None]
    assert errors and "shutting down" in str(errors[0]) and "model_unloading" in str(errors[0]), ending[-3:]
    assert_every_model_unloaded(log)
    assert slow_llm.admin("stats")["disconnected"] >= 1, "the LLM call was stopped, not left to run out"


def test_a_triton_that_cannot_stop_cleanly_fails_the_supervisor(tmp_path, slow_llm):
    """A whole answer still in flight when Triton's exit timeout (1 s here) runs out:
    Triton reports the failed stop and exits 1; the supervisor passes that on
    instead of exiting 0, so an operator (or the restart policy) sees it."""
    slow_llm.admin("mode", {"mode": "ok", "latency_ms": 20000})
    server = start_server(tmp_path, slow_llm, extra_args="--exit-timeout-secs=1")
    try:
        answer = threading.Thread(target=lambda: _infer_quietly(server), daemon=True)
        answer.start()
        deadline = time.monotonic() + 30
        while slow_llm.admin("stats")["in_flight"] < 1:
            assert time.monotonic() < deadline, "the request never reached the upstream"
            time.sleep(0.2)
        took, status = term_supervisor_alone(server)
    finally:
        server.stop()
    assert "Exit timeout expired" in server.log()
    assert status != 0
    assert "not a clean stop" in server.log()


def _infer_quietly(server):
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    image = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[PHOTO]], dtype=object))
    try:
        client.infer("classify_and_describe", [image])
    except Exception:  # noqa: BLE001 - the server goes away under it: that is the test
        pass
