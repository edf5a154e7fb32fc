"""Client-side adaptive throttling, as in Google's SRE book ("Handling
Overload", chapter 21), the same rule as Envoy's admission control filter.

Under overload a refused request is not free for the server: Triton reads the
whole photo before its queue policy refuses it (docs/reliability.md#overload).
A client whose recent requests were mostly refused therefore refuses the excess
itself, without sending it: each new attempt is refused here with probability

    max(0, (requests - k * accepts) / (requests + 1))

where `requests` counts the attempts of the last `window_s` (those refused here
included) and `accepts` those the server accepted (answered with anything but
an overload refusal). With k = 2 the server keeps receiving about twice what it
accepts, so it still sees the demand and the client notices at once when
capacity comes back, while the 20x of an overload that would otherwise reach it
stays on the client's side. Below `min_requests` in the window nothing is
refused: a client that sends a few requests a minute is never throttled by one
503.

Counts decay exponentially with time constant `window_s` (no buckets to keep).
The window sets how fast a throttled client opens up again when capacity
returns (a cold start, the end of a spike): it sends k x accepts, so while the
server has room its accepts grow by a factor e every window_s / (k - 1). With
30 s (Envoy's default) a 20x cold start took 30 s to reach full goodput
(docs/reliability.md#overload); 10 s still holds hundreds of requests at the
rates where throttling matters.
One instance per client object, shared by its requests and threads: counts are
floats updated without a lock, so concurrent threads may lose an update now and
then, which moves a probability by a fraction of one request.
"""

import math
import random
import time

# The defaults; tools/overload_client.c's THROTTLE_* copy them (a unit test keeps them equal).
DEFAULT_K = 2.0
WINDOW_S = 10.0
MIN_REQUESTS = 20


class AdaptiveThrottle:
    def __init__(self, k=DEFAULT_K, window_s=WINDOW_S, min_requests=MIN_REQUESTS, clock=time.monotonic,
                 rand=random.random):
        if k < 1.0:
            raise ValueError("k must be at least 1 (k < 1 refuses requests the server would accept)")
        if window_s <= 0 or min_requests < 0:
            raise ValueError("window_s must be > 0 and min_requests >= 0")
        self.k, self.window_s, self.min_requests = k, window_s, min_requests
        self._clock, self._rand = clock, rand
        self._requests = 0.0
        self._accepts = 0.0
        self._at = clock()

    def _decay(self):
        now = self._clock()
        factor = math.exp(-max(0.0, now - self._at) / self.window_s)
        self._requests *= factor
        self._accepts *= factor
        self._at = now

    def refusal_probability(self):
        """The probability that the next attempt is refused here."""
        self._decay()
        if self._requests < self.min_requests:
            return 0.0
        return max(0.0, (self._requests - self.k * self._accepts) / (self._requests + 1.0))

    def allow(self):
        """Count one attempt; False: refuse it here, unsent."""
        probability = self.refusal_probability()
        self._requests += 1.0
        return self._rand() >= probability

    def accepted(self):
        """The server accepted an attempt that allow() let through."""
        self._decay()
        self._accepts += 1.0
