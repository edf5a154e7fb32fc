"""Load shedding by concurrency, before a request body is read.

Triton refuses past its queue only after a request's whole body, a photo,
was read and parsed; behind the front each refused request would also cost
the front a read, a JSON parse and a base64 decode. Here a chat request past
the requests in flight (counted whole: body, Triton's answer, a stream to its
end) is refused from its headers alone with 503 and Retry-After; aiohttp then
discards its body unparsed. docs/reliability.md#overload.

How many may be in flight is learnt from Triton's answers (AdaptiveLimit),
under `OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT` as a ceiling: what keeps Triton
busy depends on the LLM's latency and on the host (about 45 answers/s x 1 s
of LLM here, hundreds a second on a GPU), so no fixed number suits every
deployment. What they hold in memory is bounded apart (ImageBytes): a slow
LLM lets the limit rise, and each request holds its image to its end.

The Retry-After grows with the overload. A fixed one second would bring every
refused client back every second: at 20x the capacity, 20 refusals for each
answer, and the refusals (and the clients making them) eat the capacity they
protect. Instead the front counts the clients away (each refusal is one
client away until the Retry-After it was given ends) and how many answers
finish per second over the last WINDOW_S, and asks each refused client to
come back after about away / (RETURNS_PER_FREED_SLOT x finished per second):
half a client comes back for each slot that frees. Beside it comes a fresh
attempt: the client just answered sends its next request, or a new one
arrives; under overload those alone fill the freed slots, so each client
coming back is mostly one more refusal, which the client and the front pay
for (the openai SDK's users took 0.2-0.27 of the 2 cores at 20x).
One back per freed slot, as this asked before, kept the slots no fuller and
cost the openai SDK's users through the front at 20x 1.6x the refusals for
fewer answers (docs/reliability.md#overload); counting only those coming
back, before that, made three attempts per freed slot. The clients away are
counted, not estimated from the refusals of the last WINDOW_S by Little's
law, as this did before: a burst of refusals (a crowd coming back together)
counted each for the whole window, took the estimate past the clients there
were, the waits to the longest and the next wave with them. Drawn at random
around that mean, so clients refused together come back spread out: from
1 s to twice the mean less 1 s, and once the mean passes half the longest
Retry-After from as far below the mean as the longest is above it, never
narrower than MIN_SPREAD_S. Before the window holds an answer (a cold
start, or answers slower than the window) there is no pace to divide by:
the n-th client away is asked for 1 to n s (at most the longest), so a lone
refusal gets 1 s, a few get a few seconds, and a crowd arriving at once is
spread over the whole range at once. Answering every refusal with 1 s until
the first answer brought a crowd of 2,432 refused clients back every
second, each with its photo to send and to be read, for as long as the
first answers took; drawn around the longest mean (the slowest pace the
window shows), the same crowd came back as one wave 39 to 59 s later.
A client that comes back before its wait ends counts again for each
refusal, so a flood of them lengthens the waits the others are asked for,
at most to the longest, as the estimate before did; what reaches Triton is
bounded by the limit all the same.
The openai SDK pinned here waits as asked for a Retry-After of up to 120 s
and does not retry at all past it; its earlier releases (and SDKs made the
same way, anthropic's) wait as asked only up to 60 s and past it fall back to
their own 0.5 to 8 s. At most LONGEST_RETRY_AFTER_S is sent, which all of
them wait as asked.

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
import heapq
import math
import random
import time
import types

from aiohttp import web

from . import expect_continue
from .errors import FrontError, unavailable

# Only these carry a costly body and hold Triton; probes, /v1/models and
# /metrics are never shed.
SHED_PATHS = frozenset({"/v1/chat/completions"})
WINDOW_S = 10.0
LONGEST_RETRY_AFTER_S = 59  # under 60 s, the most that every release of the openai SDK waits as asked
RETURNS_PER_FREED_SLOT = 0.5  # clients coming back per freed slot, beside the fresh attempt that fills it
MIN_SPREAD_S = 20  # the narrowest range (its whole width) of Retry-Afters drawn from, at the longest mean


class PerSecond:
    """How many times something happened a second, over the last WINDOW_S."""

    def __init__(self):
        self.times = collections.deque()

    def _forget_before(self, now):
        while self.times and self.times[0] < now - WINDOW_S:
            self.times.popleft()

    def add(self, now):
        self.times.append(now)
        self._forget_before(now)

    def count(self, now):
        """Times in the window ending `now`."""
        self._forget_before(now)
        return len(self.times)

    def rate(self, now):
        return self.count(now) / WINDOW_S


class RetryAfter:
    """Seconds to ask a refused client to wait: the clients away now over the answers
    finished a second in the last WINDOW_S."""

    def __init__(self, clock=time.monotonic, rng=None):
        self.clock, self.rng = clock, rng or random.Random()
        self.finished = PerSecond()  # answers
        # The refused clients still away, counted by the whole second (rounded up) their Retry-After ends:
        # at most LONGEST_RETRY_AFTER_S + 1 counts, however many were refused (a flood of
        # refusals holds no more memory); `ends` is a heap of those seconds, the earliest first.
        self.away_until = collections.Counter()
        self.ends = []
        self.away = 0  # their sum
        self.refused = 0  # refusals so far

    def _forget_back(self, now):
        while self.ends and self.ends[0] <= now:
            self.away -= self.away_until.pop(heapq.heappop(self.ends))

    def finish(self):
        self.finished.add(self.clock())

    def _pace(self, now):
        """Answers finished a second over the last WINDOW_S, None before the window holds one."""
        count = self.finished.count(now)
        return count / WINDOW_S if count else None

    def mean_s(self):
        """The mean wait to ask for now (at least 1 s)."""
        now = self.clock()
        self._forget_back(now)
        # Nothing finished yet (refuse() then draws without it): the slowest pace the window shows.
        return self._mean_s(self._pace(now) or 1 / WINDOW_S)

    def _mean_s(self, finished_per_s):
        longest_mean = LONGEST_RETRY_AFTER_S - MIN_SPREAD_S / 2
        return min(max(self.away / (RETURNS_PER_FREED_SLOT * finished_per_s), 1.0), longest_mean)

    def refuse(self):
        """The whole seconds to send in Retry-After; counted as one more client away that long."""
        now = self.clock()
        self._forget_back(now)
        pace = self._pace(now)
        if pace is None:
            # No answer in the window yet, so no pace to divide by: the n-th client away is asked
            # for 1 to n s (at most the longest), so that a few refused at a cold start come back
            # within seconds and a crowd spreads over the whole range at once, not near its top.
            seconds = self.rng.randint(1, min(self.away + 1, LONGEST_RETRY_AFTER_S))
        else:
            mean = self._mean_s(pace)
            spread = min(mean - 1, LONGEST_RETRY_AFTER_S - mean)  # each side of the mean
            seconds = self.rng.randint(round(mean - spread), round(mean + spread))
        end = math.ceil(now + seconds)  # rounded up: never forgotten before its wait ends
        if end not in self.away_until:
            heapq.heappush(self.ends, end)
        self.away_until[end] += 1
        self.away += 1
        self.refused += 1
        return seconds


class AdaptiveLimit:
    """How many chat requests the front passes on at once, learnt from what
    Triton answers, as TCP learns its congestion window: a refusal for load
    (Triton's queue full or timed out, the describe step's LLM queue full)
    says the queue holds more than its 2 s; answers say the requests got
    through.

    - Ramp (at the start, and again after PROBE_AFTER_S without a refusal):
      each answer while at least half the limit is in use adds one, so the
      limit doubles every round trip, up to the first refusal.
    - A refusal takes QUEUE_CUT_S worth of answers (the answers/s of the
      last WINDOW_S, times QUEUE_CUT_S) off the limit, or off the requests
      the front held when Triton refused where they are fewer, and at most
      halves it: the queue then holds about QUEUE_CUT_S less than the 2 s
      that refused, whatever the LLM's latency (a cut by a fraction alone
      would starve a slow LLM and hardly help behind a fast one). Requests
      passed on before the cut, or within Triton's queue time limit after
      it, are old news: a burst of refusals cuts once, not once each (TCP's
      one cut per window, RFC 5681's recovery).
      Those passed on just after the cut wait behind the queue that refused
      and time out with it: counted as news, each cut brought the next, and
      a burst of clients coming back together (a Retry-After echo) took the
      limit from 345 to 14 within 5 s, the host then partly idle for 30 s
      (docs/reliability.md#overload).
    - Then each answer adds CREEP_PER_ANSWER: the front passes on 5 % more
      than is answered, so the queue grows back to Triton's limit in about
      20 s and the next cut comes; a refusal every 20 s or so (0.6 % of the
      answers again in bodies refused, in the test's model of the server).

    `answered` counts the requests at Triton, not those admitted: requests
    still sending their body would otherwise pass for the limit in use.

    Why refusals, not latency: a request's time is mostly the LLM's, which
    varies with the answer's length, so a latency target would mistake a
    long answer for a queue. What it costs: about every 20 s the queue
    reaches Triton's limit and some requests are refused after the front read
    their body (a read and parses; no forward pass). Only successful answers
    count: a flood of bad requests, answered 4xx at once, says nothing of
    what Triton takes."""

    QUEUE_CUT_S = 1.0
    # Triton's queue time limit (default_timeout_microseconds): past it every request passed
    # on before a cut has left Triton's queues, so a refusal is news again. This default is
    # model_repository's (a test holds them equal); the front reads the served models' own
    # (queue_limit_s, app.py) once Triton answers. The describe step's refusal (its LLM queue
    # full) is bounded by the LLM's latency instead; one cut per 2 s is still at most one per
    # round trip there.
    TRITON_QUEUE_LIMIT_S = 2.0
    CREEP_PER_ANSWER = 0.05
    PROBE_AFTER_S = 30.0

    def __init__(self, ceiling, start=64, floor=8, clock=time.monotonic):
        self.ceiling, self.floor = ceiling, min(floor, ceiling)
        self.value = float(min(start, ceiling))
        self.clock = clock
        self.cuts = 0  # how many times the limit was cut
        self.ramping, self.last_cut = True, -math.inf
        self.queue_limit_s = self.TRITON_QUEUE_LIMIT_S
        self.answers = PerSecond()

    def allows(self, in_flight):
        return in_flight < int(self.value)

    def answered(self, in_flight):
        """An answer came back while `in_flight` requests were passed on."""
        now = self.clock()
        self.answers.add(now)
        if 2 * in_flight < self.value:
            return  # the limit was not what held the requests back: no news about it
        if not self.ramping and now - self.last_cut > self.PROBE_AFTER_S:
            self.ramping = True  # the LLM or the host may have changed: find the edge again
        self.value = min(self.value + (1 if self.ramping else self.CREEP_PER_ANSWER), self.ceiling)

    def refused(self, passed_at, in_flight=math.inf):
        """Triton refused for load a request passed on at `passed_at` (self.clock's time) while
        the front held `in_flight` requests. The cut is from those where fewer than the limit,
        as TCP's ssthresh is from FlightSize, not cwnd (RFC 5681, 3.1): a window grown while not
        in use says nothing of what the path holds. The limit grows while half of it is in use:
        behind clients away for their Retry-Afters it rose from 196 to 302 with 166 in flight,
        the burst that came back got past it to Triton's queue, which refused 614 bodies already
        read in 30 s (docs/reliability.md#overload), and one cut from 302 still let through
        about as many as Triton had held when it refused. A cut at most halves the limit: with
        few of the front's requests at Triton (clients reaching Triton's ports directly fill
        its queues, or a queue shorter than a second of answers) the count less a second of
        answers would be the floor, from which the creep takes minutes to climb back."""
        if passed_at < self.last_cut + self.queue_limit_s:
            return
        now = self.clock()
        cut = max(1.0, self.answers.rate(now) * self.QUEUE_CUT_S)
        self.value = max(min(self.value, in_flight) - cut, self.value / 2, self.floor)
        self.cuts += 1
        self.ramping, self.last_cut = False, now


class Admission:
    """At most `limit.value` chat requests at once; the next one is refused at once."""

    def __init__(self, ceiling, retry_after=None, limit=None):
        self.now = 0         # admitted: reading a body, fetching an image, or at Triton
        self.at_triton = 0   # of those, passed on to Triton
        self.limit = limit or AdaptiveLimit(ceiling)
        self.retry_after = retry_after or RetryAfter()

    @contextlib.contextmanager
    def passing_on(self):
        """Around one request's call to Triton (a stream to its end), so that the
        limit learns only what Triton did: a refusal for load cuts it, and an
        answer (the caller sets `outcome.status`: 200) while at least half the
        limit was at Triton raises it. A request still sending its body, a
        failed stream or a client that left says nothing about what Triton takes."""
        outcome = types.SimpleNamespace(status=None)
        passed_at = self.limit.clock()
        self.at_triton += 1
        try:
            yield outcome
        except FrontError as error:
            if error.overload:
                self.limit.refused(passed_at, self.now)  # what the limit bounds: bodies still arriving too
            raise
        finally:
            at_triton, self.at_triton = self.at_triton, self.at_triton - 1
        if outcome.status == 200:
            self.limit.answered(at_triton)

    @web.middleware
    async def middleware(self, request, handler):
        if request.path not in SHED_PATHS:
            return await handler(request)
        if not self.limit.allows(self.now):
            raise unavailable(f"the front holds {self.now} requests already, as many as Triton takes now "
                              "(at most OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT); retry after Retry-After seconds",
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


class ImageBytes:
    """The bytes of the images that admitted requests hold (each to its answer
    or its stream's end) at most `limit`, whatever the number of requests: a
    request whose image would pass it is refused (503, Retry-After). One image
    always fits, so the largest allowed is never refused for its size alone."""

    def __init__(self, limit):
        self.limit, self.now = limit, 0

    @contextlib.contextmanager
    def hold(self, size):
        if self.now and self.now + size > self.limit:
            raise unavailable(f"the front holds {self.now} bytes of images already "
                              "(OPENAI_FRONT_MAX_IMAGE_BYTES_IN_FLIGHT); retry after Retry-After seconds")
        self.now += size
        try:
            yield
        finally:
            self.now -= size


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
                # (docs/reliability.md#overload).
                while left > 0 and not request.content.at_eof():
                    chunk, _ = await request.content.readchunk()
                    left -= len(chunk)
        if not request.content.is_eof() and request.transport is not None:
            request.transport.close()
        return response
    return middleware


class InFlight:
    """How many of one costly thing run at once: request bodies being read,
    parsed and decoded (each holds up to the body, its JSON string and the image
    in memory), or image URLs being fetched. Past the limit a request waits its
    turn for up to `wait_s` (in arrival order; how many can wait is bounded by
    OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT), then is refused (503, Retry-After)."""

    def __init__(self, limit, what, setting):
        self.limit, self.now, self.what, self.setting = limit, 0, what, setting
        self._waiting = collections.deque()  # futures; a finished slot is handed to the first

    @contextlib.asynccontextmanager
    async def slot(self, wait_s=0.0):
        if self.now < self.limit:
            self.now += 1
        else:
            await self._wait_for_handover(wait_s)
        try:
            yield
        finally:
            self._release()

    async def _wait_for_handover(self, wait_s):
        handed = asyncio.get_running_loop().create_future()
        self._waiting.append(handed)
        try:
            async with asyncio.timeout(wait_s):  # 0: refused at the next turn of the loop
                await handed
        except (TimeoutError, asyncio.CancelledError) as exc:
            if handed.done() and not handed.cancelled():
                self._release()  # handed over just as we gave up: pass it on, never leak it
            else:
                handed.cancel()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise unavailable(f"the front is reading {self.now} {self.what} already ({self.setting}); "
                              "retry later") from None

    def _release(self):
        while self._waiting:
            handed = self._waiting.popleft()
            if not handed.done():
                handed.set_result(None)  # the slot changes hands: self.now stays
                return
        self.now -= 1
