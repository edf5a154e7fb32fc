"""The LLM call and its resilience, over real HTTP against the fake upstream
(tools/fake_openai) on 127.0.0.1, with the real openai SDK."""

import asyncio
import os
import pathlib
import resource
import time

import pytest
from classify_describe_server.describer import Cancelled, Describer, Job, Observer, make_client
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import Overrides, parse_settings
from openai.types.chat import ChatCompletion

from tools.fake_openai import FakeOpenAI

ROOT = pathlib.Path(__file__).resolve().parents[2]

KEY = "sk-unit-DO-NOT-LEAK-1234567890"
FAST = {"timeout_s": "2", "backoff_base_s": "0.01", "backoff_max_s": "0.05", "cancel_poll_s": "0.05",
        "circuit_failure_threshold": "100"}


class Recorder(Observer):
    def __init__(self):
        self.outcomes, self.attempts, self.max_in_flight, self.cache_hits = [], [], 0, 0
        self.usages = []

    def request_done(self, model, outcome, usage):
        self.outcomes.append(outcome)
        self.usages.append(usage)

    def attempt_done(self, model, latency_s, reason):
        self.attempts.append(reason)

    def in_flight(self, count):
        self.max_in_flight = max(self.max_in_flight, count)

    def cache(self, hit):
        self.cache_hits += hit


class Log:
    def __init__(self):
        self.lines = []
        self.request_ids = []  # the request each line named (model_log.Log puts it in the line)

    def _line(self, m, request_id):
        self.lines.append(m)
        self.request_ids.append(request_id)

    def info(self, m, request_id=None): self._line(m, request_id)
    def warn(self, m, request_id=None): self._line(m, request_id)
    def error(self, m, request_id=None): self._line(m, request_id)


def job(prompt="Describe", model="gpt-4o-mini", timeout_s=2.0, **kw):
    return Job(("tabby, tabby cat", "tiger cat"), (0.7, 0.2), prompt, Overrides(model, 0.2, 64, timeout_s), **kw)


def run(test, latency_ms=0, key=KEY, **params):
    """Run `test(fake, describer, observer, log)` on one loop with a fresh fake and describer."""
    async def main():
        fake = FakeOpenAI(port=0, latency_ms=latency_ms)
        await fake.start()
        settings = parse_settings(dict(FAST, base_url=fake.base_url, **params), {})
        observer, log = Recorder(), Log()
        describer = Describer(settings, make_client(settings, key) if key else None, Scrubber(key),
                              observer, log)
        try:
            return await test(fake, describer, observer, log)
        finally:
            await describer.aclose()
            await fake.stop()
    return asyncio.run(main())


def test_answer_usage_and_cost():
    async def test(fake, d, obs, log):
        r = await d.describe(job("What is it?"))
        assert r.source == "llm" and r.outcome == "ok" and r.description.startswith("Fake answer #1")
        assert fake.stats["last_authorization"] == f"Bearer {KEY}"
        body = fake.stats["bodies"][-1]
        assert body["model"] == "gpt-4o-mini" and body["max_tokens"] == 64 and body["temperature"] == 0.2
        assert "What is it?" in body["messages"][1]["content"] and "tabby" in body["messages"][1]["content"]
        u = r.usage
        assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.cost_usd == pytest.approx((u.prompt_tokens * 0.15 + u.completion_tokens * 0.60) / 1e6)
        assert u.attempts == 1 and u.upstream_latency_ms > 0 and u.fallback_reason is None
    run(test)


def test_identical_requests_are_answered_from_the_cache_but_fallbacks_are_not_cached():
    async def test(fake, d, obs, log):
        first = await d.describe(job("cache me"))
        again = await d.describe(job("cache me"))
        assert again.description == first.description and again.outcome == "cached"
        assert again.usage.cached and again.usage.cost_usd == 0 and fake.stats["requests"] == 1
        other = await d.describe(job("cache me", model="gpt-4o-mini-2024-07-18"))
        assert other.outcome == "ok" and fake.stats["requests"] == 2  # the model is part of the key

        fake.set_mode("500")
        assert (await d.describe(job("outage"))).source == "fallback"
        fake.set_mode("ok")
        assert (await d.describe(job("outage"))).source == "llm"  # the outage did not stick
    run(test)


def test_cache_can_be_turned_off():
    async def test(fake, d, obs, log):
        await d.describe(job("x")), await d.describe(job("x"))
        assert fake.stats["requests"] == 2
    run(test, cache_enabled="false")


