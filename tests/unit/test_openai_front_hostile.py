"""The front's HTTP surface under hostile clients, over real sockets against the
real app (run as __main__ runs it: handler cancellation, no body decompression):
bodies refused from their headers before a byte is read, a read deadline per
body, the connection closed after such a refusal, image-URL fetches bounded, a
failure after a stream started sent as an error event, and the open streams
ended at shutdown. Each case has a valid request beside it that must be served.
The same against a real server and Triton: tests/integration/test_shutdown.py."""

import asyncio
import base64
import gzip
import json
import logging
import socket
import time
import tracemalloc

import pytest
from aiohttp.test_utils import TestServer
from test_openai_front import StalledPool, body, front_with, until, value

from openai_front import __main__ as front_main
from openai_front import app as front_app
from openai_front import body as front_body
from openai_front import keys as front_keys
from openai_front import malformed_http
from openai_front.triton import Answer

# As openai_front/__main__.py runs the app (TestServer always adds handler_cancellation).
SERVER_OPTIONS = {"auto_decompress": False, "lingering_time": front_main.LINGERING_S}


async def serving(app):
    """A TestServer started with SERVER_OPTIONS and the front's logger for aiohttp's request handlers
    (its constructor drops them: start_server takes them)."""
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(**SERVER_OPTIONS, logger=malformed_http.logger(app[front_keys.METRICS]))
    return server


async def raw_exchange(port, head, payload=b"", read_timeout=5.0):
    """Send `head` (and `payload`), return (status, everything the server sent
    until it closed the connection, seconds until the status line came)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + payload)
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), read_timeout)
    answered_s = time.monotonic() - started
    rest = await asyncio.wait_for(reader.read(), read_timeout)  # b"" once the server closes
    writer.close()
    return int(status_line.split()[1]), status_line + rest, answered_s


def post_head(length, **headers):
    """The request head; the cases that test the server's closing leave keep-alive on,
    the others ask for Connection: close so that raw_exchange reads to the end."""
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: x", b"Content-Type: application/json",
             b"Content-Length: %d" % length, *(f"{k.replace('_', '-')}: {v}".encode() for k, v in headers.items())]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def photo_payload(image):
    """A chat request's JSON body asking about `image` (as a PNG data: URI)."""
    return json.dumps(body("data:image/png;base64," + base64.b64encode(image).decode(), text="What is it?")).encode()


def chat_head(framing):
    """A chat request's head, the body framed by `framing` (Content-Length or Transfer-Encoding)."""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n")


def valid_request_is_served(port, pool):
    """A valid request beside the hostile one reaches the pipeline (the stalled pool)."""
    async def send():
        payload = json.dumps(body()).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_head(len(payload)) + payload)
        await writer.drain()
        await asyncio.wait_for(pool.started.wait(), 5)
        writer.close()
    return send()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP"])
def test_a_compressed_body_is_415_before_it_is_read_and_the_connection_closes(monkeypatch, encoding):
    parsed, parse = [], front_body.parse_body
    monkeypatch.setattr(front_body, "parse_body", lambda raw, s: parsed.append(raw) or parse(raw, s))
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024))  # 64 MB of zeros in about 64 KB
    pool = StalledPool()
    app = front_with(pool)

    async def main():
        async with await serving(app) as server:
            answer = await raw_exchange(server.port, post_head(len(bomb), content_encoding=encoding), bomb)
            await valid_request_is_served(server.port, pool)
            return answer

    status, sent, _ = asyncio.run(main())
    assert status == 415 and b"unsupported_content_encoding" in sent and b"uncompressed" in sent
    assert b"Connection: close" in sent  # and read() above returned: the server closed it
    assert len(parsed) == 1, "only the valid request's body was parsed"


def test_a_declared_length_over_the_limit_is_413_at_once_without_reading_the_body():
    pool = StalledPool()
    app = front_with(pool, max_image_bytes=1024 * 1024)
    limit = front_body.max_body_bytes(app[front_keys.SETTINGS])

    async def main():
        async with await serving(app) as server:
            # 1 GB declared, not a byte sent: the answer cannot wait for the body.
            answer = await raw_exchange(server.port, post_head(1024**3))
            at_limit = await raw_exchange(server.port, post_head(limit + 1), b"{")
            await valid_request_is_served(server.port, pool)
            return answer, at_limit

    (status, sent, answered_s), (status_at_limit, _, _) = asyncio.run(main())
    assert status == 413 == status_at_limit and b"image_too_large" in sent
    assert answered_s < 2 and b"Connection: close" in sent


