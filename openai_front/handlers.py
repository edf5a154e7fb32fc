"""The routes' handlers: a chat completion (whole, or streamed as server-sent events), the
model list, metrics and the probes."""

import asyncio
import contextlib
import logging
import time

from aiohttp import web
from classify_describe_server import request_id

from . import access_log, fetch, responses, trace_context
from .body import read_request
from .errors import FrontError, unavailable
from .keys import ADMISSION, FETCHER, FETCHES, IMAGES, METRICS, POOL, SETTINGS, STREAMS
from .triton import request_parameters

log = logging.getLogger("openai_front")

# The cancel message of a stream ended by the front's shutdown (not by its client).
SHUTTING_DOWN = "the OpenAI front is shutting down"


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
