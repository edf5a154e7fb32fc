"""Traces end to end (docs/tracing.md): a real server started with
TRITON_TRACE_OTLP_ENDPOINT pointing at an OTLP/HTTP receiver (tests/otlp_receiver.py).
A client's W3C traceparent, sent through the OpenAI front or straight to
Triton, makes spans of the client's trace for the ensemble and each of its
steps (decode + classify: classify_with_view, describe), the describe
step's span for the LLM call under its own (OTLP protobuf from the Python
SDK, where Triton's are OTLP/JSON), and the LLM upstream gets a traceparent
of the same trace whose parent is the LLM call's span. Its own server:
tracing is set at start, and the session's server runs without it.

Over gRPC (the front's way to Triton) Triton 2.51 misreads the traceparent
now and then (docs/tracing.md#a-triton-bug-over-grpc), so a request through
the front may go untraced: those tests try up to FRONT_TRIES fresh requests
and check the first that Triton traced, which the LLM call shows at once."""

import base64
import os
import uuid

import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

from tests.otlp_receiver import OtlpReceiver

from .conftest import running_triton

# Spans leave Triton in batches every OTEL_BSP_SCHEDULE_DELAY ms (set to 100
# below); the bound is for a loaded machine, a pass takes well under a second.
SPANS_TIMEOUT_S = 60
# Measured: 9 of 32 requests over gRPC untraced (about 30%), so 10 in a row about once in 170,000 runs.
FRONT_TRIES = 10


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def traced(fake_llm, receiver, tmp_path_factory):
    # rate 0: only requests that carry a trace context are traced, so every
    # span the receiver gets belongs to a request of these tests.
    with running_triton(tmp_path_factory.mktemp("traced"), fake_llm, {
            "TRITON_TRACE_OTLP_ENDPOINT": receiver.url, "TRITON_TRACE_RATE": "0",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}) as server:
        yield server


def new_context():
    """(trace id, the client's span id, its traceparent)."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def llm_traceparents(fake_llm, trace_id):
    """The traceparents of this trace that the LLM upstream was called with."""
    return [t for t in fake_llm.admin("stats")["traceparents"] if t and t.split("-")[1] == trace_id]


def spans_of(receiver, trace_id, names):
    """The spans of one trace once every name in `names` has a span there."""
    spans = receiver.wait_for(lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id},
                              SPANS_TIMEOUT_S)
    return [s for s in spans if s.trace_id == trace_id]


def one(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.name, s.span_id, s.parent_span_id) for s in spans])
    return found[0]


def check_trace(receiver, fake_llm, trace_id, client_span_id, ensemble, steps, llm_step):
    """Every step's span is under the ensemble's, the whole under the client's
    span, the LLM call's span under llm_step's span, and the upstream called
    under the LLM call's span."""
    # InferRequest, the root, ends last of Triton's spans; the LLM call's span
    # comes from the describe step's own exporter (llm_span.py), in its own time.
    spans = spans_of(receiver, trace_id, {"InferRequest", ensemble, *steps, "llm call"})
    by_id = {s.span_id: s for s in spans}
    root = one(spans, "InferRequest")
    assert root.parent_span_id == client_span_id, "Triton's trace hangs under the client's span"
    assert root.service == "classify-describe"
    top = one(spans, ensemble)
    for step in steps:
        span, chain = one(spans, step), []
        while span.parent_span_id in by_id:  # up to the ensemble's span, through Triton's own
            span = by_id[span.parent_span_id]
            chain.append(span.name)
        assert top.name in chain, f"{step} is not under {ensemble}: {chain}"
    llm_call = one(spans, "llm call")
    assert llm_call.parent_span_id == one(spans, llm_step).span_id, f"the LLM call's span is under {llm_step}'s"
    assert llm_call.service == "classify-describe"
    assert (llm_call.attributes["llm.outcome"], llm_call.attributes["llm.attempts"]) == ("ok", "1")
    assert llm_traceparents(fake_llm, trace_id) == [f"00-{trace_id}-{llm_call.span_id}-01"], \
        "the upstream is called under the LLM call's span"


def ask_front(server, photo, traceparent=None, stream=False):
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    image = "data:image/png;base64," + base64.b64encode(photo).decode()
    answer = client.chat.completions.create(
        model="classify_and_describe", stream=stream, extra_headers={"traceparent": traceparent} if traceparent else None,
        messages=[{"role": "user", "content": [{"type": "text", "text": f"What is it? {uuid.uuid4().hex}"},
                                                {"type": "image_url", "image_url": {"url": image}}]}])
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    return answer.choices[0].message.content


def traced_through_front(server, fake_llm, photo, stream=False):
    """(trace id, client span id) of the first of FRONT_TRIES requests through
    the front that Triton traced: its LLM call came with the trace."""
    for _ in range(FRONT_TRIES):
        trace_id, span_id, traceparent = new_context()
        assert ask_front(server, photo, traceparent, stream)
        if llm_traceparents(fake_llm, trace_id):
            return trace_id, span_id
    pytest.fail(f"none of {FRONT_TRIES} requests with a traceparent through the front was traced")


def ask_triton_http(server, photo, traceparent):
    client = httpclient.InferenceServerClient(server.http_url)
    image = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[photo]], dtype=np.object_))
    prompt = httpclient.InferInput("PROMPT", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[f"What is it? {uuid.uuid4().hex}".encode()]], dtype=np.object_))
    result = client.infer("classify_and_describe", [image, prompt], headers={"traceparent": traceparent})
    assert result.as_numpy("DESCRIPTION")[0]


def test_a_traceparent_through_the_openai_front_traces_every_step_and_reaches_the_llm(
        traced, receiver, fake_llm, photos):
    trace_id, span_id = traced_through_front(traced, fake_llm, photos["coffee"])
    check_trace(receiver, fake_llm, trace_id, span_id, "classify_and_describe", ("classify_with_view", "describe"),
                "describe")


def test_a_streamed_answer_is_traced_and_its_llm_call_too(traced, receiver, fake_llm, photos):
    """stream=True runs classify_and_describe_stream: one model span (its BLS
    classification is not traced, see backends/openai_describe/stream_adapter.py)."""
    trace_id, span_id = traced_through_front(traced, fake_llm, photos["coffee"], stream=True)
    check_trace(receiver, fake_llm, trace_id, span_id, "classify_and_describe_stream", (),
                "classify_and_describe_stream")


def test_a_traceparent_sent_to_triton_over_http_is_always_honoured(traced, receiver, fake_llm, photos):
    for _ in range(3):  # HTTP has no gRPC misreading: every one is traced
        trace_id, span_id, traceparent = new_context()
        ask_triton_http(traced, photos["chelsea"], traceparent)
        check_trace(receiver, fake_llm, trace_id, span_id, "classify_and_describe",
                    ("classify_with_view", "describe"), "describe")


def test_without_a_traceparent_nothing_is_traced_at_rate_0(traced, receiver, fake_llm, photos):
    """The front makes no context up: with TRITON_TRACE_RATE=0 a request without one leaves no span."""
    before = len(receiver.spans)
    assert ask_front(traced, photos["coffee"])
    assert fake_llm.admin("stats")["traceparents"][-1] is None, "its LLM call came without a trace"
    # Then a traced request: once its spans are in, any of the first one's would be
    # too (one batch processor, spans exported in the order they end).
    trace_id, _, traceparent = new_context()
    ask_triton_http(traced, photos["coffee"], traceparent)
    spans_of(receiver, trace_id, {"InferRequest"})
    assert {s.trace_id for s in receiver.spans[before:]} == {trace_id}