def test_a_chunked_body_over_the_limit_is_413_and_counted_as_413_not_500():
    """No Content-Length to refuse from: aiohttp stops reading at the limit. The client got its
    413 before, but the request counter said 500 (what a 5xx alert reads)."""
    pool = StalledPool()
    app = front_with(pool, max_image_bytes=1024)
    limit = front_body.max_body_bytes(app[front_keys.SETTINGS])
    head = chat_head(b"Transfer-Encoding: chunked")
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"

    async def main():
        async with await serving(app) as server:
            answer = await raw_exchange(server.port, head, chunk * (limit // 0x10000 + 2) + b"0\r\n\r\n")
            await valid_request_is_served(server.port, pool)
            return answer, app[front_keys.METRICS].render()

    (status, sent, _), metrics = asyncio.run(main())
    assert status == 413 and b"image_too_large" in sent
    assert value(metrics, "openai_front_requests_total", model="other", stream="false", status="413") == 1
    assert not value(metrics, "openai_front_requests_total", model="other", stream="false", status="500")


class RecordingPool(StalledPool):
    """Answers at once, keeping the image and the prompt each request brought."""

    def __init__(self):
        super().__init__()
        self.received = []

    async def infer(self, model, image, prompt=None, *args, **kwargs):
        self.received.append((image, prompt))
        return Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}, description="A cup")