def test_429_is_retried_after_the_retry_after_delay():
    async def test(fake, d, obs, log):
        fake.set_mode("429", retry_after=0.5, count=1)
        r = await d.describe(job())
        assert r.source == "llm" and r.outcome == "retried" and r.usage.attempts == 2
        first, second = fake.stats["arrivals"][-2:]
        assert second - first >= 0.5
    run(test)


def test_a_retry_after_beyond_the_limit_falls_back_at_once():
    async def test(fake, d, obs, log):
        fake.set_mode("429", retry_after=30)
        started = time.monotonic()
        r = await d.describe(job())
        assert r.usage.fallback_reason == "rate_limited_http_429" and r.usage.attempts == 1
        assert time.monotonic() - started < 4  # milliseconds; waiting would take 5 s (max_retry_after_s)
    run(test, max_retry_after_s="5")


@pytest.mark.parametrize("mode, reason", [("500", "upstream_error_http_500"), ("malformed", "malformed_response"),
                                          ("drop", "connection_error")])
def test_server_errors_are_retried_then_fall_back(mode, reason):
    async def test(fake, d, obs, log):
        fake.set_mode(mode)
        r = await d.describe(job())
        assert r.source == "fallback" and r.outcome == "fallback" and r.usage.fallback_reason == reason
        assert r.usage.attempts == 3 and fake.stats["requests"] == 3
        assert r.description.startswith("Most likely a tabby (70%)")
        fake.set_mode(mode, count=2)
        r = await d.describe(job("recovers"))
        assert r.outcome == "retried" and r.usage.attempts == 3
    run(test)


@pytest.mark.parametrize("status", ["401"])
def test_client_errors_are_not_retried_and_the_key_is_never_logged(status):
    async def test(fake, d, obs, log):
        fake.set_mode(status)
        r = await d.describe(job())
        assert r.usage.fallback_reason == "authentication_failed_http_401" and r.usage.attempts == 1 and fake.stats["requests"] == 1
        assert log.lines and "Incorrect API key" in log.lines[-1]
        assert not any("1234567890" in line for line in log.lines)
    run(test)


def test_refused_connections_fall_back():
    async def test(fake, d, obs, log):
        await d.describe(job("warm the pool"))
        fake.set_mode("refuse", duration_s=1.0)
        await asyncio.sleep(0.05)
        r = await d.describe(job("refused"))
        assert r.usage.fallback_reason == "connection_error"
        await asyncio.sleep(1.2)
        assert (await d.describe(job("back"))).source == "llm"
    run(test)


def test_each_attempt_is_bounded_by_the_timeout():
    async def test(fake, d, obs, log):
        fake.set_mode("hang")
        started = time.monotonic()
        r = await d.describe(job(timeout_s=0.2))
        assert r.usage.fallback_reason == "timeout" and r.usage.attempts == 3
        # Three 0.2 s attempts; the upper bound leaves room for a loaded machine and still
        # tells them from the hang (an hour) cut by total_timeout_s (30 s).
        assert 0.6 <= time.monotonic() - started < 10
    run(test)


def test_total_timeout_bounds_all_attempts():
    async def test(fake, d, obs, log):
        fake.set_mode("hang")
        started = time.monotonic()
        r = await d.describe(job(timeout_s=20.0))
        # Cut at total_timeout_s (0.5 s), not after the job's 20 s attempt: room for a loaded machine.
        assert r.usage.fallback_reason == "timeout" and time.monotonic() - started < 10
    run(test, timeout_s="0.5", total_timeout_s="0.5")


def test_circuit_opens_stops_calling_then_probes_and_closes():
    async def test(fake, d, obs, log):
        fake.set_mode("500")
        await d.describe(job("a"))  # 3 failed attempts: the circuit opens
        r = await d.describe(job("b"))
        assert r.usage.fallback_reason == "circuit_open" and r.usage.attempts == 0
        assert fake.stats["requests"] == 3
        other = await d.describe(job("c", model="gpt-4o-mini-other"))  # one circuit per upstream model
        assert other.usage.fallback_reason == "upstream_error_http_500"
        fake.set_mode("ok")
        await asyncio.sleep(0.35)
        assert (await d.describe(job("d"))).source == "llm"  # the half-open probe closes it
        assert (await d.describe(job("e"))).source == "llm"
        assert any("is now open" in line for line in log.lines)
    run(test, circuit_failure_threshold="3", circuit_cooldown_s="0.3", allowed_models="gpt-4o-mini*")


