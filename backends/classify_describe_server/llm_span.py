"""The LLM call's span (docs/tracing.md): when Triton traces a request, the
describe step exports a span "llm call" under Triton's span for the step,
through the OpenTelemetry SDK to the collector Triton sends its own spans to,
and the upstream is called with a traceparent naming that span.

One span for the whole call, attempts as its events: an operator looking at a
request wants the LLM step as one bar (slot wait, retries and back-off
included) that says how it ended; an event per attempt says when each one ended
and why it failed. A call that made no attempt (a cached answer, no key, an open
circuit) still gets its span, which says why no upstream call follows.

What a span holds is chosen so that it cannot leak: the model, counts, reasons
from our own vocabulary and token numbers; never the prompt, the conversation,
the photo, the answer, a key or an exception's message (which may quote any of
them).

Off when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is unset (the supervisor sets it
from TRITON_TRACE_OTLP_ENDPOINT): no provider, no thread, nothing per request.
Spans leave from the batch span processor's thread; a queue that is full drops
them (OTEL_BSP_MAX_QUEUE_SIZE), so a slow or dead collector never holds a request.
"""

import logging
import time

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
NAME = "llm call"
# Outcomes where the caller got no full LLM answer: the span's status is ERROR.
FAILED = ("fallback", "error", "partial")

_propagator = TraceContextTextMapPropagator()


def from_environment(environ, log):
    """LlmSpans exporting over OTLP/HTTP protobuf, or None when tracing is off.
    The SDK reads the rest of its settings from the environment itself: the
    endpoint, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*,
    OTEL_EXPORTER_OTLP_TRACES_TIMEOUT. `log`: the model's (model_log.Log)."""
    if not environ.get(ENDPOINT_ENV):
        return None
    sdk_log = logging.getLogger("opentelemetry")
    sdk_log.handlers = [h for h in sdk_log.handlers if not isinstance(h, ExportTrouble)] + [ExportTrouble(log)]
    sdk_log.propagate = False
    # ALWAYS_ON: the decision is Triton's (a span is only made for a request it
    # traces), whatever the sampled flag of the context it hands down.
    provider = TracerProvider(resource=Resource.create(), sampler=ALWAYS_ON)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return LlmSpans(provider)


class ExportTrouble(logging.Handler):
    """The SDK's own warnings (an export failed, the queue is full) into the
    model's log: one line a minute at most, since a collector that is down
    fails every batch, and without the SDK's text or traceback, which quote
    the collector's URL (whose query may hold a token)."""

    EVERY_S = 60.0

    def __init__(self, log, clock=time.monotonic):
        super().__init__(logging.WARNING)
        self.log, self.clock, self.last = log, clock, None

    def emit(self, record):
        now = self.clock()
        if self.last is not None and now - self.last < self.EVERY_S:
            return
        self.last = now
        # The exception's type, or the fixed start of the SDK's message (before its first argument).
        what = type(record.exc_info[1]).__name__ if record.exc_info else str(record.msg).split("%")[0].strip(" :,.")
        self.log.warn(f"LLM-call spans: the OpenTelemetry SDK reports trouble exporting to the collector ({what}); "
                      f"spans may be lost, requests are not affected (at most one such line every {self.EVERY_S:g} s)")


class LlmSpans:
    def __init__(self, provider):
        self.provider = provider
        self.tracer = provider.get_tracer("openai_describe")

    def start(self, job, streamed):
        """The LlmSpan of one call of `job`, under the span its trace context
        (job.trace, from Triton) names; None when that context is not valid."""
        parent = _propagator.extract(dict(job.trace))
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return None
        o = job.overrides
        # The OpenTelemetry GenAI conventions' names where one fits, ours (llm.*) for the rest.
        span = self.tracer.start_span(NAME, context=parent, kind=SpanKind.CLIENT, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": o.model,
            "gen_ai.request.max_tokens": o.max_tokens, "gen_ai.request.temperature": o.temperature,
            "llm.streamed": streamed})
        return LlmSpan(span)

    def flush(self, timeout_s):
        """Send what is queued, waiting at most timeout_s (finalize: the stub
        process ends next, and with it the processor's daemon thread)."""
        self.provider.force_flush(int(timeout_s * 1000))


class LlmSpan:
    def __init__(self, span):
        self.span = span
        carrier = {}
        _propagator.inject(carrier, context=trace.set_span_in_context(span))
        # The headers the upstream is called with: this span is the parent of its spans.
        self.trace = tuple(carrier.items())

    def attempt(self, number, reason, latency_s):
        """One upstream attempt ended: ok, or why it failed (resilience.py's reasons)."""
        self.span.add_event("attempt", {"llm.attempt": number, "llm.attempt.outcome": reason,
                                        "llm.attempt.latency_ms": round(latency_s * 1000.0, 1)})

    def end(self, result):
        """The call ended with this describer.Result."""
        u = result.usage
        attributes = {"llm.outcome": result.outcome, "llm.source": result.source, "llm.attempts": u.attempts,
                      "llm.vision": u.vision,
                      "gen_ai.usage.input_tokens": u.prompt_tokens, "gen_ai.usage.output_tokens": u.completion_tokens}
        if u.fallback_reason:
            attributes["llm.fallback_reason"] = u.fallback_reason
        if u.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = (u.finish_reason,)
        if u.time_to_first_token_ms is not None:
            attributes["llm.time_to_first_chunk_ms"] = round(u.time_to_first_token_ms, 1)
        self.span.set_attributes(attributes)
        if result.outcome in FAILED:
            self.span.set_status(Status(StatusCode.ERROR, u.fallback_reason or result.outcome))
        self.span.end()

    def end_early(self, outcome):
        """The call ended without a Result: "cancelled" (the client left) or an
        exception's type name (unloading, a bug), never its message."""
        if outcome == "cancelled":
            self.span.set_attribute("llm.outcome", outcome)
        else:
            self.span.set_attributes({"llm.outcome": "error", "error.type": outcome})
            self.span.set_status(Status(StatusCode.ERROR, outcome))
        self.span.end()
