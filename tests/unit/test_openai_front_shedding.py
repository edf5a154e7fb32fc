"""The front's Retry-After under overload (openai_front/shedding.py): refused
clients that come back when told must not cost more than the answers, and the
slots must stay full. A simulation in fake time: no clock, no sockets."""

import collections
import heapq
import math
import random

import pytest

from openai_front.shedding import LONGEST_RETRY_AFTER_S, MIN_SPREAD_S, RetryAfter


def simulate(clients, limit=128, service_s=4.9, seconds=120.0, retry_after_factory=None, obey=True, think_s=1.0):
    """Closed-loop clients (each sends its next request `think_s` after its answer) that
    wait what Retry-After says when refused (or resend at once, obey=False). Returns
    (answers/s, refusals/s, largest Retry-After) over the second half of the run."""
    now = [0.0]
    shedder = (retry_after_factory or RetryAfter)(clock=lambda: now[0], rng=random.Random(1))
    starts = random.Random(2)
    events = [(starts.uniform(0, 1), "attempt") for _ in range(clients)]
    heapq.heapify(events)
    in_flight, answers, refusals, largest, half = 0, 0, 0, 0, seconds / 2
    while events:
        at, kind = heapq.heappop(events)
        if at > seconds:
            break
        now[0] = at
        if kind == "finish":
            in_flight -= 1
            shedder.finish()
            answers += at > half
            heapq.heappush(events, (at + think_s, "attempt"))
        elif in_flight < limit:
            in_flight += 1
            heapq.heappush(events, (at + service_s, "finish"))
        else:
            wait = shedder.refuse()
            largest = max(largest, wait)
            refusals += at > half
            heapq.heappush(events, (at + (wait if obey else 0.001), "attempt"))
    return answers / half, refusals / half, largest


def test_no_overload_no_refusal():
    answered, refused, _ = simulate(clients=100)
    assert refused == 0 and answered == pytest.approx(100 / (4.9 + 1.0), rel=0.05)


@pytest.mark.parametrize("overload, refusals_per_answer", [(2, 0.6), (10, 1.0), (20, 2.0)])
def test_under_overload_refusals_cost_a_few_per_answer_and_the_slots_stay_busy(overload, refusals_per_answer):
    """Half a client back per freed slot, beside the fresh attempt of the client answered:
    0.46, 0.89 and 1.85 refusals per answer (more at 20x, where the longest Retry-After
    binds), the slots 0.98-0.99 busy. One back per freed slot gave 0.88, 0.96 and 1.85, as
    busy; the clients away estimated from the last 10 s of refusals (Little's law) 0.98,
    1.45 and 2.3; counting only those coming back 2.1, 2.1, 3.0."""
    capacity = 128 / 4.9  # answers/s with every slot busy
    answered, refused, largest = simulate(clients=128 * overload)
    assert answered >= 0.97 * capacity, "a Retry-After so long that slots went idle"
    assert refused <= refusals_per_answer * answered, f"{refused:.0f} refusals/s for {answered:.1f} answers/s"
    assert 1 <= largest <= LONGEST_RETRY_AFTER_S


@pytest.mark.parametrize("mean, shortest, longest", [
    (1.0, 1, 1), (1.4, 1, 2), (7.5, 1, 14), (30.0, 1, 59), (40.0, 21, 59),
    (LONGEST_RETRY_AFTER_S - MIN_SPREAD_S / 2, LONGEST_RETRY_AFTER_S - MIN_SPREAD_S, LONGEST_RETRY_AFTER_S)])
def test_retry_afters_are_drawn_around_the_mean_within_the_longest(mean, shortest, longest):
    """Every whole second from `shortest` to `longest`, centred on the mean (whole
    seconds move it by at most a quarter): spread, so that clients refused
    together do not come back together."""
    shedder = RetryAfter(clock=lambda: 0.0, rng=random.Random(0))
    shedder.finish()  # the pace is known
    shedder._mean_s = lambda finished_per_s: mean
    drawn = [shedder.refuse() for _ in range(20_000)]
    assert set(drawn) == set(range(shortest, longest + 1))
    assert abs((shortest + longest) / 2 - mean) <= 0.25


