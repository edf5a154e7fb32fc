"""Describer.describe(job, emit=...), the streamed answer (streaming.py), over real HTTP against the fake upstream streaming
server-sent events, with the real openai SDK: the same Describer as the plain
call (cache, retries, breaker, slots, fallback, billing), text chunk by chunk."""

import asyncio

from classify_describe_server.describer import Cancelled, Describer, make_client
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import parse_settings
from test_describe_describer import FAST, KEY, Log, Recorder, job

from tools.fake_openai import FakeOpenAI


def run(test, key=KEY, **params):
    """`test(fake, describer, observer)` on one loop with a fresh fake and describer."""
    async def main():
        fake = FakeOpenAI(port=0)
        await fake.start()
        settings = parse_settings(dict(FAST, base_url=fake.base_url, **params), {})
        observer = Recorder()
        describer = Describer(settings, make_client(settings, key) if key else None, Scrubber(key), observer, Log())
        try:
            return await test(fake, describer, observer)
        finally:
            await describer.aclose()
            await fake.stop()
    return asyncio.run(main())


async def stream(describer, the_job=None, is_cancelled=lambda: False):
    chunks = []
    result = await describer.describe(the_job or job(), is_cancelled, chunks.append)
    return chunks, result


def test_the_text_comes_chunk_by_chunk_and_is_billed_from_the_usage_chunk():
    async def test(fake, d, obs):
        fake.set_mode("ok", answer_words=12)
        chunks, r = await stream(d)
        assert len(chunks) == 12 and "".join(chunks) == r.description == fake.stats["streamed_answers"][-1]
        assert r.source == "llm" and r.outcome == "ok" and r.usage.chunks == 12
        assert r.usage.completion_tokens == 12 and r.usage.cost_usd > 0 and r.usage.time_to_first_token_ms > 0
        assert fake.stats["bodies"][-1]["stream_options"] == {"include_usage": True}
        assert obs.max_in_flight == 1 and d._in_flight == 0  # the slot was held while streaming, then freed
    run(test)


def test_a_cached_answer_replays_as_one_chunk_and_a_partial_one_is_not_cached():
    async def test(fake, d, obs):
        fake.set_mode("cut", cut_after=2, chunk_ms=20)
        chunks, r = await stream(d)
        assert r.source == "llm_partial" and len(chunks) == 2 and r.usage.fallback_reason == "connection_error"
        fake.set_mode("ok", chunk_ms=0)
        first, _ = await stream(d)
        again, r = await stream(d)
        assert again == ["".join(first)] and r.outcome == "cached" and r.usage.chunks == 1
        assert fake.stats["streams_started"] == 2
    run(test)


def test_retries_happen_before_the_first_token_only():
    async def test(fake, d, obs):
        fake.set_mode("500", count=1)
        _, r = await stream(d)
        assert r.source == "llm" and r.usage.attempts == 2 and obs.attempts == ["upstream_error_http_500", "ok"]
        fake.set_mode("500")
        chunks, r = await stream(d, job("other"))
        assert r.source == "fallback" and chunks == [r.description] and r.usage.attempts == 3
    run(test)


def test_on_failure_error_emits_nothing():
    async def test(fake, d, obs):
        fake.set_mode("500")
        chunks, r = await stream(d)
        assert r.outcome == "error" and chunks == []
    run(test, on_failure="error")


def test_a_cancelled_stream_closes_the_upstream_connection():
    async def test(fake, d, obs):
        fake.set_mode("ok", chunk_ms=20, answer_words=500)
        cancelled = []

        def emit(text):
            if len(cancelled) == 0 and text:
                cancelled.append(True)

        try:
            await d.describe(job(), lambda: bool(cancelled), emit)
        except Cancelled:
            pass
        else:
            raise AssertionError("not cancelled")
        for _ in range(100):
            if fake.stats["disconnected"]:
                break
            await asyncio.sleep(0.01)
        assert fake.stats["disconnected"] == 1 and fake.stats["streams_completed"] == 0
        assert obs.outcomes == ["cancelled"] and d._in_flight == 0
    run(test)


def test_without_a_key_the_fallback_is_the_one_chunk():
    async def test(fake, d, obs):
        chunks, r = await stream(d)
        assert r.usage.fallback_reason == "no_api_key" and chunks == [r.description] and fake.stats["requests"] == 0
    run(test, key=None)


def test_a_stream_that_stalls_after_its_first_token_ends_as_partial():
    """Each chunk must come within timeout_s of the previous one."""
    async def test(fake, d, obs):
        fake.set_mode("ok", chunk_ms=600, answer_words=5)
        started = asyncio.get_running_loop().time()
        chunks, r = await stream(d, job(timeout_s=0.3))
        assert r.source == "llm_partial" and chunks == [r.description] and r.usage.fallback_reason == "timeout"
        assert asyncio.get_running_loop().time() - started < 1.5 and d._in_flight == 0
    run(test)


def test_the_streams_finish_reason_is_passed_on_in_usage():
    async def test(fake, d, obs):
        fake.set_mode("ok", answer_words=80)
        _, r = await stream(d)
        assert r.usage.finish_reason == "length" and r.source == "llm"
        fake.set_mode("ok", answer_words=12)
        _, r = await stream(d, job("short"))
        assert r.usage.finish_reason == "stop"
        fake.set_mode("cut", cut_after=2, chunk_ms=20)
        _, r = await stream(d, job("cut"))
        assert r.source == "llm_partial" and r.usage.finish_reason is None
    run(test)
