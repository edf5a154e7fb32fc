"""A refused client that is still sending its body (openai_front/shedding.py,
discard_refused_bodies): it gets its 503 and keeps its connection, never a
reset, however long past aiohttp's 1 s lingering_time its body takes; a body
that does not end (stalled, or chunked without end) has its connection closed.
Raw blocking sockets in a thread, against the real app served as __main__
serves it, with the one slot held by a valid request beside; and 2,560 C
users connecting at once, each refused, none reset."""

import asyncio
import json
import shutil
import socket
import threading
import time

import pytest
from aiohttp import web
from raw_http import read_answer, somaxconn
from test_openai_front import StalledPool, body, front_with, large_body
from test_openai_front_hostile import serving

from openai_front import __main__ as front_main
from openai_front import keys as front_keys
from tools import overload

SOCKET_TIMEOUT_S = 15  # generous: only a hang reaches it on a loaded machine


def head(length=None, chunked=False):
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % length
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + framing + b"\r\n\r\n")


def refused_then_again(port, payload, pieces=4, pause_s=0.5):
    """A well-behaved client whose request is refused while it sends: the body in
    `pieces` over (pieces - 1) x pause_s, the answer read only once all is sent
    (as most clients do), then its next request on the same connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(head(len(payload)))
        step = -(-len(payload) // pieces)
        for start in range(0, len(payload), step):
            if start:
                time.sleep(pause_s)
            sock.sendall(payload[start:start + step])
        refused = read_answer(sock)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        return refused, read_answer(sock)


def hold_the_slot(server, pool):
    async def hold():
        payload = json.dumps(body()).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(head(len(payload)) + payload)
        await writer.drain()
        await asyncio.wait_for(pool.started.wait(), 10)
        return writer
    return hold()


def beside_a_held_slot(app, pool, client):
    """`app` served, its one slot held by a valid request, and client(port) run in a thread
    (raw blocking sockets) -> (what it returns, whether the valid request was held throughout)."""
    async def main():
        async with await serving(app) as server:
            holder = await hold_the_slot(server, pool)
            result = await asyncio.to_thread(client, server.port)
            held = app[front_keys.ADMISSION].now == 1 and not pool.cancelled.is_set()
            holder.close()
            return result, held

    return asyncio.run(main())


def test_a_refused_client_sending_its_body_slowly_gets_its_503_and_keeps_its_connection():
    """150 KB in four pieces over 1.5 s, past the front's 1 s lingering_time: without
    the drain the front closed after 1 s and the client's next bytes met a reset."""
    pool = StalledPool()
    app = front_with(pool, max_requests_in_flight=1)
    payload = json.dumps(large_body()).encode()
    ((status, headers, answer), (next_status, _, _)), held = beside_a_held_slot(
        app, pool, lambda port: refused_then_again(port, payload))
    assert status == 503 and b"\r\nRetry-After: " in headers
    assert json.loads(answer)["error"]["code"] == "service_unavailable"
    assert next_status == 200, "the refused client's connection served its next request"
    assert held, "the valid request beside was held throughout"


def closed_by_server(sock, send_first=b""):
    """Whether the server ends the connection (EOF or reset) within the socket timeout,
    once `send_first` is sent; the refusal sent before is read and ignored."""
    try:
        if send_first:
            sock.sendall(send_first)
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_a_refused_body_that_stalls_has_its_connection_closed_after_the_body_deadline():
    pool = StalledPool()
    app = front_with(pool, max_requests_in_flight=1, body_timeout_s=0.5)

    def stall(port):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head(100_000) + b"{")  # and nothing more
            started = time.monotonic()
            return closed_by_server(sock), time.monotonic() - started

    (closed, seconds), held = beside_a_held_slot(app, pool, stall)
    assert closed and seconds < SOCKET_TIMEOUT_S
    assert held


def test_a_refused_chunked_body_without_end_is_cut_after_the_largest_body():
    """max_image_bytes 1024: the largest body is about 1 MB; an endless chunked body
    is read that far and its connection closed, long before 64 MB went."""
    pool = StalledPool()
    app = front_with(pool, max_requests_in_flight=1, max_image_bytes=1024)
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"

    def endless(port):
        sent = 0
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head(chunked=True))
            try:
                while sent < 64 * 1024 * 1024:
                    sock.sendall(chunk)
                    sent += len(chunk)
            except (ConnectionResetError, BrokenPipeError):
                return sent
            return sent if closed_by_server(sock) else None

    sent, held = beside_a_held_slot(app, pool, endless)
    assert sent is not None and sent < 64 * 1024 * 1024, sent
    assert held


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
@pytest.mark.skipif(somaxconn() < 2560, reason="net.core.somaxconn caps the listen backlog below 2,560 here")
def test_thousands_connecting_at_once_are_each_refused_none_reset(tmp_path):
    """2,560 C users (tools/overload_client.c, openai mode) connect at once to the
    front, listening as __main__ has it listen, its one slot held: every attempt is
    a refusal. With aiohttp's default listen backlog (128) the kernel reset
    hundreds of them (its SYN cookies failed: lost:send / lost:recv ECONNRESET)."""
    pool = StalledPool()
    app = front_with(pool, max_requests_in_flight=1)
    started, stop = threading.Event(), None
    port = []

    def serve():
        nonlocal stop
        loop = asyncio.new_event_loop()

        async def main():
            runner = web.AppRunner(app, handler_cancellation=True, auto_decompress=False,
                                   lingering_time=front_main.LINGERING_S)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=front_main.LISTEN_BACKLOG)
            await site.start()
            port.append(runner.addresses[0][1])
            holder = await hold_the_slot(type("S", (), {"port": port[0]}), pool)
            done = asyncio.Event()
            nonlocal stop
            stop = lambda: loop.call_soon_threadsafe(done.set)  # noqa: E731 - the thread's way out
            started.set()
            await done.wait()
            holder.close()
            await runner.cleanup()

        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(SOCKET_TIMEOUT_S), "the front did not start"
    try:
        (tmp_path / "photo").write_bytes(b"p" * 65536)
        figures = overload.c_phase(overload.compile_c_client(tmp_path), f"127.0.0.1:{port[0]}", tmp_path / "photo",
                                   users=2560, seconds=2, timeout_s=30, backoff_base_s=0, openai=True)
    finally:
        stop()
        thread.join(SOCKET_TIMEOUT_S)
    # Every user's attempts are seen to their end, so none lost is the whole check; how many
    # refusals end within the 2 s depends on the machine's load (only the window's are counted).
    assert figures["lost"] == 0, figures["lost_by_reason"]
    assert figures["rejected"] >= 1 and figures["admitted"] == 0
