"""The LLM call with everything around it: cache, circuit breaker, concurrency
cap, per-attempt timeout, retries with back-off, cancellation, fallback and
accounting. Runs on one asyncio loop; knows nothing about Triton.
"""

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass

import aiohttp
import httpx2
import openai
from openai.types.chat import ChatCompletion

from accounting import Usage, cost_usd, tokens_from
from llm_cache import LRUCache, cache_key
from prompting import build_messages, fallback_description
from resilience import CircuitBreaker, Failure, backoff_delay, classify_status

NO_KEY_HELP = (
    "no API key found in {where}: every description is the classification-only fallback "
    "(DESCRIPTION_SOURCE=fallback, USAGE.fallback_reason=no_api_key). To use an LLM, set "
    "{prefix}API_KEY (or {prefix}API_KEY_FILE, e.g. a Kubernetes secret mount) and "
    "{prefix}BASE_URL / {prefix}MODEL for the endpoint; for a local vLLM or Ollama that "
    "needs no key, set {prefix}API_KEY_REQUIRED=false. See docs/llm-endpoints.md."
)


class Cancelled(Exception):
    """The client gave up on the request (Triton request cancellation)."""


class MalformedResponse(Exception):
    pass


@dataclass(frozen=True)
class Job:
    labels: tuple
    scores: tuple
    prompt: str
    model: str
    temperature: float
    max_tokens: int
    timeout_s: float


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


class Observer:
    """Hooks for metrics; the Triton adapter implements them with MetricFamily."""

    def request_done(self, model, outcome, usage): pass
    def attempt_done(self, model, latency_s, reason): pass
    def in_flight(self, count): pass
    def queued(self, count): pass
    def circuit(self, model, state): pass
    def cache(self, hit): pass


