"""A test double of an OpenTelemetry collector: an OTLP/HTTP receiver on a free
loopback port (POST /v1/traces) that keeps every span it is sent.

Triton 2.51's exporter (opentelemetry-cpp's OTLP/HTTP) posts OTLP/JSON
(application/json, ids as lowercase hex); the describe step's LLM-call span
(backends/classify_describe_server/llm_span.py, the Python SDK's exporter) comes as
OTLP protobuf (application/x-protobuf). Anything else is answered 400 and
shown in wait_for's error."""

import base64
import dataclasses
import http.server
import json
import threading

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclasses.dataclass(frozen=True)
class Span:
    trace_id: str        # lowercase hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    attributes: dict
    service: str         # the resource's service.name


def decode_json(body):
    """The spans of one ExportTraceServiceRequest in OTLP/JSON."""
    spans = []
    for resource_spans in json.loads(body)["resourceSpans"]:
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                spans.append(Span(span["traceId"].lower(), span["spanId"].lower(),
                                  span.get("parentSpanId", "").lower(), span["name"],
                                  _attributes(span.get("attributes", [])), resource.get("service.name", "")))
    return spans


def decode_protobuf(body):
    """The spans of one ExportTraceServiceRequest in OTLP protobuf."""
    message = MessageToDict(ExportTraceServiceRequest.FromString(body))
    # protobuf's JSON mapping writes bytes as base64: the ids as OTLP/JSON has them (hex).
    for resource_spans in message.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return decode_json(json.dumps(message))


def _attributes(items):
    """{key: value} of OTLP KeyValues ({"key": k, "value": {"stringValue": v}})."""
    return {item["key"]: next(iter(item.get("value", {}).values()), None) for item in items}


class OtlpReceiver:
    """Start with `with OtlpReceiver() as receiver:`; receiver.url is the traces URL."""

    def __init__(self):
        self.spans, self.posts, self._lock = [], [], threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                kind = self.headers.get("Content-Type", "")
                try:
                    if "json" in kind:
                        spans = decode_json(body)
                    elif "protobuf" in kind:
                        spans = decode_protobuf(body)
                    else:
                        raise ValueError(f"not OTLP/JSON nor protobuf: {kind!r}")
                    error = None
                except (ValueError, KeyError, TypeError, AttributeError, DecodeError) as exc:  # shown by wait_for's error
                    spans, error = [], f"{type(exc).__name__}: {exc}"
                with receiver._lock:
                    receiver.posts.append((self.path, kind, len(body), error))
                    receiver.spans.extend(spans)
                    receiver._lock.notify_all()
                self.send_response(400 if error else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")  # an ExportTraceServiceResponse: all accepted

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, predicate, timeout_s):
        """The spans once predicate(spans) holds; raises TimeoutError with what came."""
        with self._lock:
            if not self._lock.wait_for(lambda: predicate(list(self.spans)), timeout=timeout_s):
                raise TimeoutError(f"posts {self.posts}; spans received: {[(s.name, s.trace_id) for s in self.spans]}")
            return list(self.spans)
