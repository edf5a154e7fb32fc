"""The client's pure parts at their edges: how each failure is reported, how
stream responses and server-sent events become events, and how a response
becomes a Result (found by `make mutants`, docs/mutation.md). The client
against real servers: tests/unit/test_client.py."""

import asyncio
import base64
import http.client
import inspect
import json
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from classify_describe import client as c


def error(status, message="m"):
    return InferenceServerException(message, status=status)


@pytest.mark.parametrize("failure, retryable, answered, message", [
    # Triton's queue policy: full, or waited past its time limit (the server answered both)
    (error("StatusCode.UNAVAILABLE", "Exceeds maximum queue size"), True, True, "Exceeds maximum queue size"),
    (error("StatusCode.UNAVAILABLE", "in ensemble 'classify', Request timeout expired"), True, True,
     "in ensemble 'classify', Request timeout expired"),
    (error("StatusCode.UNAVAILABLE", "failed to connect"), True, False, "failed to connect"),
    (error("503", "stopping"), True, True, "stopping"),
    (error("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded"), True, False, "Deadline Exceeded"),
    (error("400", "bad image"), False, True, "bad image"),
    (error("StatusCode.INVALID_ARGUMENT", None), False, True, None),
    (TimeoutError(), True, False, "no answer within 2.5 s (timed out)"),
    (asyncio.TimeoutError(), True, False, "no answer within 2.5 s (timed out)"),
    (ConnectionRefusedError("refused"), True, False, "no answer: refused"),
    (ConnectionResetError(), True, False, "no answer: ConnectionResetError"),
    (http.client.RemoteDisconnected("closed"), True, False, "no answer: closed"),
    (ValueError("odd"), False, False, "ValueError: odd"),
])
def test_each_failure_is_reported_as_what_it_is(failure, retryable, answered, message):
    reported = c._request_error(failure, httpclient, 2.5)
    assert (reported.retryable, reported.answered) == (retryable, answered)
    assert reported.__cause__ is failure
    if message is not None:
        assert str(reported) == message


def test_aiohttp_connection_failures_count_as_no_answer():
    import aiohttp

    assert c._retryable(aiohttp.ClientConnectionError(), httpclient)
    assert c._retryable(aiohttp.ClientPayloadError(), httpclient)
    assert not c._retryable(aiohttp.ClientResponseError(None, ()), httpclient)


def test_stream_responses_become_labels_text_and_done():
    state = c._StreamState()
    [labels] = state.events({"LABELS": np.array([b"tabby", "cat"], dtype=object), "SCORES": np.array([0.75, 0.25])})
    assert (labels.kind, labels.labels, labels.scores) == ("labels", ["tabby", "cat"], [0.75, 0.25])
    assert list(state.events({"DESCRIPTION": b""})) == []  # an empty chunk is no event
    [first] = state.events({"DESCRIPTION": b"A ca"})
    [second] = state.events({"DESCRIPTION": "t."})
    assert (first.kind, first.text, second.text) == ("text", "A ca", "t.")
    [done] = state.events({"DESCRIPTION_SOURCE": b"llm", "USAGE": b'{"total_tokens": 5}'})
    assert done.kind == "done"
    result = done.result
    assert (result.labels, result.scores, result.description, result.description_source, result.usage) == (
        ["tabby", "cat"], [0.75, 0.25], "A cat.", "llm", {"total_tokens": 5})
    assert result.latency_ms >= 0


def test_a_final_response_with_text_and_odd_usage():
    state = c._StreamState()
    events = list(state.events({"LABELS": [b"x"], "SCORES": [1.0], "DESCRIPTION": b"all", "DESCRIPTION_SOURCE": b"fallback",
                                "USAGE": b"not json"}))
    assert [e.kind for e in events] == ["labels", "text", "done"]
    assert events[-1].result.usage == {"raw": "not json"} and events[-1].result.description == "all"
    [done] = c._StreamState().events({"DESCRIPTION_SOURCE": b"llm"})
    assert done.result.usage == {} and done.result.labels == []


def test_server_sent_events_become_outputs():
    assert c._sse_outputs("") is None and c._sse_outputs(": keep-alive") is None
    line = "data: " + json.dumps({"LABELS": ["a", "b"], "SCORES": [0.5, 0.25], "DESCRIPTION": ["text"],
                                  "DESCRIPTION_SOURCE": "llm", "USAGE": "{}", "model_name": "x"})
    assert c._sse_outputs(line) == {"LABELS": ["a", "b"], "SCORES": [0.5, 0.25], "DESCRIPTION": "text",
                                    "DESCRIPTION_SOURCE": "llm", "USAGE": "{}"}
    with pytest.raises(c.TritonRequestError) as info:
        c._sse_outputs('data:{"error": "model busy"}')
    assert str(info.value) == "model busy" and info.value.answered and not info.value.retryable


