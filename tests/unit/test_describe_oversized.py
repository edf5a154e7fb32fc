"""Oversized answers: an upstream that writes far past the
request's max_tokens, as a whole answer or a stream, over real HTTP against the
fake upstream ("huge", "flood") with the real openai SDK. The text is cut at
CHARS_PER_TOKEN a token (or max_answer_chars), ends as llm_partial with
fallback_reason answer_too_long, is never cached; a stream stops being read
there, and a body past response_bytes_limit is not read at all."""

import asyncio
import time

from classify_describe_server.describer import CHARS_PER_TOKEN, response_bytes_limit
from classify_describe_server.settings import parse_settings
from test_describe_describer import job, run
from test_describe_streaming import stream

LIMIT = CHARS_PER_TOKEN * 64  # job() asks for max_tokens 64


def assert_cut(r, limit=LIMIT):
    assert r.source == "llm_partial" and r.outcome == "partial", (r.source, r.outcome)
    assert len(r.description) == limit and r.usage.fallback_reason == "answer_too_long"
    assert r.usage.finish_reason == "length" and r.usage.attempts == 1


def test_a_whole_answer_past_max_tokens_is_cut_and_not_cached():
    async def test(fake, d, obs, log):
        fake.set_mode("huge", huge_chars=50_000)
        r = await d.describe(job())
        assert_cut(r)
        again = await d.describe(job())
        assert again.outcome == "partial" and fake.stats["requests"] == 2  # not from the cache
    run(test)


def test_max_answer_chars_caps_whatever_max_tokens_allows():
    async def test(fake, d, obs, log):
        fake.set_mode("huge", huge_chars=50_000)
        assert_cut(await d.describe(job()), limit=300)
        fake.set_mode("flood")
        chunks, r = await stream(d)
        assert_cut(r, limit=300)
        assert len("".join(chunks)) == 300
    run(test, max_answer_chars="300")


def test_a_whole_answer_past_the_byte_limit_is_not_read_and_falls_back():
    limit = response_bytes_limit(parse_settings({}, {}))

    async def test(fake, d, obs, log):
        fake.set_mode("huge", huge_chars=4 * limit)
        started = time.monotonic()
        r = await d.describe(job())
        assert r.source == "fallback" and r.usage.fallback_reason == "answer_too_long", r.usage
        assert r.usage.attempts == 1 and time.monotonic() - started < 2
        assert fake.stats["requests"] == 1  # not retried: it would run long again
    run(test)


def test_a_flooding_stream_is_cut_and_the_upstream_call_closed():
    async def test(fake, d, obs, log):
        fake.set_mode("flood")
        chunks, r = await stream(d)
        assert_cut(r)
        assert "".join(chunks) == r.description  # nothing past the limit went out
        for _ in range(100):
            if fake.stats["disconnected"]:
                break
            await asyncio.sleep(0.02)
        assert fake.stats["disconnected"] == 1
        sent = fake.stats["flood_chunks"]
        await asyncio.sleep(0.2)
        # About 170 chunks make 1,024 characters; what the socket buffers is the rest.
        assert fake.stats["flood_chunks"] == sent < 2000, sent
        chunks, again = await stream(d)
        assert again.outcome == "partial" and fake.stats["streams_started"] == 2  # not cached
    run(test)


def test_one_huge_stream_chunk_is_cut_and_one_past_the_byte_limit_not_read():
    limit = response_bytes_limit(parse_settings({}, {}))

    async def test(fake, d, obs, log):
        fake.set_mode("huge", huge_chars=50_000)
        chunks, r = await stream(d)
        assert_cut(r)
        assert chunks == [r.description]
        fake.set_mode("huge", huge_chars=4 * limit)
        chunks, r = await stream(d)
        assert r.source == "fallback" and r.usage.fallback_reason == "answer_too_long", r.usage
        assert r.usage.attempts == 1
    run(test)
