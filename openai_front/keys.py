"""The application's shared state, by key (aiohttp's AppKeys): what app.py sets up at start
and every step of a request's path reads."""

import asyncio

from aiohttp import web

from .shedding import Admission, ImageBytes

SETTINGS, POOL, METRICS, FETCHER, BODIES, FETCHES, STREAMS = (
    web.AppKey(name, object) for name in ("settings", "pool", "metrics", "fetcher", "bodies", "fetches", "streams"))
ADMISSION = web.AppKey("admission", Admission)
IMAGES = web.AppKey("images", ImageBytes)
QUEUE_LIMIT_READER = web.AppKey("queue_limit_reader", asyncio.Task)
