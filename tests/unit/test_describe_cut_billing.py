"""Billing of answers without usage: a stream that ends before its usage chunk (the
upstream dropped the connection, a chunk timed out, the client cancelled, the answer
ran past its limit) was billed upstream all the same, and some servers send no usage
at all, whole or streamed. Their tokens are estimated from the prompt and the text
(4 characters a token), flagged tokens_estimated in USAGE, and counted in cost and
metrics, by one rule for both paths (accounting.billed_tokens)."""

import json
import math

import pytest
from classify_describe_server.describer import Cancelled
from classify_describe_server.prompting import build_messages
from test_describe_describer import job
from test_describe_streaming import run, stream


def expected_prompt_tokens(d, the_job):
    messages = build_messages(d.settings, the_job.labels, the_job.scores, the_job.prompt)
    return math.ceil(sum(len(m["content"]) for m in messages) / 4)


def assert_estimated(d, obs, usage, text, read_past=False):
    """`read_past`: the text was cut, and what was read past the cut is billed too."""
    assert usage.tokens_estimated is True, usage
    assert usage.prompt_tokens == expected_prompt_tokens(d, job()) > 0
    if read_past:
        assert math.ceil(len(text) / 4) < usage.completion_tokens < math.ceil(len(text) / 4) + 20
    else:
        assert usage.completion_tokens == math.ceil(len(text) / 4)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.cost_usd > 0
    assert json.loads(usage.to_json())["tokens_estimated"] is True
    assert obs.usages[-1] is usage  # what the metrics count


@pytest.mark.parametrize("mode, settings, reason", [
    ({"mode": "cut", "cut_after": 3, "chunk_ms": 20, "answer_words": 20}, {}, "connection_error"),
    ({"mode": "ok", "chunk_ms": 800, "answer_words": 5}, {"timeout_s": "0.3"}, "timeout"),
    ({"mode": "flood"}, {}, "answer_too_long"),
])
def test_a_stream_cut_short_is_billed_by_estimate(mode, settings, reason):
    async def test(fake, d, obs):
        fake.set_mode(**mode)
        chunks, r = await stream(d, job(timeout_s=float(settings.get("timeout_s", 2))))
        assert r.source == "llm_partial" and r.usage.fallback_reason == reason and chunks
        assert_estimated(d, obs, r.usage, "".join(chunks), read_past=reason == "answer_too_long")
    run(test, **settings)


def test_a_cancelled_stream_is_billed_by_estimate_in_the_metrics():
    async def test(fake, d, obs):
        fake.set_mode("ok", chunk_ms=30, answer_words=200)
        chunks = []
        with pytest.raises(Cancelled):
            await d.describe(job(), lambda: len(chunks) >= 3, chunks.append)
        assert obs.outcomes[-1] == "cancelled"
        usage = obs.usages[-1]
        assert usage.tokens_estimated is True and usage.completion_tokens >= math.ceil(len("".join(chunks)) / 4)
        assert usage.prompt_tokens == expected_prompt_tokens(d, job()) and usage.cost_usd > 0
    run(test)


def test_streams_dropped_before_their_first_text_are_billed_by_estimate_per_attempt():
    async def test(fake, d, obs):
        fake.set_mode("cut", cut_after=0)
        chunks, r = await stream(d)
        assert r.source == "fallback" and r.usage.attempts == 3
        assert r.usage.tokens_estimated and r.usage.prompt_tokens == 3 * expected_prompt_tokens(d, job())
        assert r.usage.completion_tokens == 0
    run(test)


def test_a_whole_stream_is_billed_from_its_usage_chunk_not_estimated():
    async def test(fake, d, obs):
        fake.set_mode("ok", answer_words=12)
        chunks, r = await stream(d)
        assert r.source == "llm" and r.usage.tokens_estimated is None and r.usage.completion_tokens == 12
        assert "tokens_estimated" not in json.loads(r.usage.to_json())
    run(test)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_an_answer_without_usage_is_billed_by_estimate_the_same_on_both_paths(streamed):
    """A local server that sends no usage (in the answer or as the stream's last chunk): the
    answer is kept and billed from the prompt and its text, flagged, and what USAGE shows is
    what the metrics count."""
    async def test(fake, d, obs):
        fake.set_mode("ok", answer_words=12, usage=False)
        if streamed:
            chunks, r = await stream(d)
            text = "".join(chunks)
        else:
            r = await d.describe(job())
            text = r.description
        assert r.source == "llm" and r.usage.attempts == 1
        assert_estimated(d, obs, r.usage, text)
    run(test)
