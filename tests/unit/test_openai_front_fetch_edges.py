"""openai_front/fetch.py at its edges, against a real HTTP server on
127.0.0.1: the byte limit exactly, bodies that arrive in pieces, answers that
are not the image, and every failure turned into that request's 4xx (found
by `make mutants`, docs/mutation.md)."""

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from openai_front import fetch
from openai_front.errors import FrontError

LIMIT = 1000
# Generous: each bound only has to end a mutant that would otherwise wait
# forever; a correct fetch finishes in milliseconds, a loaded machine may be slow.
BOUND_S = 30


async def pieces(request):
    """The body of ?size= bytes written in ?piece=-byte writes, so it arrives in several reads."""
    size, piece = int(request.query["size"]), int(request.query.get("piece", "100"))
    response = web.StreamResponse()
    await response.prepare(request)
    for start in range(0, size, piece):
        await response.write(bytes([start // piece % 256]) * min(piece, size - start))
    await response.write_eof()
    return response


def body(size, piece=100):
    return b"".join(bytes([start // piece % 256]) * min(piece, size - start) for start in range(0, size, piece))


async def missing(request):
    return web.Response(status=404)


async def moved(request):
    raise web.HTTPFound("/pieces?size=10")


def fetch_from(path, limit=LIMIT, timeout_s=5.0, handlers=None):
    async def main():
        app = web.Application()
        app.router.add_get("/pieces", pieces)
        app.router.add_get("/missing", missing)
        app.router.add_get("/moved", moved)
        for route, handler in (handlers or {}).items():
            app.router.add_get(route, handler)
        async with TestServer(app, host="127.0.0.1") as server:
            async with fetch.session(timeout_s, allow_private=True) as session:
                return await asyncio.wait_for(
                    fetch.fetch_image(session, f"http://127.0.0.1:{server.port}{path}", limit), BOUND_S)

    return asyncio.run(main())


def refusal(path, **kwargs):
    with pytest.raises(FrontError) as info:
        fetch_from(path, **kwargs)
    return info.value


@pytest.mark.parametrize("size, piece", [(LIMIT, 100), (LIMIT, 7), (LIMIT - 1, LIMIT), (1, 1)])
def test_a_body_up_to_the_limit_comes_back_whole_however_it_arrives(size, piece):
    assert fetch_from(f"/pieces?size={size}&piece={piece}") == body(size, piece)


@pytest.mark.parametrize("size, piece", [(LIMIT + 1, 100), (LIMIT + 1, LIMIT + 1), (3 * LIMIT, 64)])
def test_one_byte_past_the_limit_is_413(size, piece):
    error = refusal(f"/pieces?size={size}&piece={piece}")
    assert (error.status, error.code) == (413, "image_too_large")
    assert error.message == f"the image at the URL is more than the {LIMIT} bytes allowed"


async def in_two(request):
    """?first= bytes, then a pause in which the fetch reads them, then ?second= more: two reads for certain."""
    first, second = int(request.query["first"]), int(request.query["second"])
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"a" * first)
    # Not a timed assertion: the pause only lets the client's read of the first
    # part run first (same event loop), however slow the machine.
    await asyncio.sleep(0.3)
    await response.write(b"b" * second)
    await response.write_eof()
    return response


def test_a_body_read_in_two_parts_keeps_both():
    assert fetch_from("/two?first=400&second=300", handlers={"/two": in_two}) == b"a" * 400 + b"b" * 300


def test_the_byte_past_the_limit_is_waited_for_when_the_limit_came_first():
    error = refusal(f"/two?first={LIMIT}&second=1", handlers={"/two": in_two})
    assert (error.status, error.code) == (413, "image_too_large")


def test_an_answer_other_than_200_is_that_requests_400():
    error = refusal("/missing")
    assert (error.status, error.message) == (400, "fetching the image URL answered HTTP 404")


def test_a_redirect_is_not_followed():
    error = refusal("/moved")
    assert (error.status, error.message) == (400, "fetching the image URL answered HTTP 302")


def test_a_closed_port_is_a_400_naming_the_failure():
    with socket.socket() as probe:  # a port nothing listens on once the socket is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def main():
        async with fetch.session(5.0, allow_private=True) as session:
            return await fetch.fetch_image(session, f"http://127.0.0.1:{port}/x", LIMIT)

    with pytest.raises(FrontError) as info:
        asyncio.run(main())
    assert info.value.status == 400
    assert info.value.message == "fetching the image URL failed (ClientConnectorError)"


def test_an_image_host_that_does_not_answer_in_time_is_a_400():
    async def stalled(request):
        await asyncio.sleep(BOUND_S)

    error = refusal("/stalled", timeout_s=0.2, handlers={"/stalled": stalled})
    assert error.status == 400
    assert error.message.startswith("fetching the image URL failed (") and "Timeout" in error.message


def test_the_default_session_refuses_a_name_that_resolves_to_loopback():
    async def main():
        app = web.Application()
        app.router.add_get("/pieces", pieces)
        async with TestServer(app, host="127.0.0.1") as server:
            async with fetch.session(5.0) as session:
                return await fetch.fetch_image(session, f"http://localhost:{server.port}/pieces?size=10", LIMIT)

    with pytest.raises(FrontError) as info:
        asyncio.run(main())
    assert (info.value.status, info.value.code) == (400, "image_url_not_allowed")
    assert info.value.message == ("the image URL is refused: its host resolves to a loopback, private or "
                                  "otherwise non-public address")


class RecordingResolver:
    def __init__(self, *addresses):
        self.addresses, self.calls = addresses, []

    async def resolve(self, host, port=0, family=0):
        self.calls.append((host, port, family))
        return [{"hostname": host, "host": a, "port": port, "family": family, "proto": 0, "flags": 0}
                for a in self.addresses]

    async def close(self):
        pass


def test_the_resolver_asks_for_the_name_port_and_family_it_was_given_and_names_the_host_it_refuses():
    inner = RecordingResolver("10.1.2.3")
    with pytest.raises(fetch.NonPublicAddress, match="^photos.example.com resolves to no public address$"):
        asyncio.run(fetch.PublicOnlyResolver(resolver=inner).resolve("photos.example.com", 8080, socket.AF_INET6))
    assert inner.calls == [("photos.example.com", 8080, socket.AF_INET6)]
