"""The LLM call's span (backends/classify_describe_server/llm_span.py), on each way to
serve, through the model with the OpenTelemetry SDK's in-memory exporter in
place of OTLP: under Triton's span for the step, the upstream called under
it, attributes that say how the call went and nothing of what was asked.
Against a real server and collector: tests/integration/test_tracing.py."""

import base64
import json
import socket
import threading
import time

import numpy as np
import pytest
from classify_describe_server import llm_span
from classify_describe_server.describer import Cancelled
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from test_describe_describer import job, run
from test_describe_model import KEY, make_model
from test_describe_stream_model import labelling_classifier, make_stream_model, sent
from test_describe_trace import TRACEPARENT, traced

from tools.fake_openai import ThreadedFakeOpenAI

TRACE_ID, TRITON_SPAN_ID = TRACEPARENT.split("-")[1:3]
CONTEXT = json.dumps({"traceparent": TRACEPARENT, "tracestate": "rojo=1"})
PROMPT = "What is it? secret-prompt-7f3a"
PHOTO = b"\xff\xd8\xff" + b"secret-photo-bytes" * 4


@pytest.fixture
def fake():
    with ThreadedFakeOpenAI() as fake:
        yield fake


@pytest.fixture
def exported(monkeypatch):
    """Spans on, exported into memory: the list the model's spans end up in once flushed."""
    exporter = InMemorySpanExporter()
    monkeypatch.setenv(llm_span.ENDPOINT_ENV, "http://127.0.0.1:9/v1/traces")
    monkeypatch.setattr(llm_span, "OTLPSpanExporter", lambda: exporter)
    return exporter


def describe_request(pb_utils):
    return pb_utils.InferenceRequest({
        "LABELS": np.array([[b"tabby, tabby cat", b"tiger cat"]], dtype=np.object_),
        "SCORES": np.array([[0.7, 0.2]], dtype=np.float32),
        "PROMPT": np.array([[PROMPT.encode()]], dtype=np.object_),
        "VIEW": np.array([[PHOTO]], dtype=np.object_)})


def serve(pb_utils, monkeypatch, fake, kind, contexts, **params):
    """Run one request per trace context (None: untraced) through a model of `kind`; finalize flushes the spans."""
    if kind == "describe":
        model, make = make_model(monkeypatch, fake.base_url, cache_enabled="false", **params), describe_request
    elif kind == "describe_stream":
        model, make = make_stream_model(monkeypatch, fake.base_url, cache_enabled="false", **params), describe_request
    else:
        monkeypatch.setitem(pb_utils.InferenceRequest.models, "classify", labelling_classifier(pb_utils, []))
        model = make_stream_model(monkeypatch, fake.base_url, classify_model="classify", cache_enabled="false",
                                  **params)

        def make(pb_utils):
            return pb_utils.InferenceRequest({"IMAGE": np.array([[PHOTO]], dtype=np.object_),
                                              "PROMPT": np.array([[PROMPT.encode()]], dtype=np.object_)})
    try:
        for context in contexts:
            req = make(pb_utils)
            if context is not None:
                traced(pb_utils, req, context)
            model.execute([req])
            if kind == "describe":
                req.get_response_sender().wait()
            else:
                assert sent(req, pb_utils)[-1][1], "the stream ended"
    finally:
        model.finalize()
    return model


def texts(span):
    """Every text a span carries to the collector."""
    values = [span.name, span.status.description or ""]
    for attributes in [span.attributes, *(e.attributes for e in span.events)]:
        values += [str(v) for v in attributes.values()]
    return "\n".join(values)


@pytest.mark.parametrize("kind", ["describe", "describe_stream", "classify_and_describe_stream"])
def test_a_traced_call_has_its_span_under_tritons_and_the_upstream_is_called_under_it(
        fake_pb_utils_module, fake, monkeypatch, exported, kind):
    serve(fake_pb_utils_module, monkeypatch, fake, kind, [CONTEXT, None])
    spans = exported.get_finished_spans()
    assert [s.name for s in spans] == ["llm call"], "one span, for the traced request only"
    span = spans[0]
    assert span.kind == SpanKind.CLIENT
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == TRITON_SPAN_ID, "under Triton's span for the step"
    span_id = format(span.context.span_id, "016x")
    assert fake.stats()["traceparents"] == [f"00-{TRACE_ID}-{span_id}-01", None], "the upstream is called under it"
    streamed = kind != "describe"
    a = span.attributes
    assert (a["gen_ai.request.model"], a["llm.outcome"], a["llm.source"], a["llm.attempts"], a["llm.streamed"]) == \
        ("gpt-4o-mini", "ok", "llm", 1, streamed)
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert ("llm.time_to_first_chunk_ms" in a) == streamed
    assert [e.attributes["llm.attempt.outcome"] for e in span.events] == ["ok"]
    assert span.status.status_code == StatusCode.UNSET
    carried = texts(span)
    for secret in (PROMPT, "secret-prompt", "secret-photo", base64.b64encode(PHOTO).decode()[:16], KEY):
        assert secret not in carried, f"{secret!r} in the span"


