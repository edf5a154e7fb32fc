"""resilience.py at its edges: statuses no table names, and a verdict that
arrives after the circuit has moved on twice (found by `make mutants`,
docs/mutation.md)."""

import email.utils
import time

from classify_describe_server.resilience import (
    CircuitBreaker,
    Failure,
    backoff_delay,
    classify_status,
    parse_retry_after,
    refuses_image,
    status_reason,
)


def test_a_status_below_500_that_no_table_names_is_unexpected_and_not_the_upstreams_fault():
    assert status_reason(302) == "unexpected_status_http_302"
    assert status_reason(418) == "unexpected_status_http_418"
    assert status_reason(500) == "upstream_error_http_500"
    assert classify_status(302) == Failure("unexpected_status_http_302", retryable=False, upstream_fault=False)
    assert classify_status(401) == Failure("authentication_failed_http_401", retryable=False, upstream_fault=False)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_verdict_from_an_earlier_closed_period_says_nothing_about_a_later_probe():
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure(breaker.allow())            # open
    clock.now += 10
    breaker.record_success(breaker.allow())            # the probe closes it
    late = breaker.allow()                             # a call of this closed period, still running...
    breaker.record_failure(breaker.allow())            # ...when another opens the circuit again
    clock.now += 10
    probe = breaker.allow()
    assert probe is not None and breaker.state == CircuitBreaker.HALF_OPEN
    breaker.record_failure(late)                       # the late verdict is ignored
    assert breaker.state == CircuitBreaker.HALF_OPEN
    assert breaker.allow() is None                     # and the probe keeps its place
    breaker.record_success(probe)
    assert breaker.state == CircuitBreaker.CLOSED


def test_which_statuses_are_retried():
    for status in (408, 409, 429, 500, 503):
        failure = classify_status(status)
        assert failure.retryable and failure.upstream_fault, status
    for status in (302, 410, 413, 418):
        assert classify_status(status) == Failure(status_reason(status), retryable=False, upstream_fault=False)


def test_an_image_refusal_is_a_400_or_422_that_mentions_images():
    assert refuses_image(422, "", "model is not a multimodal model")
    assert refuses_image(400, '{"error": "image_url is only supported by certain models"}', "")
    assert not refuses_image(400, '{"error": "max_tokens is too large"}', "bad request")
    assert not refuses_image(423, "", "vision")
    assert not refuses_image(500, "", "image")


def test_retry_after_below_a_second_is_kept():
    assert parse_retry_after({"retry-after-ms": "250"}) == 0.25
    assert parse_retry_after({"retry-after": "0.5"}) == 0.5
    now = 1_700_000_000.0
    soon = email.utils.formatdate(now + 30, usegmt=True)
    assert parse_retry_after({"retry-after": soon}, now=now - 0.5) == 30.5
    assert parse_retry_after({"retry-after": soon}, now=now + 29.5) == 0.5
    # without `now`, the date is read against the wall clock
    assert 0 < parse_retry_after({"retry-after": email.utils.formatdate(time.time() + 3600, usegmt=True)}) <= 3600


def test_a_retry_after_gets_at_most_a_tenth_of_itself_as_jitter():
    # attempt 3: the exponential ceiling is 0.25 * 4 = 1 s, all of it drawn (rand 1.0)
    assert backoff_delay(3, 0.25, 4.0, retry_after_s=10.0, rand=lambda: 1.0) == 11.0
    assert backoff_delay(3, 0.25, 4.0, retry_after_s=2.0, rand=lambda: 1.0) == 2.2
    assert backoff_delay(3, 0.25, 4.0, retry_after_s=0.0, rand=lambda: 1.0) == 0.025  # a tenth of base_s
