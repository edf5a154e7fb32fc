"""Load shedding by concurrency, before a request body is read.

Triton refuses past its queue only after a request's whole body, a photo,
was read and parsed; behind the front each refused request would also cost
the front a read, a JSON parse and a base64 decode. Here a chat request past
`OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT` (counted whole: body, Triton's answer,
a stream to its end) is refused from its headers alone with 503 and
Retry-After; aiohttp then discards its body unparsed. docs/reliability.md#overload.
"""

from aiohttp import web

from .errors import unavailable

# Only these carry a costly body and hold Triton; probes, /v1/models and
# /metrics are never shed.
SHED_PATHS = frozenset({"/v1/chat/completions"})


class Admission:
    """At most `limit` chat requests at once; the next one is refused at once."""

    def __init__(self, limit):
        self.limit, self.now = limit, 0

    @web.middleware
    async def middleware(self, request, handler):
        if request.path not in SHED_PATHS:
            return await handler(request)
        if self.now >= self.limit:
            raise unavailable(f"the front holds {self.now} requests already "
                              "(OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT); retry after Retry-After seconds")
        self.now += 1
        try:
            return await handler(request)
        finally:
            self.now -= 1