def test_retries_are_events_and_a_fallback_is_an_error_with_its_reason(
        fake_pb_utils_module, fake, monkeypatch, exported):
    fake.set_mode("500", count=1)  # the first attempt fails, the second answers
    serve(fake_pb_utils_module, monkeypatch, fake, "describe", [CONTEXT], backoff_base_s="0.01")
    fake.set_mode("500")  # every attempt fails: the classification-only fallback
    serve(fake_pb_utils_module, monkeypatch, fake, "describe", [CONTEXT], backoff_base_s="0.01", max_attempts="2")
    retried, fell_back = exported.get_finished_spans()
    assert (retried.attributes["llm.outcome"], retried.attributes["llm.attempts"]) == ("retried", 2)
    assert [e.attributes["llm.attempt.outcome"] for e in retried.events] == ["upstream_error_http_500", "ok"]
    assert retried.status.status_code == StatusCode.UNSET
    assert (fell_back.attributes["llm.outcome"], fell_back.attributes["llm.fallback_reason"]) == \
        ("fallback", "upstream_error_http_500")
    assert (fell_back.status.status_code, fell_back.status.description) == (StatusCode.ERROR, "upstream_error_http_500")


def test_off_without_an_endpoint(fake_pb_utils_module, fake, monkeypatch):
    monkeypatch.delenv(llm_span.ENDPOINT_ENV, raising=False)
    model = serve(fake_pb_utils_module, monkeypatch, fake, "describe", [CONTEXT])
    assert model.spans is None and model.handler.describer.spans is None
    assert fake.stats()["traceparents"] == [TRACEPARENT], "Triton's context goes up as it came"


def test_a_collector_that_never_answers_costs_spans_not_requests(fake_pb_utils_module, fake, monkeypatch):
    """The real OTLP exporter against a socket that accepts and never answers:
    every export waits out its 30 s timeout, on the processor's thread only."""
    collector = socket.socket()
    collector.bind(("127.0.0.1", 0))
    collector.listen(64)  # connections queue and are never answered
    monkeypatch.setenv(llm_span.ENDPOINT_ENV, f"http://127.0.0.1:{collector.getsockname()[1]}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "30")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1")  # the first span leaves at once and the export hangs
    done = threading.Event()

    def run():
        serve(fake_pb_utils_module, monkeypatch, fake, "describe", [CONTEXT] * 5)
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        # Five calls and finalize take well under a second here; each blocking export
        # would take 30 s (and finalize's flush waits at most SPANS_FLUSH_S = 5 s):
        # 20 s tells them apart on a loaded machine.
        assert done.wait(20), "requests or finalize waited for the collector"
    finally:
        collector.close()
    assert len(fake.stats()["traceparents"]) == 5


def test_a_dead_collector_is_said_once_in_the_log_without_its_url(fake_pb_utils_module, fake, monkeypatch):
    """Connection refused on every export: one warning, which names neither the
    URL's query (a collector token may be there) nor the SDK's traceback."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: every export is refused
    monkeypatch.setenv(llm_span.ENDPOINT_ENV, f"http://127.0.0.1:{port}/v1/traces?token=secret-token")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1")
    serve(fake_pb_utils_module, monkeypatch, fake, "describe", [CONTEXT] * 3)
    logged = [message for _, message in fake_pb_utils_module.Logger.records]
    trouble = [m for m in logged if "trouble exporting" in m]
    assert len(trouble) == 1, logged
    assert "ConnectionError" in trouble[0]
    assert not [m for m in logged if "secret-token" in m or "Traceback" in m]
    assert len(fake.stats()["traceparents"]) == 3, "every request went up"


def test_a_cached_answer_a_cancelled_call_and_a_bug_each_end_their_span(fake_pb_utils_module):
    """Straight on the Describer: a call that made no attempt says why, and one
    that ended without a Result ends its span all the same, never quoting the error."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced_job = job(PROMPT, trace=(("traceparent", TRACEPARENT),))

    async def test(fake, d, obs, log):
        d.spans = llm_span.LlmSpans(provider)
        await d.describe(traced_job)
        await d.describe(traced_job)  # from the answer cache

        def broken_emit(text):
            raise RuntimeError(f"a bug that quotes {PROMPT}")
        with pytest.raises(RuntimeError):
            await d.describe(traced_job, emit=broken_emit)  # the cached answer goes to emit at once
        fake.set_mode("hang")
        started = time.monotonic()
        with pytest.raises(Cancelled):
            await d.describe(job("other", timeout_s=20.0, trace=traced_job.trace),
                             is_cancelled=lambda: time.monotonic() - started > 0.2)
    run(test)
    first, cached, bug, cancelled = exporter.get_finished_spans()
    assert (first.attributes["llm.outcome"], first.attributes["llm.attempts"]) == ("ok", 1)
    assert (cached.attributes["llm.outcome"], cached.attributes["llm.attempts"], cached.events) == ("cached", 0, ())
    assert (bug.attributes["llm.outcome"], bug.attributes["error.type"], bug.status.status_code) == \
        ("error", "RuntimeError", StatusCode.ERROR)
    assert bug.attributes["llm.streamed"] is True and PROMPT not in texts(bug)
    assert (cancelled.attributes["llm.outcome"], cancelled.status.status_code) == ("cancelled", StatusCode.UNSET)
    assert all(format(s.parent.span_id, "016x") == TRITON_SPAN_ID for s in (first, cached, bug, cancelled))
