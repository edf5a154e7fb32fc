"""The streaming models (classify_and_describe_stream, describe_stream) against
the real server and the fake upstream streaming server-sent events, over a
gRPC stream and HTTP generate_stream: the order and content of the responses,
fallback before the first token, a stream cut short after it, the client
cancelling, a cached answer replayed, and bad input answered with a clear
error as the stream's only response."""

import asyncio
import base64
import http.client
import json
import pathlib
import queue
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from classify_describe import TritonRequestError

from .public_models import COFFEE_TOP1, STREAM_MODELS
from .test_isolation import png_header

PROTOCOLS = ("grpc", "http")
STREAM_TIMEOUT_S = 60


class Stream:
    """What one streamed request got: each response's outputs ({name: first row}),
    the seconds since sending when each came, and the error if one came."""

    def __init__(self):
        self.responses, self.times, self.error = [], [], None

    @property
    def text(self):
        return "".join(r["DESCRIPTION"] for r in self.responses if "DESCRIPTION" in r)

    @property
    def chunks(self):
        return [r["DESCRIPTION"] for r in self.responses if "DESCRIPTION" in r]

    @property
    def last(self):
        return self.responses[-1]


def _value(name, array):
    row = array[0]
    if name == "SCORES":
        return [float(x) for x in row]
    if name == "LABELS":
        return [x.decode() if isinstance(x, bytes) else x for x in row]
    value = row[0] if np.ndim(row) else row
    return value.decode() if isinstance(value, bytes) else value


