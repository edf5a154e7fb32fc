"""Hostile clients on every port a client reaches, against the session server
(the class, not the instance): slow, stalled, oversized and
compressed bodies and disconnects on Triton's HTTP port; oversized messages,
cancels at every stage and a flood of streams on its gRPC port; disconnects
and a misbehaving upstream while an HTTP generate_stream is open; a compressed
and a stalled body on the OpenAI front. Beside each, valid requests
(hostile.Beside) must keep getting their correct answer; at the end the
server's memory and its readiness are bounded.

What is covered elsewhere is not repeated: the front's refusals one by one
(tests/unit/test_openai_front_hostile.py), a closed stream stopping the
upstream and a flood from the upstream over gRPC (test_streaming.py), TERM
with open streams (test_shutdown.py), malformed tensors (test_isolation.py)."""

import base64
import http.client
import json
import queue
import shutil
import socket
import time
import urllib.request
import uuid

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .hostile import Beside, Memory, classify_request, gzip_bomb, open_infer, read_answer, top1
from .public_models import COFFEE_TOP1
from .raw_infer import GrpcInfer, bytes_tensor, fp32_tensor
from .test_streaming import Requests, assert_complete, grpc_stream, http_stream

# Over the whole module, every process of the server. What it is made of
# (2026-12-02, by process): tritonserver 250-275 MB (the 48 MB gRPC message
# left in its allocator: 280-350 MB after any number of them, it plateaus;
# the gzip bomb's inflated body, which Triton 2.51 leaks), the stubs that
# took the large inputs 20-50 MB each. A failure names each process's growth.
RSS_GROWTH_LIMIT_MB = 450
# Not wedged after all of it: well under a second on an idle machine, room for a loaded one.
READY_WITHIN_S = 10.0
# Its own upstream model name (allowed by `gpt-4o-mini*`): the faults here open
# no circuit that other tests use.
FAULT_MODEL = "gpt-4o-mini-it-hostile"
# A copy of classify_and_describe_stream loaded for the flood, with a gate small
# enough to fill on 2 cores; the committed model's is 512 (settings.py).
FLOOD_MODEL = "hostile_stream"
FLOOD_GATE = 4
PHOTO = "classify_and_describe_stream"


@pytest.fixture(scope="module")
def memory(triton):
    reading = Memory(triton)
    reading.start_mb = reading.total_mb()
    reading.start_by_process = reading.by_process()
    return reading


@pytest.fixture
def beside(triton, photos, memory):
    """Valid classify requests over HTTP and gRPC for the whole test; checked after it."""
    with Beside(triton, photos["coffee"]) as valid:
        yield valid
    valid.check()


def fake_stats(llm):
    return llm.admin("stats")


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- 8000: Triton's HTTP port --------------------------------------------------------

def test_http_a_body_that_trickles_in_is_answered(triton, photos, beside):
    """A valid request whose body comes in 40 pieces over 2 s: answered right."""
    head, body = classify_request(photos["coffee"])
    connection = open_infer(triton.http_url, "classify", len(body), len(head))
    step = len(body) // 40 + 1
    for offset in range(0, len(body), step):
        connection.send(body[offset:offset + step])
        time.sleep(0.05)
    assert top1(read_answer(connection)) == COFFEE_TOP1.decode()
    connection.close()


def test_http_stalled_bodies_hold_nothing_that_valid_requests_need(triton, photos, beside):
    """50 connections send their head and 100 bytes of the body, then nothing.
    Triton 2.51 has no body read deadline on this port: each waits until its
    client leaves (finding, docs/reliability.md); what matters is that the
    valid requests beside them are served meanwhile, and after."""
    head, body = classify_request(photos["coffee"])
    stalled = []
    for _ in range(50):
        connection = open_infer(triton.http_url, "classify", len(body), len(head))
        connection.send(body[:100])
        stalled.append(connection)
    beside.wait_answers(6)
    beside.check(at_least=6)
    for connection in stalled:
        connection.sock.settimeout(0.01)
        with pytest.raises(TimeoutError):  # still waiting for the body: nothing was answered
            connection.sock.recv(1)
        connection.close()
    beside.wait_answers(2)


