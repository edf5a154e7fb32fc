"""`Expect: 100-continue` at the front (openai_front/expect_continue.py): a client
that waits for 100 Continue gets its refusal (or any answer decided from the
headers) before it sends a byte of its body, with Connection: close, and the
connection then ends with a FIN, never a reset; an admitted one gets 100 Continue,
then its answer, and keeps its connection; one that sends its body anyway is
answered and closed cleanly. The shedding counts them as every other request.
Raw blocking sockets in a thread against the real app, served as __main__ serves
it, the one slot held by a valid request where a refusal is wanted."""

import asyncio
import json
import shutil
import socket
import time

import aiohttp
import pytest
from raw_http import read_answer
from test_openai_front import StalledPool, front_with, large_body, until
from test_openai_front_hostile import serving
from test_openai_front_refused_bodies import hold_the_slot

from openai_front import keys as front_keys
from openai_front.triton import Answer
from tools import overload

SOCKET_TIMEOUT_S = 15  # generous: only a hang reaches it on a loaded machine
PAYLOAD = json.dumps(large_body()).encode()


class AnsweringPool(StalledPool):
    """Answers at once; while `stall` is set, waits as StalledPool does."""

    stall = False

    async def infer(self, *args, **kwargs):
        if self.stall:
            await self._wait()
        return Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}, description="A cup")


def head(length=None, expect="100-continue", extra=b""):
    length = len(PAYLOAD) if length is None else length
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Expect: %s\r\n" % expect.encode() if expect else b"") + extra
            + b"Content-Length: %d\r\n\r\n" % length)


def first_head(sock):
    """The first answer's status line and headers (an interim one included), nothing after them."""
    data = b""
    while b"\r\n\r\n" not in data:
        byte = sock.recv(1)
        assert byte, f"closed before an answer: {data!r}"
        data += byte
    return data


def first_answer(sock):
    """The first answer, whatever it is (an interim 100 Continue included): (head, body)."""
    head = first_head(sock)
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    data = b""
    while len(data) < length:
        chunk = sock.recv(length - len(data))
        assert chunk, "closed in the middle of an answer"
        data += chunk
    return head, data


def closed_cleanly(sock):
    """The server ends the connection with a FIN (EOF), not a reset, once the answer was read."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return False


async def in_thread(client, port):
    """client(port) in a thread. A StopIteration there (raw_http.read_answer given an answer
    without Content-Length: an interim one) would leave asyncio's future unresolved, a hang."""
    def guarded():
        try:
            return client(port)
        except StopIteration as error:
            raise AssertionError("an answer without Content-Length (an interim 100 Continue?)") from error
    return await asyncio.to_thread(guarded)


def refused_app(**changes):
    pool = StalledPool()
    return pool, front_with(pool, max_requests_in_flight=1, **changes)


def run_beside_a_held_slot(app, pool, client):
    """client(port) in a thread while a valid request holds the one slot; its result, and the
    shedding's figures after it: (now, refusals counted) and whether the holder was still held."""
    async def main():
        async with await serving(app) as server:
            holder = await hold_the_slot(server, pool)
            try:
                result = await in_thread(client, server.port)
                admission = app[front_keys.ADMISSION]
                return result, (admission.now, admission.retry_after.refused, not pool.cancelled.is_set())
            finally:
                holder.close()  # also when the client failed: the server's shutdown would wait on it
    return asyncio.run(main())


def test_a_refused_client_that_waits_never_sends_its_body_and_is_counted_as_without_expect():
    """The 503 comes to the headers alone, without 100 Continue before it; the body is never
    sent; the server closes (body_timeout_s 1 s bounds its wait for a body) with a FIN. A
    request without Expect, refused beside it, counts the same: one refusal each."""
    pool, app = refused_app(body_timeout_s=1)

    def client(port):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head())
            answer_head, _ = first_answer(sock)
            first = answer_head.split(b"\r\n", 1)[0], closed_cleanly(sock)
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head(expect=None) + PAYLOAD)
            second = read_answer(sock)
        return first, second

    ((status_line, clean), (status, headers, _)), (now, refusals, held) = run_beside_a_held_slot(app, pool, client)
    assert status_line == b"HTTP/1.1 503 Service Unavailable", "refused before any 100 Continue"
    assert clean, "closed with a FIN once the answer went, not a reset"
    assert status == 503 and b"\r\nRetry-After: " in headers
    assert (now, refusals, held) == (1, 2, True), "one refusal each, the holder's slot untouched"


def test_the_refusal_says_retry_after_and_connection_close():
    pool, app = refused_app(body_timeout_s=1)

    def client(port):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head())
            return read_answer(sock)

    (status, headers, answer), _ = run_beside_a_held_slot(app, pool, client)
    assert status == 503 and json.loads(answer)["error"]["code"] == "service_unavailable"
    assert b"\r\nRetry-After: " in headers
    assert b"\r\nConnection: close" in headers, "the client holds its body back: the connection cannot go on"