def dribbled(payload, piece_bytes, chunked):
    """The body in pieces: as they are (Content-Length), or each an HTTP chunk of its own
    whose end comes in a later write (so the front may read a chunk's data before its end)."""
    pieces = [payload[at:at + piece_bytes] for at in range(0, len(payload), piece_bytes)]
    if not chunked:
        return pieces
    return [part for piece in pieces for part in (b"%x\r\n%s" % (len(piece), piece), b"\r\n")] + [b"0\r\n\r\n"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("piece_bytes", [1_000_003, 65_536, 7_919])
def test_a_body_arriving_in_pieces_reaches_the_pipeline_whole(chunked, piece_bytes):
    """The front gathers a body's pieces itself (body.read_body): every byte, in order, once,
    however it arrives. A 400 KB photo, sent whole, in 64 KiB pieces or in odd-sized ones
    with pauses between, with Content-Length or chunked."""
    image = bytes(range(251)) * 1_600
    payload = photo_payload(image)
    head = chat_head(b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(payload))
    pool = RecordingPool()

    async def main():
        async with await serving(front_with(pool)) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(head)
            for piece in dribbled(payload, piece_bytes, chunked):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return answer

    answer = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert pool.received == [(image, "What is it?")]


def peak_memory_reading_in_tiny_chunks(image, monkeypatch):
    """(the traced memory's peak while the front reads (body.read_body) a request
    whose body comes in 2-byte HTTP chunks, the body's length)."""
    payload = photo_payload(image)
    message = chat_head(b"Transfer-Encoding: chunked") + b"".join(dribbled(payload, 2, chunked=True))
    pool, peaks, read_body = RecordingPool(), [], front_body.read_body

    async def traced_read_body(request, limit, *args):
        # Only the read: orjson's parse next reserves 13 times the body (tracemalloc counts
        # it; the pages it touches are about twice the body).
        tracemalloc.reset_peak()
        raw = await read_body(request, limit, *args)
        peaks.append(tracemalloc.get_traced_memory()[1])
        return raw

    monkeypatch.setattr(front_body, "read_body", traced_read_body)

    async def main():
        loop = asyncio.get_running_loop()
        async with await serving(front_with(pool)) as server:
            # A plain socket: asyncio's sock_sendall sends from the message itself, where a
            # stream writer would copy what the socket has not taken yet into its buffer.
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.setblocking(False)
                tracemalloc.start()
                try:
                    await loop.sock_sendall(sock, message)
                    answer = b""
                    while piece := await asyncio.wait_for(loop.sock_recv(sock, 65536), 30):
                        answer += piece
                    return answer
                finally:
                    tracemalloc.stop()

    answer = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert pool.received == [(image, "What is it?")]
    return peaks[0], len(payload)


def test_a_body_of_tiny_chunks_holds_about_its_own_size_while_it_is_read(monkeypatch):
    """Each HTTP chunk is a bytes object of its own (about 56 bytes of memory for a
    1-byte chunk): kept one by one until the body ends, a chunked body of 2-byte
    chunks held some 28 times its size, and 16 bodies at once the front's memory
    many times over. read_body gathers small pieces as they come. Measured as what
    a body twice as large adds, so that what each socket read holds for a moment
    (the same for both) cancels out."""
    peak, length = peak_memory_reading_in_tiny_chunks(bytes(range(251)) * 600, monkeypatch)
    peak_twice, length_twice = peak_memory_reading_in_tiny_chunks(bytes(range(251)) * 1_200, monkeypatch)
    # Per byte more: the body itself, about 1.
    assert peak_twice - peak < 3 * (length_twice - length), (peak, peak_twice, length, length_twice)


MALFORMED = {
    "a bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "a header line past 8 KB": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n",
    "a bad header name": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    "two lengths": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx",
}


def test_a_flood_of_requests_that_are_not_http_logs_a_line_a_second_and_counts_each(caplog):
    """aiohttp answers them itself, 400, before any middleware, and logged each with its traceback
    (about ten lines at ERROR): 200 in a loop were 2,000 lines. Now one line a second, naming the
    error, and the count in the metrics; a valid request beside them is served."""
    pool = StalledPool()
    app = front_with(pool)

    async def main():
        async with await serving(app) as server:
            statuses = [(await raw_exchange(server.port, raw))[0] for raw in list(MALFORMED.values()) * 50]
            await asyncio.sleep(malformed_http.INTERVAL_S)
            statuses.append((await raw_exchange(server.port, MALFORMED["a bad chunk size"]))[0])
            await valid_request_is_served(server.port, pool)
            return statuses, app[front_keys.METRICS].render()

    with caplog.at_level("INFO", logger="openai_front.http"):
        statuses, metrics = asyncio.run(main())
    assert statuses == [400] * 201
    lines = [r for r in caplog.records if r.name == "openai_front.http"]
    assert len(lines) == 2 and not any(r.exc_info or r.exc_text for r in lines), [r.getMessage() for r in lines]
    assert "not HTTP the front can read, answered 400 (Invalid character in chunk size" in lines[0].getMessage()
    assert lines[1].getMessage().endswith("; 199 more since the last such line, not logged")
    assert value(metrics, "openai_front_errors_total", status="400", code="malformed_http") == 201


SECRET = "sk-DO-NOT-LOG-" + "7" * 16
LEAKY_LINES = {
    "a header line ending in a bare LF": f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\n\r\n",
    "a control character in a value": f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\x01\r\n\r\n",
    "bare LFs throughout": f"GET /v1/models HTTP/1.1\nHost: x\nAuthorization: Bearer {SECRET}\n\n",
    "a bad header name": f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX Key{SECRET}: y\r\n\r\n",
}


@pytest.mark.parametrize("name", LEAKY_LINES)
def test_a_malformed_request_is_logged_without_anything_the_client_sent(name, caplog):
    """aiohttp's message quotes the bytes it could not parse: a broken client's key was in the log."""
    async def main():
        async with await serving(front_with(StalledPool())) as server:
            return (await raw_exchange(server.port, LEAKY_LINES[name].encode()))[0]

    with caplog.at_level("DEBUG"):
        assert asyncio.run(main()) == 400
    logged = [r.getMessage() for r in caplog.records]
    assert any("not HTTP the front can read, answered 400 (" in line for line in logged), logged
    assert not [line for line in logged if "DO-NOT-LOG" in line or "Bearer" in line], logged


def test_what_the_front_logs_for_anything_else_keeps_its_traceback():
    record_of = lambda error: logging.LogRecord(  # noqa: E731
        "openai_front.http", logging.ERROR, __file__, 1, "Unhandled exception", (), (type(error), error, None))
    keep = malformed_http.OneLineEach(clock=lambda: 0.0)
    for error in (RuntimeError("a bug of ours"), RuntimeError("another")):
        record = record_of(error)
        assert keep.filter(record) and record.exc_info[1] is error and record.getMessage() == "Unhandled exception"


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions")])
def test_a_bearer_token_that_is_not_utf8_is_401_in_openais_format(method, path):
    """aiohttp hands such header bytes over as lone surrogates; encoding them failed the request
    outside every handler: a text/plain 500 and a traceback in the log."""
    pool = StalledPool()
    app = front_with(pool, api_key="sk-front-key")
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n".encode()
            + b"Authorization: Bearer \xff\xfe\r\n\r\n")

    async def main():
        async with await serving(app) as server:
            return await raw_exchange(server.port, head)

    status, sent, _ = asyncio.run(main())
    assert status == 401 and b'"code":"invalid_api_key"' in sent.replace(b" ", b"")
    assert b"sk-front-key" not in sent