def test_http_a_declared_length_far_over_any_limit(triton, photos, beside, memory):
    """Content-Length of 1 TB, then 64 MB sent and the connection closed: the
    server does not reserve the declared size and holds at most what came."""
    head, body = classify_request(photos["coffee"])
    before = memory.server_rss_mb()
    connection = open_infer(triton.http_url, "classify", 1 << 40, len(head))
    chunk = b"\0" * (1 << 20)
    try:
        connection.send(body)
        for _ in range(64):
            connection.send(chunk)
    except OSError:
        pass  # refused while sending: fine too
    grown = memory.server_rss_mb() - before
    connection.close()
    print(f"\n1 TB declared, 64 MB sent: tritonserver RSS +{grown:.0f} MB")
    assert grown < 200, grown
    beside.wait_answers(2)


def test_http_a_gzip_bomb(triton, beside, memory):
    """Triton's HTTP port inflates a Content-Encoding gzip body whole, before it
    parses it or any model sees it, and 2.51 has no flag to bound that (no
    --http-max-input-size); on the parse failure it never frees the inflated
    body, so each bomb leaks its inflated size (five 64 MiB bombs: +68 MB of
    tritonserver's anonymous RSS each; fixed upstream after 2.51). The
    shipped proxy refuses compressed bodies (test_shedding_proxy.py); here the
    bare port, 32 MiB, so that `make test` stays small: the bomb is refused,
    valid requests beside it are served, and the cost stays at about 3x the
    inflated size at its peak and the inflated size after, so that it cannot
    get worse unnoticed (docs/reliability.md)."""
    inflated_mib = 32
    prefix = b'{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[1,1],"data":["'
    bomb = gzip_bomb(prefix, inflated_mib)  # never closed: invalid JSON once inflated
    with memory.sampled() as seen:
        before = memory.server_rss_mb()
        connection = open_infer(triton.http_url, "classify", len(bomb), headers={
            "Content-Encoding": "gzip", "Content-Type": "application/json"})
        started = time.monotonic()
        connection.send(bomb)
        status, answer = read_answer(connection)
        took = time.monotonic() - started
        connection.close()
    peak, kept = seen["max_mb"] - before, memory.server_rss_mb() - before
    print(f"\ngzip bomb, {len(bomb) / 1e3:.0f} KB -> {inflated_mib} MiB: HTTP {status} in {took:.1f} s; "
          f"tritonserver RSS peak +{peak:.0f} MB, after +{kept:.0f} MB")
    assert status in (400, 500) and "failed to parse the request JSON" in answer["error"], answer
    assert peak < 4 * inflated_mib + 100, f"inflating {inflated_mib} MiB cost {peak:.0f} MB"
    assert kept < 1.1 * inflated_mib * 1.048576 + 40, f"the {inflated_mib} MiB bomb left {kept:.0f} MB"
    assert triton.is_ready()
    beside.wait_answers(2)


def test_http_clients_that_leave_mid_body_or_before_the_answer(triton, photos, llm, beside):
    """20 leave halfway through their body; 20 send a whole classify_and_describe
    (the upstream takes 1 s) and leave without reading the answer."""
    head, body = classify_request(photos["coffee"])
    for _ in range(20):
        connection = open_infer(triton.http_url, "classify", len(body), len(head))
        connection.send(body[:len(body) // 2])
        connection.close()
    llm.admin("mode", {"mode": "ok", "latency_ms": 1000})
    for _ in range(20):
        prompt = f"Gone before the answer ({uuid.uuid4().hex})".encode()
        tensors = [bytes_tensor("IMAGE", [[photos["coffee"]]]), bytes_tensor("PROMPT", [[prompt]])]
        whole_head = json.dumps({"inputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape,
                                             "parameters": {"binary_data_size": len(t.raw)}} for t in tensors],
                                 "parameters": {"model": FAULT_MODEL}}).encode()
        connection = open_infer(triton.http_url, "classify_and_describe", len(whole_head) + sum(
            len(t.raw) for t in tensors), len(whole_head))
        connection.send(whole_head + b"".join(t.raw for t in tensors))
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
    beside.wait_answers(4)
    assert wait_for(lambda: fake_stats(llm)["in_flight"] == 0, timeout_s=20)


# -- 8001: Triton's gRPC port --------------------------------------------------------

def test_grpc_an_oversized_message_is_refused_alone(triton, beside, memory):
    """A 48 MB IMAGE: over preprocess's 20 MiB, refused INVALID_ARGUMENT naming it."""
    infer = GrpcInfer(triton.grpc_url)
    try:
        answer = infer("classify", [bytes_tensor("IMAGE", [[b"\xff" * (48 << 20)]])])
    finally:
        infer.close()
    assert answer.code == "INVALID_ARGUMENT" and "IMAGE" in answer.message, answer
    beside.wait_answers(2)


