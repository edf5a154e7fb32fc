"""Token usage and money spent, as reported in the USAGE output."""

import json
import math
from dataclasses import asdict, dataclass

# Characters per token when the tokens must be estimated (OpenAI's rule of thumb for English).
CHARS_PER_TOKEN_ESTIMATE = 4


@dataclass
class Usage:
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cost_usd: float = 0.0  # None: the model's price is unknown (settings.prices_for)
    upstream_latency_ms: float = 0.0  # time spent waiting on upstream attempts (not back-off)
    attempts: int = 0
    cached: bool = False
    fallback_reason: str = None
    # The upstream's own finish_reason ("stop", "length", ...) for an LLM
    # answer, passed on as it came (the OpenAI front answers with it); None
    # for a fallback, a stream cut short, or an upstream that sent none.
    finish_reason: str = None
    # Whether the LLM was shown the photo; when not, why (off, no_view, refused_by_upstream,
    # fallback). Image tokens are in prompt_tokens, as the upstream counts them.
    vision: bool = False
    vision_skipped_reason: str = None
    # Streams only (describe_stream), left out of the JSON otherwise: from the
    # step receiving the request to the first text chunk sent, and the chunks sent.
    time_to_first_token_ms: float = None
    chunks: int = None
    # True when some of the tokens above are estimated (billed_tokens): an answer, whole or
    # streamed, cut short or complete, that came without usage. Left out otherwise.
    tokens_estimated: bool = None

    def to_json(self):
        fields = asdict(self)
        fields["cost_usd"] = None if self.cost_usd is None else round(self.cost_usd, 9)
        fields["upstream_latency_ms"] = round(self.upstream_latency_ms, 1)
        for name in STREAM_FIELDS:
            if fields[name] is None:
                del fields[name]
        if self.time_to_first_token_ms is not None:
            fields["time_to_first_token_ms"] = round(self.time_to_first_token_ms, 1)
        return json.dumps(fields, separators=(",", ":"))


STREAM_FIELDS = ("time_to_first_token_ms", "chunks", "tokens_estimated")


def cost_usd(prompt_tokens, completion_tokens, prices):
    """USD for the tokens at `prices` (input, output per million), None when prices is None."""
    if prices is None:
        return None
    price_input_per_million, price_output_per_million = prices
    return (prompt_tokens * price_input_per_million + completion_tokens * price_output_per_million) / 1e6


def add_cost(total, cost):
    """A running cost plus one more: unknown (None) once any part is."""
    return None if total is None or cost is None else total + cost


# More tokens than any model's context holds: a count past it is not a count.
MAX_REPORTED_TOKENS = 100_000_000


def billed_tokens(reported, messages, answer_chars):
    """(prompt, completion, estimated) for one answer the upstream sent, whole or streamed,
    complete or cut short: its usage as reported, or, where it sent none that can be read (a
    local server's stream, a stream cut before its usage chunk), an estimate from the prompt's
    text and the answer's (estimated_tokens). The one rule for both paths."""
    prompt_tokens, completion_tokens = tokens_from(reported)
    if prompt_tokens or completion_tokens:
        return prompt_tokens, completion_tokens, False
    return estimated_tokens(message_chars(messages)), estimated_tokens(answer_chars), True


def tokens_from(usage):
    """(prompt, completion) tokens from an SDK usage object, (0, 0) for none; a count
    that is not one (negative, fractional, text, absurd) is 0: billed as sent, it would
    write a negative or unbounded cost into USAGE and the metrics' counters, or fail the
    answer it came with (billed_tokens then estimates)."""
    if usage is None:
        return 0, 0
    return _token_count(getattr(usage, "prompt_tokens", 0)), _token_count(getattr(usage, "completion_tokens", 0))


def _token_count(value):
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)  # as some servers write it: "12"
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPORTED_TOKENS:
        return 0
    return value


def estimated_tokens(chars):
    """Tokens for `chars` characters of text, CHARS_PER_TOKEN_ESTIMATE a token, rounded up."""
    return math.ceil(chars / CHARS_PER_TOKEN_ESTIMATE)


def message_chars(messages):
    """Characters of text in chat messages (a content string, or its text parts)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return total


def finish_reason_of(response):
    """The finish_reason of a chat completion or of a stream's chunk, or None."""
    try:
        reason = response.choices[0].finish_reason
    except (AttributeError, IndexError, TypeError):
        return None
    return reason if isinstance(reason, str) else None