def grpc_stream(url, model, inputs, parameters=None):
    """One request on its own gRPC stream; `inputs` are tritonclient InferInputs."""
    client = grpcclient.InferenceServerClient(url)
    answers, stream = queue.Queue(), Stream()
    client.start_stream(callback=lambda result, error: answers.put((time.perf_counter(), result, error)))
    try:
        sent = time.perf_counter()
        client.async_stream_infer(model, inputs, parameters=parameters, enable_empty_final_response=True)
        while True:
            at, result, error = answers.get(timeout=STREAM_TIMEOUT_S)
            stream.times.append(at - sent)
            if error is not None:
                stream.error = str(error)
                # Nothing may follow an error: wait a moment for a stray response.
                try:
                    at, result, error = answers.get(timeout=0.5)
                    stream.responses.append({"unexpected": (result, error)})
                except queue.Empty:
                    pass
                return stream
            response = result.get_response()
            if response.outputs:
                stream.responses.append({o.name: _value(o.name, result.as_numpy(o.name)) for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                return stream
    finally:
        client.stop_stream()
        client.close()


def http_stream(url, model, body):
    """POST generate_stream with a JSON body of inputs by name; the SSE events."""
    stream = Stream()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    try:
        response = urllib.request.urlopen(request, timeout=STREAM_TIMEOUT_S)
    except urllib.error.HTTPError as error:
        response = error  # an error before any response: the status is 400, the body one event
    with response:
        if not response.headers.get("Content-Type", "").startswith("text/event-stream"):
            # Triton's own refusal before the model (a JSON value of the wrong type): one JSON error.
            stream.status, stream.error = response.status, json.loads(response.read())["error"]
            return stream
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            stream.times.append(time.perf_counter() - sent)
            event = json.loads(line[5:])
            if "error" in event:
                if stream.error is not None:
                    stream.responses.append({"unexpected": event})
                stream.error = event["error"]
                continue
            outputs = {}
            for name in ("LABELS", "SCORES", "DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE"):
                if name in event:
                    value = event[name]
                    outputs[name] = value if name in ("LABELS", "SCORES") or not isinstance(value, list) else value[0]
            stream.responses.append(outputs)
    return stream


def grpc_bytes(name, values, datatype="BYTES", shape=None):
    array = np.array([values], dtype=np.object_ if datatype == "BYTES" else datatype.lower())
    tensor = grpcclient.InferInput(name, list(shape or array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def grpc_rows(name, rows):
    tensor = grpcclient.InferInput(name, [len(rows), len(rows[0])], "BYTES")
    tensor.set_data_from_numpy(np.array(rows, dtype=np.object_))
    return tensor


def grpc_fp32(name, values):
    tensor = grpcclient.InferInput(name, [1, len(values)], "FP32")
    tensor.set_data_from_numpy(np.array([values], dtype=np.float32))
    return tensor


class Requests:
    """A valid request to each stream model, over each protocol."""

    def __init__(self, photo):
        self.photo = photo

    def grpc_inputs(self, model, prompt):
        if model == "classify_and_describe_stream":
            return [grpc_bytes("IMAGE", [self.photo]), grpc_bytes("PROMPT", [prompt.encode()])]
        return [grpc_bytes("LABELS", [COFFEE_TOP1, b"cup", b"coffee mug"]), grpc_fp32("SCORES", [0.9, 0.05, 0.02]),
                grpc_bytes("PROMPT", [prompt.encode()])]

    def http_body(self, model, prompt):
        if model == "classify_and_describe_stream":
            return {"IMAGE": base64.b64encode(self.photo).decode(), "PROMPT": prompt}
        return {"LABELS": [COFFEE_TOP1.decode(), "cup", "coffee mug"], "SCORES": [0.9, 0.05, 0.02], "PROMPT": prompt}

    def send(self, server, model, protocol, prompt=None, parameters=None):
        prompt = prompt or f"Describe it ({uuid.uuid4().hex[:8]})"  # a new prompt: no cached answer
        if protocol == "grpc":
            return grpc_stream(server.grpc_url, model, self.grpc_inputs(model, prompt), parameters)
        return http_stream(server.http_url, model, {**self.http_body(model, prompt), **(parameters or {})})


@pytest.fixture(scope="module")
def requests_(photos):
    return Requests(photos["coffee"])


def stats(llm):
    return llm.admin("stats")


def assert_complete(stream):
    """LABELS and SCORES first, then text chunks, then DESCRIPTION_SOURCE and USAGE."""
    assert stream.error is None, stream.error
    first, middle, last = stream.responses[0], stream.responses[1:-1], stream.responses[-1]
    assert sorted(first) == ["LABELS", "SCORES"], first
    assert first["LABELS"][0] == COFFEE_TOP1.decode()
    assert all(sorted(r) == ["DESCRIPTION"] for r in middle), middle
    assert sorted(last) == ["DESCRIPTION_SOURCE", "USAGE"], last
    return json.loads(last["USAGE"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", STREAM_MODELS)
def test_labels_first_then_the_text_as_written_then_source_and_usage(triton, llm, requests_, model, protocol):
    # The upstream waits 400 ms before its first word, then 30 ms per word: the
    # labels must not wait for it, and the words must come one by one.
    llm.admin("mode", {"mode": "ok", "latency_ms": 400, "chunk_ms": 30, "answer_words": 20})
    stream = requests_.send(triton, model, protocol)
    usage = assert_complete(stream)
    upstream_text = stats(llm)["streamed_answers"][-1]
    assert stream.text == upstream_text
    assert len(stream.chunks) == 20 and all(stream.chunks)
    assert stream.last["DESCRIPTION_SOURCE"] == "llm"
    assert usage["chunks"] == 20 and usage["attempts"] == 1 and not usage["cached"]
    assert usage["completion_tokens"] == 20 and usage["cost_usd"] > 0  # billed from the stream's usage chunk
    assert usage["time_to_first_token_ms"] >= 400
    labels_at, first_text_at, last_text_at = stream.times[0], stream.times[1], stream.times[-2]
    assert first_text_at - labels_at > 0.3, stream.times
    assert last_text_at - first_text_at > 19 * 0.03 * 0.8, stream.times  # not sent all at once at the end
    body = stats(llm)["bodies"][-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_failure_before_the_first_token_falls_back(triton, llm, requests_, protocol):
    llm.admin("mode", {"mode": "500", "count": 3})  # the three attempts of one request
    stream = requests_.send(triton, "classify_and_describe_stream", protocol)
    usage = assert_complete(stream)
    assert stream.last["DESCRIPTION_SOURCE"] == "fallback"
    assert len(stream.chunks) == 1 and stream.text.startswith("Most likely an espresso")
    assert usage["fallback_reason"] == "upstream_error_http_500" and usage["attempts"] == 3
    # A success resets the circuit breaker's count of consecutive failures for the next tests.
    assert_complete(requests_.send(triton, "classify_and_describe_stream", protocol))


def test_a_retry_before_the_first_token_is_invisible(triton, llm, requests_):
    llm.admin("mode", {"mode": "500", "count": 1})
    stream = requests_.send(triton, "classify_and_describe_stream", "grpc")
    usage = assert_complete(stream)
    assert stream.last["DESCRIPTION_SOURCE"] == "llm" and usage["attempts"] == 2
    assert stream.text == stats(llm)["streamed_answers"][-1]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_failure_after_the_first_token_keeps_the_partial_text(triton, llm, requests_, protocol):
    # 20 ms between words: the upstream dies while it writes, not before its first bytes are read.
    llm.admin("mode", {"mode": "cut", "cut_after": 3, "answer_words": 20, "chunk_ms": 20})
    requests_before = stats(llm)["requests"]
    stream = requests_.send(triton, "classify_and_describe_stream", protocol)
    usage = assert_complete(stream)
    assert stream.last["DESCRIPTION_SOURCE"] == "llm_partial"
    assert len(stream.chunks) == 3 and stream.text.startswith("Fake answer #")
    assert usage["fallback_reason"] == "connection_error" and usage["attempts"] == 1
    # Billed upstream though no usage chunk came: estimated.
    assert usage["tokens_estimated"] is True and usage["completion_tokens"] > 0 and usage["cost_usd"] > 0
    assert stats(llm)["requests"] == requests_before + 1  # no retry once text went out
    # A partial answer is not cached: the same request streams anew.
    llm.admin("mode", {"mode": "ok"})


@pytest.mark.parametrize("model", STREAM_MODELS)
def test_an_upstream_that_floods_is_cut_at_the_limit_and_closed(triton, llm, requests_, model):
    """An endless stream: the text stops at 16 characters per
    max_tokens token, ends llm_partial (answer_too_long) billed by estimate, and
    the upstream connection is closed rather than read for total_timeout_s."""
    llm.admin("mode", {"mode": "flood"})
    before = stats(llm)
    stream = requests_.send(triton, model, "grpc", parameters={"max_tokens": 64})
    usage = assert_complete(stream)
    assert stream.last["DESCRIPTION_SOURCE"] == "llm_partial" and len(stream.text) == 16 * 64
    assert usage["fallback_reason"] == "answer_too_long" and usage["finish_reason"] == "length"
    assert usage["tokens_estimated"] is True and usage["cost_usd"] > 0
    deadline = time.monotonic() + 30  # generous: the wait ends as soon as the fake sees the close
    while stats(llm)["disconnected"] == before["disconnected"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats(llm)["disconnected"] == before["disconnected"] + 1
    # Closed early, not read for total_timeout_s (the fake floods thousands of chunks a
    # second for as long as it is read); how many it wrote before it saw the close
    # depends on socket buffers and the machine's load (6,509 seen under a full suite).
    assert stats(llm)["flood_chunks"] - before["flood_chunks"] < 50_000


def model_successes(server, model):
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/stats", timeout=10) as response:
        return json.loads(response.read())["model_stats"][0]["inference_stats"]["success"]["count"]


def streams_finished(server, model):
    """describe_requests_total of `model`, every outcome (cancelled ones too): one per stream it ended."""
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith("describe_requests_total{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_streams_cancelled_while_they_wait_are_not_classified(triton, llm, requests_):
    """60 photo streams on one gRPC stream, cancelled by the client at 0.1 s: a request
    whose client left is skipped before its BLS call, not classified for nobody."""
    llm.admin("mode", {"mode": "ok", "latency_ms": 2000})
    # The photo stream classifies by BLS to classify_with_view (its classify_model).
    classified_before, llm_before = model_successes(triton, "classify_with_view"), stats(llm)["requests"]
    finished_before = streams_finished(triton, PHOTO)
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    for _ in range(60):
        client.async_stream_infer(PHOTO, requests_.grpc_inputs(PHOTO, f"Gone ({uuid.uuid4().hex})"))
    time.sleep(0.1)
    client.stop_stream(cancel_requests=True)
    client.close()
    # Until the model has ended all 60, however long a loaded machine takes: what it
    # classified by then is the point. Triton may drop a request cancelled while still
    # in its queue (it never reaches the model, nor the classifier): the count then
    # stops short of 60, and 3 s without a change count as the end.
    ended, still_since = streams_finished(triton, PHOTO) - finished_before, time.monotonic()
    while ended < 60 and time.monotonic() - still_since < 3:
        time.sleep(0.2)
        now = streams_finished(triton, PHOTO) - finished_before
        if now != ended:
            ended, still_since = now, time.monotonic()
    classified = model_successes(triton, "classify_with_view") - classified_before
    called = stats(llm)["requests"] - llm_before
    print(f"\n60 streams cancelled at 0.1 s: {ended:.0f} ended by the model, {classified} classified, "
          f"{called} LLM calls")
    assert classified < 45 and called <= classified, (classified, called)
    assert_complete(requests_.send(triton, PHOTO, "grpc"))  # and the model still streams


def test_a_cached_answer_replays_as_one_chunk(triton, llm, requests_):
    prompt = f"Once only ({uuid.uuid4().hex[:8]})"
    llm.admin("mode", {"mode": "ok", "answer_words": 12})
    first = requests_.send(triton, "classify_and_describe_stream", "grpc", prompt)
    assert_complete(first)
    upstream_requests = stats(llm)["requests"]
    for protocol in PROTOCOLS:
        again = requests_.send(triton, "classify_and_describe_stream", protocol, prompt)
        usage = assert_complete(again)
        assert again.chunks == [first.text] and again.last["DESCRIPTION_SOURCE"] == "llm"
        assert usage["cached"] is True and usage["chunks"] == 1 and usage["total_tokens"] == 0
    assert stats(llm)["requests"] == upstream_requests


def test_the_api_key_never_shows_in_a_stream(triton, llm, requests_, test_api_key):
    llm.admin("mode", {"mode": "401"})  # the fake echoes the key, as providers do
    stream = requests_.send(triton, "classify_and_describe_stream", "grpc")
    assert_complete(stream)
    assert "authentication_failed" in stream.last["USAGE"]
    assert test_api_key not in json.dumps(stream.responses)
    assert test_api_key not in triton.log()


def open_then_close(server, requests_, protocol, prompt):
    """Start a long stream, read its labels and three chunks, close it: when it was closed."""
    if protocol == "grpc":
        client = grpcclient.InferenceServerClient(server.grpc_url)
        answers = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("classify_and_describe_stream",
                                  requests_.grpc_inputs("classify_and_describe_stream", prompt),
                                  enable_empty_final_response=True)
        for _ in range(4):
            result, error = answers.get(timeout=STREAM_TIMEOUT_S)
            assert error is None, error
        closed_at = time.time()
        client.stop_stream(cancel_requests=True)
        client.close()
        return closed_at
    host, port = server.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=STREAM_TIMEOUT_S)
    connection.request("POST", "/v2/models/classify_and_describe_stream/generate_stream",
                       body=json.dumps(requests_.http_body("classify_and_describe_stream", prompt)))
    response = connection.getresponse()
    events = 0
    while events < 4:
        events += response.fp.readline().startswith(b"data:")
    closed_at = time.time()
    connection.sock.close()
    connection.close()
    return closed_at


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_client_that_closes_its_stream_stops_the_upstream_stream(triton, llm, requests_, protocol):
    """The server sees the cancellation (gRPC: the stream cancelled; HTTP: the
    connection closed) and closes the upstream connection within about
    cancel_poll_s (0.25 s in the stream models' configs)."""
    llm.admin("mode", {"mode": "ok", "chunk_ms": 50, "answer_words": 400})  # a 20 s answer
    before = stats(llm)
    closed_at = open_then_close(triton, requests_, protocol, f"Long ({uuid.uuid4().hex})")
    deadline = time.monotonic() + 10
    while stats(llm)["disconnected"] == before["disconnected"] and time.monotonic() < deadline:
        time.sleep(0.02)
    after = stats(llm)
    assert after["disconnected"] == before["disconnected"] + 1, "the upstream stream was not closed"
    closed_after_s = after["disconnect_times"][-1] - closed_at
    print(f"\n{protocol}: upstream connection closed {closed_after_s * 1000:.0f} ms after the client closed")
    # About cancel_poll_s on an idle machine; the bound leaves room for a loaded one and
    # still tells a closed stream from the 20 s answer read to its end.
    assert closed_after_s < 5.0
    assert after["streams_completed"] == before["streams_completed"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", STREAM_MODELS)
def test_a_valid_stream_is_answered_beside_bad_ones(triton, llm, requests_, model, protocol):
    """After every malformed request below, the same model still streams."""
    assert_complete(requests_.send(triton, model, protocol))


PHOTO = "classify_and_describe_stream"
GRPC_BAD = {  # case -> (model, inputs builder, parameters, text the error must name)
    "image_not_a_photo": (PHOTO, lambda r: [grpc_bytes("IMAGE", [b"hello, not a photo"])], None, "IMAGE"),
    "image_empty": (PHOTO, lambda r: [grpc_bytes("IMAGE", [b""])], None, "IMAGE"),
    "image_missing": (PHOTO, lambda r: [grpc_bytes("PROMPT", [b"hi"])], None, "IMAGE"),
    "image_wrong_datatype": (PHOTO, lambda r: [grpc_bytes("IMAGE", [1], "INT32")], None, "IMAGE"),
    "image_two_rows": (PHOTO, lambda r: [grpc_rows("IMAGE", [[r.photo], [r.photo]])], None, "batch"),
    "prompt_not_utf8": (PHOTO, lambda r: [grpc_bytes("IMAGE", [r.photo]), grpc_bytes("PROMPT", [b"\xff\xfe caf\xe9"])],
                        None, "PROMPT"),
    "prompt_oversized": (PHOTO, lambda r: [grpc_bytes("IMAGE", [r.photo]), grpc_bytes("PROMPT", [b"x" * 100_000])],
                         None, "PROMPT"),
    "temperature_out_of_range": (PHOTO, lambda r: [grpc_bytes("IMAGE", [r.photo])], {"temperature": 5.0},
                                 "temperature"),
    "model_not_allowed": (PHOTO, lambda r: [grpc_bytes("IMAGE", [r.photo])], {"model": "gpt-5-pro"}, "model"),
    "image_decompression_bomb": (PHOTO, lambda r: [grpc_bytes("IMAGE", [png_header(100_000, 100_000)])], None,
                                 "IMAGE"),
    "labels_too_many": ("describe_stream", lambda r: [grpc_bytes("LABELS", [b"cup"] * 1000),
                                                      grpc_fp32("SCORES", [0.001] * 1000)], None, "LABELS"),
    "labels_not_utf8": ("describe_stream", lambda r: [grpc_bytes("LABELS", [b"\xff\xfe"]), grpc_fp32("SCORES", [0.5])],
                        None, "LABELS"),
    "scores_missing": ("describe_stream", lambda r: [grpc_bytes("LABELS", [b"cup"])], None, "SCORES"),
    "describe_prompt_oversized": ("describe_stream", lambda r: [grpc_bytes("LABELS", [b"cup"]), grpc_fp32("SCORES", [0.5]),
                                                                grpc_bytes("PROMPT", [b"x" * 100_000])], None, "PROMPT"),
    "labels_scores_mismatch": ("describe_stream", lambda r: [grpc_bytes("LABELS", [b"cup", b"mug"]),
                                                             grpc_fp32("SCORES", [0.5])], None, "SCORES"),
    "scores_not_finite": ("describe_stream", lambda r: [grpc_bytes("LABELS", [b"cup"]),
                                                        grpc_fp32("SCORES", [float("nan")])], None, "SCORES"),
}
HTTP_BAD = {  # case -> (model, body builder, text the error must name)
    "image_not_a_photo": (PHOTO, lambda r: {"IMAGE": "hello, not a photo"}, "IMAGE"),
    "image_base64_not_a_photo": (PHOTO, lambda r: {"IMAGE": base64.b64encode(b"GIF89a nope").decode()}, "IMAGE"),
    "image_missing": (PHOTO, lambda r: {"PROMPT": "hi"}, "IMAGE"),
    # Triton parses JSON values before the model and says only "Unable to parse" (HTTP 500 in 2.51).
    "image_a_number": (PHOTO, lambda r: {"IMAGE": 5}, "Unable to parse"),
    "prompt_oversized": (PHOTO, lambda r: {"IMAGE": base64.b64encode(r.photo).decode(), "PROMPT": "x" * 100_000},
                         "PROMPT"),
    "temperature_out_of_range": (PHOTO, lambda r: {"IMAGE": base64.b64encode(r.photo).decode(), "temperature": 5},
                                 "temperature"),
    "labels_too_many": ("describe_stream", lambda r: {"LABELS": ["cup"] * 1000, "SCORES": [0.001] * 1000}, "LABELS"),
    "scores_missing": ("describe_stream", lambda r: {"LABELS": ["cup"]}, "SCORES"),
    "describe_prompt_oversized": ("describe_stream", lambda r: {"LABELS": ["cup"], "SCORES": [0.5], "PROMPT": "x" * 100_000},
                                  "PROMPT"),
    "scores_as_text": ("describe_stream", lambda r: {"LABELS": ["cup"], "SCORES": ["high"]}, "Unable to parse"),
}


@pytest.mark.parametrize("case", sorted(GRPC_BAD))
def test_bad_input_over_grpc_gets_one_clear_error(triton, llm, requests_, case):
    model, build, parameters, expect = GRPC_BAD[case]
    requests_before = stats(llm)["requests"]
    stream = grpc_stream(triton.grpc_url, model, build(requests_), parameters)
    assert stream.responses == [] and stream.error is not None, stream.responses
    assert expect.lower() in stream.error.lower(), stream.error
    assert stats(llm)["requests"] == requests_before  # refused before any LLM call
    assert triton.is_ready()


@pytest.mark.parametrize("case", sorted(HTTP_BAD))
def test_bad_input_over_generate_stream_gets_one_clear_error(triton, llm, requests_, case):
    model, build, expect = HTTP_BAD[case]
    requests_before = stats(llm)["requests"]
    stream = http_stream(triton.http_url, model, build(requests_))
    assert stream.responses == [] and stream.error is not None, stream.responses
    assert expect.lower() in stream.error.lower(), stream.error
    assert stats(llm)["requests"] == requests_before
    assert triton.is_ready()


def test_stream_metrics_are_exported(triton):
    """Runs after the streams above (pytest keeps file order)."""
    metrics = triton.metrics()

    def value(name, model="classify_and_describe_stream", extra=""):
        for line in metrics.splitlines():
            if line.startswith(name + "{") and f'model="{model}"' in line and extra in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no {name} for {model} {extra}")

    for model in STREAM_MODELS:
        for histogram in ("describe_stream_time_to_labels_seconds", "describe_stream_time_to_first_token_seconds",
                          "describe_stream_duration_seconds"):
            count = value(histogram + "_count", model)
            assert count > 0 and value(histogram + "_bucket", model, 'le="+Inf"') == count
        # In seconds: the streams above average about 0.2 s (about 200 in milliseconds); the session's
        # other files (held and trickling streams of up to a few seconds) count too, hence 30.
        average_s = value("describe_stream_duration_seconds_sum", model) / value("describe_stream_duration_seconds_count", model)
        assert 0 < average_s < 30, average_s
        # A first token is observed with the first chunk: at least as many chunks as first tokens.
        assert value("describe_stream_chunks_total", model) >= value("describe_stream_time_to_first_token_seconds_count", model)
    assert value("describe_requests_total", extra='outcome="cancelled"') >= 1
    assert value("describe_requests_total", extra='outcome="partial"') >= 1


README = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
GENERATE_STREAM_CURL = [block for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
                        if "/generate_stream" in block]


def test_the_readme_curl_example_of_generate_stream(triton, llm):
    assert len(GENERATE_STREAM_CURL) == 1
    command = GENERATE_STREAM_CURL[0].replace("127.0.0.1:8000", triton.http_url)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=pathlib.Path(__file__).resolve().parents[2],
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    events = [json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("data:")]
    assert events[0]["LABELS"][0] == "espresso" and "DESCRIPTION" not in events[0]
    assert "".join(e.get("DESCRIPTION", "") for e in events).startswith("Fake answer #")
    assert events[-1]["DESCRIPTION_SOURCE"] == "llm" and json.loads(events[-1]["USAGE"])["chunks"] >= 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_client_streams(triton, llm, photos, protocol):
    from classify_describe import AsyncClient, Client

    llm.admin("mode", {"mode": "ok", "chunk_ms": 10, "answer_words": 15})
    url = triton.grpc_url if protocol == "grpc" else triton.http_url
    with Client(url, protocol=protocol) as client:
        events = list(client.stream(photos["coffee"], prompt=f"Sync ({uuid.uuid4().hex})"))
        with pytest.raises(TritonRequestError, match="IMAGE"):
            list(client.stream(b"not a photo"))
    assert [e.kind for e in events] == ["labels"] + ["text"] * 15 + ["done"]
    assert events[0].labels[0] == "espresso" and events[-1].result.description_source == "llm"
    assert events[-1].result.description == "".join(e.text for e in events[1:-1]) == stats(llm)["streamed_answers"][-1]

    async def stream_async():
        async with AsyncClient(url, protocol=protocol) as client:
            return [e async for e in client.stream(photos["chelsea"], prompt=f"Async ({uuid.uuid4().hex})")]

    events = asyncio.run(stream_async())
    assert events[0].kind == "labels" and "cat" in events[0].labels[0]
    assert events[-1].result.description == stats(llm)["streamed_answers"][-1]


def test_leaving_the_client_loop_early_stops_the_upstream(triton, llm, photos):
    from classify_describe import Client

    llm.admin("mode", {"mode": "ok", "chunk_ms": 50, "answer_words": 400})
    before = stats(llm)["disconnected"]
    with Client(triton.grpc_url, protocol="grpc") as client:
        for event in client.stream(photos["coffee"], prompt=f"Early ({uuid.uuid4().hex})"):
            if event.kind == "text":
                break
    deadline = time.monotonic() + 5
    while stats(llm)["disconnected"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(llm)["disconnected"] == before + 1


def test_the_command_line_streams(triton, llm):
    llm.admin("mode", {"mode": "ok", "chunk_ms": 10, "answer_words": 15})
    run = subprocess.run([sys.executable, "-m", "classify_describe", "docs/sample/coffee.png", "--stream",
                          "--json", "--prompt", f"CLI ({uuid.uuid4().hex})", "--url", triton.http_url],
                         cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in run.stdout.splitlines()]
    assert [e["event"] for e in events] == ["labels"] + ["text"] * 15 + ["done"]
    assert events[-1]["result"]["description"] == stats(llm)["streamed_answers"][-1]