def describe_request(prompt, model=FAULT_MODEL):
    request = service_pb2.ModelInferRequest(model_name="describe")
    request.parameters["model"].string_param = model
    for tensor in (bytes_tensor("LABELS", [[COFFEE_TOP1, b"cup"]]), fp32_tensor("SCORES", [[0.9, 0.05]]),
                   bytes_tensor("PROMPT", [[prompt.encode()]])):
        request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request


def photo_request(photo, model="classify_and_describe", size=None):
    request = service_pb2.ModelInferRequest(model_name=model)
    request.parameters["model"].string_param = FAULT_MODEL
    image = photo if size is None else photo + b"\0" * (size - len(photo))
    for tensor in (bytes_tensor("IMAGE", [[image]]),
                   bytes_tensor("PROMPT", [[f"Cancelled ({uuid.uuid4().hex})".encode()]])):
        request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request


def test_grpc_calls_cancelled_at_every_stage(triton, photos, llm, beside):
    """Cancelled before the message was all sent (16 MB, at once), while queued
    (30 behind a 1 s upstream, at 0.2 s), while the LLM step runs (the upstream
    holds the answer): each gets CANCELLED, the upstream call in flight is
    closed, and nothing is left running."""
    channel = grpc.insecure_channel(triton.grpc_url, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        sending = [stub.ModelInfer.future(photo_request(photos["coffee"], size=16 << 20)) for _ in range(4)]
        for call in sending:
            call.cancel()
        llm.admin("mode", {"mode": "ok", "latency_ms": 1000})
        queued = [stub.ModelInfer.future(photo_request(photos["coffee"])) for _ in range(30)]
        time.sleep(0.2)
        for call in queued:
            call.cancel()
        cancelled = sum(call.cancelled() for call in queued)
        print(f"\ncancelled: {sum(call.cancelled() for call in sending)} of 4 while sending, {cancelled} of 30 queued")
        assert cancelled >= 25, [call.exception() for call in queued if not call.cancelled()][:3]
        # Triton 2.51 does not pass a cancel on to an ensemble step already running: the describe
        # steps of the queued requests that had started end on their own, then the stage below starts.
        assert wait_for(lambda: fake_stats(llm)["in_flight"] == 0, timeout_s=15)
        llm.admin("mode", {"mode": "hang", "count": 1})
        before = fake_stats(llm)
        running = stub.ModelInfer.future(describe_request(f"Held ({uuid.uuid4().hex})"), timeout=60)
        assert wait_for(lambda: fake_stats(llm)["requests"] > before["requests"], timeout_s=10)
        running.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            running.result()
        # describe asks Triton every cancel_poll_s (1 s) whether its client left.
        assert wait_for(lambda: fake_stats(llm)["disconnected"] > before["disconnected"], timeout_s=5), \
            "the upstream call of a cancelled describe went on"
    finally:
        channel.close()
    beside.wait_answers(2)


@pytest.fixture
def flood_model(triton):
    """FLOOD_MODEL: classify_and_describe_stream with max_open_streams=FLOOD_GATE,
    added to the session server's copy of the repository, loaded, and removed after."""
    source = triton.repository / "classify_and_describe_stream"
    target = triton.repository / FLOOD_MODEL
    shutil.copytree(source, target)
    config = (source / "config.pbtxt").read_text().replace(
        'name: "classify_and_describe_stream"', f'name: "{FLOOD_MODEL}"').replace(
        "parameters [", f'parameters [\n  {{ key: "max_open_streams", value: {{ string_value: "{FLOOD_GATE}" }} }},', 1)
    (target / "config.pbtxt").write_text(config)
    admin = httpclient.InferenceServerClient(triton.http_url)
    try:
        admin.load_model(FLOOD_MODEL, headers=triton.admin_headers)
        yield FLOOD_MODEL
    finally:
        try:
            admin.unload_model(FLOOD_MODEL, headers=triton.admin_headers)
        finally:
            admin.close()
            shutil.rmtree(target)


def test_grpc_a_flood_of_streams_is_refused_at_once_and_valid_streams_go_on(triton, photos, llm, flood_model,
                                                                                beside):
    """FLOOD_GATE streams held open by an upstream that does not answer, then
    20 more on the same gRPC stream: each refused UNAVAILABLE (code=overloaded)
    at once; the committed stream model still streams a valid request;
    once the held ones are cancelled the model takes a stream again."""
    requests_ = Requests(photos["coffee"])
    llm.admin("mode", {"mode": "hang", "count": FLOOD_GATE})
    before = fake_stats(llm)
    answers = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((time.monotonic(), result, error)))
    try:
        for index in range(FLOOD_GATE):
            client.async_stream_infer(flood_model, requests_.grpc_inputs(PHOTO, f"Held {index} ({uuid.uuid4().hex})"),
                                      parameters={"model": FAULT_MODEL})
        assert wait_for(lambda: fake_stats(llm)["in_flight"] - before["in_flight"] == FLOOD_GATE, timeout_s=20)
        sent = time.monotonic()
        for index in range(20):
            client.async_stream_infer(flood_model, requests_.grpc_inputs(PHOTO, f"Flood {index}"),
                                      parameters={"model": FAULT_MODEL})
        refusals = []
        while len(refusals) < 20:
            at, _, error = answers.get(timeout=10)  # a held stream's labels may still come
            if error is not None:
                refusals.append((at, str(error)))
        assert all("code=overloaded" in error and "max_open_streams" in error for _, error in refusals), refusals
        slowest = max(at for at, _ in refusals) - sent
        # At once, not after a slot: the held streams never end. Milliseconds on an idle
        # machine; the bound leaves room for a loaded one.
        assert slowest < 5.0, f"the last refusal came {slowest:.2f} s after the flood was sent"
        assert_complete(requests_.send(triton, PHOTO, "grpc"))  # the committed model, beside the flood
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert wait_for(lambda: fake_stats(llm)["in_flight"] == 0, timeout_s=10)
    assert_complete(grpc_stream(triton.grpc_url, flood_model, requests_.grpc_inputs(PHOTO, f"After ({uuid.uuid4().hex})"),
                                {"model": FAULT_MODEL}))
    print(f"\n{FLOOD_GATE} held, 20 refused within {slowest * 1000:.0f} ms")