class Describer:
    def __init__(self, settings, client, scrub, observer=None, log=None,
                 clock=time.monotonic, rand=random.random):
        self.settings = settings
        self.client = client  # AsyncOpenAI-like, or None when no key is configured
        self.scrub = scrub
        self.observer = observer or Observer()
        self.log = log
        self._clock = self.clock = clock
        self._rand = rand
        self._slots = asyncio.Semaphore(settings.max_in_flight)
        self._in_flight = 0
        self._queued = 0
        self._breakers = {}
        self._last_warned = {}
        self.cache = LRUCache(settings.cache_max_entries, settings.cache_ttl_s, clock) \
            if settings.cache_enabled else None

    async def describe(self, job, is_cancelled=lambda: False):
        messages = build_messages(self.settings, job.labels, job.scores, job.prompt)
        key, text = self.lookup(job, messages)
        if text is not None:
            # Nothing was spent on this request: the USAGE sums stay the real bill.
            return self.done(job, Result(text, "llm", Usage(job.model, cached=True), "cached"))
        if self.client is None:
            return self.fallback(job, Usage(job.model), "no_api_key")

        usage = Usage(job.model)
        try:
            answer = await self.attempts(job, usage, is_cancelled,
                                         lambda timeout: self._complete(job, messages, usage, timeout, is_cancelled))
        except Cancelled:
            # No USAGE goes back, but what earlier attempts were billed still counts.
            self.observer.request_done(job.model, "cancelled", usage)
            raise
        if isinstance(answer, str):
            return self.fallback(job, usage, answer)
        if key is not None:
            self.cache.put(key, answer.value)
        outcome = "ok" if usage.attempts == 1 else "retried"
        return self.done(job, Result(answer.value, "llm", usage, outcome))

    def lookup(self, job, messages):
        """(cache key or None, the cached answer or None)."""
        if self.cache is None:
            return None, None
        key = cache_key(job.model, job.temperature, job.max_tokens, messages)
        text = self.cache.get(key)
        self.observer.cache(text is not None)
        return key, text

    async def attempts(self, job, usage, is_cancelled, attempt, keep_slot=False):
        """Upstream attempts under the circuit breaker, the concurrency cap, the
        request's deadline and the retry policy. `attempt(timeout)` makes one
        (on a slot) and returns what it got or raises. Returns an Answer, or
        the reason to fall back (a str); raises Cancelled.

        keep_slot: a successful attempt keeps its slot (a stream still being
        read); the caller gives it back with release_slot()."""
        breaker = self._breaker(job.model)
        deadline = self._clock() + self.settings.total_timeout_s
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
            timeout = max(0.001, min(job.timeout_s, deadline - self._clock()))
            started = self._clock()
            try:
                value = await attempt(timeout)
            except Cancelled:
                self.release_slot()
                breaker.release(ticket)
                raise
            except Exception as exc:  # every failure becomes a decision below, never a crash
                failure = self.classify(exc)
            else:
                failure = None
            if failure is not None or not keep_slot:
                self.release_slot()
            elapsed = self._clock() - started
            usage.upstream_latency_ms += elapsed * 1000.0
            self.observer.attempt_done(job.model, elapsed, failure.reason if failure else "ok")

            if failure is None:
                breaker.record_success(ticket)
                return Answer(value, breaker, ticket)

            if failure.reason == "timeout" and timeout < job.timeout_s:
                # An attempt cut short by our deadline had no fair chance: no verdict.
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
        if self.client is not None:
            await self.client.close()

    # -- one upstream attempt ------------------------------------------------------

    async def _take_slot(self, deadline, is_cancelled):
        """Wait for a slot under the concurrency cap (queueing, not failing)
        until the request's deadline; TimeoutError if none came. The holder
        gives it back with release_slot()."""
        self._queued += 1
        self.observer.queued(self._queued)
        try:
            await self.wait(asyncio.ensure_future(self._slots.acquire()),
                            deadline - self._clock(), is_cancelled)
        finally:
            self._queued -= 1
            self.observer.queued(self._queued)
        self._in_flight += 1
        self.observer.in_flight(self._in_flight)

    def release_slot(self):
        self._slots.release()
        self._in_flight -= 1
        self.observer.in_flight(self._in_flight)

    async def _complete(self, job, messages, usage, timeout, is_cancelled):
        """One chat completion, bounded by `timeout`: its answer's text."""
        # The SDK's generic post() with the typed ChatCompletion result: same
        # auth, errors and parsing as chat.completions.create(), without its
        # per-call TypedDict transform of the body (about 1 ms of CPU per call
        # here, on the path of every request).
        call = self.client.post(
            "/chat/completions", cast_to=ChatCompletion, options={"timeout": timeout},
            body={"model": job.model, "messages": messages, "max_tokens": job.max_tokens,
                  "temperature": job.temperature})
        response = await self.wait(asyncio.ensure_future(call), timeout, is_cancelled)
        self.bill(job, usage, getattr(response, "usage", None))  # an answer we cannot use is billed all the same
        return _answer_text(response)

    async def wait(self, task, timeout, is_cancelled):
        """Await `task` for at most `timeout` seconds, checking for cancellation
        every cancel_poll_s; the task is cancelled if we stop waiting."""
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

    def classify(self, exc):
        if isinstance(exc, openai.APIStatusError):
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
        self._warn_rate_limited(failure.reason, f"upstream attempt failed ({failure.reason}): "
                                f"{type(exc).__name__}: {self.scrub(exc)}")
        return failure

    def bill(self, job, usage, reported):
        """Add what the upstream reported (an SDK usage object, or None) to `usage`."""
        prompt_tokens, completion_tokens = tokens_from(reported)
        usage.prompt_tokens += prompt_tokens
        usage.completion_tokens += completion_tokens
        usage.total_tokens += prompt_tokens + completion_tokens
        usage.cost_usd += cost_usd(prompt_tokens, completion_tokens, *self.settings.prices_for(job.model))

    def fallback(self, job, usage, reason):
        usage.fallback_reason = reason
        if self.settings.on_failure == "error":
            return self.done(job, Result("", "fallback", usage, "error"))
        return self.done(job, Result(fallback_description(job.labels, job.scores), "fallback", usage, "fallback"))

    def done(self, job, result):
        self.observer.request_done(job.model, result.outcome, result.usage)
        return result

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

    def _warn_rate_limited(self, reason, message, every_s=10.0):
        # An outage at 1,000 requests/s must not turn into 1,000 log lines/s.
        now = self._clock()
        if self.log and now - self._last_warned.get(reason, -every_s) >= every_s:
            self._last_warned[reason] = now
            self.log.warn(message)


def _caused_by(exc, kind):
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _answer_text(response):
    try:
        text = response.choices[0].message.content
    except (AttributeError, IndexError, TypeError):
        raise MalformedResponse("no choices[0].message.content in the response") from None
    if not isinstance(text, str) or not text.strip():
        raise MalformedResponse("empty answer")
    return text.strip()


def make_client(settings, api_key):
    """One AsyncOpenAI client for the model's lifetime, with a connection pool
    as large as the concurrency cap, and no SDK retries: ours are explicit.

    The SDK's aiohttp transport, not its default httpx2 pool: measured here,
    600 concurrent 1 s calls took 7 s through the httpx2 pool and 2 s through
    aiohttp (docs/benchmarks.md)."""
    http_client = openai.DefaultAioHttpClient(
        limits=httpx2.Limits(max_connections=settings.max_in_flight,
                             max_keepalive_connections=settings.max_in_flight),
        timeout=httpx2.Timeout(settings.timeout_s, connect=min(5.0, settings.timeout_s)),
    )
    return openai.AsyncOpenAI(api_key=api_key, base_url=settings.base_url, max_retries=0,
                              timeout=settings.timeout_s, http_client=http_client)
