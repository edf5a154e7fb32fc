"""The aiohttp application: routes, auth, the translation of one chat
request into one Triton request (or stream), and errors in OpenAI's format."""

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import time

import orjson
from aiohttp import web
from classify_describe_server import request_id

from . import access_log, chat, expect_continue, fetch, responses, trace_context
from .errors import FrontError, invalid, too_large, unavailable
from .metrics import Metrics
from .shedding import Admission, ImageBytes, discard_refused_bodies
from .triton import TritonPool, request_parameters

log = logging.getLogger("openai_front")
OPEN_PATHS = frozenset({"/health", "/health/ready", "/metrics"})  # no key needed: probes and Prometheus
SETTINGS, POOL, METRICS, FETCHER, BODIES, FETCHES, STREAMS = (
    web.AppKey(name, object) for name in ("settings", "pool", "metrics", "fetcher", "bodies", "fetches", "streams"))
ADMISSION = web.AppKey("admission", Admission)
IMAGES = web.AppKey("images", ImageBytes)
QUEUE_LIMIT_READER = web.AppKey("queue_limit_reader", asyncio.Task)
QUEUE_LIMIT_RETRY_S, QUEUE_LIMIT_REREAD_S = 1.0, 60.0
# Bodies larger than this are parsed and decoded in a worker thread: a 20 MB
# image takes about 20 ms, during which the loop would stall every open stream.
# Smaller ones stay on the loop (at most about 1 ms): the hop to a thread and
# back cost the front 0.36 ms of CPU per 622 KB photo, more than its parse
# (docs/benchmarks-method.md#the-openai-fronts-cpu).
OFFLOAD_BYTES = 1024 * 1024
# read_body gathers pieces of a body smaller than this before keeping them.
SMALL_PIECE_BYTES = 16 * 1024
# Answers after which the connection is closed: the rest of the body is never read.
CLOSE_AFTER = frozenset({408, 413, 415, 417})
# The cancel message of a stream ended by the front's shutdown (not by its client).
SHUTTING_DOWN = "the OpenAI front is shutting down"


def max_body_bytes(settings):
    """The largest body: a data: URI of the largest image (base64: 4/3) plus the rest of the JSON."""
    return settings.max_image_bytes * 4 // 3 + 1024 * 1024


def create_app(settings):
    # Outermost, the body of a refusal is read and dropped once its 503 went out (after the
    # access log's line: its duration is the answer's). The access log next: it sees every answer,
    # the error answers the next one makes included. Shedding after auth (its 503 in OpenAI's
    # format) and before any handler reads a body.
    admission = Admission(settings.max_requests_in_flight)
    middlewares = [discard_refused_bodies(max_body_bytes(settings), settings.body_timeout_s),
                   *([access_log.middleware] if settings.access_log else []), _errors_and_auth,
                   admission.middleware]
    app = web.Application(client_max_size=max_body_bytes(settings), middlewares=middlewares)
    app[ADMISSION] = admission
    app[SETTINGS] = settings
    app[BODIES] = InFlight(settings.max_bodies_in_flight, "request bodies", "OPENAI_FRONT_MAX_BODIES_IN_FLIGHT")
    app[FETCHES] = InFlight(settings.max_fetches_in_flight, "image URLs", "OPENAI_FRONT_MAX_FETCHES_IN_FLIGHT")
    app[IMAGES] = ImageBytes(settings.max_image_bytes_in_flight)
    app[STREAMS] = set()
    app[METRICS] = Metrics((m.id for m in settings.models), admission_limit=lambda: int(admission.limit.value))
    # 100 Continue only once the body is wanted (expect_continue.py): a refusal costs no body.
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_continue.handler)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/health/ready", ready)
    app.on_response_prepare.append(request_id.send_back)
    app.on_startup.append(_start)
    app.on_shutdown.append(_end_streams)
    app.on_cleanup.append(_stop)
    return app


async def _start(app):
    settings = app[SETTINGS]
    app[POOL] = TritonPool(settings.triton_grpc_url, settings.grpc_channels, settings.timeout_s,
                           inference_key=settings.triton_inference_key)
    app[FETCHER] = None
    if settings.image_url_allowlist:
        app[FETCHER] = fetch.session(settings.remote_fetch_timeout_s, settings.image_url_allow_private)
    app[QUEUE_LIMIT_READER] = asyncio.create_task(_read_queue_limit(app))


