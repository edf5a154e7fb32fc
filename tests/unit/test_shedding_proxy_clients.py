"""The shipped shedding proxy (deploy/nginx/triton-shed.conf.template, nginx
from tools/nginx.py) full, against well-behaved clients it refuses: one still
sending its body gets its 503 and keeps its connection, and thousands that
connect at once each get a refusal, none a reset. Its one slot is held by a
request whose body is still arriving; the upstream only answers the probes
(what it admits, Triton answers: tests/integration/test_shedding_proxy.py)."""

import contextlib
import http.server
import json
import pathlib
import selectors
import shutil
import socket
import threading
import time

import pytest
from raw_http import read_answer, somaxconn

from tools import nginx, overload

SOCKET_TIMEOUT_S = 15  # generous: only a hang reaches it on a loaded machine
pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")


class Probes(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def infer_head(length):
    return (b"POST /v2/models/classify_and_describe/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % length)


@contextlib.contextmanager
def held_proxy(workdir, **settings):
    """The proxy with TRITON_MAX_IN_FLIGHT 1, that one slot taken."""
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Probes)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with nginx.ShedProxy(workdir, f"127.0.0.1:{upstream.server_address[1]}", 1, **settings) as proxy:
            host, port = proxy.url.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as holder:
                holder.sendall(infer_head(1_000_000) + b"x" * 1024)  # its body still to come
                deadline = time.monotonic() + SOCKET_TIMEOUT_S
                while refused_probe(proxy) != 503:  # an event, not a sleep: the slot is counted
                    assert time.monotonic() < deadline, "the proxy never counted the held request"
                yield proxy
    finally:
        upstream.shutdown()
        upstream.server_close()


@pytest.fixture
def full_proxy(tmp_path):
    with held_proxy(tmp_path / "nginx") as proxy:
        yield proxy


def refused_probe(proxy):
    host, port = proxy.url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(infer_head(0))
        return read_answer(sock)[0]


def test_a_refused_client_sending_its_body_slowly_gets_its_503_and_keeps_its_connection(full_proxy):
    """150 KB in four pieces over 1.5 s, read only once all is sent: nginx
    answers from the headers and discards the body as it comes."""
    host, port = full_proxy.url.rsplit(":", 1)
    body = b"x" * 150_000
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(infer_head(len(body)))
        for start in range(0, len(body), len(body) // 4):
            if start:
                time.sleep(0.5)
            sock.sendall(body[start:start + len(body) // 4])
        status, headers, answer = read_answer(sock)
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        again, _, _ = read_answer(sock)
    assert status == 503 and b"Retry-After: 1" in headers and "in-flight limit" in json.loads(answer)["error"]
    assert again == 200, "the refused client's connection served its next request"


@pytest.mark.skipif(somaxconn() < 2560, reason="net.core.somaxconn caps the listen backlog below 2,560 here")
def test_thousands_connecting_at_once_are_each_refused_none_reset(full_proxy, tmp_path):
    """2,560 C users connect at once and resend a 456 KB photo at once: every
    attempt is a refusal. With nginx's default listen backlog (511) the kernel
    reset hundreds of them (its SYN cookies failed: lost:recv:ECONNRESET)."""
    import skimage.data

    photo = pathlib.Path(skimage.data.__file__).parent / "coffee.png"
    figures = overload.c_phase(overload.compile_c_client(tmp_path), full_proxy.url, photo, users=2560,
                               seconds=2, timeout_s=30, backoff_base_s=0)
    # Every user's attempts are seen to their end, so none lost is the whole check; how many
    # refusals end within the 2 s depends on the machine's load (only the window's are counted).
    assert figures["lost"] == 0, figures["lost_by_reason"]
    assert figures["rejected"] >= 1 and figures["admitted"] == 0


def test_a_flood_of_refusals_is_answered_at_the_pace_each_waiting_its_turn(tmp_path):
    """Past NGINX_REFUSALS_PER_S a refused request waits in nginx, its body
    unread, for its turn: 12 refused at once at 6 a second are answered over
    about 2 s (unpaced, or all held alike, within milliseconds of each other),
    each a whole 503 with Retry-After; the last one's body, sent after its
    503, is dropped and its connection serves the next request."""
    pace, count = 6, 12
    body = b"x" * 150_000
    with held_proxy(tmp_path / "nginx", refusals_per_s=pace) as proxy:
        host, port = proxy.url.rsplit(":", 1)
        socks = [socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) for _ in range(count)]
        try:
            for sock in socks:
                sock.sendall(infer_head(len(body)))  # the headers: the body follows the 503
            arrived = first_bytes_at(socks)
            answers = [read_answer(sock) for sock in socks]
            socks[-1].sendall(body)
            socks[-1].sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            again, _, _ = read_answer(socks[-1])
        finally:
            for sock in socks:
                sock.close()
    for status, headers, answer in answers:
        assert status == 503 and b"Retry-After: 1" in headers and "in-flight limit" in json.loads(answer)["error"]
    spread = max(arrived) - min(arrived)
    assert spread >= 0.7 * (count - 1) / pace, f"{count} refusals answered within {spread:.2f} s at {pace} a second"
    assert again == 200, "a paced refusal's connection served its next request"


def first_bytes_at(socks):
    """When each socket's answer began to arrive (monotonic seconds), read from none of them."""
    arrived = {}
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + SOCKET_TIMEOUT_S
        while len(arrived) < len(socks):
            assert time.monotonic() < deadline, f"{len(socks) - len(arrived)} refusals never answered"
            for key, _ in selector.select(timeout=1):
                arrived[key.fileobj] = time.monotonic()
                selector.unregister(key.fileobj)
    return [arrived[sock] for sock in socks]
