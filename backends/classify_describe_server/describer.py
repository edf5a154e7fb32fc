"""The LLM call with everything around it: cache, circuit breaker, concurrency
cap, per-attempt timeout, retries with back-off, cancellation, fallback and
accounting, one path for the whole answer and the streamed one (streaming.py
reads a stream). Runs on one asyncio loop; knows nothing about Triton.
"""

import asyncio
import base64
import dataclasses
import hashlib
import random
import time
from dataclasses import dataclass

import aiohttp
import httpx2
import openai
from openai.types.chat import ChatCompletion

from .accounting import Usage, add_cost, billed_tokens, cost_usd, finish_reason_of
from .chat_endpoint import ChatEndpoint
from .llm_cache import LRUCache, cache_key
from .prompting import build_messages, fallback_description
from .request_id import HEADER
from .resilience import (
    ANSWER_TOO_LONG,
    IMAGE_FAILED,
    IMAGE_REFUSED,
    AnswerTooLarge,
    Cancelled,
    CircuitBreaker,
    EmptyStream,
    Failure,
    MalformedResponse,
    UnreadableAnswer,
    backoff_delay,
    classify_status,
    image_may_be_why,
    refuses_image,
)
from .settings import Overrides
from .streaming import StreamedAnswer

# The most characters of answer kept per max_tokens: generous (English runs about
# 4 a token), so only an upstream that ignores max_tokens is cut (settings.max_answer_chars).
CHARS_PER_TOKEN = 16
# Of an upstream error's text in a log line: its status and message are at the start; a body
# quoted whole (up to the response's byte limit) would be hundreds of KB a line.
SHOWN_ERROR_CHARS = 2000

# How many image requests' text-only retries must answer before a model that never said it
# takes no images is asked text-only (each such request gets its text-only answer anyway).
IMAGE_FAILURES_TO_REMEMBER = 2

NO_KEY_HELP = (
    "no API key found in {where}, and {url} needs one: every description is the classification-only "
    "fallback (DESCRIPTION_SOURCE=fallback, USAGE.fallback_reason=no_api_key). To use it, set "
    "{prefix}API_KEY (or {prefix}API_KEY_FILE, e.g. a Kubernetes secret mount); for another endpoint "
    "set {prefix}BASE_URL / {prefix}MODEL (a local vLLM, Ollama or llama.cpp server is called without "
    "a key). See docs/llm-endpoints.md."
)


@dataclass(frozen=True)
class Job:
    """One description to make: what the classifier saw, the caller's question
    and the request's Overrides. The upstream request is built from it
    (messages(), body()), so what the LLM is shown lives here and nowhere else."""

    labels: tuple
    scores: tuple
    prompt: str
    overrides: Overrides
    # The photo as the LLM sees it (preprocess's VIEW, a JPEG), or None: text only,
    # and then why not (vision_skipped): off, no_view, refused_by_upstream.
    image: bytes = dataclasses.field(default=None, repr=False)  # never in a log line
    vision_skipped: str = None
    conversation: tuple = ()    # ((role, content), ...): the client's system messages and earlier turns
    response_format: dict = None  # OpenAI's response_format object, passed on as it came
    # Triton's request id (request_id.py): sent to the upstream as X-Request-ID, never part of the cache key.
    request_id: str = ""
    # ((header, value), ...) sent with the upstream call: the W3C trace context, or ().
    # Not part of what is asked: two Jobs differing only here are the same question.
    trace: tuple = dataclasses.field(default=(), compare=False)

    @property
    def model(self):
        return self.overrides.model

    def messages(self, settings):
        image_url = None if self.image is None else "data:image/jpeg;base64," + base64.b64encode(self.image).decode()
        return build_messages(settings, self.labels, self.scores, self.prompt, image_url, self.conversation)

    def cache_key(self, settings):
        """The answer cache's key: everything the upstream is sent, with the photo
        as its digest (two photos with equal labels never share an answer)."""
        image_url = None if self.image is None else "sha256:" + hashlib.sha256(self.image).hexdigest()
        o = self.overrides
        return cache_key(o.model, o.temperature, o.max_tokens,
                         build_messages(settings, self.labels, self.scores, self.prompt, image_url, self.conversation),
                         self.response_format)

    def text_only(self, reason):
        return dataclasses.replace(self, image=None, vision_skipped=reason)

    def body(self, messages, **extra):
        """The chat-completions request body."""
        o = self.overrides
        body = {"model": o.model, "messages": messages, "max_tokens": o.max_tokens, "temperature": o.temperature}
        if self.response_format is not None:
            body["response_format"] = self.response_format
        return {**body, **extra}

    def options(self, timeout):
        """The SDK's request options of one attempt: its timeout, and as headers the
        request id (for the upstream's logs) and the W3C trace context."""
        headers = {**({HEADER: self.request_id} if self.request_id else {}), **dict(self.trace)}
        return {"timeout": timeout, **({"headers": headers} if headers else {})}