def test_cancellation_stops_the_upstream_call():
    async def test(fake, d, obs, log):
        fake.set_mode("hang")
        started = time.monotonic()
        with pytest.raises(Cancelled):
            await d.describe(job(timeout_s=20.0), is_cancelled=lambda: time.monotonic() - started > 0.2)
        # Polled every 0.05 s (cancel_poll_s): long before the 20 s attempt's end, with room for a loaded machine.
        assert time.monotonic() - started < 10
        await asyncio.sleep(0.1)
        assert fake.stats["disconnected"] == 1 and fake.stats["in_flight"] == 0
    run(test)


def test_on_failure_error_returns_no_description():
    async def test(fake, d, obs, log):
        fake.set_mode("500")
        r = await d.describe(job())
        assert r.outcome == "error" and r.usage.fallback_reason == "upstream_error_http_500"
    run(test, on_failure="error")


@pytest.mark.parametrize("response_format, outcome", [
    ({"type": "json_object"}, "error"),
    ({"type": "json_schema", "json_schema": {"name": "d", "schema": {"type": "object"}}}, "error"),
    ({"type": "text"}, "fallback"),
    (None, "fallback"),
])
def test_a_client_that_asked_for_json_gets_an_error_not_the_prose_fallback(response_format, outcome):
    async def test(fake, d, obs, log):
        fake.set_mode("500")
        r = await d.describe(job(response_format=response_format))
        assert r.outcome == outcome and r.usage.fallback_reason == "upstream_error_http_500"
        assert (r.description == "") == (outcome == "error")
    run(test)


def test_without_a_key_it_answers_with_the_fallback():
    async def test(fake, d, obs, log):
        r = await d.describe(job())
        assert r.source == "fallback" and r.usage.fallback_reason == "no_api_key"
        assert fake.stats["requests"] == 0
    run(test, key=None)


def test_the_concurrency_cap_queues_instead_of_failing():
    async def test(fake, d, obs, log):
        results = await asyncio.gather(*(d.describe(job(f"q{i}")) for i in range(20)))
        assert all(r.source == "llm" for r in results)
        assert fake.stats["max_in_flight"] == 4 and obs.max_in_flight == 4
    run(test, latency_ms=100, max_in_flight="4")