def test_a_body_that_does_not_arrive_in_time_is_408_and_frees_its_slot():
    """A slow-loris sender (headers and one byte) held a body slot for as long as it
    liked; now for OPENAI_FRONT_BODY_TIMEOUT_S, then the connection is closed."""
    pool = StalledPool()
    app = front_with(pool, max_bodies_in_flight=1, body_timeout_s=0.5)

    async def main():
        async with await serving(app) as server:
            slow = asyncio.create_task(raw_exchange(server.port, post_head(1000), b"{"))
            # Polled, not slept on: the slot is held from the first byte read until the deadline.
            await until(lambda: app[front_keys.BODIES].now == 1 or slow.done(), "the slow body is being read")
            held = app[front_keys.BODIES].now
            status, sent, answered_s = await slow
            freed = app[front_keys.BODIES].now
            await valid_request_is_served(server.port, pool)  # the one slot serves again
            return held, status, sent, answered_s, freed

    held, status, sent, answered_s, freed = asyncio.run(main())
    assert held == 1 and freed == 0
    assert status == 408 and b"OPENAI_FRONT_BODY_TIMEOUT_S" in sent and b"Connection: close" in sent
    assert 0.4 < answered_s < 3


def test_connections_that_send_only_their_head_hold_no_body_slot():
    """A body took its slot before its first byte: 16 connections sending a head and
    nothing more held every slot for OPENAI_FRONT_BODY_TIMEOUT_S, and every other
    chat request waited BODY_SLOT_WAIT_S for one and was refused. Now they hold none,
    a valid request beside them is served, and each ends after the pace's grace second
    (its admission, OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT's, held that long only)."""
    pool = StalledPool()
    app = front_with(pool, max_bodies_in_flight=1, body_timeout_s=5)

    async def main():
        async with await serving(app) as server:
            heads_only = [asyncio.create_task(raw_exchange(server.port, post_head(1000), read_timeout=10))
                          for _ in range(3)]
            await until(lambda: app[front_keys.METRICS].in_flight >= 3 or any(t.done() for t in heads_only),
                        "the three heads are in their handlers")
            held = app[front_keys.BODIES].now
            started = time.monotonic()
            await valid_request_is_served(server.port, pool)
            served_s = time.monotonic() - started
            return held, served_s, await asyncio.gather(*heads_only)

    held, served_s, answers = asyncio.run(main())
    assert held == 0, "a head without a body holds no body slot"
    assert served_s < front_body.BODY_SLOT_WAIT_S, "served at once, not after waiting for a slot"
    # Nor its admission for long: a body must start within the pace's grace second.
    assert [status for status, _, _ in answers] == [408] * 3
    assert all(b"OPENAI_FRONT_MIN_BODY_RATE" in sent for _, sent, _ in answers)
    assert all(front_body.BODY_RATE_GRACE_S * 0.9 < answered_s < 4 for _, _, answered_s in answers), answers


def test_a_body_that_falls_behind_the_minimum_rate_is_408_after_its_grace_and_frees_its_slot():
    """A trickle (a byte, then nothing) held a slot for all of OPENAI_FRONT_BODY_TIMEOUT_S;
    behind OPENAI_FRONT_MIN_BODY_RATE it is cut once its grace second is over."""
    pool = StalledPool()
    app = front_with(pool, max_bodies_in_flight=1, body_timeout_s=10, min_body_rate=1000)

    async def main():
        async with await serving(app) as server:
            trickle = asyncio.create_task(raw_exchange(server.port, post_head(1000), b"{", read_timeout=15))
            await until(lambda: app[front_keys.BODIES].now == 1 or trickle.done(), "the trickle holds the slot")
            status, sent, answered_s = await trickle
            freed = app[front_keys.BODIES].now
            await valid_request_is_served(server.port, pool)
            return status, sent, answered_s, freed

    status, sent, answered_s, freed = asyncio.run(main())
    assert status == 408 and b"OPENAI_FRONT_MIN_BODY_RATE" in sent and b"Connection: close" in sent
    assert front_body.BODY_RATE_GRACE_S < answered_s < 5, "cut after its grace, long before the body timeout"
    assert freed == 0