# -- HTTP generate_stream --------------------------------------------------------------

def open_generate_stream(triton, body):
    host, port = triton.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", f"/v2/models/{PHOTO}/generate_stream", body=json.dumps(body))
    return connection


def read_events(connection, count):
    """The next `count` events of the stream on `connection`."""
    if not hasattr(connection, "stream_response"):
        connection.stream_response = connection.getresponse()
    response, events = connection.stream_response, []
    while len(events) < count:
        line = response.fp.readline()
        assert line, f"the stream ended after {len(events)} events"
        if line.startswith(b"data:"):
            events.append(json.loads(line[5:]))
    return events


def test_generate_stream_clients_that_leave_at_every_stage(triton, photos, llm, beside):
    """Five leave right after sending, five after the labels, five mid-text
    (the upstream writes a 20 s answer): no upstream call is left open, and a
    valid stream is answered after."""
    requests_ = Requests(photos["coffee"])
    llm.admin("mode", {"mode": "ok", "chunk_ms": 50, "answer_words": 400})
    before = fake_stats(llm)
    for events in (0, 1, 4):
        connections = []
        for _ in range(5):
            body = {**requests_.http_body(PHOTO, f"Left after {events} ({uuid.uuid4().hex})"), "model": FAULT_MODEL}
            connections.append(open_generate_stream(triton, body))
        for connection in connections:
            if events:
                read_events(connection, events)
            connection.sock.close()
            connection.close()
    assert wait_for(lambda: fake_stats(llm)["in_flight"] == 0, timeout_s=10), fake_stats(llm)["in_flight"]
    after = fake_stats(llm)
    assert after["streams_completed"] == before["streams_completed"]
    print(f"\n15 streams left: {after['requests'] - before['requests']} upstream calls, all closed")
    llm.admin("mode", {"mode": "ok"})
    assert_complete(requests_.send(triton, PHOTO, "http"))


UPSTREAM_FAULTS = {  # mode -> (admin settings, what the stream must end with)
    "huge": ({"mode": "huge", "count": 1, "huge_chars": 2_000_000}, ("llm_partial", "fallback")),
    "flood": ({"mode": "flood", "count": 1}, ("llm_partial",)),
    "malformed": ({"mode": "malformed", "count": 3}, ("fallback",)),
    "hang": ({"mode": "hang", "count": 1}, None),  # the client leaves: the upstream call must close
}


