"""W3C trace context (https://www.w3.org/TR/trace-context/) from the client to
Triton: the client's `traceparent` and `tracestate` headers go on as gRPC
metadata, where Triton's OpenTelemetry mode reads them, so Triton's spans join
the client's trace (docs/tracing.md).

Without a valid traceparent nothing is sent and Triton starts the trace itself
at its sampling rate: a context made up here would make Triton trace every
request (a request that carries one is always traced), whatever
TRITON_TRACE_RATE says. Headers that are not valid W3C values are dropped, not
passed on: gRPC refuses metadata values that are not printable ASCII."""

import re

# version-trace_id-parent_id-flags, lowercase hex; version ff is invalid, and so
# are all-zero ids.
_TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
# tracestate: passed on as it came when it is printable ASCII of at most 512
# characters (what the spec asks every vendor to keep); else dropped.
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")


def grpc_metadata(headers):
    """The (key, value) pairs to send to Triton with this HTTP request's call: the
    trace context when the client sent a valid one, else ()."""
    traceparent = headers.get("traceparent", "").strip()
    # A version after 00 may append fields; those are not understood here.
    if not _TRACEPARENT.fullmatch(traceparent):
        return ()
    metadata = [("traceparent", traceparent)]
    tracestate = headers.get("tracestate", "").strip()
    if tracestate and _TRACESTATE.fullmatch(tracestate):
        metadata.append(("tracestate", tracestate))
    return tuple(metadata)