@dataclass(frozen=True)
class Answer:
    """A successful upstream attempt: what it returned, and the circuit breaker
    ticket it was let through with (a stream that fails later still reports)."""

    value: object
    breaker: CircuitBreaker
    ticket: int


@dataclass
class Result:
    description: str
    source: str   # "llm", "fallback", or "llm_partial" (a stream cut short)
    usage: Usage
    outcome: str  # ok, retried, cached, fallback, partial, error (on_failure=error)


@dataclass(frozen=True)
class Call:
    """What one mode's reader (WholeAnswer here, streaming.StreamedAnswer) gets
    for one request: the upstream client, the body to send, and the Describer's
    waiting, billing, failure classifying and slot, bound to this request."""

    client: object
    job: Job
    messages: list
    usage: Usage
    wait: object           # await wait(awaitable, timeout): honours cancellation
    bill: object           # bill(sdk_usage or None, answer_chars): adds to usage (accounting.billed_tokens)
    classify_failure: object
    release_slot: object
    is_cancelled: object
    clock: object
    deadline: float        # the request's, for every attempt and the whole stream
    max_chars: int = None  # the longest answer kept (answer_chars_limit)


class WholeAnswer:
    """One chat completion per attempt; its text is the answer."""

    keeps_slot = False

    def __init__(self, call):
        self.call = call

    async def attempt(self, timeout):
        """One chat completion, bounded by `timeout`: (its text, its finish_reason)."""
        c = self.call
        # ChatEndpoint.post: the SDK's signature and errors, one aiohttp POST
        # (the SDK's own post() cost 5x its CPU: chat_endpoint.py).
        try:
            response = await c.wait(c.client.post("/chat/completions", cast_to=ChatCompletion,
                                                  options=c.job.options(timeout), body=c.job.body(c.messages)), timeout)
        except UnreadableAnswer as unreadable:
            c.bill(None, unreadable.body_bytes)  # billed upstream all the same, as a cut stream
            raise
        # An answer we cannot use is billed all the same.
        c.bill(getattr(response, "usage", None), len(_content_of(response)))
        return _answer_text(response), finish_reason_of(response)

    async def read(self, answer):
        """(text, finish_reason, the Failure that cut it short or None)."""
        text, finish_reason = answer.value
        if len(text) > self.call.max_chars:  # an upstream that ignored max_tokens
            return text[:self.call.max_chars], "length", ANSWER_TOO_LONG
        return text, finish_reason, None


class Observer:
    """Hooks for metrics; the Triton adapter implements them with MetricFamily."""

    def request_done(self, model, outcome, usage): pass
    def attempt_done(self, model, latency_s, reason): pass
    def in_flight(self, count): pass
    def queued(self, count): pass
    def circuit(self, model, state): pass
    def cache(self, hit): pass


# response_format types whose answer must be JSON: no fallback description for them.
JSON_FORMATS = ("json_object", "json_schema")


