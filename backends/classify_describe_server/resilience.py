"""Retry decisions, back-off and the circuit breaker. No network, no Triton:
the clock and the random source are injectable so tests are exact."""

import email.utils
import random
import re
import time
from dataclasses import dataclass

# Status codes that retrying cannot fix: the request or the credentials are wrong.
NO_RETRY_STATUS = {400, 401, 403, 404, 422}
# The reason of an attempt whose model refused the image part (vision=auto then asks text-only).
IMAGE_REFUSED = "image_refused_by_upstream"
# The reason of an image request's attempt that failed as a request without the image may not:
# a server that takes no list content or no images and says so in words of its own (llama.cpp's
# 500, Groq's 400 "'messages.1.content' : value must be a string"). vision=auto asks again
# text-only; never the upstream's fault, so it opens no circuit.
IMAGE_FAILED = "image_request_failed"
# What upstreams say when a model takes no images: OpenAI "... does not support image input" /
# "image_url is only supported by certain models", vLLM "... is not a multimodal model" / "At most 0
# image(s) may be provided", DeepSeek "unknown variant `image_url`", and the like. Both a word for
# images and a phrase of refusal: "You uploaded an unsupported image" or "Image exceeds max size" is
# about this photo, and read as a refusal it would turn vision off for every request for a while.
_IMAGE_WORDS = ("image", "multimodal", "vision")
_REFUSAL_PHRASES = ("not support", "n't support", "only supported", "not a multimodal", "not multimodal",
                    "not a vision", "unknown variant", "unsupported content type", "at most 0",
                    "missing data required for image input", "not enabled", "not available for this model",
                    "unsupported content part", "must be a string")


def refuses_image(status, body, message):
    """Whether an error answer says the model does not take image input."""
    if status not in (400, 422):
        return False
    text = f"{message} {body}".lower()
    return any(word in text for word in _IMAGE_WORDS) and any(phrase in text for phrase in _REFUSAL_PHRASES)


# Words an error about the request's content says it in: the parts, a list where a string was
# wanted (llama.cpp's "can only concatenate str (not "list") to str"), the image.
_CONTENT_WORDS = re.compile(r"\b(content|parts?|list|str|string|image|image_url|multimodal|vision)\b", re.I)


def image_may_be_why(status, message):
    """Whether an image request answered `status` with `message` may succeed without the image:
    any 4xx but authentication, a wrong path, a timeout, a conflict and rate limits (the same
    text-only), or a 500 or 501 (a server whose template cannot take the parts; 502-504 are its
    availability), whose message speaks of the content. A 500 that says nothing of it is the
    upstream's own trouble, retried as such, and never turns vision off."""
    return (((400 <= status < 500 and status not in (401, 403, 404, 408, 409, 429)) or status in (500, 501))
            and bool(_CONTENT_WORDS.search(message or "")))


class Cancelled(Exception):
    """The client gave up on the request (Triton request cancellation)."""


class MalformedResponse(Exception):
    """A 200 whose body holds no usable answer: retried like a glitch."""


class EmptyStream(MalformedResponse):
    """A stream that ended without any text: what llama-cpp-python's server streams when its chat
    template fails on the request's parts after the 200 went out."""

    def __init__(self):
        super().__init__("the stream ended without text")


class UnreadableAnswer(MalformedResponse):
    """A 200 whose body could not be parsed at all (not JSON, not UTF-8): the upstream billed it
    all the same, so its tokens are estimated from its size, as a stream cut short is."""

    def __init__(self, body_bytes):
        super().__init__(f"the answer's {body_bytes} bytes are not JSON")
        self.body_bytes = body_bytes


@dataclass(frozen=True)
class Failure:
    """What went wrong with one upstream attempt, in words safe to log and return."""

    reason: str               # short code: rate_limited_http_429, timeout, connection_error, ...
    retryable: bool
    retry_after_s: float = None  # from the Retry-After header, when the upstream sent one
    # Whether the failure says something about the upstream's health
    # (counts toward opening the circuit); a 400 or 401 does not.
    upstream_fault: bool = True


class AnswerTooLarge(Exception):
    """An upstream response body past the bytes read of one (describer.response_bytes_limit)."""


