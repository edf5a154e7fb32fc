"""classify_describe/throttle.py: the adaptive throttle's rule, on a fake clock.
The clients' use of it (what is sent, what is counted) is in test_client.py."""

import pytest

from classify_describe.throttle import AdaptiveThrottle


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def throttle(clock, **kwargs):
    return AdaptiveThrottle(clock=clock, rand=lambda: 0.5, **kwargs)


def test_the_refusal_probability_is_the_sre_rule():
    clock = Clock()
    gate = throttle(clock, k=2.0, min_requests=0)
    for _ in range(100):
        gate.allow()
    for _ in range(10):
        gate.accepted()
    assert gate.refusal_probability() == pytest.approx((100 - 2 * 10) / 101)


def test_nothing_is_refused_while_the_server_accepts_what_it_gets():
    clock = Clock()
    gate = throttle(clock, min_requests=0)
    for _ in range(200):
        assert gate.allow()
        gate.accepted()
    assert gate.refusal_probability() == 0.0


def test_k_leaves_the_server_twice_what_it_accepts():
    # requests up to k x accepts pass: with k = 2, half of them refused by the server is not throttled
    clock = Clock()
    gate = throttle(clock, k=2.0, min_requests=0)
    for number in range(100):
        gate.allow()
        if number % 2 == 0:
            gate.accepted()
    assert gate.refusal_probability() == 0.0
    gate.allow()
    assert gate.refusal_probability() > 0.0


def test_below_min_requests_a_few_refusals_throttle_nothing():
    clock = Clock()
    gate = throttle(clock, min_requests=20)
    for _ in range(19):
        assert gate.allow()  # all refused by the server, none accepted
    assert gate.refusal_probability() == 0.0
    gate.allow()
    assert gate.refusal_probability() == pytest.approx(20 / 21)


def test_refused_attempts_count_as_requests():
    clock = Clock()
    gate = AdaptiveThrottle(clock=clock, rand=lambda: 0.0, min_requests=0)  # refused whenever p > 0
    assert gate.allow()  # p = 0 for the first
    assert not gate.allow()  # p = 1/2 after one that was not accepted
    assert gate.refusal_probability() == pytest.approx(2 / 3)


def test_the_counts_fade_with_the_window():
    clock = Clock()
    gate = throttle(clock, window_s=30.0, min_requests=20)
    for _ in range(100):
        gate.allow()
    assert gate.refusal_probability() > 0.9
    clock.now = 30.0  # one time constant: 100 -> 37 requests, still throttled
    assert gate.refusal_probability() == pytest.approx(100 * 0.36788 / (100 * 0.36788 + 1), rel=1e-3)
    clock.now = 90.0  # 100 -> 5 requests: under min_requests, the server is tried again
    assert gate.refusal_probability() == 0.0


def test_settings_are_checked():
    with pytest.raises(ValueError):
        AdaptiveThrottle(k=0.5)
    with pytest.raises(ValueError):
        AdaptiveThrottle(window_s=0)
