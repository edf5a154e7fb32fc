"""python -m openai_front [--host H] [--port P] [--triton-grpc-url HOST:PORT]
Settings otherwise from the environment (openai_front/settings.py)."""

import argparse
import logging
import sys

from aiohttp import web

from . import malformed_http
from . import settings as front_settings
from .app import METRICS, create_app

LINGERING_S = 1.0
# Connections the kernel holds until the front accepts them (aiohttp's default: 128).
# Thousands of clients connecting at once overflowed it and the kernel reset their
# connections (SYN cookies that failed): lost requests (docs/reliability.md#overload).
# Capped by net.core.somaxconn (4096 on current kernels).
LISTEN_BACKLOG = 4096


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m openai_front", description=__doc__)
    parser.add_argument("--host", help="address to listen on (OPENAI_ADDRESS, LISTEN_ADDRESS; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (OPENAI_PORT; default 8003)")
    parser.add_argument("--triton-grpc-url", help="Triton's gRPC endpoint (TRITON_GRPC_URL; default 127.0.0.1:8001)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        settings = front_settings.from_environ(host=args.host, port=args.port, triton_grpc_url=args.triton_grpc_url)
    except front_settings.ConfigError as error:
        print(f"openai_front: {error}", file=sys.stderr)
        return 2
    if settings.api_key:
        auth = f"requests need 'Authorization: Bearer <key>', the key {settings.api_key_source}"
    else:
        auth = (f"OPEN: no API key (OPENAI_FRONT_API_KEY or OPENAI_FRONT_API_KEY_FILE; key: {settings.api_key_source}),"
                " every client that reaches the port is served")
    urls = ", ".join(sorted(settings.image_url_allowlist)) or "none (data: URIs only)"
    print(f"openai_front: http://{settings.host}:{settings.port}/v1 -> Triton gRPC {settings.triton_grpc_url}; "
          f"{auth}; image URLs from: {urls}", file=sys.stderr, flush=True)
    serve(settings)
    return 0


def serve(settings):
    """Serve the front until TERM or INT, with the server's options below."""
    # handler_cancellation: a client that leaves cancels its handler, and with it
    # the gRPC call (Triton then cancels the request, and the LLM call with it).
    # auto_decompress=False: a compressed body stays compressed (it is refused, 415),
    # never inflated into memory. shutdown_timeout: how long whole answers may finish
    # after TERM; open streams end at once (app._end_streams). lingering_time: after an
    # answer to a body it did not read (413, 415, 408) the connection is closed within
    # 1 s (aiohttp's default reads and discards the rest for 10 s); the body of a refusal
    # (503) is read and dropped for longer, its client is not hostile (shedding.py).
    # logger: a request that is not HTTP gets one line (not a traceback), at most one a second.
    app = create_app(settings)
    web.run_app(app, host=settings.host, port=settings.port, access_log=None, print=None,
                shutdown_timeout=settings.drain_s, handler_cancellation=True, auto_decompress=False,
                lingering_time=LINGERING_S, backlog=LISTEN_BACKLOG, logger=malformed_http.logger(app[METRICS]))


if __name__ == "__main__":
    sys.exit(main())
