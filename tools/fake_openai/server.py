"""A fake OpenAI-compatible chat-completions upstream on real HTTP.

It answers POST /v1/chat/completions, and its behaviour can be changed while
it runs through an admin API on the same port:

  POST /_admin/mode   {"mode": "ok" | "429" | "500" | "401" | "hang" | "malformed"
                                | "drop" | "refuse" | "cut" | "huge" | "flood" | "no_vision",
                       "latency_ms": 0,      # added before every answer (before the first chunk)
                       "chunk_ms": 0,        # streamed answers: added before each further chunk
                       "answer_words": 0,    # pad every answer to at least this many words
                       "cut_after": 3,       # "cut": chunks sent before the connection drops
                       "huge_chars": 1000000,  # "huge": characters of the answer
                       "retry_after": 1,     # Retry-After header of "429"
                       "count": null,        # apply to the next N requests, then "ok"
                       "hold_for": null,     # hold every request until N are in flight at once
                       "duration_s": 3}      # "refuse": stop listening this long
  GET  /_admin/stats  requests received, in flight, last Authorization header,
                      requests by Authorization header ("" when absent),
                      recent X-Request-ID headers (request_ids; None when absent),
                      recent bodies and arrival times, disconnects (and the
                      time of each: disconnect_times), streamed answers' texts,
                      images: per request, the image parts it carried, decoded
                      ({format, width, height, bytes, sha256, detail, corner_rgb}),
                      in `bodies` each data URI is replaced by "<image sha256=...>"
  POST /_admin/reset  back to "ok" with the start-up latencies; clears the stats

A request with "stream": true is answered with server-sent events as the
OpenAI API does: one chat.completion.chunk per word (the first one carries
the role), then, with "stream_options": {"include_usage": true}, a last chunk
with no choices and the usage, then "data: [DONE]". "cut" sends `cut_after`
chunks of the answer and closes the connection (a plain request is dropped).
"huge" answers `huge_chars` characters whatever max_tokens says (streamed: in
one chunk); "flood" streams chunks of text without end, as fast as it can
(`chunk_ms` apart), until the client goes away (`flood_chunks` in the stats
counts them; a plain request gets the "huge" answer).

"no_vision" answers a request that carries an image part with OpenAI's 400
("... does not support image input", invalid_request_error), like a text-only
model; text-only requests are answered as "ok". `refusal_status` and
`refusal_message` change that answer to how other servers say it (llama.cpp's
500, Groq's 400 "'messages.1.content' : value must be a string"), and with
`refuse_lists` any message whose content is a list of parts is refused so, as
servers whose chat template takes strings only do; `refusal_status` 200 answers
such a request with nothing (a stream of [DONE] alone, or an empty message), as
llama-cpp-python's server streams when its template fails. `usage` false leaves the
usage out of answers and streams, as some local servers do. An image part costs 85 prompt
tokens at detail "low" and 765 otherwise (OpenAI's count for a 768 px photo).
A request with response_format json_object or json_schema is answered with a
JSON object {"description": <the answer>}.

"drop" accepts the connection and closes it without an answer; "refuse" stops
the listener and closes open connections, so new connections are refused,
then listens again after `duration_s` (the admin API is unreachable while it
does not listen). "hang" holds the request until the client goes away.
Each "ok" answer is numbered, so a test can tell a cached answer from a new one.
"hold_for": N holds each request (before latency_ms) until N are in flight at
once, then lets them all go: a test of concurrency waits for that event rather
than hoping that a latency outlasts its slowest request's arrival.
"""

import asyncio
import base64
import binascii
import copy
import hashlib
import io
import json
import re
import time

from aiohttp import web

MODES = ("ok", "429", "500", "401", "hang", "malformed", "drop", "refuse", "cut", "huge", "flood", "no_vision")
IMAGE_TOKENS = {"low": 85}  # OpenAI's count at detail low; 765 for a 768x768 photo at high
IMAGE_TOKENS_HIGH = 765
RECENT = 50  # bodies and arrival times kept for /_admin/stats
RECENT_ANSWERS = 2000  # streamed answers' texts kept: a 500-stream benchmark compares them all
FILLER = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut "
          "labore et dolore magna aliqua").split()