class Describer:
    def __init__(self, settings, client, scrub, observer=None, log=None,
                 clock=time.monotonic, rand=random.random, spans=None):
        self.settings = settings
        self.scrub = scrub
        self.observer = observer or Observer()
        self.log = log
        self.spans = spans  # llm_span.LlmSpans, or None: tracing off
        self._client = client  # AsyncOpenAI-like, or None when no key is configured
        self._clock = clock
        self._rand = rand
        self._slots = asyncio.Semaphore(settings.max_in_flight)
        self._in_flight = 0
        self._queued = 0
        self._breakers = {}
        self._image_refused_until = {}  # model -> until when it is asked text-only (vision=auto)
        self._text_only_answers = {}  # model -> when an image request's text-only retry answered
        self._last_warned = {}
        self._cache = LRUCache(settings.cache_max_entries, settings.cache_ttl_s, clock) \
            if settings.cache_enabled else None

    async def describe(self, job, is_cancelled=lambda: False, emit=None):
        """The Result for `job`; raises Cancelled. With `emit`, the text is
        streamed: emit(text) gets it chunk by chunk as the upstream writes it
        (a cached answer or the fallback as one chunk; nothing on
        on_failure=error), and USAGE tells the time to the first chunk and how
        many went out. Retries happen only before the first chunk; a stream
        that fails after it ends as "llm_partial" with the text sent.

        A traced request's call (job.trace) has a span of its own when spans
        are on (llm_span.py), and the upstream is called under that span."""
        span = self.spans.start(job, streamed=emit is not None) if self.spans is not None and job.trace else None
        if span is None:
            return await self._timed(job, is_cancelled, emit, None)
        try:
            result = await self._timed(dataclasses.replace(job, trace=span.trace), is_cancelled, emit, span)
        except Cancelled:
            span.end_early("cancelled")
            raise
        except BaseException as exc:  # unloading (CancelledError) or a bug: the span ends all the same
            span.end_early(type(exc).__name__)
            raise
        span.end(result)
        return result

    async def _timed(self, job, is_cancelled, emit, span):
        started = self._clock()
        if emit is None:
            return await self._describe(job, is_cancelled, None, started, span)
        sent = []  # when each chunk went out

        def send(text):
            emit(text)
            sent.append(self._clock())

        result = await self._describe(job, is_cancelled, send, started, span)
        if sent:
            result.usage.time_to_first_token_ms = (sent[0] - started) * 1000.0
            result.usage.chunks = len(sent)
        return result

    async def _describe(self, job, is_cancelled, emit, started, span):
        if job.image is not None and self._refused_image(job.model):
            job = job.text_only("refused_by_upstream")
        messages = job.messages(self.settings)
        key, cached = self._lookup(job)
        if cached is not None:
            # Nothing was spent on this request: the USAGE sums stay the real bill.
            text, finish_reason = cached
            if emit is not None:
                emit(text)
            return self._done(job, Result(text, "llm", Usage(job.model, cached=True, finish_reason=finish_reason),
                                          "cached"))
        if self._client is None:
            return self._fallback(job, Usage(job.model), "no_api_key", emit)

        usage = Usage(job.model)

        def reader_for(job, messages):
            call = Call(self._client, job, messages, usage,
                        lambda task, timeout: self._wait(task, timeout, is_cancelled),
                        lambda reported, answer_chars: self._bill(job, messages, usage, reported, answer_chars),
                        lambda exc: self.classify_failure(exc, job.request_id), self._release_slot,
                        is_cancelled, self._clock, started + self.settings.total_timeout_s,
                        answer_chars_limit(self.settings, job.overrides))
            return WholeAnswer(call) if emit is None else StreamedAnswer(call, emit)

        reader = reader_for(job, messages)
        try:
            answer = await self._attempts(job, usage, is_cancelled, reader.attempt, reader.keeps_slot, span)
            if answer in (IMAGE_REFUSED, IMAGE_FAILED) and job.image is not None and self.settings.vision == "auto":
                # A model that takes no images: ask again text-only at once, and text-only
                # for a while (the refusal cost a round trip; it must not cost one per request).
                # One that said so is remembered at once; one that only failed, once a text-only
                # retry has answered twice (one bad photo must not turn vision off for all).
                said = answer == IMAGE_REFUSED
                if said:
                    self._remember_image_refusal(job.model)
                job = job.text_only("refused_by_upstream")
                messages = job.messages(self.settings)
                key = job.cache_key(self.settings) if key is not None else None
                reader = reader_for(job, messages)
                answer = await self._attempts(job, usage, is_cancelled, reader.attempt, reader.keeps_slot, span)
                if not said and not isinstance(answer, str):
                    self._text_only_answered(job.model)
            if isinstance(answer, str):
                return self._fallback(job, usage, answer, emit)
            text, finish_reason, failure = await reader.read(answer)
        except Cancelled:
            # No USAGE goes back, but what earlier attempts were billed still counts.
            self.observer.request_done(job.model, "cancelled", usage)
            raise
        usage.finish_reason = finish_reason
        if failure is not None:
            if failure.upstream_fault:
                answer.breaker.record_failure(answer.ticket)
            usage.fallback_reason = failure.reason
            return self._done(job, Result(text, "llm_partial", usage, "partial"))
        if key is not None:
            self._cache.put(key, (text, finish_reason))
        return self._done(job, Result(text, "llm", usage, "ok" if usage.attempts == 1 else "retried"))

    def _lookup(self, job):
        """(cache key or None, the cached (text, finish_reason) or None)."""
        if self._cache is None:
            return None, None
        key = job.cache_key(self.settings)
        cached = self._cache.get(key)
        self.observer.cache(cached is not None)
        return key, cached

    async def _attempts(self, job, usage, is_cancelled, attempt, keep_slot=False, span=None):
        """Upstream attempts under the circuit breaker, the concurrency cap, the
        request's deadline and the retry policy. `attempt(timeout)` makes one
        (on a slot) and returns what it got or raises. Returns an Answer, or
        the reason to fall back (a str); raises Cancelled.

        keep_slot: a successful attempt keeps its slot (a stream still being
        read); the reader gives it back with Call.release_slot(). span: the
        call's LlmSpan or None; each attempt is an event of it."""
        breaker = self._breaker(job.model)
        deadline = self._clock() + self.settings.total_timeout_s
        timeout_s = job.overrides.timeout_s
        while True:
            if usage.attempts and is_cancelled():
                raise Cancelled()
            ticket = breaker.allow()
            if ticket is None:
                return "circuit_open"
            try:
                await self._take_slot(deadline, is_cancelled)
            except TimeoutError:
                # Our own queue under max_in_flight was too long: that says nothing
                # about the upstream, so no verdict for the breaker and no latency.
                breaker.release(ticket)
                return "local_queue_timeout"
            except Cancelled:
                breaker.release(ticket)
                raise
            usage.attempts += 1
            # Time spent queued for a slot or in back-off may leave this attempt
            # less than its timeout_s before the request's deadline.
            timeout = max(0.001, min(timeout_s, deadline - self._clock()))
            started = self._clock()
            try:
                try:
                    value = await attempt(timeout)
                except Cancelled:
                    raise
                except Exception as exc:  # every failure becomes a decision below, never a crash
                    failure = self.classify_failure(exc, job.request_id, image=job.image is not None)
                else:
                    failure = None
            except BaseException:
                # Cancelled, or a failure that could not be read: neither may keep the slot
                # (max_in_flight would shrink for good) or the half-open circuit's probe.
                self._release_slot()
                breaker.release(ticket)
                raise
            if failure is not None or not keep_slot:
                self._release_slot()
            elapsed = self._clock() - started
            usage.upstream_latency_ms += elapsed * 1000.0
            self.observer.attempt_done(job.model, elapsed, failure.reason if failure else "ok")
            if span is not None:
                span.attempt(usage.attempts, failure.reason if failure else "ok", elapsed)

            if failure is None:
                breaker.record_success(ticket)
                return Answer(value, breaker, ticket)

            if failure.reason == "timeout" and timeout < self.settings.timeout_s:
                # An attempt cut short (by our deadline, or by the client's own shorter timeout_s)
                # had no fair chance: no verdict, or two clients asking 1 ms would open the circuit
                # for everyone.
                failure = dataclasses.replace(failure, upstream_fault=False)
            if failure.upstream_fault:
                breaker.record_failure(ticket)
            else:
                breaker.release(ticket)
            if not failure.retryable or usage.attempts >= self.settings.max_attempts:
                return failure.reason
            if failure.retry_after_s is not None and failure.retry_after_s > self.settings.max_retry_after_s:
                return failure.reason
            delay = backoff_delay(usage.attempts, self.settings.backoff_base_s, self.settings.backoff_max_s,
                                  failure.retry_after_s, self._rand)
            if self._clock() + delay >= deadline:
                return failure.reason
            await self._sleep(delay, is_cancelled)

    async def aclose(self):
        if self._client is not None:
            await self._client.close()

    # -- one upstream attempt ------------------------------------------------------

    async def _take_slot(self, deadline, is_cancelled):
        """Wait for a slot under the concurrency cap (queueing, not failing)
        until the request's deadline; TimeoutError if none came. The holder
        gives it back with _release_slot()."""
        if not self._slots.locked():
            # A free slot (and none waiting: locked() counts waiters) is taken at once, without
            # the polling task below: one task and two loop turns less on every request's path.
            await self._slots.acquire()
        else:
            await self._wait_for_slot(deadline, is_cancelled)
        self._in_flight += 1
        self.observer.in_flight(self._in_flight)

    async def _wait_for_slot(self, deadline, is_cancelled):
        self._queued += 1
        self.observer.queued(self._queued)
        try:
            await self._wait(self._slots.acquire(), deadline - self._clock(), is_cancelled)
        finally:
            self._queued -= 1
            self.observer.queued(self._queued)

    def _release_slot(self):
        self._slots.release()
        self._in_flight -= 1
        self.observer.in_flight(self._in_flight)

    async def _wait(self, awaitable, timeout, is_cancelled):
        """Await `awaitable` for at most `timeout` seconds, checking for cancellation
        every cancel_poll_s; it is cancelled if we stop waiting."""
        task = asyncio.ensure_future(awaitable)
        end = self._clock() + timeout
        try:
            while True:
                remaining = end - self._clock()
                if remaining <= 0:
                    raise TimeoutError()
                done, _ = await asyncio.wait({task}, timeout=min(remaining, self.settings.cancel_poll_s))
                if done:
                    return task.result()
                if is_cancelled():
                    raise Cancelled()
        except BaseException:
            if not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:
                    pass
            raise

    async def _sleep(self, delay, is_cancelled):
        end = self._clock() + delay
        while (remaining := end - self._clock()) > 0:
            await asyncio.sleep(min(remaining, self.settings.cancel_poll_s))
            if is_cancelled():
                raise Cancelled()

    # -- decisions and bookkeeping ---------------------------------------------------

    def classify_failure(self, exc, request_id=None, image=False):
        """The Failure an upstream attempt's exception stands for (rate-limited warning logged,
        naming the request whose attempt it was); `image`: the attempt carried the photo."""
        photo_may_be_why = image and self.settings.vision == "auto"
        if _caused_by(exc, AnswerTooLarge):  # raised under the SDK, which wraps it
            failure = ANSWER_TOO_LONG
        elif _caused_by(exc, EmptyStream) and photo_may_be_why:
            # A stream with no text to a request with the photo: a server whose template fails on
            # the image part once its stream has begun (llama-cpp-python's) says so no other way.
            failure = Failure(IMAGE_FAILED, retryable=False, upstream_fault=False)
        elif _caused_by(exc, MalformedResponse):  # the same: from _bound_body, under the SDK
            failure = Failure("malformed_response", retryable=True)
        elif isinstance(exc, openai.APIStatusError) and refuses_image(exc.status_code, exc.body, exc.message):
            failure = Failure(IMAGE_REFUSED, retryable=False, upstream_fault=False)
        elif (isinstance(exc, openai.APIStatusError) and photo_may_be_why
              and image_may_be_why(exc.status_code, f"{exc.message} {exc.body}")):
            failure = Failure(IMAGE_FAILED, retryable=False, upstream_fault=False)
        elif isinstance(exc, openai.APIStatusError):
            failure = classify_status(exc.status_code, exc.response.headers)
        elif isinstance(exc, (TimeoutError, openai.APIConnectionError)):
            # The aiohttp transport reports a refused or dropped connection as a
            # connect *timeout*; the original exception down the chain tells them apart.
            # A body cut short (a stream dropped mid-way) is a ClientPayloadError there.
            refused = (_caused_by(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))
                       and not _caused_by(exc, TimeoutError))
            failure = Failure("connection_error" if refused else "timeout", retryable=True)
        else:
            # A 200 whose body is not a chat completion: a proxy or server glitch.
            failure = Failure("malformed_response", retryable=True)
        self._warn_rate_limited(failure.reason, lambda: f"upstream attempt failed ({failure.reason}): "
                                f"{type(exc).__name__}: {self.scrub(exc)[:SHOWN_ERROR_CHARS]}", request_id)
        return failure

    def _bill(self, job, messages, usage, reported, answer_chars):
        """Add one answer's tokens to `usage`: what the upstream reported (an SDK usage object),
        or the estimate where it reported none (accounting.billed_tokens)."""
        prompt_tokens, completion_tokens, estimated = billed_tokens(reported, messages, answer_chars)
        if estimated:
            usage.tokens_estimated = True
        usage.prompt_tokens += prompt_tokens
        usage.completion_tokens += completion_tokens
        usage.total_tokens += prompt_tokens + completion_tokens
        usage.cost_usd = add_cost(usage.cost_usd, cost_usd(prompt_tokens, completion_tokens,
                                                           self.settings.prices_for(job.model)))

    def _fallback(self, job, usage, reason, emit=None):
        usage.fallback_reason = reason
        # The adapter answers with an error instead (nothing emitted): with on_failure=error,
        # and for a client that asked for JSON, which the prose fallback is not.
        wants_json = (job.response_format or {}).get("type") in JSON_FORMATS
        if self.settings.on_failure == "error" or wants_json:
            return self._done(job, Result("", "fallback", usage, "error"))
        result = Result(fallback_description(job.labels, job.scores), "fallback", usage, "fallback")
        if emit is not None:
            emit(result.description)
        return self._done(job, result)

    def _done(self, job, result):
        # Whether the LLM saw the photo: only an LLM answer (or a cached one) to a request that carried it.
        saw = job.image is not None and result.source != "fallback"
        result.usage.vision = saw
        result.usage.vision_skipped_reason = None if saw else (job.vision_skipped or "fallback")
        self.observer.request_done(job.model, result.outcome, result.usage)
        return result

    def _refused_image(self, model):
        until = self._image_refused_until.get(model)
        return until is not None and self._clock() < until

    def _text_only_answered(self, model):
        """An image request failed and its text-only retry answered: the second time within
        vision_refusal_memory_s, the model is asked text-only from now on for that long."""
        now, memory = self._clock(), self.settings.vision_refusal_memory_s
        recent = [t for t in self._text_only_answers.get(model, ()) if now - t < memory] + [now]
        self._text_only_answers[model] = recent
        if len(recent) >= IMAGE_FAILURES_TO_REMEMBER:
            del self._text_only_answers[model]
            self._remember_image_refusal(model)

    def _remember_image_refusal(self, model):
        self._image_refused_until[model] = self._clock() + self.settings.vision_refusal_memory_s
        self._warn_rate_limited("image_refusal_remembered", f"upstream model '{model}' refused image input: asking it text-only "
                                f"for {self.settings.vision_refusal_memory_s:g} s (vision=auto)")

    def _breaker(self, model):
        breaker = self._breakers.get(model)
        if breaker is None:
            def on_change(state, model=model):
                self.observer.circuit(model, state)
                if self.log:
                    self.log.warn(f"circuit for upstream model '{model}' is now {state}")
            breaker = CircuitBreaker(self.settings.circuit_failure_threshold, self.settings.circuit_cooldown_s,
                                     self._clock, on_change)
            self._breakers[model] = breaker
            self.observer.circuit(model, breaker.state)
        return breaker

    def _warn_rate_limited(self, reason, message, request_id=None, every_s=10.0):
        # An outage at 1,000 requests/s must not turn into 1,000 log lines/s: the line
        # names the first request of its 10 s (the others are in the metrics).
        now = self._clock()
        if self.log and now - self._last_warned.get(reason, -every_s) >= every_s:
            self._last_warned[reason] = now
            self.log.warn(message() if callable(message) else message, request_id)


