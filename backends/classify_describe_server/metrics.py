"""Prometheus metrics of the describe step, fed by the Describer through the Observer
interface. `family` is pb_utils.MetricFamily, handed in by the backend's model.py."""

import threading

from .describer import Observer

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
# The streaming step's own delay before the labels go out: IPC and our loop, no network.
LABELS_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1]
OUTCOMES = ("ok", "retried", "cached", "fallback", "partial", "error", "cancelled", "invalid", "overloaded")
CIRCUIT_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}


class Metrics(Observer):
    """Prometheus metrics through Triton's MetricFamily, labelled with the Triton
    model and version; per-upstream-model series are created on first use.

    Every Metric call is a round trip to the Triton process. About ten per
    request cost more than the request itself at 500 requests/s, so updates
    are buffered here and written by `flush()` every FLUSH_S seconds (counters
    summed, gauges at their latest value, histogram observations replayed).
    """

    FLUSH_S = 0.25

    def __init__(self, family, labels, streams=False):
        self.labels = labels
        self.requests = family("describe_requests_total",
                               "Describe requests by outcome (ok, retried, cached, fallback, partial, error, "
                               "cancelled, invalid, overloaded)", family.COUNTER)
        self.prompt_tokens = family("describe_prompt_tokens_total", "Prompt tokens billed upstream",
                                    family.COUNTER)
        self.completion_tokens = family("describe_completion_tokens_total",
                                        "Completion tokens billed upstream", family.COUNTER)
        self.cost = family("describe_cost_usd_total", "Upstream cost in US dollars", family.COUNTER)
        # outcome says how the request was answered without a whole LLM text; reason
        # is the describer's fixed failure name (timeout, circuit_open, rate_limited_http_429...),
        # never free text, so the series stay few.
        self.fallbacks = family("describe_fallbacks_total",
                                "Requests answered without a whole LLM text (fallback, partial, error), "
                                "by outcome and reason", family.COUNTER)
        self.latency = family("describe_upstream_latency_seconds",
                              "Latency of each upstream attempt, by result", family.HISTOGRAM)
        self.circuit_state = family("describe_circuit_state",
                                    "Circuit breaker per upstream model: 0 closed, 1 half-open, 2 open",
                                    family.GAUGE)
        in_flight = family("describe_upstream_in_flight", "Upstream calls in flight", family.GAUGE)
        queued = family("describe_upstream_queued", "Upstream calls waiting for a slot under max_in_flight",
                        family.GAUGE)
        lookups = family("describe_cache_lookups_total", "In-model LLM answer cache lookups",
                         family.COUNTER)
        # A MetricFamily must outlive its Metrics (the stub refuses updates otherwise).
        self._families = [in_flight, queued, lookups]
        self.in_flight_gauge = in_flight.Metric(labels=labels)
        self.queued_gauge = queued.Metric(labels=labels)
        self.cache_hit = lookups.Metric(labels=dict(labels, result="hit"))
        self.cache_miss = lookups.Metric(labels=dict(labels, result="miss"))
        self._series = {}
        self._lock = threading.Lock()  # the model thread counts rejected requests too
        self._counts, self._gauges, self._observations = {}, {}, []
        for outcome in OUTCOMES:  # created up front, so every outcome shows from the start
            self._metric(self.requests, outcome=outcome)
        if streams:
            self._stream_metrics(family)

    def _stream_metrics(self, family):
        """The streaming model's own series (describe_stream); cancelled streams are
        describe_requests_total{outcome="cancelled"}."""
        times = [
            family("describe_stream_time_to_labels_seconds",
                   "From the streaming step receiving a request to its first response (LABELS, SCORES) sent",
                   family.HISTOGRAM),
            family("describe_stream_time_to_first_token_seconds",
                   "From the streaming step receiving a request to the first text chunk sent", family.HISTOGRAM),
            family("describe_stream_duration_seconds",
                   "From the streaming step receiving a request to its last response sent", family.HISTOGRAM),
        ]
        chunks = family("describe_stream_chunks_total", "Text chunks sent by the streaming step", family.COUNTER)
        self._families += times + [chunks]
        self.time_to_labels = times[0].Metric(labels=self.labels, buckets=LABELS_BUCKETS_S)
        self.time_to_first_token = times[1].Metric(labels=self.labels, buckets=LATENCY_BUCKETS_S)
        self.stream_duration = times[2].Metric(labels=self.labels, buckets=LATENCY_BUCKETS_S)
        self.chunks = chunks.Metric(labels=self.labels)

    def stream_started(self):
        return _StreamTimes(self)

    def _observe(self, metric, value):
        with self._lock:
            self._observations.append((metric, value))

    def _metric(self, family, buckets=None, **extra):
        key = (id(family), tuple(sorted(extra.items())))
        metric = self._series.get(key)
        if metric is None:
            with self._lock:
                metric = self._series.get(key)
                if metric is None:
                    labels = dict(self.labels, **extra)
                    metric = family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)
                    self._series[key] = metric
        return metric

    def _add(self, metric, value):
        with self._lock:
            self._counts[metric] = self._counts.get(metric, 0) + value

    def _set(self, metric, value):
        with self._lock:
            self._gauges[metric] = value

    def flush(self):
        with self._lock:
            counts, gauges, observations = self._counts, self._gauges, self._observations
            self._counts, self._gauges, self._observations = {}, {}, []
        for metric, value in counts.items():
            metric.increment(value)
        for metric, value in gauges.items():
            metric.set(value)
        for metric, value in observations:
            metric.observe(value)

    # -- Observer ------------------------------------------------------------------

    def request_done(self, model, outcome, usage):
        self._add(self._metric(self.requests, outcome=outcome), 1)
        if usage is not None and usage.fallback_reason:
            self._add(self._metric(self.fallbacks, upstream_model=model, outcome=outcome,
                                   reason=usage.fallback_reason), 1)
        if usage is not None and usage.total_tokens:
            self._add(self._metric(self.prompt_tokens, upstream_model=model), usage.prompt_tokens)
            self._add(self._metric(self.completion_tokens, upstream_model=model), usage.completion_tokens)
            if usage.cost_usd is not None:  # an unknown price counts no cost, not a made-up one
                self._add(self._metric(self.cost, upstream_model=model), usage.cost_usd)

    def attempt_done(self, model, latency_s, reason):
        metric = self._metric(self.latency, buckets=LATENCY_BUCKETS_S, upstream_model=model, result=reason)
        with self._lock:
            self._observations.append((metric, latency_s))

    def in_flight(self, count):
        self._set(self.in_flight_gauge, count)

    def queued(self, count):
        self._set(self.queued_gauge, count)

    def circuit(self, model, state):
        self._set(self._metric(self.circuit_state, upstream_model=model), CIRCUIT_STATE_VALUE[state])

    def cache(self, hit):
        self._add(self.cache_hit if hit else self.cache_miss, 1)


class _StreamTimes:
    """One stream's times, in seconds since the step received the request."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.chunks = 0

    def labels(self, elapsed_s):
        self.metrics._observe(self.metrics.time_to_labels, elapsed_s)

    def chunk(self, elapsed_s):
        if self.chunks == 0:
            self.metrics._observe(self.metrics.time_to_first_token, elapsed_s)
        self.chunks += 1

    def done(self, elapsed_s):
        self.metrics._observe(self.metrics.stream_duration, elapsed_s)
        if self.chunks:
            self.metrics._add(self.metrics.chunks, self.chunks)
