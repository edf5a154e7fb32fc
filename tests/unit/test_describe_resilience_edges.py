"""resilience.py at its edges: statuses no table names, and a verdict that
arrives after the circuit has moved on twice (found by `make mutants`,
docs/mutation.md)."""

from resilience import CircuitBreaker, Failure, classify_status, status_reason


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
