"""Pure logic of the describe step: retries, back-off, circuit breaker, cache,
secret scrubbing, prompts and fallback text."""

import email.utils
import json

from classify_describe_server.accounting import Usage, cost_usd
from classify_describe_server.llm_cache import LRUCache, cache_key
from classify_describe_server.prompting import build_messages, fallback_description
from classify_describe_server.resilience import CircuitBreaker, backoff_delay, classify_status, parse_retry_after
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import parse_settings


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_client_errors_are_not_retried_and_do_not_trip_the_circuit():
    for status in (400, 401, 403, 404):
        failure = classify_status(status)
        assert not failure.retryable and not failure.upstream_fault and failure.reason.endswith(f"_http_{status}")
    assert classify_status(401).reason == "authentication_failed_http_401"
    for status in (429, 500, 502, 503):
        assert classify_status(status).retryable and classify_status(status).upstream_fault


def test_retry_after_in_seconds_milliseconds_and_http_date():
    assert classify_status(429, {"retry-after": "2"}).retry_after_s == 2.0
    assert parse_retry_after({"retry-after-ms": "1500"}) == 1.5
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert parse_retry_after({"retry-after": date}, now=1_000_000) == 30.0
    assert parse_retry_after({"retry-after": "soon"}) is None and parse_retry_after({}) is None


def test_backoff_is_exponential_capped_and_jittered():
    assert [backoff_delay(n, 0.25, 1.0, rand=lambda: 1.0) for n in (1, 2, 3, 4)] == [0.25, 0.5, 1.0, 1.0]
    assert backoff_delay(3, 0.25, 1.0, rand=lambda: 0.0) == 0.0
    # Retry-After is a floor; jitter only adds a little on top.
    assert 2.0 <= backoff_delay(1, 0.25, 1.0, retry_after_s=2.0, rand=lambda: 1.0) <= 2.2


def test_circuit_opens_after_consecutive_failures_then_half_opens_one_probe():
    clock, changes = Clock(), []
    breaker = CircuitBreaker(threshold=3, cooldown_s=10, clock=clock, on_change=changes.append)
    breaker.record_failure(breaker.allow()), breaker.record_failure(breaker.allow())
    breaker.record_success(breaker.allow())  # a success resets the count
    for _ in range(3):
        ticket = breaker.allow()
        assert ticket is not None
        breaker.record_failure(ticket)
    assert breaker.state == "open" and breaker.allow() is None
    clock.now += 10
    probe = breaker.allow()
    assert probe is not None and breaker.state == "half_open"
    assert breaker.allow() is None  # only one probe at a time
    breaker.record_failure(probe)   # the probe failed: open for another cooldown
    assert breaker.state == "open" and breaker.allow() is None
    clock.now += 10
    breaker.record_success(breaker.allow())
    assert breaker.state == "closed" and breaker.allow() is not None
    assert changes == ["open", "half_open", "open", "half_open", "closed"]


def test_a_probe_without_verdict_lets_the_next_one_through():
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=1, clock=clock)
    breaker.record_failure(breaker.allow())
    clock.now += 1
    probe = breaker.allow()
    assert probe is not None and breaker.allow() is None
    breaker.release(probe)
    assert breaker.allow() is not None


def test_calls_from_before_the_circuit_opened_have_no_say_in_half_open():
    clock, changes = Clock(), []
    breaker = CircuitBreaker(threshold=1, cooldown_s=10, clock=clock, on_change=changes.append)
    stale = [breaker.allow() for _ in range(3)]  # admitted while closed, still in flight
    breaker.record_failure(breaker.allow())      # another call fails: open
    clock.now += 10
    probe = breaker.allow()
    assert probe is not None
    breaker.release(stale[0])          # ends without a verdict: the probe's place stays taken
    assert breaker.allow() is None
    breaker.record_success(stale[1])   # neither closes the circuit ...
    breaker.record_failure(stale[2])   # ... nor re-opens it
    assert breaker.state == "half_open" and breaker.allow() is None
    breaker.record_success(probe)
    assert breaker.state == "closed"
    assert changes == ["open", "half_open", "closed"]


def test_lru_cache_evicts_least_recent_and_expires():
    clock = Clock()
    cache = LRUCache(max_entries=2, ttl_s=60, clock=clock)
    cache.put("a", 1), cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and len(cache) == 2
    clock.now += 61
    assert cache.get("a") is None


def test_cache_key_covers_model_and_sampling_parameters():
    messages = [{"role": "user", "content": "x"}]
    keys = {cache_key("m", 0.2, 256, messages), cache_key("n", 0.2, 256, messages),
            cache_key("m", 0.3, 256, messages), cache_key("m", 0.2, 100, messages),
            cache_key("m", 0.2, 256, [{"role": "user", "content": "y"}])}
    assert len(keys) == 5


def test_scrubber_removes_the_key_and_key_shaped_strings():
    scrub = Scrubber("sk-test-DO-NOT-LEAK-7f3a9c2e51")
    text = scrub("Error code: 401 - Incorrect API key provided: sk-test-DO-NOT-LEAK-7f3a9c2e51. "
                 "headers {'Authorization': 'Bearer abc.def'} other sk-proj-abcdefgh1234 api_key=zzz")
    assert "7f3a9c2e51" not in text and "abc.def" not in text and "abcdefgh1234" not in text
    assert "zzz" not in text and "Error code: 401" in text


def test_prompt_ranks_labels_and_uses_the_template():
    s = parse_settings({"prompt_template": "{prompt} | top: {top_label}\n{labels}"}, {})
    system, user = build_messages(s, ["tiger cat", "tabby, tabby cat"], [0.2, 0.7], "What is it?")
    assert system["role"] == "system" and user["role"] == "user"
    assert user["content"] == "What is it? | top: tabby, tabby cat\n- tabby, tabby cat (70.0%)\n- tiger cat (20.0%)"


def test_fallback_reads_like_a_sentence():
    assert fallback_description(["tiger cat", "tabby, tabby cat", "Egyptian cat", "lynx"],
                                [0.21, 0.62, 0.09, 0.01]) == \
        "Most likely a tabby (62%); it could also be a tiger cat (21%) or an Egyptian cat (9%)."
    assert fallback_description(["espresso"], [0.9]) == "Most likely an espresso (90%)."


def test_usage_json_and_cost():
    assert cost_usd(1_000_000, 1_000_000, (0.15, 0.60)) == 0.75 and cost_usd(10, 10, None) is None
    usage = json.loads(Usage("m", 10, 5, 15, 1.23456789012e-5, 12.345, 2).to_json())
    assert usage == {"model": "m", "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                     "cost_usd": 1.2346e-05, "upstream_latency_ms": 12.3, "attempts": 2,
                     "cached": False, "fallback_reason": None, "finish_reason": None,
                     "vision": False, "vision_skipped_reason": None}