# An answer longer than its max_tokens allows, or than max_answer_chars: cut there
# (or, past the body's byte limit, unread), never cached, not retried (the same
# request would run long again), and no verdict on the upstream's health.
ANSWER_TOO_LONG = Failure("answer_too_long", retryable=False, upstream_fault=False)


# What a status means to the operator reading USAGE.fallback_reason or the metrics.
STATUS_MEANING = {
    400: "bad_request", 401: "authentication_failed", 403: "permission_denied",
    404: "model_or_endpoint_not_found", 408: "upstream_timeout", 422: "bad_request",
    429: "rate_limited",
}


def status_reason(status):
    meaning = STATUS_MEANING.get(status, "upstream_error" if status >= 500 else "unexpected_status")
    return f"{meaning}_http_{status}"


def classify_status(status, headers=None):
    retry_after = parse_retry_after(headers or {})
    reason = status_reason(status)
    if status in NO_RETRY_STATUS:
        return Failure(reason, retryable=False, upstream_fault=False)
    if status == 429 or status == 408 or status == 409 or status >= 500:
        return Failure(reason, retryable=True, retry_after_s=retry_after)
    return Failure(reason, retryable=False, upstream_fault=False)


def parse_retry_after(headers, now=None):
    """Seconds to wait from `retry-after-ms`, or `retry-after` as seconds or an
    HTTP date; None when absent or unreadable."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # a year past datetime's (9999) or the platform's time_t is an OverflowError
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, OverflowError):
        return None
    now = time.time() if now is None else now
    return max(0.0, when - now)


def backoff_delay(attempt, base_s, max_s, retry_after_s=None, rand=random.random):
    """Delay before attempt `attempt + 1` (attempt counts from 1).

    Exponential with full jitter spreads synchronized retries of many
    requests; a Retry-After from the upstream is a floor, not a suggestion.
    """
    ceiling = min(max_s, base_s * (2 ** (attempt - 1)))
    delay = ceiling * rand()
    if retry_after_s is not None:
        # Honour the server's wait, plus a little jitter so 500 waiting
        # requests do not all come back in the same millisecond.
        delay = retry_after_s + min(delay, 0.1 * max(retry_after_s, base_s))
    return delay


class CircuitBreaker:
    """Closed -> open after `threshold` consecutive upstream faults; after
    `cooldown_s` one probe call is let through (half-open): success closes
    the circuit, failure opens it again for another cooldown.

    allow() gives each call it lets through a ticket, the breaker's state
    generation at that moment, and the call hands it back with its verdict.
    A verdict on an older ticket is ignored: a call that started before the
    circuit opened and ends during half-open says nothing about the probe,
    so it must neither close nor re-open the circuit, nor free the probe's
    place for a second probe.

    Used from one asyncio loop thread only, so it needs no lock.
    """

    CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"

    def __init__(self, threshold, cooldown_s, clock=time.monotonic, on_change=None):
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change or (lambda state: None)
        self.state = self.CLOSED
        self._generation = 0  # bumped on every change of state
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False

    def allow(self):
        """A ticket if a call may go upstream now, else None. In half-open, only the single probe may."""
        if self.state == self.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._set(self.HALF_OPEN)
        if self.state == self.CLOSED:
            return self._generation
        if self.state == self.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return self._generation
        return None

    def record_success(self, ticket):
        if ticket != self._generation:
            return
        self._failures = 0
        self._probe_in_flight = False
        if self.state != self.CLOSED:
            self._set(self.CLOSED)

    def record_failure(self, ticket):
        if ticket != self._generation:
            return
        self._failures += 1
        self._probe_in_flight = False
        if self.state == self.HALF_OPEN or self._failures >= self.threshold:
            self._opened_at = self._clock()
            self._set(self.OPEN)

    def release(self, ticket):
        """A call that ended without a verdict (cancelled, or a client error):
        let another probe through instead of waiting forever."""
        if ticket == self._generation:
            self._probe_in_flight = False

    def _set(self, state):
        if state != self.state:
            self.state = state
            self._generation += 1
            self._on_change(state)
