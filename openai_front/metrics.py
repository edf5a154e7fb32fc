"""The front's own Prometheus metrics, served on its port at /metrics (the
pipeline's own are on Triton's metrics port) by prometheus_client, with its
process and Python runtime metrics. Labels hold the model id, the status and
a fixed error code, never anything a client sent verbatim, so the series stay
few and no key or prompt can reach them.

The names and labels are a contract (dashboards and alerts use them):
openai_front_requests_total, openai_front_errors_total,
openai_front_tokens_total, openai_front_in_flight,
openai_front_admission_limit and the openai_front_request_duration_seconds
histogram."""

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# The exposition keeps exactly the series named above: without this, every
# counter and histogram child would add a `<name>_created` series as well.
prometheus_client.disable_created_metrics()


class Metrics:
    """One registry per app (tests build several in one process)."""

    def __init__(self, model_ids, admission_limit=lambda: 0):
        self._model_ids = set(model_ids)
        self.registry = CollectorRegistry()
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)
        self.requests = Counter("openai_front_requests", "Chat-completion requests answered, by model, stream "
                                "and HTTP status.", ["model", "stream", "status"], registry=self.registry)
        self.errors = Counter("openai_front_errors", "Requests refused or failed, by HTTP status and OpenAI error "
                              "code.", ["status", "code"], registry=self.registry)
        self.tokens = Counter("openai_front_tokens", "LLM tokens reported in usage, by model and kind.",
                              ["model", "kind"], registry=self.registry)
        # A plain number the handlers count up and down; the gauge reads it at each scrape.
        self.in_flight = 0
        Gauge("openai_front_in_flight", "Chat-completion requests being answered now.",
              registry=self.registry).set_function(lambda: self.in_flight)
        Gauge("openai_front_admission_limit", "Chat-completion requests the front passes on at once now, learnt "
              "from Triton's refusals (at most OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT).",
              registry=self.registry).set_function(admission_limit)
        self.latency = Histogram("openai_front_request_duration_seconds", "Time from the request to the last "
                                 "byte of its answer.", ["model", "stream"], buckets=BUCKETS_S,
                                 registry=self.registry)
        # The GET /metrics handler: the text format, or OpenMetrics when the scraper asks for it.
        self.serve = make_aiohttp_handler(self.registry)

    def _model(self, model):
        return model if model in self._model_ids else "other"

    def observe(self, model, stream, status, seconds, usage=None):
        model, stream = self._model(model), "true" if stream else "false"
        self.requests.labels(model, stream, str(status)).inc()
        self.latency.labels(model, stream).observe(seconds)
        if usage:
            self.tokens.labels(model, "prompt").inc(int(usage.get("prompt_tokens") or 0))
            self.tokens.labels(model, "completion").inc(int(usage.get("completion_tokens") or 0))

    def error(self, status, code):
        self.errors.labels(str(status), code or "none").inc()

    def render(self):
        """The text exposition (format 0.0.4), as a scrape without an Accept header gets it."""
        return prometheus_client.generate_latest(self.registry).decode()
