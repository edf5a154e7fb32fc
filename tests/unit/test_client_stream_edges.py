"""The clients' HTTP stream (generate_stream) and readiness against a stand-in
server on 127.0.0.1: what is sent, the events that come back, and how an
error event or status ends the stream (found by `make mutants`,
docs/mutation.md). Against a real server: tests/integration."""

import asyncio
import base64
import http.server
import json
import threading
import time

import pytest
import tritonclient.http as httpclient

from classify_describe import AsyncClient, Client, TritonRequestError
from classify_describe import client as client_module

EVENTS = [
    {"LABELS": ["tabby", "tiger cat"], "SCORES": [0.75, 0.25], "model_name": "x"},
    {"DESCRIPTION": ["A tabby "]},
    {"DESCRIPTION": ["cat."]},
    {"DESCRIPTION": [""], "DESCRIPTION_SOURCE": ["llm"], "USAGE": [json.dumps({"total_tokens": 9})]},
]


class StandIn(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, events=EVENTS, status=200, ready=True, hang=False, dribble=False):
        super().__init__(("127.0.0.1", 0), Handler)
        self.events, self.status, self.ready = events, status, ready
        self.hang = threading.Event() if hang else None  # GETs wait for it (set at teardown)
        # POSTs send a comment line every 50 ms for 8 s instead of the events: a stream that is
        # alive for every read and far longer than the clients' timeout_s
        self.dribble = threading.Event() if dribble else None
        self.requests = []  # (method, path, body)

    @property
    def url(self):
        return f"127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.requests.append(("GET", self.path, None))
        if self.server.hang is not None:
            self.server.hang.wait(30)
            self.close_connection = True
            return
        self.send_response(200 if self.server.ready else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(("POST", self.path, body))
        if self.server.dribble is not None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            ends = time.monotonic() + 8  # then closes, so that a client without the bound fails, not hangs
            try:
                while time.monotonic() < ends and not self.server.dribble.wait(0.05):
                    self.wfile.write(b": still here\n\n")
                    self.wfile.flush()
            except OSError:
                pass  # the client gave up, as it should
            self.close_connection = True
            return
        lines = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in self.server.events)
        self.send_response(self.server.status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(lines) + len(b": comment\n\n")))
        self.end_headers()
        self.wfile.write(b": comment\n\n" + lines)


@pytest.fixture
def serve():
    servers = []

    def start(**kwargs):
        server = StandIn(**kwargs)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        for event in (server.hang, server.dribble):
            if event is not None:
                event.set()
        server.shutdown()
        server.server_close()


def check_events(events):
    assert [e.kind for e in events] == ["labels", "text", "text", "done"]
    assert (events[0].labels, events[0].scores) == (["tabby", "tiger cat"], [0.75, 0.25])
    assert [e.text for e in events[1:3]] == ["A tabby ", "cat."]
    result = events[-1].result
    assert (result.description, result.description_source, result.usage) == ("A tabby cat.", "llm", {"total_tokens": 9})
    assert result.labels == ["tabby", "tiger cat"]


def check_request(server, model="classify_and_describe_stream"):
    [(method, path, body)] = server.requests
    assert (method, path) == ("POST", f"/v2/models/{model}/generate_stream")
    assert body == {"IMAGE": base64.b64encode(b"img").decode(), "PROMPT": "why?", "temperature": 0.5}


def test_the_http_stream_sends_the_photo_and_yields_labels_text_and_done(serve):
    server = serve()
    with Client(server.url, timeout_s=10) as client:
        check_events(list(client.stream(b"img", "why?", {"temperature": 0.5})))
    check_request(server)


def test_the_async_http_stream_does_the_same(serve):
    server = serve()

    async def main():
        async with AsyncClient(server.url, timeout_s=10) as client:
            return [event async for event in client.stream(b"img", "why?", {"temperature": 0.5})]

    check_events(asyncio.run(main()))
    check_request(server)


def test_a_stream_goes_to_the_model_named(serve):
    server = serve()
    with Client(server.url, timeout_s=10) as client:
        list(client.stream(b"img", "why?", {"temperature": 0.5}, model_name="describe_stream"))
    check_request(server, "describe_stream")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_error_event_or_status_ends_the_stream_with_a_request_error(serve, asynchronous):
    def events(server):
        if not asynchronous:
            with Client(server.url, timeout_s=10) as client:
                return list(client.stream(b"img"))

        async def main():
            async with AsyncClient(server.url, timeout_s=10) as client:
                return [event async for event in client.stream(b"img")]

        return asyncio.run(main())

    with pytest.raises(TritonRequestError) as info:
        events(serve(events=[EVENTS[0], {"error": "the LLM step failed"}]))
    assert str(info.value) == "the LLM step failed" and info.value.answered
    with pytest.raises(TritonRequestError) as info:
        events(serve(events=[], status=404))
    assert str(info.value) == "HTTP 404" and info.value.answered and not info.value.retryable


@pytest.mark.parametrize("status", [400, 404, 429, 500, 502, 503, 504])
def test_infer_and_stream_call_the_same_statuses_retryable(serve, status):
    """Only 503 (unavailable) is worth sending again; a 500 or 502 is the server's answer.
    The stream reads the HTTP status, infer tritonclient's error: one rule for both."""
    from tritonclient.http import InferenceServerException

    with Client(serve(events=[], status=status).url, timeout_s=10) as client, pytest.raises(TritonRequestError) as info:
        list(client.stream(b"img"))
    stream = info.value
    infer = client_module._request_error(InferenceServerException("x", status=str(status)), httpclient, 10)
    assert stream.answered and stream.retryable == infer.retryable == (status == 503), status


def test_ready_means_the_server_and_the_model(serve):
    server = serve()
    with Client(server.url, model_name="mine") as client:
        assert client.is_ready()
    assert [path for _, path, _ in server.requests] == ["/v2/health/ready", "/v2/models/mine/ready"]
    with Client(serve(ready=False).url) as client:
        assert not client.is_ready()


def test_a_server_that_does_not_answer_is_given_up_on_after_timeout_s(serve):
    server = serve(hang=True)
    with Client(server.url, timeout_s=0.3) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # the transport's deadline
            client.is_ready()
        # 0.3 s asked for, against tritonclient's own 60 s default: 20 s is room for a busy machine
        assert time.monotonic() - started < 20


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_timeout_s_bounds_a_whole_http_stream_not_each_read(serve, client_kind):
    # The stream sends a line every 50 ms and never ends: each read is well within 0.5 s,
    # the stream is not. (The sync client bounded each read until 2026-12-07.)
    server = serve(dribble=True)
    started = time.monotonic()
    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        if client_kind == "sync":
            with Client(server.url, timeout_s=0.5) as client:
                list(client.stream(b"img"))
        else:
            async def run():
                async with AsyncClient(server.url, timeout_s=0.5) as client:
                    return [event async for event in client.stream(b"img")]

            asyncio.run(run())
    assert time.monotonic() - started < 2.5