async def _read_queue_limit(app):
    """How long Triton may queue a request of ours (AdaptiveLimit.queue_limit_s), from the served
    models' configs, read once Triton answers and again every QUEUE_LIMIT_REREAD_S (a model
    reloaded with another config); until then, and where no model sets one, the shipped
    configs' TRITON_QUEUE_LIMIT_S. Each new outcome is logged once."""
    limit, models = app[ADMISSION].limit, [name for m in app[SETTINGS].models for name in (m.ensemble, m.stream_model)]
    said = None
    while True:
        try:
            longest = await app[POOL].longest_queue_time_s(models)
        except Exception as error:  # noqa: BLE001 - Triton not up yet, a model not loaded, or a bug: ask again
            text = (f"Triton's queue time limit unknown, {limit.queue_limit_s:g} s kept: the served models' "
                    f"configs could not be read ({type(error).__name__}: {str(error)[:200]})")
            if text != said:
                log.warning(text)
                said = text
            await asyncio.sleep(QUEUE_LIMIT_RETRY_S)
            continue
        limit.queue_limit_s = longest or limit.TRITON_QUEUE_LIMIT_S
        text = (f"Triton queues a request of ours at most {longest:.3g} s (the served models' queue policies, "
                "along their steps)" if longest else
                f"no queue time limit in the served models' configs: {limit.queue_limit_s:g} s kept")
        if text != said:
            log.info(text + "; refusals within it after a cut of the admission limit are old news")
            said = text
        await asyncio.sleep(QUEUE_LIMIT_REREAD_S)


async def _end_streams(app):
    """Shutdown, after the port closed: every open stream ends now with an error
    event, which cancels its Triton stream and so its LLM call. Whole answers get
    the runner's shutdown_timeout (OPENAI_FRONT_DRAIN_S) to finish. Triton can only
    unload a streaming model once its streams are gone (docs/reliability.md)."""
    for task in list(app[STREAMS]):
        task.cancel(SHUTTING_DOWN)


async def _stop(app):
    if QUEUE_LIMIT_READER in app:
        app[QUEUE_LIMIT_READER].cancel()
    await app[POOL].close()
    if app[FETCHER] is not None:
        await app[FETCHER].close()


def error_response(error):
    response = web.Response(status=error.status, body=error.json_bytes(), content_type="application/json",
                            headers=error.headers())
    if error.status in CLOSE_AFTER:
        response.force_close()
    return response


def _refuse_body_early(request):
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


def _authorized(request, key):
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    # aiohttp hands a header's bytes that are not UTF-8 over as lone surrogates, which .encode()
    # refuses: surrogateescape gives back the bytes as sent, so such a token is compared (and
    # refused, 401) instead of failing the request outside every handler (500).
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                                                              key.encode())


@web.middleware
async def _errors_and_auth(request, handler):
    """Every answer in OpenAI's error format, also aiohttp's own (404, 405,
    413); everything but the probes and metrics needs the key when one is
    configured (a list of what is open, so no spelling of a path slips past)."""
    key = request.app[SETTINGS].api_key
    if key and request.path not in OPEN_PATHS and not _authorized(request, key):
        error = FrontError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")
        request.app[METRICS].error(error.status, error.code)
        return error_response(error)
    try:
        if request.can_read_body:
            _refuse_body_early(request)
        return await handler(request)
    except FrontError as error:
        request.app[METRICS].error(error.status, error.code)
        return error_response(error)
    except web.HTTPRequestEntityTooLarge:
        error = too_large("the request body is larger than the largest image allowed")
    except web.HTTPException as http:
        if http.status < 400:
            raise
        error = FrontError(http.status, f"{request.method} {request.path}: {http.reason}",
                           code="not_found" if http.status == 404 else None)
    except Exception as bug:  # noqa: BLE001 - a bug answers that request alone, in OpenAI's format
        # The type and message only: a traceback's locals could hold the request (or a key).
        log.error("openai_front: %sunexpected %s: %s", request_id.log_tag(request), type(bug).__name__, bug)
        error = FrontError(500, "internal error in the OpenAI front", type="server_error", code="server_error")
    request.app[METRICS].error(error.status, error.code)
    return error_response(error)


BODY_SLOT_WAIT_S = 2.0
# A body's first second is free of the pace OPENAI_FRONT_MIN_BODY_RATE sets (a connection's
# slow start, a client's pause between its head and its body).
BODY_RATE_GRACE_S = 1.0


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


def _parse_body(raw, settings):
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
                return await asyncio.to_thread(_parse_body, raw, settings)
            return _parse_body(raw, settings)
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


def _model(settings, model_id):
    model = settings.model(model_id)
    if model is None:
        raise FrontError(404, f"The model '{model_id[:100]}' does not exist; GET /v1/models lists the models",
                         param="model", code="model_not_found")
    return model


