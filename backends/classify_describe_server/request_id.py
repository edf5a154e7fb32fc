"""A request's id, the one rule every part applies to it: the OpenAI front
takes a client's `X-Request-ID` (or makes one), sends it to Triton as the
request id, and the describe step sends it on to the LLM upstream as
`X-Request-ID`; each puts it in its log lines about that request.

An id travels into HTTP headers and log lines, and a client chooses it: one
that is too long or holds anything outside a plain set of characters (a
space, a newline, a quote, a bracket, a byte outside ASCII) is replaced by a
new one, never trimmed or escaped into something that looks like the
client's. This one file is the rule: backends/openai_describe/ holds it,
openai_front/ links to it (as it does error_contract.py). Standard library and
aiohttp, which both sides use already.
"""

import re
import uuid

from aiohttp import web

HEADER = "X-Request-ID"
MAX_CHARS = 128
# What UUIDs, hex and base64 ids, and prefixed ones (req_..., trace:span) are made of.
_VALID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_CHARS}}}")


def new():
    return uuid.uuid4().hex


def valid(value):
    return isinstance(value, str) and _VALID.fullmatch(value) is not None


def accept(value):
    """`value` when it is a valid id, else a new one."""
    return value if valid(value) else new()


def tag(request_id):
    """How a log line names its request: the way Triton's own messages do."""
    return f"[request id: {request_id}] "


# -- the OpenAI front's: the id of an aiohttp request --

KEY = web.RequestKey("request_id", str)


def of(request):
    """The id of an aiohttp request: its client's X-Request-ID if valid, else a
    new one; chosen on first use and kept in the request for every later use."""
    request_id = request.get(KEY)
    if request_id is None:
        request_id = request[KEY] = accept(request.headers.get(HEADER))
    return request_id


def log_tag(request):
    """The start of a front log line about this request."""
    return tag(of(request))


async def send_back(request, response):
    """An aiohttp on_response_prepare signal: every answer carries its request's
    id (whole, streamed and error answers alike), as its headers go out."""
    response.headers[HEADER] = of(request)