def test_before_any_answer_the_nth_client_away_waits_one_to_n_seconds():
    """No pace to divide by yet: a few refused at a cold start come back within seconds, and
    a crowd is spread evenly over the whole range at once, not near its top (drawn around
    the longest mean, a crowd came back as one wave 39 to 59 s later)."""
    shedder = RetryAfter(clock=lambda: 0.0, rng=random.Random(0))
    drawn = [shedder.refuse() for _ in range(20_000)]
    assert all(1 <= wait <= min(n, LONGEST_RETRY_AFTER_S) for n, wait in enumerate(drawn, start=1))
    crowd = collections.Counter(drawn[LONGEST_RETRY_AFTER_S:])
    assert set(crowd) == set(range(1, LONGEST_RETRY_AFTER_S + 1))
    even = len(drawn[LONGEST_RETRY_AFTER_S:]) / LONGEST_RETRY_AFTER_S
    assert all(abs(count - even) < 0.25 * even for count in crowd.values()), "the crowd is not spread evenly"


def test_the_mean_stops_where_the_draws_still_spread():
    now = [0.0]
    shedder = RetryAfter(clock=lambda: now[0], rng=random.Random(0))
    for step in range(20_000):  # 2,000 refusals a second, one answer a second
        now[0] = step * 0.0005
        shedder.finish() if step % 2000 == 0 else shedder.refuse()
    assert shedder.mean_s() == LONGEST_RETRY_AFTER_S - MIN_SPREAD_S / 2


def test_a_fixed_one_second_would_refuse_twenty_times_per_answer():
    """The baseline the adaptive Retry-After replaces (and what the test above would catch)."""
    class OneSecond(RetryAfter):
        def refuse(self):
            return 1
    answered, refused, _ = simulate(clients=128 * 20, retry_after_factory=OneSecond)
    assert refused > 15 * answered


def test_a_lone_refusal_before_any_answer_gets_one_second():
    shedder = RetryAfter(clock=lambda: 0.0, rng=random.Random(0))
    assert shedder.refuse() == 1


def test_the_clients_away_are_counted_until_their_wait_ends():
    """Each refusal is one client away until its Retry-After ends (rounded up to the whole
    second, never forgotten before), however many were refused together: a count over a
    window of refusals overshoots in a burst."""
    now = [0.3]
    shedder = RetryAfter(clock=lambda: now[0], rng=random.Random(0))
    shedder.finish()
    ends = [0.3 + shedder.refuse() for _ in range(500)]
    for step in range(1260):
        now[0] = step / 20  # whole seconds, and between them
        shedder.mean_s()
        assert shedder.away == sum(math.ceil(end) > now[0] for end in ends)
        assert shedder.away >= sum(end > now[0] for end in ends)


def test_a_crowd_arriving_at_once_before_any_answer_is_spread_at_once():
    """20x the slots arrive within 50 ms, the first answer 3 s later: each
    refused client is refused about once before it, not once per second (a
    Retry-After of 1 s until the first answer refused them three times), and
    the slots still stay busy from the start."""
    clients, limit, service_s = 128 * 20, 128, 3.0
    now = [0.0]
    shedder = RetryAfter(clock=lambda: now[0], rng=random.Random(1))
    starts = random.Random(2)
    events = [(starts.uniform(0, 0.05), "attempt") for _ in range(clients)]
    heapq.heapify(events)
    in_flight, answers, refused_early = 0, 0, 0
    while events and events[0][0] <= 30:
        now[0], kind = heapq.heappop(events)
        if kind == "finish":
            in_flight, answers = in_flight - 1, answers + 1
            shedder.finish()
            heapq.heappush(events, (now[0], "attempt"))
        elif in_flight < limit:
            in_flight += 1
            heapq.heappush(events, (now[0] + service_s, "finish"))
        else:
            refused_early += now[0] < service_s
            heapq.heappush(events, (now[0] + shedder.refuse(), "attempt"))
    assert refused_early <= 1.1 * (clients - limit), f"{refused_early} refusals before the first answer"
    assert answers / 30 >= 0.85 * limit / service_s, "slots went idle in the first 30 s"


def test_once_the_refused_are_back_the_next_refusal_gets_about_a_second():
    now = [0.0]
    shedder = RetryAfter(clock=lambda: now[0], rng=random.Random(0))
    for step in range(2000):
        now[0] = step * 0.005
        shedder.finish() if step % 40 == 0 else shedder.refuse()
    assert shedder.mean_s() > 5
    now[0] += LONGEST_RETRY_AFTER_S + 1
    shedder.finish()
    assert shedder.mean_s() == 1.0