async def chat_completions(request):
    app, started = request.app, time.monotonic()
    settings, metrics = app[SETTINGS], app[METRICS]
    model_id, stream, status, usage = None, False, 500, None
    metrics.in_flight += 1
    try:
        parsed = await read_request(request)
        model_id, stream = parsed.model, parsed.stream
        access_log.note(request, model=model_id, stream=stream)
        model = _model(settings, parsed.model)
        image = parsed.image
        if image is None:
            async with app[FETCHES].slot():
                image = await fetch.fetch_image(app[FETCHER], parsed.image_url, settings.max_image_bytes)
        with app[IMAGES].hold(len(image)), app[ADMISSION].passing_on() as outcome:
            if parsed.stream:
                app[STREAMS].add(asyncio.current_task())
                try:
                    response, usage, status = await _stream(request, model, parsed, image)
                finally:
                    app[STREAMS].discard(asyncio.current_task())
                outcome.status = status
                return response
            answer = await app[POOL].infer(model.ensemble, image, parsed.prompt, request_parameters(parsed),
                                           request_id=request_id.of(request),
                                           metadata=trace_context.grpc_metadata(request.headers))
            usage, status = answer.usage, 200
            outcome.status = status
            return web.json_response(responses.completion(responses.completion_id(), model.id, answer))
    except FrontError as error:
        status = error.status
        if status >= 500:
            log.warning("openai_front: %s%s %s", request_id.log_tag(request), status, error.message)
        raise
    except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit (no Content-Length to refuse early)
        status = 413
        raise
    except asyncio.CancelledError:
        # The client left (aiohttp's handler_cancellation): the gRPC call was
        # cancelled with this task, and Triton cancels the request.
        status = 499
        metrics.error(499, "client_closed_request")
        raise
    finally:
        metrics.in_flight -= 1
        metrics.observe(model_id, stream, status, time.monotonic() - started, usage)


async def _stream(request, model, parsed, image):
    """Wait for the first response before the headers go out, so a bad image
    or an unavailable server is still an HTTP status; later errors go as an
    `error` event (the openai SDK raises it) and the stream ends without [DONE]."""
    pool = request.app[POOL]
    async with contextlib.aclosing(pool.stream(model.stream_model, image, parsed.prompt, request_parameters(parsed),
                                               request_id=request_id.of(request),
                                               metadata=trace_context.grpc_metadata(request.headers))) as events:
        try:
            answer, text = await events.__anext__()
        except StopAsyncIteration:
            raise FrontError(502, "the pipeline ended the stream without an answer", type="server_error",
                             code="server_error") from None
        except asyncio.CancelledError as cancel:
            if cancel.args != (SHUTTING_DOWN,):
                raise
            raise unavailable(SHUTTING_DOWN) from None
        response = access_log.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            chunks = responses.ChunkWriter(responses.completion_id(), model.id, parsed.include_usage)
            await response.write(chunks.first(answer.labels, answer.scores))
            if text:
                await response.write(chunks.text(text))
            try:
                async for _same_answer, text in events:  # one Answer, filled in as responses come
                    if text:
                        await response.write(chunks.text(text))
            except (FrontError, asyncio.CancelledError, Exception) as failure:  # noqa: BLE001
                # Headers are out: the failure goes as an error event, never as a second status line.
                error = _stream_error(failure, request)
                request.app[METRICS].error(error.status, error.code)
                log.warning("openai_front: %sstream failed after it started: %s", request_id.log_tag(request), error.message)
                await response.write(responses.sse(error.body()))
                await response.write_eof()
                return response, None, error.status
            await response.write(chunks.last(answer.source, answer.usage))
            await response.write_eof()
        except ConnectionResetError:
            # The client left while a chunk was written: leaving this block closes
            # `events`, which cancels the gRPC stream, and the streaming model stops
            # its LLM call. When it leaves while the front waits on Triton, aiohttp
            # cancels the handler instead (handler_cancellation), and the
            # cancellation closes `events` the same way (chat_completions counts it).
            request.app[METRICS].error(499, "client_closed_request")
            return response, None, 499
        return response, answer.usage, 200


def _stream_error(failure, request):
    """The error event for a stream that failed after its headers went out; a
    client's own cancel (not the front's shutdown) is passed on as it is."""
    if isinstance(failure, FrontError):
        return failure
    if isinstance(failure, ConnectionResetError):  # the client left: nobody to tell
        raise failure
    if isinstance(failure, asyncio.CancelledError):
        if failure.args != (SHUTTING_DOWN,):
            raise failure
        return unavailable(SHUTTING_DOWN)
    log.error("openai_front: %sunexpected %s in a stream: %s", request_id.log_tag(request), type(failure).__name__, failure)
    return FrontError(500, "internal error in the OpenAI front", type="server_error", code="server_error")


async def list_models(request):
    return web.json_response(responses.models_list(request.app[SETTINGS].models))


async def get_model(request):
    model = _model(request.app[SETTINGS], request.match_info["model"])
    return web.json_response(responses.models_list([model])["data"][0])


async def metrics(request):
    response = await request.app[METRICS].serve(request)
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


async def health(request):
    return web.json_response({"status": "ok"})


async def ready(request):
    if await request.app[POOL].is_ready():
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "triton not ready"}, status=503)