def test_image_url_fetches_past_the_limit_are_503_before_any_fetch(monkeypatch):
    fetched = []

    async def fetch_image(session, url, limit):
        fetched.append(url)
        return b""

    monkeypatch.setattr(front_app.fetch, "fetch_image", fetch_image)
    app = front_with(StalledPool(), image_url_allowlist=frozenset({"images.example"}), max_fetches_in_flight=2)
    payload = json.dumps(body(url="https://images.example/cat.png")).encode()

    async def main():
        async with await serving(app) as server:
            app[front_keys.FETCHES].now = 2  # two fetches under way
            return await raw_exchange(server.port, post_head(len(payload), connection="close") + payload)

    status, sent, _ = asyncio.run(main())
    assert status == 503 and b"OPENAI_FRONT_MAX_FETCHES_IN_FLIGHT" in sent and b"Retry-After" in sent
    assert fetched == []


class FailingStreamPool(StalledPool):
    """A stream whose first response comes, then the pool fails (a bug, not a FrontError)."""

    async def stream(self, *args, **kwargs):
        yield Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}), "A cup"
        raise RuntimeError("something the front did not expect")


def test_a_failure_after_the_stream_started_is_an_error_event_not_a_second_status_line():
    app = front_with(FailingStreamPool())
    payload = json.dumps(body(stream=True)).encode()

    async def main():
        async with await serving(app) as server:
            return await raw_exchange(server.port, post_head(len(payload), connection="close") + payload)

    status, sent, _ = asyncio.run(main())
    assert status == 200
    assert sent.count(b"HTTP/1.1") == 1, sent
    last_event = [line for line in sent.split(b"\n") if line.startswith(b"data: ")][-1]
    error = json.loads(last_event[6:])["error"]
    assert error["code"] == "server_error" and "something" not in error["message"]  # no internals
    assert b"[DONE]" not in sent


def test_shutdown_ends_open_streams_at_once_with_an_error_event():
    """TERM: aiohttp stops listening, then app.shutdown(): every open stream ends
    now (in its own format), so the runner's drain time is left to whole answers."""
    class OpenStreamPool(StalledPool):
        async def stream(self, *args, **kwargs):
            yield Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}), "A cup"
            await self._wait()

    pool = OpenStreamPool()
    app = front_with(pool)
    payload = json.dumps(body(stream=True)).encode()

    async def main():
        server = await serving(app)
        exchange = asyncio.create_task(raw_exchange(server.port, post_head(len(payload), connection="close") + payload,
                                                    read_timeout=10))
        await asyncio.wait_for(pool.started.wait(), 5)
        started = time.monotonic()
        await app.shutdown()
        status, sent, _ = await exchange
        took = time.monotonic() - started
        await server.close()
        return status, sent, took

    status, sent, took = asyncio.run(main())
    assert status == 200 and took < 2
    last_event = [line for line in sent.split(b"\n") if line.startswith(b"data: ")][-1]
    error = json.loads(last_event[6:])["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
    assert pool.cancelled.is_set(), "the Triton stream (and so the LLM call) was cancelled"


def test_the_front_runs_with_the_options_these_tests_use(monkeypatch):
    seen = {}
    monkeypatch.setattr(front_main.web, "run_app", lambda app, **kwargs: seen.update(kwargs))
    assert front_main.main(["--port", "1"]) == 0
    assert {key: seen[key] for key in SERVER_OPTIONS} == SERVER_OPTIONS
    assert seen["handler_cancellation"] is True and seen["shutdown_timeout"] == 5.0  # OPENAI_FRONT_DRAIN_S
    # As test_openai_front_refused_bodies.py listens for its 2,560 clients connecting at once.
    assert seen["backlog"] == front_main.LISTEN_BACKLOG >= 2560
    assert seen["logger"].name == "openai_front.http"
    assert [type(f) for f in seen["logger"].filters] == [malformed_http.OneLineEach]
