"""The front's access log: one JSON line per request, on the `openai_front.access`
logger (stderr, beside the server's log), on unless OPENAI_FRONT_ACCESS_LOG=0.

A line holds what an operator needs to follow one request (its id, as the
client, Triton and the LLM upstream see it) and nothing a client could use to
leak or flood it: no header values (never Authorization), no query string, no
body (never an image); the path and the model id a client chose are cut to
MAX_FIELD_CHARS, and json.dumps escapes what could forge a line.

It is a middleware, not aiohttp's access logger, because aiohttp logs nothing
for a request whose client left (the handler is cancelled): those are 499 here."""

import asyncio
import datetime
import json
import logging
import time

from aiohttp import web
from classify_describe_server import request_id

log = logging.getLogger("openai_front.access")
NOTES = web.RequestKey("access_log", dict)  # what only the handler knows: model, stream, bytes_in
MAX_FIELD_CHARS = 200


def note(request, **fields):
    """Record model=, stream= or bytes_in= for this request's line."""
    request.setdefault(NOTES, {}).update(fields)


@web.middleware
async def middleware(request, handler):
    started, status, response = time.monotonic(), 500, None
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as http:
        status = http.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client left before its answer
        raise
    finally:
        log.info(json.dumps(entry(request, response, status, time.monotonic() - started)))


def entry(request, response, status, seconds):
    notes = request.get(NOTES, {})
    model = notes.get("model")
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "request_id": request_id.of(request),
        "method": request.method,
        "path": request.path[:MAX_FIELD_CHARS],
        "status": status,
        "duration_s": round(seconds, 6),
        "bytes_in": notes.get("bytes_in", 0),
        "bytes_out": _bytes_out(response),
        "model": model[:MAX_FIELD_CHARS] if isinstance(model, str) else None,
        "stream": bool(notes.get("stream", False)),
        "client": request.remote,
    }


class StreamResponse(web.StreamResponse):
    """A streamed answer that counts its body's bytes for the access log
    (aiohttp's body_length counts the headers and the chunk framing too)."""

    body_bytes = 0

    async def write(self, data):
        await super().write(data)
        self.body_bytes += len(data)


def _bytes_out(response):
    """The answer body's bytes (before any compression): as written for a
    stream, else the length of the body about to go out."""
    if response is None:
        return 0
    if isinstance(response, StreamResponse):
        return response.body_bytes
    return response.content_length or 0