def calls_the_open_file_limit_allows(wanted, per_call=2, spare=100):
    """Each call in flight holds two sockets here (the describer's and the fake's, one
    process). tests/conftest.py raised the soft limit to the hard one; below `wanted`
    calls' worth, the test runs as many as fit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    return min(wanted, (soft - open_now - spare) // per_call)


def test_one_describer_holds_500_calls_in_flight():
    calls = calls_the_open_file_limit_allows(500)
    # Well past httpx's default pool of 100 connections, however low the limit.
    assert calls > 200, f"{calls} calls fit under the open-file limit: raise it (ulimit -n)"

    async def test(fake, d, obs, log):
        # The fake answers none until all `calls` are in flight at once: no race with the
        # machine's speed. A describer that held fewer would leave them waiting until
        # their 60 s attempt timeout (generous: a busy machine opens the connections
        # slowly) and answer with the fallback.
        fake.set_mode("ok", hold_for=calls)
        results = await asyncio.gather(*(d.describe(job(f"p{i}", timeout_s=60)) for i in range(calls)))
        assert [r.source for r in results] == ["llm"] * calls, {r.usage.fallback_reason for r in results}
        assert fake.stats["max_in_flight"] == calls == obs.max_in_flight
    run(test, timeout_s="60", total_timeout_s="60", max_attempts="1")


def test_waiting_for_a_local_slot_is_not_an_upstream_failure():
    """A request that gets no slot under max_in_flight in time says nothing about
    the upstream: its own fallback reason, no upstream latency, no breaker verdict."""
    async def test(fake, d, obs, log):
        assert (await d.describe(job("warm the client"))).source == "llm"
        await d._slots.acquire()  # the only slot, held by another request's call
        r = await d.describe(job("queued"))
        assert r.source == "fallback" and r.usage.fallback_reason == "local_queue_timeout"
        assert r.usage.attempts == 0 and r.usage.upstream_latency_ms == 0
        assert obs.attempts == ["ok"] and fake.stats["requests"] == 1
        # A slot freed just before the deadline leaves the call a sliver of its
        # timeout: its timeout is not held against the upstream either.
        fake.set_mode("hang", count=1)
        # 200 ms of margin either way for a late timer on a busy machine.
        asyncio.get_running_loop().call_later(0.8, d._slots.release)
        r = await d.describe(job("late slot"))
        assert r.usage.fallback_reason == "timeout" and r.usage.attempts == 1
        assert r.usage.upstream_latency_ms < 700  # the 800 ms in the queue are not in it
        # The provider is healthy and the circuit (threshold 1) stayed closed.
        assert (await d.describe(job("after"))).source == "llm"
    run(test, max_in_flight="1", timeout_s="1.0", total_timeout_s="1.0", circuit_failure_threshold="1")


class ScriptedClient:
    """Stands in for AsyncOpenAI: each call waits until the test answers it."""

    def __init__(self):
        self.calls = []

    def post(self, path, cast_to=None, options=None, body=None):
        call = asyncio.get_running_loop().create_future()
        self.calls.append(call)
        return call

    async def close(self):
        pass


def completion(content, prompt_tokens, completion_tokens):
    return ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}})


def scripted(test, **params):
    """Run `test(client, describer, observer)` with a ScriptedClient."""
    async def main():
        client, observer = ScriptedClient(), Recorder()
        settings = parse_settings(dict(FAST, **params), {})
        return await test(client, Describer(settings, client, Scrubber(KEY), observer, Log()), observer)
    return asyncio.run(main())


async def until(condition, timeout=2.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.001)


def test_half_open_lets_one_probe_through_even_when_an_older_call_ends():
    async def test(client, d, obs):
        cancelled = []
        old = asyncio.create_task(d.describe(job("old"), is_cancelled=lambda: bool(cancelled)))
        await until(lambda: len(client.calls) == 1)
        failing = asyncio.create_task(d.describe(job("fails")))
        await until(lambda: len(client.calls) == 2)
        client.calls[1].set_exception(TimeoutError())  # threshold 1: the circuit opens
        assert (await failing).usage.fallback_reason == "timeout"
        await asyncio.sleep(0.06)  # the cooldown
        probe = asyncio.create_task(d.describe(job("probe")))
        await until(lambda: len(client.calls) == 3)
        cancelled.append(True)  # the call from before the circuit opened ends without a verdict
        with pytest.raises(Cancelled):
            await old
        second = await asyncio.wait_for(d.describe(job("second")), 1.0)
        assert second.usage.fallback_reason == "circuit_open" and len(client.calls) == 3
        client.calls[2].set_result(completion("A tabby.", 10, 3))
        assert (await probe).source == "llm"  # the probe's verdict closes the circuit
    scripted(test, circuit_failure_threshold="1", circuit_cooldown_s="0.05", max_attempts="1")


def test_a_billed_empty_answer_counts_in_usage_and_metrics():
    async def test(client, d, obs):
        task = asyncio.create_task(d.describe(job()))
        await until(lambda: len(client.calls) == 1)
        client.calls[0].set_result(completion("", 50, 7))  # HTTP 200, billed, no text
        await until(lambda: len(client.calls) == 2)
        client.calls[1].set_result(completion("A tabby.", 50, 3))
        r = await task
        assert r.outcome == "retried" and r.usage.attempts == 2
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (100, 10, 110)
        assert r.usage.cost_usd == pytest.approx((100 * 0.15 + 10 * 0.60) / 1e6)
        assert obs.usages[-1].total_tokens == 110  # what the metrics add up

        task = asyncio.create_task(d.describe(job("only empty answers")))
        for n in (3, 4, 5):
            await until(lambda: len(client.calls) == n)  # noqa: B023 (awaited here)
            client.calls[-1].set_result(completion("  ", 40, 2))
        r = await task
        assert r.source == "fallback" and r.usage.fallback_reason == "malformed_response"
        assert r.usage.total_tokens == 126 and obs.usages[-1].total_tokens == 126

        cancelled = []
        task = asyncio.create_task(d.describe(job("cancelled after an empty answer"),
                                              is_cancelled=lambda: bool(cancelled)))
        await until(lambda: len(client.calls) == 6)
        client.calls[-1].set_result(completion("", 40, 2))
        await until(lambda: len(client.calls) == 7)
        cancelled.append(True)
        with pytest.raises(Cancelled):
            await task
        assert obs.outcomes[-1] == "cancelled" and obs.usages[-1].total_tokens == 42
    scripted(test, circuit_failure_threshold="100")


def test_the_upstreams_finish_reason_is_passed_on_in_usage():
    """The fake says "length" when its answer used all of max_tokens (the Job asks for 64)."""
    async def test(fake, d, obs, log):
        fake.set_mode("ok", answer_words=12)
        assert (await d.describe(job("short"))).usage.finish_reason == "stop"
        fake.set_mode("ok", answer_words=80)
        cut = await d.describe(job("long"))
        assert cut.usage.finish_reason == "length" and cut.source == "llm"
        again = await d.describe(job("long"))
        assert again.outcome == "cached" and again.usage.finish_reason == "length"  # cached with its text
        fake.set_mode("500")
        assert (await d.describe(job("down"))).usage.finish_reason is None  # a fallback has none
    run(test)
