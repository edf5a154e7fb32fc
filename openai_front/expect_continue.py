"""`Expect: 100-continue` (RFC 9110 10.1.1): the body is asked for only once
the request is admitted.

A client that sends the expectation sends its headers, then waits for
`100 Continue` before its body (curl for large bodies, aiohttp's
`expect100=True`). aiohttp answers 100 Continue as soon as the route matches,
before any middleware runs (web_app.Application._handle calls the route's
expect handler first), so such a client sent its whole photo only to be
refused from its headers. The chat route's expect handler therefore sends
nothing; `send` sends 100 Continue when the handler is about to read the body,
after the key, the header checks and the shedding. A request answered before
that (a 503 refusal, 401, 413, 415) never had its body asked for: the client
does not send it, so its answer carries `Connection: close` (the next bytes
could be a body or a new request; curl closes too), and a body sent anyway is
read and dropped as a refused one (shedding.discard_refused_bodies).
"""

from aiohttp import HttpVersion11, hdrs, web

from .errors import FrontError

CONTINUED = web.RequestKey("continued", bool)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def expected(request):
    """Whether the client waits for 100 Continue (HTTP/1.0 ignores the expectation)."""
    return request.version >= HttpVersion11 and hdrs.EXPECT in request.headers


async def handler(request):
    """The route's expect handler: answers nothing yet (send does, when the body is wanted)."""
    return None


def check(request):
    """An expectation other than 100-continue cannot be met: 417, before the body."""
    if expected(request) and request.headers[hdrs.EXPECT].strip().lower() != "100-continue":
        raise FrontError(417, "the only expectation this server meets is 'Expect: 100-continue'",
                         code="expectation_failed")


async def send(request):
    """100 Continue, once, to a client that waits for it: its body is wanted now."""
    if expected(request) and not request.get(CONTINUED):
        request[CONTINUED] = True
        await request.writer.write(CONTINUE)
        request.writer.output_size = 0  # as aiohttp's own handler: the answer's size starts after it


def unasked(request):
    """The client waits for 100 Continue and was answered without it: its body never comes."""
    return expected(request) and not request.get(CONTINUED) and request.can_read_body \
        and not request.content.is_eof()
