"""The front's own Prometheus metrics, served on its port at /metrics (the
pipeline's own are on Triton's metrics port). Labels hold the model id, the
status and a fixed error code, never anything a client sent verbatim, so the
series stay few and no key or prompt can reach them."""

import bisect
import collections

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model_ids):
        self._model_ids = set(model_ids)
        self.requests = collections.Counter()   # (model, stream, status) -> count
        self.errors = collections.Counter()     # (status, code) -> count
        self.tokens = collections.Counter()     # (model, kind) -> count
        self.in_flight = 0
        self._latency = collections.defaultdict(lambda: [0] * (len(BUCKETS_S) + 1))
        self._latency_sum = collections.Counter()

    def _model(self, model):
        return model if model in self._model_ids else "other"

    def observe(self, model, stream, status, seconds, usage=None):
        model, stream = self._model(model), "true" if stream else "false"
        self.requests[(model, stream, str(status))] += 1
        self._latency[(model, stream)][bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self._latency_sum[(model, stream)] += seconds
        if usage:
            self.tokens[(model, "prompt")] += int(usage.get("prompt_tokens") or 0)
            self.tokens[(model, "completion")] += int(usage.get("completion_tokens") or 0)

    def error(self, status, code):
        self.errors[(str(status), code or "none")] += 1

    def render(self):
        lines = [
            "# HELP openai_front_requests_total Chat-completion requests answered, by model, stream and HTTP status.",
            "# TYPE openai_front_requests_total counter"]
        lines += [f'openai_front_requests_total{{model="{m}",stream="{s}",status="{st}"}} {n}'
                  for (m, s, st), n in sorted(self.requests.items())]
        lines += ["# HELP openai_front_errors_total Requests refused or failed, by HTTP status and OpenAI error code.",
                  "# TYPE openai_front_errors_total counter"]
        lines += [f'openai_front_errors_total{{status="{st}",code="{c}"}} {n}' for (st, c), n in sorted(self.errors.items())]
        lines += ["# HELP openai_front_tokens_total LLM tokens reported in usage, by model and kind.",
                  "# TYPE openai_front_tokens_total counter"]
        lines += [f'openai_front_tokens_total{{model="{m}",kind="{k}"}} {n}' for (m, k), n in sorted(self.tokens.items())]
        lines += ["# HELP openai_front_in_flight Chat-completion requests being answered now.",
                  "# TYPE openai_front_in_flight gauge", f"openai_front_in_flight {self.in_flight}",
                  "# HELP openai_front_request_duration_seconds Time from the request to the last byte of its answer.",
                  "# TYPE openai_front_request_duration_seconds histogram"]
        for (m, s), counts in sorted(self._latency.items()):
            labels, cumulative = f'model="{m}",stream="{s}"', 0
            for bound, count in zip([*BUCKETS_S, "+Inf"], counts):
                cumulative += count
                lines.append(f'openai_front_request_duration_seconds_bucket{{{labels},le="{bound}"}} {cumulative}')
            lines.append(f"openai_front_request_duration_seconds_sum{{{labels}}} {self._latency_sum[(m, s)]:.6f}")
            lines.append(f"openai_front_request_duration_seconds_count{{{labels}}} {cumulative}")
        return "\n".join(lines) + "\n"