def answer_chars_limit(settings, overrides):
    """The longest answer kept for a request: CHARS_PER_TOKEN a token of its max_tokens, at most max_answer_chars."""
    return min(settings.max_answer_chars, CHARS_PER_TOKEN * overrides.max_tokens)


def response_bytes_limit(settings):
    """The most bytes read of one upstream response: the longest answer JSON-escaped
    (6 bytes a character at worst, \\uXXXX), a stream chunk's envelope (about 250
    bytes, 512 allowed) per token up to max_tokens_limit, and 64 KiB for the rest."""
    return 6 * settings.max_answer_chars + 512 * settings.max_tokens_limit + 65536


class _BoundedBody(httpx2.AsyncByteStream):
    """A response body that raises AnswerTooLarge past `limit` bytes, before
    reading more: the SDK would otherwise read and parse any size."""

    def __init__(self, stream, limit):
        self.stream, self.limit = stream, limit

    async def __aiter__(self):
        read = 0
        async for part in self.stream:
            read += len(part)
            if read > self.limit:
                raise AnswerTooLarge(f"the upstream's response passed {self.limit} bytes")
            yield part

    async def aclose(self):
        await self.stream.aclose()


def _bound_body(limit):
    async def hook(response):  # before the body is read (httpx response event hook)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Asked for identity (make_client): a compressed body would be inflated past the
            # limit, which counts the bytes as they come (688 KB of gzip inflate to 670 MB).
            await response.aclose()
            raise MalformedResponse(f"the upstream sent Content-Encoding {encoding[:40]!r}, not asked for")
        response.stream = _BoundedBody(response.stream, limit)
    return hook


