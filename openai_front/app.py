"""The aiohttp application, as a request meets it: the middlewares (a refusal's body dropped,
the access log, every error in OpenAI's format and the key, admission), the routes
(handlers.py; a body is read by body.py), and the start and stop of what they share (keys.py)."""

import asyncio
import hmac
import logging

from aiohttp import web
from classify_describe_server import request_id

from . import access_log, expect_continue, fetch
from .body import max_body_bytes, refuse_early
from .errors import FrontError, too_large
from .handlers import SHUTTING_DOWN, chat_completions, get_model, health, list_models, metrics, ready
from .keys import ADMISSION, BODIES, FETCHER, FETCHES, IMAGES, METRICS, POOL, QUEUE_LIMIT_READER, SETTINGS, STREAMS
from .metrics import Metrics
from .shedding import Admission, ImageBytes, InFlight, discard_refused_bodies
from .triton import TritonPool

log = logging.getLogger("openai_front")
OPEN_PATHS = frozenset({"/health", "/health/ready", "/metrics"})  # no key needed: probes and Prometheus
QUEUE_LIMIT_RETRY_S, QUEUE_LIMIT_REREAD_S = 1.0, 60.0
# Answers after which the connection is closed: the rest of the body is never read.
CLOSE_AFTER = frozenset({408, 413, 415, 417})


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
            refuse_early(request)
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