class FakeOpenAI:
    def __init__(self, host="127.0.0.1", port=0, latency_ms=0.0, chunk_ms=0.0):
        self.host = host
        self.port = port
        self.default_latency_ms = float(latency_ms)
        self.default_chunk_ms = float(chunk_ms)
        self._runner = None
        self._site = None
        self._transports = set()
        self._reset()

    # -- lifecycle (call from the event loop that serves) ---------------------------

    async def start(self):
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/_admin/mode", self._admin_mode)
        app.router.add_get("/_admin/stats", self._admin_stats)
        app.router.add_post("/_admin/reset", self._admin_reset)
        # handler_cancellation: a client that disconnects cancels its handler, so a
        # "hang" ends when the caller gives up and the stats can count it.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await self._listen()
        self.port = self._site._server.sockets[0].getsockname()[1]

    async def stop(self):
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def base_url(self):
        return f"http://{self.host}:{self.port}/v1"

    async def _listen(self):
        self._site = web.TCPSite(self._runner, self.host, self.port, backlog=4096, reuse_address=True)
        await self._site.start()

    # -- behaviour ----------------------------------------------------------------------

    def _reset(self):
        self.mode = "ok"
        self.latency_ms = self.default_latency_ms
        self.chunk_ms = self.default_chunk_ms
        self.answer_words = 0
        self.cut_after = 3
        self.huge_chars = 1_000_000
        self.retry_after = 1.0
        self.count = None
        self.hold_for = None
        self.refusal = (400, None, False)
        self.sends_usage = True
        self._held = asyncio.Event()
        self._stats = {"requests": 0, "in_flight": 0, "max_in_flight": 0, "answered_ok": 0,
                      "disconnected": 0, "disconnect_times": [], "last_authorization": None,
                      "authorizations": {}, "bodies": [], "arrivals": [], "by_mode": {},
                      "streams_started": 0, "streams_completed": 0, "streamed_answers": [], "flood_chunks": 0,
                      "images": [], "request_ids": [], "traceparents": []}

    @property
    def stats(self):
        """What the fake saw, each photo sent decoded the first time the stats are read."""
        return _inspected(self._stats)

    def set_mode(self, mode="ok", latency_ms=None, retry_after=None, count=None, duration_s=3.0,
                 chunk_ms=None, answer_words=None, cut_after=None, huge_chars=None, hold_for=None,
                 refusal_status=400, refusal_message=None, refuse_lists=False, usage=True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.sends_usage = bool(usage)
        self.refusal = (int(refusal_status), refusal_message, bool(refuse_lists))
        if hold_for is not None:
            self.hold_for = int(hold_for)
            self._held = asyncio.Event()
        self.mode = mode
        self.count = count
        if latency_ms is not None:
            self.latency_ms = float(latency_ms)
        if chunk_ms is not None:
            self.chunk_ms = float(chunk_ms)
        if answer_words is not None:
            self.answer_words = int(answer_words)
        if cut_after is not None:
            self.cut_after = int(cut_after)
        if huge_chars is not None:
            self.huge_chars = int(huge_chars)
        if retry_after is not None:
            self.retry_after = float(retry_after)
        if mode == "refuse":
            asyncio.get_running_loop().create_task(self._refuse(float(duration_s)))

    async def _refuse(self, duration_s):
        await self._site.stop()
        for transport in list(self._transports):
            transport.close()
        self._transports.clear()
        await asyncio.sleep(duration_s)
        self.mode = "ok"
        await self._listen()

    def _take_mode(self):
        mode = self.mode
        if self.count is not None:
            self.count -= 1
            if self.count <= 0:
                self.mode, self.count = "ok", None
        return mode

    async def _chat(self, request):
        stats = self._stats
        stats["requests"] += 1
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        stats["last_authorization"] = request.headers.get("Authorization")
        authorization = stats["last_authorization"] or ""
        stats["authorizations"][authorization] = stats["authorizations"].get(authorization, 0) + 1
        stats["arrivals"] = (stats["arrivals"] + [time.time()])[-RECENT:]
        stats["request_ids"] = (stats["request_ids"] + [request.headers.get("X-Request-ID")])[-RECENT:]
        # The W3C trace context each call came with (None: none), for the tracing tests.
        stats["traceparents"] = (stats["traceparents"] + [request.headers.get("traceparent")])[-RECENT:]
        if request.transport is not None:
            self._transports.add(request.transport)
        mode = self._take_mode()
        stats["by_mode"][mode] = stats["by_mode"].get(mode, 0) + 1
        try:
            body = await request.json()
            images = _image_parts(body)
            stats["images"] = (stats["images"] + [images])[-RECENT:]
            stats["bodies"] = (stats["bodies"] + [_without_data_uris(body)])[-RECENT:]
            if self.hold_for is not None:
                if stats["in_flight"] >= self.hold_for:
                    self._held.set()
                await self._held.wait()
            if self.latency_ms:
                await asyncio.sleep(self.latency_ms / 1000.0)
            status, message, refuse_lists = self.refusal
            lists = any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in body.get("messages", []))
            if mode == "no_vision" and (images or (refuse_lists and lists)) and status == 200:
                return await self._nothing(request, body)
            if mode == "no_vision" and (images or (refuse_lists and lists)):
                return _error(status, message or f"The model `{body.get('model', '')}` does not support image input.",
                              None, error_type="invalid_request_error")
            return await self._answer(mode, request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            stats["disconnected"] += 1
            stats["disconnect_times"] = (stats["disconnect_times"] + [time.time()])[-RECENT:]
            raise
        finally:
            stats["in_flight"] -= 1

    async def _answer(self, mode, request, body):
        if mode == "429":
            return _error(429, "Rate limit reached", "rate_limit_exceeded",
                          headers={"Retry-After": _seconds(self.retry_after)})
        if mode == "500":
            return _error(500, "The server had an error while processing your request", "server_error")
        if mode == "401":
            # Real providers echo (part of) the key they were given: a good test for scrubbing.
            given = (request.headers.get("Authorization") or "").removeprefix("Bearer ")
            return _error(401, f"Incorrect API key provided: {given}.", "invalid_api_key")
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "malformed":
            return web.Response(status=200, text='{"id": "chatcmpl-x", "choices": [', content_type="application/json")
        if mode == "drop" or (mode == "cut" and not body.get("stream")):
            request.transport.close()
            raise asyncio.CancelledError()
        if body.get("stream"):
            if mode == "flood":
                return await self._flood(request, body)
            return await self._stream(request, body, cut_after=self.cut_after if mode == "cut" else None,
                                      huge=mode == "huge")
        if mode == "refuse":  # a request that slipped in before the listener stopped
            request.transport.close()
            raise asyncio.CancelledError()
        return self._completion(body, huge=mode in ("huge", "flood"))

    def _content(self, body):
        """(number, content, usage) of the next answer."""
        self._stats["answered_ok"] += 1
        number = self._stats["answered_ok"]
        model = body.get("model", "")
        messages = body.get("messages") or [{"content": ""}]
        user = _text_of(messages[-1].get("content", ""))
        content = f"Fake answer #{number} from {model}: {(user.splitlines() or [''])[0][:80]}"
        missing = self.answer_words - len(content.split())
        if missing > 0:
            content += " " + " ".join(FILLER[i % len(FILLER)] for i in range(missing))
        if (body.get("response_format") or {}).get("type") in ("json_object", "json_schema"):
            content = json.dumps({"description": content})
        prompt_tokens = sum(len(_text_of(m.get("content", "")).split()) for m in messages)
        prompt_tokens += sum(IMAGE_TOKENS.get((part.get("image_url") or {}).get("detail"), IMAGE_TOKENS_HIGH)
                             for part, _ in _data_uris(body))
        completion_tokens = len(content.split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return number, content, usage

    def _huge(self, content):
        return (content + " " + " ".join(FILLER) * (self.huge_chars // 100 + 1))[:self.huge_chars]

    def _completion(self, body, huge=False):
        number, content, usage = self._content(body)
        if huge:
            content = self._huge(content)
        return web.json_response({
            "id": f"chatcmpl-fake-{number}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": _finish_reason(body, usage),
                         "message": {"role": "assistant", "content": content}}],
            **({"usage": usage} if self.sends_usage else {}),
        })

    async def _stream(self, request, body, cut_after=None, huge=False):
        """Server-sent events, one chunk per word; `cut_after` chunks then a dropped connection;
        `huge`: the whole huge answer in one chunk."""
        stats = self._stats
        number, content, usage = self._content(body)
        if huge:
            content = self._huge(content)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        stats["streams_started"] += 1
        base = {"id": f"chatcmpl-fake-{number}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model", "")}

        async def event(payload):
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        words = [content] if huge else re.findall(r"\S+\s*", content)
        for index, word in enumerate(words):
            if cut_after is not None and index >= cut_after:
                request.transport.close()
                raise asyncio.CancelledError()
            if index and self.chunk_ms:
                await asyncio.sleep(self.chunk_ms / 1000.0)
            delta = {"role": "assistant", "content": word} if index == 0 else {"content": word}
            await event(dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": None}]))
        await event(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": _finish_reason(body, usage)}]))
        if (body.get("stream_options") or {}).get("include_usage") and self.sends_usage:
            await event(dict(base, choices=[], usage=usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        stats["streams_completed"] += 1
        stats["streamed_answers"] = (stats["streamed_answers"] + [content])[-RECENT_ANSWERS:]
        return response

    async def _nothing(self, request, body):
        """A 200 that carries no answer: a stream of [DONE] alone, or an empty message."""
        if not body.get("stream"):
            return web.json_response({"id": "chatcmpl-fake-empty", "object": "chat.completion", "created": int(time.time()),
                                      "model": body.get("model", ""), "choices": [
                                          {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ""}}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _flood(self, request, body):
        """Chunks of text without end, until the client goes away."""
        number, _, _ = self._content(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        self._stats["streams_started"] += 1
        base = {"id": f"chatcmpl-fake-{number}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model", "")}
        index = 0
        while True:
            delta = {"content": FILLER[index % len(FILLER)] + " "}
            await response.write(b"data: " + json.dumps(dict(base, choices=[{"index": 0, "delta": delta,
                                                                                "finish_reason": None}])).encode()
                                 + b"\n\n")
            self._stats["flood_chunks"] += 1
            index += 1
            await asyncio.sleep(self.chunk_ms / 1000.0)  # 0: yield to the loop, so a disconnect is seen

    # -- admin API --------------------------------------------------------------------

    async def _admin_mode(self, request):
        payload = await request.json()
        try:
            self.set_mode(payload.get("mode", "ok"), payload.get("latency_ms"), payload.get("retry_after"),
                          payload.get("count"), payload.get("duration_s", 3.0), payload.get("chunk_ms"),
                          payload.get("answer_words"), payload.get("cut_after"), payload.get("huge_chars"),
                          payload.get("hold_for"), payload.get("refusal_status", 400), payload.get("refusal_message"),
                          payload.get("refuse_lists", False), payload.get("usage", True))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(self._describe_mode())

    async def _admin_stats(self, request):
        return web.json_response(dict(self.stats, **self._describe_mode()))

    async def _admin_reset(self, request):
        self._reset()
        return web.json_response(self._describe_mode())

    def _describe_mode(self):
        return {"mode": self.mode, "latency_ms": self.latency_ms, "chunk_ms": self.chunk_ms,
                "answer_words": self.answer_words, "cut_after": self.cut_after, "huge_chars": self.huge_chars,
                "retry_after": self.retry_after, "hold_for": self.hold_for,
                "count": self.count}


def _seconds(value):
    return str(int(value)) if float(value).is_integer() else str(value)


def _error(status, message, code, headers=None, error_type="error"):
    return web.json_response({"error": {"message": message, "type": error_type, "param": None, "code": code}},
                             status=status, headers=headers)


def _text_of(content):
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content
                         if isinstance(part, dict) and part.get("type") == "text")
    return str(content)


def _data_uris(body):
    """(the image part's dict, its URL) for every image part of every message."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield part, str((part.get("image_url") or {}).get("url", ""))


def _image_parts(body):
    """The image parts, for tests: detail, size, a hash; the base64 is kept
    as it came (`_inspected` decodes, hashes and opens it when the stats are
    read: the upstream shares the server's cores in every benchmark, and a
    strict stdlib decode alone cost it 0.4 ms per request)."""
    images = []
    for part, url in _data_uris(body):
        detail = (part.get("image_url") or {}).get("detail", "auto")
        record = {"detail": detail, "url_prefix": url[:30]}
        match = re.match(r"data:([\w/+.-]+);base64,(.*)$", url, re.S)
        if match:
            record.update(mime=match.group(1), _base64=match.group(2))
        images.append(record)
    return images


# What Pillow reports of a picture's metadata (EXIF, XMP, ICC, comments, IPTC): the tests check none arrives.
METADATA_KEYS = ("exif", "xmp", "icc_profile", "comment", "photoshop", "Comment")


def _inspected(stats):
    """The stats with each image's bytes replaced, once, by what they decode to:
    format, size, one corner's colour (or the error when not a picture)."""
    for request_images in stats["images"]:
        for record in request_images:
            encoded = record.pop("_base64", None)
            if encoded is None:
                continue
            try:
                data = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                data = b""
            record.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
            try:
                from PIL import Image

                with Image.open(io.BytesIO(data)) as image:
                    rgb = image.convert("RGB")
                    record.update(format=image.format, width=image.width, height=image.height,
                                  corner_rgb=list(rgb.getpixel((0, 0))),
                                  metadata=sorted(key for key in METADATA_KEYS if key in image.info))
            except Exception as exc:  # not a picture: the test says so
                record["error"] = f"{type(exc).__name__}: {exc}"
    return stats


def _without_data_uris(body):
    """The body as recorded: each image's data URI replaced by its digest (bodies stay small)."""
    if not any(True for _ in _data_uris(body)):
        return body
    body = copy.deepcopy(body)  # its strings are shared, not copied: a JSON round trip of the URI cost 0.4 ms
    for part, _ in _data_uris(body):
        part["image_url"]["url"] = "<data URI: see stats['images']>"
    return body


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.fake_openai", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--chunk-ms", type=float, default=0.0, help="streamed answers: delay before each further chunk")
    args = parser.parse_args(argv)

    async def serve():
        fake = FakeOpenAI(args.host, args.port, args.latency_ms, args.chunk_ms)
        await fake.start()
        print(f"fake_openai: listening on {fake.base_url} (latency {args.latency_ms} ms)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await fake.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


class ThreadedFakeOpenAI:
    """The fake on its own event loop thread, for tests whose code under test
    runs its own loop (e.g. the Triton adapter): `with ThreadedFakeOpenAI() as fake:`."""

    def __init__(self, latency_ms=0.0, chunk_ms=0.0):
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-openai", daemon=True)
        self.fake = FakeOpenAI(port=0, latency_ms=latency_ms, chunk_ms=chunk_ms)

    def __enter__(self):
        self._thread.start()
        self._run(self.fake.start())
        return self

    def __exit__(self, *exc):
        self._run(self.fake.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def base_url(self):
        return self.fake.base_url

    def set_mode(self, mode="ok", **kwargs):
        async def apply():
            self.fake.set_mode(mode, **kwargs)
        self._run(apply())

    def stats(self):
        async def copy():
            return json.loads(json.dumps(self.fake.stats))
        return self._run(copy())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)


def _finish_reason(body, usage):
    """"length" when the answer used all of the request's max_tokens. The fake
    still sends its whole text (tests read it), but reports the cut as a real
    upstream would."""
    max_tokens = body.get("max_tokens")
    return "length" if isinstance(max_tokens, int) and usage["completion_tokens"] >= max_tokens else "stop"
