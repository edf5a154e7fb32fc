"""The describe step passes the request's W3C trace context (Triton's
request.trace().get_context() in OpenTelemetry mode) to the LLM upstream as a
`traceparent` header, on each way to serve; without one it sends none. Against
a real server and collector: tests/integration/test_tracing.py."""

import json

import numpy as np
import pytest
from test_describe_model import make_model, request
from test_describe_stream_model import labelling_classifier, make_stream_model, sent

from tools.fake_openai import ThreadedFakeOpenAI

# Triton's span for the describe step, as Triton writes it into the trace's context.
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def fake():
    with ThreadedFakeOpenAI() as fake:
        yield fake


def traced(pb_utils, req, context):
    req._trace = pb_utils.InferenceTrace(context)
    return req


def photo(pb_utils):
    return pb_utils.InferenceRequest({"IMAGE": np.array([[b"\xff\xd8 a photo"]], dtype=np.object_)})


@pytest.mark.parametrize("kind", ["describe", "describe_stream", "classify_and_describe_stream"])
def test_the_upstream_call_carries_the_requests_trace_context(fake_pb_utils_module, fake, monkeypatch, kind):
    pb_utils = fake_pb_utils_module
    if kind == "describe":
        model, make = make_model(monkeypatch, fake.base_url, cache_enabled="false"), lambda: request(pb_utils)
    elif kind == "describe_stream":
        model, make = make_stream_model(monkeypatch, fake.base_url, cache_enabled="false"), lambda: request(pb_utils)
    else:
        monkeypatch.setitem(pb_utils.InferenceRequest.models, "classify", labelling_classifier(pb_utils, []))
        model = make_stream_model(monkeypatch, fake.base_url, classify_model="classify", cache_enabled="false")
        make = lambda: photo(pb_utils)  # noqa: E731
    try:
        context = json.dumps({"traceparent": TRACEPARENT, "tracestate": "rojo=1"})
        for req in (traced(pb_utils, make(), context), make(), traced(pb_utils, make(), "not json")):
            model.execute([req])
            if kind == "describe":
                req.get_response_sender().wait()
            else:
                assert sent(req, pb_utils)[-1][1], "the stream ended"
    finally:
        model.finalize()
    assert fake.stats()["traceparents"] == [TRACEPARENT, None, None]


def test_the_trace_context_is_not_part_of_the_question(fake_pb_utils_module, fake, monkeypatch):
    """Two requests that differ only in their trace share the cached answer."""
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    try:
        for parent in ("00f067aa0ba902b7", "00f067aa0ba902b8"):
            req = traced(pb_utils, request(pb_utils), json.dumps({"traceparent": TRACEPARENT[:36] + parent + "-01"}))
            model.execute([req])
            req.get_response_sender().wait()
    finally:
        model.finalize()
    assert fake.stats()["requests"] == 1
