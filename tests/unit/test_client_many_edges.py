"""AsyncClient.infer_many and the clients' arguments at their edges: the
prompt reaches every request, the window slides (a new image is sent as soon
as any one finishes), an unreadable file is that image's error, and the
arguments' checks and defaults (found by `make mutants`, docs/mutation.md)."""

import asyncio
import http.server
import inspect
import json
import threading

import pytest
from test_client import answer

from classify_describe import AsyncClient, TritonRequestError


class StandIn(http.server.ThreadingHTTPServer):
    """Answers every infer; an image holding b"slow" waits until an image holding
    b"last" has arrived (or 20 s, so a client that never sends it still ends)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies, self.events = [], []
        self.last_arrived = threading.Event()
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.bodies.append(body)
        if b"last" in body:
            self.server.events.append("last arrived")
            self.server.last_arrived.set()
        if b"slow" in body:
            self.server.last_arrived.wait(20)
            self.server.events.append("slow answered")
        data = json.dumps(answer("x")).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    server = StandIn()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server
    server.last_arrived.set()
    server.shutdown()
    server.server_close()


def many(server, images, prompt=None, concurrency=2):
    async def main():
        async with AsyncClient(server.url, concurrency=concurrency, timeout_s=30) as client:
            return [item async for item in client.infer_many(images, prompt)]

    return asyncio.run(main())


def test_the_prompt_reaches_every_request(server):
    results = many(server, [b"img-a", b"img-b"], prompt="PROMPT-MARK")
    assert sorted(index for index, _ in results) == [0, 1]
    assert len(server.bodies) == 2 and all(b"PROMPT-MARK" in body for body in server.bodies)


def test_the_window_slides_a_new_image_goes_out_when_any_one_finishes(server):
    results = many(server, [b"slow", b"quick", b"last"], concurrency=2)
    assert sorted(index for index, _ in results) == [0, 1, 2]
    # "last" was sent while "slow" was still waiting: the window did not wait for its slowest member
    assert server.events == ["last arrived", "slow answered"]


def test_an_unreadable_file_is_that_images_error_and_the_others_go_on(server, tmp_path):
    results = dict(many(server, [tmp_path / "missing.jpg", b"img"]))
    failure = results[0]
    assert isinstance(failure, TritonRequestError) and not failure.retryable
    assert str(failure) == "cannot read the file: No such file or directory"
    assert isinstance(failure.__cause__, FileNotFoundError)
    assert results[1].description == "described x"


def test_concurrency_must_be_at_least_one():
    with pytest.raises(ValueError) as info:
        AsyncClient(concurrency=0)
    assert str(info.value) == "concurrency must be at least 1"

    async def one():
        async with AsyncClient(concurrency=1):
            pass

    asyncio.run(one())


def test_the_async_clients_documented_defaults_and_a_bare_request_error():
    assert inspect.signature(AsyncClient).parameters["concurrency"].default == 8
    error = TritonRequestError("x")
    assert (error.retryable, error.answered) == (False, False)