@pytest.mark.parametrize("fault", sorted(UPSTREAM_FAULTS))
def test_generate_stream_with_a_misbehaving_upstream(triton, photos, llm, beside, memory, fault):
    requests_ = Requests(photos["coffee"])
    settings, sources = UPSTREAM_FAULTS[fault]
    llm.admin("mode", settings)
    before = fake_stats(llm)
    body = {**requests_.http_body(PHOTO, f"Upstream {fault} ({uuid.uuid4().hex})"), "model": FAULT_MODEL,
            "max_tokens": 64}
    if sources is None:
        connection = open_generate_stream(triton, body)
        assert read_events(connection, 1)[0]["LABELS"][0] == COFFEE_TOP1.decode()
        assert wait_for(lambda: fake_stats(llm)["in_flight"] > before["in_flight"], timeout_s=10)
        beside.wait_answers(2)  # while the stream waits on the upstream
        connection.sock.close()
        connection.close()
        assert wait_for(lambda: fake_stats(llm)["in_flight"] == 0, timeout_s=5)
    else:
        stream = http_stream(triton.http_url, PHOTO, body)
        usage = assert_complete(stream)
        assert stream.last["DESCRIPTION_SOURCE"] in sources, (stream.last, usage)
        assert len(stream.text) <= 16 * 64, len(stream.text)
        assert wait_for(lambda: fake_stats(llm)["in_flight"] == 0, timeout_s=5)
    llm.admin("mode", {"mode": "ok"})
    assert_complete(requests_.send(triton, PHOTO, "http"))


# -- 8003: the OpenAI front, end to end -------------------------------------------------

def front_chat(triton, photo, timeout=60):
    body = {"model": "classify_and_describe", "messages": [{"role": "user", "content": [
        {"type": "text", "text": f"What is it? ({uuid.uuid4().hex[:8]})"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(photo).decode()}}]}]}
    request = urllib.request.Request(f"{triton.openai_base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["classify_describe"]["labels"][0]


def front_raw(triton, head_lines, payload):
    sock = socket.create_connection(("127.0.0.1", triton.openai_port), timeout=30)
    sock.sendall(b"\r\n".join([b"POST /v1/chat/completions HTTP/1.1", b"Host: x",
                               *head_lines]) + b"\r\n\r\n" + payload)
    return sock


def test_front_a_compressed_body_is_refused_and_a_valid_one_answered(triton, photos, llm, beside):
    bomb = gzip_bomb(b'{"model":"classify_and_describe","messages":"', 256)
    sock = front_raw(triton, [b"Content-Type: application/json", b"Content-Encoding: gzip",
                              b"Content-Length: %d" % len(bomb)], bomb)
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 415"), answer[:300]
    assert b"unsupported_content_encoding" in answer
    assert front_chat(triton, photos["coffee"]) == COFFEE_TOP1.decode()


@pytest.mark.parametrize("sent", [b"{" * 100, b""], ids=["100 bytes", "the head alone"])
def test_front_a_stalled_body_waits_alone(triton, photos, llm, beside, sent):
    """The head (and 100 bytes), then nothing: valid requests are answered meanwhile; the
    stalled one gets 408 once it falls behind OPENAI_FRONT_MIN_BODY_RATE (32 KiB/s after
    its first second, in which it must start), long before the read deadline
    (OPENAI_FRONT_BODY_TIMEOUT_S=10)."""
    sock = front_raw(triton, [b"Content-Type: application/json", b"Content-Length: 100000"], sent)
    started = time.monotonic()
    for _ in range(3):
        assert front_chat(triton, photos["coffee"]) == COFFEE_TOP1.decode()
    answer = sock.recv(65536)
    took = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"OPENAI_FRONT_MIN_BODY_RATE" in answer, answer[:500]
    assert 0.9 < took < 9, took  # the pace's second, with room for a loaded machine; not the 10 s deadline


# -- at the end --------------------------------------------------------------------------

def test_memory_and_readiness_are_bounded_after_all_of_it(triton, memory):
    """Runs last (pytest keeps file order)."""
    started = time.monotonic()
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/health/ready", timeout=READY_WITHIN_S) as response:
        assert response.status == 200
    took = time.monotonic() - started
    grown = memory.total_mb() - memory.start_mb
    print(f"\nready in {took * 1000:.0f} ms; server RSS {memory.start_mb:.0f} -> {memory.total_mb():.0f} MB "
          f"({memory.processes()} processes); tritonserver peak {memory.server_peak_mb():.0f} MB; "
          f"grown by process: {memory.growth_by_process()}")
    assert took < READY_WITHIN_S
    assert grown < RSS_GROWTH_LIMIT_MB, (f"RSS grew {grown:.0f} MB over the hostile clients; "
                                         f"by process: {memory.growth_by_process()}")