def test_a_refused_client_that_sends_its_body_anyway_is_answered_and_closed_cleanly():
    """Expect sent, then the body at once in four pieces over 3 s without waiting: the body
    is drained like any refused one, the 503 is read after it, and the connection ends with
    a FIN, never a reset. aiohttp's own lingering read (lingering_time 1 s, its timeout
    rounded up to whole seconds) would have closed on the last pieces: a reset."""
    pool, app = refused_app()

    def client(port):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head())
            step = -(-len(PAYLOAD) // 4)
            for start in range(0, len(PAYLOAD), step):
                if start:
                    time.sleep(1.0)
                sock.sendall(PAYLOAD[start:start + step])
            return read_answer(sock), closed_cleanly(sock)

    ((status, headers, _), clean), (now, refusals, held) = run_beside_a_held_slot(app, pool, client)
    assert status == 503 and b"\r\nRetry-After: " in headers
    assert clean
    assert (now, refusals, held) == (1, 1, True)


def test_an_admitted_client_gets_100_continue_then_its_answer_and_keeps_its_connection():
    app = front_with(AnsweringPool(), max_requests_in_flight=1)

    def client(port):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head())
            interim = first_head(sock)
            sock.sendall(PAYLOAD)
            answer = read_answer(sock)
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            return interim, answer, read_answer(sock)[0]

    async def main():
        async with await serving(app) as server:
            result = await in_thread(client, server.port)
            admission = app[front_keys.ADMISSION]
            return result, (admission.now, len(admission.retry_after.finished.times), admission.retry_after.refused)

    (interim, (status, _, answer), next_status), figures = asyncio.run(main())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"]
    assert next_status == 200, "the connection serves the next request"
    assert figures == (0, 1, 0), "the slot freed, the answer counted as one finished, nothing refused"


@pytest.mark.parametrize("expect, extra, length, changes, status", [
    ("100-continue", b"", 50 * 1024 * 1024, {"max_image_bytes": 1024}, 413),
    ("100-continue", b"Content-Encoding: gzip\r\n", len(PAYLOAD), {}, 415),
    ("100-continue", b"", len(PAYLOAD), {"api_key": "sk-test"}, 401),
    ("something-else", b"", len(PAYLOAD), {}, 417),
], ids=["413", "415", "401", "417"])
def test_what_the_headers_decide_is_answered_before_100_continue(expect, extra, length, changes, status):
    """Too large by its Content-Length, compressed, without the key, another expectation:
    the answer comes to the headers alone, says Connection: close, and the connection
    ends with a FIN."""
    app = front_with(AnsweringPool(), **changes)

    def client(port):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head(length, expect, extra))
            answer = read_answer(sock)
            return answer, closed_cleanly(sock)

    async def main():
        async with await serving(app) as server:
            return await in_thread(client, server.port)

    (got, headers, answer), clean = asyncio.run(main())
    assert got == status, answer
    assert b"\r\nConnection: close" in headers and clean
    assert json.loads(answer)["error"]["message"]


def test_aiohttps_own_client_with_expect100_is_refused_then_served():
    """A real client that sends Expect: 100-continue (aiohttp's expect100=True): the 503 with
    its Retry-After while the slot is held, then, the slot free, the answer."""
    pool = AnsweringPool()
    pool.stall = True
    app = front_with(pool, max_requests_in_flight=1)

    async def main():
        async with await serving(app) as server, aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"

            async def post():
                async with session.post(url, data=PAYLOAD, headers={"Content-Type": "application/json"},
                                        expect100=True) as response:
                    return response.status, response.headers.get("Retry-After"), await response.json()

            holder = await hold_the_slot(server, pool)
            try:
                refused = await asyncio.wait_for(post(), SOCKET_TIMEOUT_S)
            finally:
                holder.close()
            await until(lambda: app[front_keys.ADMISSION].now == 0, "the holder left: its slot is free")
            pool.stall = False
            return refused, await asyncio.wait_for(post(), SOCKET_TIMEOUT_S)

    (status, retry_after, _), (second, _, answer) = asyncio.run(main())
    assert status == 503 and retry_after
    assert second == 200 and answer["choices"]


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_c_generators_expect_mode_against_the_front_is_refused_then_served_and_loses_nothing(tmp_path):
    """tools/overload_client.c in openai + expect mode, 16 users resending at once: with the one
    slot held every attempt is a refusal (each on a new connection: the front's
    Connection: close), then, the slot free, answers; nothing lost either way."""
    (tmp_path / "photo").write_bytes(b"p" * 65536)
    binary = overload.compile_c_client(tmp_path)
    pool = AnsweringPool()
    pool.stall = True
    app = front_with(pool, max_requests_in_flight=1)

    def phase(port):
        return overload.c_phase(binary, f"127.0.0.1:{port}", tmp_path / "photo", users=16, seconds=1,
                                timeout_s=30, backoff_base_s=0, openai=True, expect=True)

    async def main():
        async with await serving(app) as server:
            holder = await hold_the_slot(server, pool)
            try:
                refused = await asyncio.to_thread(phase, server.port)
            finally:
                holder.close()
            await until(lambda: app[front_keys.ADMISSION].now == 0, "the holder left: its slot is free")
            pool.stall = False
            return refused, await asyncio.to_thread(phase, server.port)

    refused, served = asyncio.run(main())
    assert refused["lost"] == 0 and refused["admitted"] == 0 and refused["rejected"] >= 1, refused["lost_by_reason"]
    assert served["lost"] == 0 and served["admitted"] >= 1, served["lost_by_reason"]