def _caused_by(exc, kind):
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _content_of(response):
    """choices[0].message.content when it is text, else ''."""
    try:
        text = response.choices[0].message.content
    except (AttributeError, IndexError, TypeError):
        return ""
    return text if isinstance(text, str) else ""


def _answer_text(response):
    try:
        text = response.choices[0].message.content
    except (AttributeError, IndexError, TypeError):
        raise MalformedResponse("no choices[0].message.content in the response") from None
    if not isinstance(text, str) or not text.strip():
        raise MalformedResponse("empty answer")
    return text.strip()


def make_client(settings, api_key):
    """The upstream's client for the model's lifetime (chat_endpoint.ChatEndpoint:
    a whole answer over aiohttp directly, a stream through the SDK), with a
    connection pool as large as the concurrency cap, and no SDK retries: ours
    are explicit.

    The SDK on its aiohttp transport, not its default httpx2 pool: measured here,
    600 concurrent 1 s calls took 7 s through the httpx2 pool and 2 s through
    aiohttp (docs/benchmarks.md)."""
    connect_s, max_response_bytes = min(5.0, settings.timeout_s), response_bytes_limit(settings)
    http_client = openai.DefaultAioHttpClient(
        limits=httpx2.Limits(max_connections=settings.max_in_flight,
                             max_keepalive_connections=settings.max_in_flight),
        timeout=httpx2.Timeout(settings.timeout_s, connect=connect_s),
        event_hooks={"response": [_bound_body(max_response_bytes)]},
    )
    # identity: what the byte limit counts is what is parsed (_bound_body refuses anything else).
    # No key (an endpoint that takes none): the SDK insists on one, so it gets one that
    # ChatEndpoint never sends (keyless: no Authorization header at all).
    sdk = openai.AsyncOpenAI(api_key=api_key or "unsent", base_url=settings.base_url, max_retries=0,
                             timeout=settings.timeout_s, http_client=http_client,
                             default_headers={"Accept-Encoding": "identity"})
    return ChatEndpoint(sdk, settings.max_in_flight, connect_s, max_response_bytes, keyless=not api_key)
