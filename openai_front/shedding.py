"""Load shedding by concurrency, before a request body is read.

Triton refuses past its queue only after a request's whole body, a photo,
was read and parsed; behind the front each refused request would also cost
the front a read, a JSON parse and a base64 decode. Here a chat request past
`OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT` (counted whole: body, Triton's answer,
a stream to its end) is refused from its headers alone with 503 and
Retry-After; aiohttp then discards its body unparsed. docs/reliability.md#overload.

The Retry-After grows with the overload. A fixed one second would bring every
refused client back every second: at 20x the capacity, 20 refusals for each
answer, and the refusals (and the clients making them) eat the capacity they
protect. Instead the front estimates how many clients wait to come back
(Little's law over the last WINDOW_S: each refusal stands for one client away
for the Retry-After it was given) and how many answers finish per second, and
asks each refused client to come back after about waiting / (2 x finished per
second): then about two attempts arrive for each slot that frees, enough to
keep the slots full and few enough to cost little. Drawn at random around
that mean (1 to 2 x mean), so clients refused together come back spread out.
Before the window holds an answer (a cold start, or answers slower than the
window) the pace is taken as one answer per window, the least it could have
seen: a lone refusal still gets 1 s, but a crowd arriving at once is spread
at once. Answering every refusal with 1 s until the first answer brought a
crowd of 2,432 refused clients back every second, each with its photo to
send and to be read, for as long as the first answers took.
The openai SDK waits as asked for a Retry-After of up to 120 s and does not
retry at all past it; at most MAX_RETRY_AFTER_S - 1 is sent.

A refused client is still sending its body when its 503 goes out. Closing the
connection on it would reset it (the kernel answers data sent to a closed
socket with a reset), and a reset can destroy the 503 before the client reads
it: aiohttp reads and drops an unread body for only `lingering_time` (1 s
here, for the hostile cases), then closes. So a refusal's body is read and
dropped here, bounded in bytes and time, as nginx discards the body of a
request it refused; the connection then serves the client's next attempt.
A client that sent `Expect: 100-continue` holds its body back instead
(expect_continue.py): its refusal says Connection: close.
"""

import asyncio
import collections
import contextlib
import random
import time

from aiohttp import web

from . import expect_continue
from .errors import unavailable

# Only these carry a costly body and hold Triton; probes, /v1/models and
# /metrics are never shed.
SHED_PATHS = frozenset({"/v1/chat/completions"})
WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60  # under the openai SDK's 120 s, past which it gives up instead of waiting
ATTEMPTS_PER_FREED_SLOT = 2


class RetryAfter:
    """Seconds to ask a refused client to wait, from what the last WINDOW_S saw."""

    def __init__(self, clock=time.monotonic, rng=None):
        self.clock, self.rng = clock, rng or random.Random()
        self.finished = collections.deque()  # times answers finished
        self.refused = collections.deque()   # (time, Retry-After given)
        self.refused_wait_s = 0.0            # sum of the Retry-Afters in self.refused

    def _forget_before(self, now):
        edge = now - WINDOW_S
        while self.finished and self.finished[0] < edge:
            self.finished.popleft()
        while self.refused and self.refused[0][0] < edge:
            self.refused_wait_s -= self.refused.popleft()[1]

    def finish(self):
        now = self.clock()
        self.finished.append(now)
        self._forget_before(now)

    def mean_s(self):
        """The mean wait to ask for now (at least 1 s)."""
        self._forget_before(self.clock())
        # Nothing finished yet: as if one answer had, the slowest pace the window can show.
        finished_per_s = max(len(self.finished), 1) / WINDOW_S
        waiting = self.refused_wait_s / WINDOW_S  # clients away at any moment (Little's law)
        return min(max(waiting / (ATTEMPTS_PER_FREED_SLOT * finished_per_s), 1.0), MAX_RETRY_AFTER_S / 2)

    def refuse(self):
        """The whole seconds to send in Retry-After; counted as one more client away that long."""
        mean = self.mean_s()
        seconds = self.rng.randint(1, max(1, round(2 * mean - 1)))
        now = self.clock()
        self.refused.append((now, seconds))
        self.refused_wait_s += seconds
        return seconds


class Admission:
    """At most `limit` chat requests at once; the next one is refused at once."""

    def __init__(self, limit, retry_after=None):
        self.limit, self.now = limit, 0
        self.retry_after = retry_after or RetryAfter()

    @web.middleware
    async def middleware(self, request, handler):
        if request.path not in SHED_PATHS:
            return await handler(request)
        if self.now >= self.limit:
            raise unavailable(f"the front holds {self.now} requests already "
                              "(OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT); retry after Retry-After seconds",
                              retry_after_s=self.retry_after.refuse())
        self.now += 1
        try:
            response = await handler(request)
        finally:
            self.now -= 1
        # Only answers measure the pace at which slots free for the waiting; a request
        # refused inside (bodies in flight, Triton's queue) or failed is not one.
        if response.status < 500:
            self.retry_after.finish()
        return response


def discard_refused_bodies(max_bytes, within_s):
    """Middleware (the outermost): a 503 decided before its request's body was read
    goes out at once, then at most `max_bytes` of that body are read and dropped,
    for at most `within_s`; a body that does not end within both (a chunked one
    without end, a sender that stalls) has its connection closed."""
    @web.middleware
    async def middleware(request, handler):
        response = await handler(request)
        unasked = expect_continue.unasked(request)
        if unasked:
            response.force_close()  # its client holds the body back: the framing is lost
        if response.status != 503 or (response.keep_alive is False and not unasked) \
                or not request.can_read_body or request.content.is_eof():
            return response
        await response.prepare(request)
        await response.write_eof()
        left = max_bytes
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                # readchunk hands over each chunk as received; readany joins those waiting
                # (a copy of what is dropped): the refusal's CPU fell by about a fifth
                # (tools/refusal_cost.py, docs/reliability.md#overload).
                while left > 0 and not request.content.at_eof():
                    chunk, _ = await request.content.readchunk()
                    left -= len(chunk)
        if not request.content.is_eof() and request.transport is not None:
            request.transport.close()
        return response
    return middleware