async def relay_counting(port):
    """A TCP relay to 127.0.0.1:`port` that counts what clients send through it:
    (server, [bytes sent, per connection])."""
    sent = []

    async def pipe(reader, writer, count=None):
        try:
            while chunk := await reader.read(65536):
                if count is not None:
                    sent[count] += len(chunk)
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def accept(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
        sent.append(0)
        await asyncio.gather(pipe(client_reader, server_writer, len(sent) - 1), pipe(server_reader, client_writer))

    return await asyncio.start_server(accept, "127.0.0.1", 0), sent


def test_the_openai_sdk_with_the_expect_header_is_refused_without_sending_its_body_then_served():
    """The openai SDK on DefaultAioHttpClient with default_headers={"Expect": "100-continue"}
    (README: it works, but under overload it answered less; docs/reliability.md#overload). Refused while the slot is held, the
    SDK sends its headers only (not the 150 KB body) and gets the 503 with Retry-After;
    the slot free, the same client sends its body after 100 Continue and is answered.
    Without the header the refused SDK sends the whole body (what the header saves)."""
    import openai

    pool = AnsweringPool()
    pool.stall = True
    app = front_with(pool, max_requests_in_flight=1)
    request = large_body()

    async def main():
        async with await serving(app) as server:
            relay, sent = await relay_counting(server.port)
            base_url = f"http://127.0.0.1:{relay.sockets[0].getsockname()[1]}/v1"

            def sdk(headers):
                return openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=SOCKET_TIMEOUT_S,
                                          http_client=openai.DefaultAioHttpClient(), default_headers=headers)

            async def refused(client):
                before = len(sent)
                with pytest.raises(openai.APIStatusError) as error:
                    await client.chat.completions.create(**request)
                await asyncio.sleep(0.2)  # what the client still sends after its answer reaches the relay
                return error.value.status_code, error.value.response.headers.get("Retry-After"), sum(sent[before:])

            expecting, plain = sdk({"Expect": "100-continue"}), sdk(None)
            holder = await hold_the_slot(server, pool)
            try:
                with_expect = await refused(expecting)
                without = await refused(plain)
            finally:
                holder.close()
            await until(lambda: app[front_keys.ADMISSION].now == 0, "the holder left: its slot is free")
            pool.stall = False
            answer = await expecting.chat.completions.create(**request)
            for client in (expecting, plain):
                await client.close()
            relay.close()
            return with_expect, without, answer

    (status, retry_after, sent_refused), (_, _, sent_plain), answer = asyncio.run(main())
    assert status == 503 and retry_after
    assert sent_refused < 4096, f"the refused SDK sent {sent_refused} bytes: its body went too"
    assert sent_plain > 150_000
    assert answer.choices[0].message.content


def test_a_client_that_waits_is_refused_a_body_slot_before_100_continue():
    """Every body slot taken (here the one, by a body that trickles): a client waiting for
    100 Continue is asked for its body only with a slot held, so the body-slot 503 comes to
    its headers alone and the photo is never sent."""
    pool = StalledPool()
    app = front_with(pool, max_bodies_in_flight=1, min_body_rate=0, body_timeout_s=5)

    def client(port):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head())
            answer_head, answer = first_answer(sock)
            return answer_head.split(b"\r\n", 1)[0], answer

    async def main():
        async with await serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(head(expect=None) + PAYLOAD[:10])  # holds the one body slot
            await writer.drain()
            await until(lambda: app[front_keys.BODIES].now == 1, "the trickle holds the body slot")
            try:
                return await in_thread(client, server.port)
            finally:
                writer.close()

    status_line, answer = asyncio.run(main())
    assert status_line == b"HTTP/1.1 503 Service Unavailable", "refused before any 100 Continue"
    assert b"OPENAI_FRONT_MAX_BODIES_IN_FLIGHT" in answer