def test_the_generate_body_carries_the_photo_as_base64_and_the_parameters():
    body = json.loads(c._generate_body(bytearray(b"\x89PNG"), "why?", {"temperature": 0.5}))
    assert body == {"IMAGE": base64.b64encode(b"\x89PNG").decode(), "PROMPT": "why?", "temperature": 0.5}
    assert json.loads(c._generate_body(b"x", None, None)) == {"IMAGE": "eA=="}
    with pytest.raises(TypeError, match="image must be the encoded bytes"):
        c._generate_body("photo.jpg", None, None)


def test_protocols():
    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http.aio as http_aio

    assert c._protocol_module("http", False) is httpclient and c._protocol_module("http", True) is http_aio
    assert c._protocol_module("grpc", False) is grpcclient and c._protocol_module("grpc", True) is grpc_aio
    with pytest.raises(ValueError, match="protocol must be 'http' or 'grpc', not 'ftp'"):
        c._protocol_module("ftp", False)


@pytest.mark.parametrize("module", [httpclient, grpcclient])
def test_the_inputs_are_the_photo_and_the_utf8_prompt_and_every_output_is_asked_for(module):
    inputs, outputs = c._build_inputs(module, bytearray(b"img"), "café")
    assert [i.name() for i in inputs] == ["IMAGE", "PROMPT"]
    assert [i.shape() for i in inputs] == [[1, 1], [1, 1]] and {i.datatype() for i in inputs} == {"BYTES"}
    assert [o.name() for o in outputs] == list(c.OUTPUT_NAMES)
    assert [i.name() for i in c._build_inputs(module, b"img", None)[0]] == ["IMAGE"]
    with pytest.raises(TypeError):
        c._build_inputs(module, None, None)


class Response:
    def __init__(self, usage=b'{"cost_usd": 1e-06}'):
        self.outputs = {"LABELS": np.array([[b"tabby, tabby cat", b"caf\xc3\xa9"]], dtype=object),
                        "SCORES": np.array([[0.5, 0.25]], dtype=np.float32),
                        "DESCRIPTION": np.array([[b"A cat \xff"]], dtype=object),
                        "DESCRIPTION_SOURCE": np.array([[b"llm"]], dtype=object),
                        "USAGE": np.array([[usage]], dtype=object)}

    def as_numpy(self, name):
        return self.outputs[name]


def test_a_response_becomes_a_result():
    result = c._parse(Response(), 12.3456)
    assert result.as_dict() == {"labels": ["tabby, tabby cat", "café"], "scores": [0.5, 0.25],
                                "description": "A cat \ufffd", "description_source": "llm",
                                "usage": {"cost_usd": 1e-06}, "latency_ms": 12.35}
    assert c._parse(Response(usage=b"{broken"), 0).usage == {"raw": "{broken"}
    with pytest.raises(ValueError, match="output LABELS holds a int, not text"):  # a number is no label
        c._text(7, "LABELS")


def test_a_streams_latency_is_the_milliseconds_since_it_started():
    state = c._StreamState()
    time.sleep(0.05)  # a lower bound only: sleep never returns early
    [done] = state.events({"DESCRIPTION_SOURCE": b"llm"})
    assert 50 <= done.result.latency_ms < 600_000  # the upper bound only rules out a clock reading, not speed


def test_an_image_that_is_not_bytes_is_refused_with_what_to_send():
    for build in (lambda: c._generate_body("photo.jpg", None, None), lambda: c._build_inputs(httpclient, "photo.jpg", None)):
        with pytest.raises(TypeError) as info:
            build()
        assert str(info.value) == "image must be the encoded bytes of a photo (JPEG, PNG, ...)"


@pytest.mark.parametrize("cls", [c.Client, c.AsyncClient])
def test_the_documented_defaults(cls):
    defaults = {name: p.default for name, p in inspect.signature(cls).parameters.items()}
    assert (defaults["url"], defaults["protocol"], defaults["model_name"], defaults["timeout_s"]) == (
        "127.0.0.1:8000", "http", "classify_and_describe", 120.0)
    assert (defaults["retries"], defaults["retry_backoff_s"]) == (0, 0.5)
