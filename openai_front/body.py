"""A chat request's body, from the headers to the parsed ChatRequest: refused from its headers
when it can be (compressed, too long, an unknown Expect), its slot among the bodies read at
once, 100 Continue when asked for, read at a minimum pace within one deadline, copied once,
parsed (in a worker thread when large)."""

import asyncio
import json

import orjson
from aiohttp import web

from . import access_log, chat, expect_continue
from .errors import FrontError, invalid, too_large
from .keys import BODIES, SETTINGS

# Bodies larger than this are parsed and decoded in a worker thread: a 20 MB
# image takes about 20 ms, during which the loop would stall every open stream.
# Smaller ones stay on the loop (at most about 1 ms): the hop to a thread and
# back cost the front 0.36 ms of CPU per 622 KB photo, more than its parse
# (docs/benchmarks-method.md#the-openai-fronts-cpu).
OFFLOAD_BYTES = 1024 * 1024
# read_body gathers pieces of a body smaller than this before keeping them.
SMALL_PIECE_BYTES = 16 * 1024
# The longest a body waits for one of OPENAI_FRONT_MAX_BODIES_IN_FLIGHT before its 503.
BODY_SLOT_WAIT_S = 2.0
# A body's first second is free of the pace OPENAI_FRONT_MIN_BODY_RATE sets (a connection's
# slow start, a client's pause between its head and its body).
BODY_RATE_GRACE_S = 1.0


def max_body_bytes(settings):
    """The largest body: a data: URI of the largest image (base64: 4/3) plus the rest of the JSON."""
    return settings.max_image_bytes * 4 // 3 + 1024 * 1024


def refuse_early(request):
    """What can be refused from the headers alone, before a byte of the body is
    read: a compressed body (a 1 MB gzip inflates to 1 GB), a declared length
    over the limit (read whole, it would stall the loop for seconds) and an
    expectation other than 100-continue."""
    expect_continue.check(request)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raise FrontError(415, f"Content-Encoding {encoding[:40]!r} is not accepted: send the body uncompressed",
                         code="unsupported_content_encoding")
    limit = max_body_bytes(request.app[SETTINGS])
    if request.content_length is not None and request.content_length > limit:
        raise too_large(f"the request body ({request.content_length} bytes) is larger than the {limit} bytes allowed")


def parse_body(raw, settings):
    return chat.parse(load_json(raw), settings.max_image_bytes, settings.image_url_allowlist,
                      settings.image_url_allow_private, settings.max_prompt_chars)


def load_json(raw):
    """The body's JSON. orjson reads a photo's 622 KB body in a third of the stdlib's
    time, but it is stricter (RFC 8259): it refuses NaN and Infinity, a lone surrogate's
    escape, a UTF-8 byte order mark, nesting past 1,024. A body it refuses is read
    again by the stdlib, whose reading the front's answers were made for (a lone
    surrogate or a NaN is refused naming its field, not as bad JSON). Two differences
    remain: integers past 64 bits come out as floats (max_tokens refuses either; in a
    response_format's schema one would reach the LLM as a float), and a body
    neither reads costs both parses (at most OPENAI_FRONT_MAX_BODIES_IN_FLIGHT at once)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: absurd nesting
        raise invalid("the request body is not valid JSON") from None


async def read_body(request, limit, first=None, min_rate=0):
    """The whole body as bytes, copied once: as aiohttp's request.read() reads it
    (its buffers raised to the limit, the same 413 past it) but without its
    bytearray, whose growth and copy into bytes cost three to four copies of a
    photo's 622 KB (docs/benchmarks-method.md#the-openai-fronts-cpu). Pieces of
    SMALL_PIECE_BYTES or more are kept as aiohttp made them; smaller ones are
    gathered first, so that a chunked body of 1-byte chunks (each its own bytes
    object, about 56 bytes of memory a byte) holds about its own size. The
    bytes are not kept for request.read(): nothing reads the body twice.

    first: the body's first readchunk(), when the caller read it already.
    min_rate: after BODY_RATE_GRACE_S, the body must have come at this many
    bytes a second on average, else 408 (0: no pace)."""
    request.content.set_read_chunk_size(limit)
    pieces, small, size = [], bytearray(), 0
    started = asyncio.get_running_loop().time()
    pace = asyncio.timeout_at(started + BODY_RATE_GRACE_S if min_rate else None)
    try:
        async with pace:
            while True:
                if first is not None:
                    (chunk, end_of_http_chunk), first = first, None
                else:
                    chunk, end_of_http_chunk = await request.content.readchunk()
                if not chunk:
                    if end_of_http_chunk and not request.content.at_eof():
                        continue  # a chunked body's chunk ended where the last read did
                    break
                size += len(chunk)
                if size > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
                if min_rate:  # the next byte is due when the body would fall behind the pace
                    pace.reschedule(started + BODY_RATE_GRACE_S + size / min_rate)
                if len(chunk) < SMALL_PIECE_BYTES:
                    small += chunk
                    if len(small) < SMALL_PIECE_BYTES:
                        continue
                    chunk = bytes(small)
                    small.clear()
                elif small:
                    pieces.append(bytes(small))
                    small.clear()
                pieces.append(chunk)
    except TimeoutError:
        # Only the pace's own expiry arrives here as TimeoutError: read_request's deadline
        # passes through this block as a cancellation, and becomes its 408 there.
        if not pace.expired():
            raise
        raise too_slow(min_rate) from None
    if small:
        pieces.append(bytes(small))
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def read_request(request):
    """The request's ChatRequest: the body read, parsed and its image decoded,
    in a worker thread when the body is large."""
    settings = request.app[SETTINGS]
    deadline = asyncio.timeout(settings.body_timeout_s)
    try:
        first = None
        if not expect_continue.expected(request):
            # A body takes its slot once its first bytes are in: a connection that sent its head
            # and nothing more holds none (16 of them held every slot for body_timeout_s), and
            # with a pace it must start within its grace second, as it must go on at the pace
            # (it holds its admission meanwhile). A client that waits for 100 Continue sends
            # nothing before it: it is asked with a slot held (refused before its body is sent),
            # and read_body's pace covers its first bytes.
            async with deadline:
                first = await _body_start(request, settings.min_body_rate)
        async with request.app[BODIES].slot(wait_s=min(BODY_SLOT_WAIT_S, settings.body_timeout_s)):
            async with asyncio.timeout_at(deadline.when()):  # set when made: the same deadline either way
                await expect_continue.send(request)
                raw = await read_body(request, max_body_bytes(settings), first, settings.min_body_rate)
            access_log.note(request, bytes_in=len(raw))
            if len(raw) > OFFLOAD_BYTES:
                return await asyncio.to_thread(parse_body, raw, settings)
            return parse_body(raw, settings)
    except TimeoutError:
        raise FrontError(408, f"the request body did not arrive within {settings.body_timeout_s:g} s "
                              "(OPENAI_FRONT_BODY_TIMEOUT_S)", code="request_timeout") from None


async def _body_start(request, min_rate):
    """The body's first readchunk(); with a pace, 408 when nothing came within its grace second."""
    if not min_rate:
        return await request.content.readchunk()
    try:
        async with asyncio.timeout(BODY_RATE_GRACE_S):
            return await request.content.readchunk()
    except TimeoutError:
        raise too_slow(min_rate) from None


def too_slow(min_rate):
    return FrontError(408, f"the request body came slower than {min_rate} bytes a second after its "
                           f"first {BODY_RATE_GRACE_S:g} s (OPENAI_FRONT_MIN_BODY_RATE)", code="request_timeout")
