"""classify_describe (client and command line) against a stand-in server on 127.0.0.1.

The stand-in speaks just enough of KServe v2 (POST /v2/models/<m>/infer) for
tritonclient: each image's bytes say how the stand-in treats it, "ok:cat" is
answered, "drop:x" gets the connection closed without an answer, "timeout:x" no
answer until the test ends, "unavailable:x" a 503, "invalid:x" a 400, "hangup:x"
is answered and then its connection closed without a word (as a server's idle
timeout closes a kept-alive connection), and a "-once" suffix on the kind
("drop-once:x") fails only the first attempt.
"""

import asyncio
import collections
import concurrent.futures
import http.client
import http.server
import itertools
import json
import pathlib
import re
import socket
import threading
import time
import types

import pytest

from classify_describe import AsyncClient, Client, Result, TritonRequestError
from classify_describe import __main__ as cli
from classify_describe import client as client_module

IMAGE_PATTERN = re.compile(rb"(ok|drop|timeout|unavailable|invalid|hangup)(-once)?:(\w+)")


class StandIn(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.attempts = collections.Counter()  # image bytes -> requests seen
        self.connections = 0  # accepted so far
        self.closed = threading.Event()  # set each time the server closes a connection
        self.arrivals = []  # what on_arrival() returned, per request in arrival order
        self.on_arrival = lambda: None
        self.release = threading.Event()  # ends the "timeout" waits
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address):
        pass  # a client that gave up on a "timeout" answer is expected

    def shutdown_request(self, request):
        super().shutdown_request(request)
        self.closed.set()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as tritonclient expects

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        found = IMAGE_PATTERN.search(body)
        with self.server.lock:
            self.server.arrivals.append(self.server.on_arrival())
            self.server.attempts[found.group(0)] += 1
            attempt = self.server.attempts[found.group(0)]
        kind, once, name = found.group(1).decode(), found.group(2), found.group(3).decode()
        if once and attempt > 1:
            kind = "ok"
        if kind == "drop":
            self.close_connection = True  # closed with no answer at all
        elif kind == "timeout":
            self.server.release.wait(10)
            self.close_connection = True
        elif kind == "unavailable":
            self.reply(503, {"error": "Request for unknown model: 'classify_and_describe' is not ready"})
        elif kind == "invalid":
            self.reply(400, {"error": "IMAGE is not a recognised image file"})
        elif kind == "hangup":
            self.reply(200, answer(name))
            self.close_connection = True  # no "Connection: close": the client learns it from the FIN
        else:
            self.reply(200, answer(name))

    def reply(self, status, document):
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def answer(name):
    def output(output_name, datatype, data):
        return {"name": output_name, "datatype": datatype, "shape": [1, len(data)], "data": data}

    return {"model_name": "classify_and_describe", "model_version": "1", "outputs": [
        output("LABELS", "BYTES", ["tabby", "tiger cat"]),
        output("SCORES", "FP32", [0.6, 0.3]),
        output("DESCRIPTION", "BYTES", [f"described {name}"]),
        output("DESCRIPTION_SOURCE", "BYTES", ["llm"]),
        output("USAGE", "BYTES", [json.dumps({"total_tokens": 12, "cost_usd": 0.0})]),
    ]}


@pytest.fixture
def stand_in():
    server = StandIn()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def no_backoff(monkeypatch):
    """Retries resend at once: the tests count resends, they do not wait for them."""
    monkeypatch.setattr(client_module, "backoff_s", lambda base_s, attempt, retry_after_s=None: 0.0)


@pytest.fixture
def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def write_images(directory, contents):
    paths = []
    for number, content in enumerate(contents):
        path = directory / f"{number:02d}.jpg"
        path.write_bytes(content)
        paths.append(path)
    return paths


def json_lines(text):
    return {pathlib.Path(line["image"]).name: line for line in map(json.loads, text.splitlines())}


# ---------------------------------------------------------------- AsyncClient.infer_many
# (a 1 s timeout: "timeout" images wait it out, the others must be answered within it)

def test_infer_many_reports_each_failure_with_its_image_and_goes_on(stand_in, no_backoff):
    images = [b"ok:first", b"drop:gone", b"timeout:slow", b"invalid:bad", b"unavailable:down",
              b"drop-once:blip", b"unavailable-once:restart", b"ok:last"]

    async def run():
        async with AsyncClient(stand_in.url, concurrency=3, timeout_s=1.0, retries=1) as client:
            outcomes = {index: outcome async for index, outcome in client.infer_many(images)}
            return outcomes, client.retried

    outcomes, retried = asyncio.run(run())
    assert sorted(outcomes) == list(range(len(images)))
    by_image = dict(zip(images, (outcomes[i] for i in range(len(images)))))
    for image in (b"ok:first", b"ok:last", b"drop-once:blip", b"unavailable-once:restart"):
        assert isinstance(by_image[image], Result), (image, by_image[image])
    assert by_image[b"ok:last"].description == "described last"

    gone, slow, bad, down = (by_image[i] for i in (b"drop:gone", b"timeout:slow", b"invalid:bad",
                                                   b"unavailable:down"))
    assert isinstance(gone, TritonRequestError) and gone.retryable and "no answer" in str(gone)
    assert gone.__cause__ is not None  # the transport's own error, for whoever debugs it
    assert isinstance(slow, TritonRequestError) and slow.retryable and "within 1 s" in str(slow)
    assert isinstance(bad, TritonRequestError) and not bad.retryable
    assert "not a recognised image" in str(bad)
    assert isinstance(down, TritonRequestError) and down.retryable and "not ready" in str(down)

    # retries=1 resent what got no answer and the 503s, but never a timeout or a 400
    assert stand_in.attempts[b"drop:gone"] == 2 and stand_in.attempts[b"unavailable:down"] == 2
    assert stand_in.attempts[b"drop-once:blip"] == 2
    assert stand_in.attempts[b"timeout:slow"] == 1 and stand_in.attempts[b"invalid:bad"] == 1
    assert retried == 4


def test_infer_many_takes_images_only_as_the_window_frees(stand_in):
    taken = []

    def images():
        for number in range(10):
            taken.append(number)
            yield f"ok:n{number}".encode()

    async def run():
        seen_when_answered = []
        async with AsyncClient(stand_in.url, concurrency=2, timeout_s=5) as client:
            async for _index, outcome in client.infer_many(images()):
                assert isinstance(outcome, Result)
                seen_when_answered.append(len(taken))
        return seen_when_answered

    seen = asyncio.run(run())
    assert len(seen) == 10 and taken == list(range(10))
    # the k-th answer (from 1) came with at most k - 1 + 2 images taken: 2 in flight
    assert all(count <= k + 2 for k, count in enumerate(seen)), seen


def test_infer_many_reads_paths_and_reports_an_unreadable_one(stand_in, tmp_path):
    good = write_images(tmp_path, [b"ok:cat"])[0]
    missing = tmp_path / "missing.jpg"

    async def run():
        async with AsyncClient(stand_in.url, timeout_s=5) as client:
            return dict([item async for item in client.infer_many([missing, str(good)])])

    outcomes = asyncio.run(run())
    assert isinstance(outcomes[1], Result) and outcomes[1].description == "described cat"
    assert isinstance(outcomes[0], TritonRequestError) and not outcomes[0].retryable
    assert "cannot read" in str(outcomes[0]) and "No such file" in str(outcomes[0])


# ---------------------------------------------------------------- sync Client

def test_sync_client_retries_unavailable_and_a_closed_connection(stand_in, no_backoff):
    with Client(stand_in.url, timeout_s=5, retries=1) as client:
        assert client.infer(b"unavailable-once:restart").description == "described restart"
        assert client.retried == 1
        # a connection closed with no answer: http.client's RemoteDisconnected, resent once
        with pytest.raises(http.client.HTTPException):
            client.infer(b"drop:gone")
        assert client.retried == 2 and stand_in.attempts[b"drop:gone"] == 2
        with pytest.raises(TritonRequestError) as down:
            client.infer(b"unavailable:down")
        assert down.value.retryable and client.retried == 3
        with pytest.raises(TritonRequestError) as bad:
            client.infer(b"invalid:bad")
        assert not bad.value.retryable and client.retried == 3


def test_sync_http_sends_each_attempt_once(stand_in):
    # retries=0 is one send. (tritonclient's own HTTP transport, geventhttpclient, sent a
    # request closed without an answer up to three times by itself.)
    with Client(stand_in.url, timeout_s=5, retries=0) as client:
        with pytest.raises(http.client.HTTPException):
            client.infer(b"drop:gone")
        assert stand_in.attempts[b"drop:gone"] == 1 and client.retried == 0
        assert client.infer(b"ok:after").description == "described after"  # a new connection


def test_sync_http_keeps_one_connection_and_notices_when_the_server_closed_it(stand_in):
    with Client(stand_in.url, timeout_s=5, retries=0) as client:
        for number in range(3):
            assert client.infer(f"ok:n{number}".encode()).description == f"described n{number}"
        assert stand_in.connections == 1  # kept alive
        stand_in.closed.clear()
        client.infer(b"hangup:idle")  # answered, then the server closes the connection silently
        assert stand_in.closed.wait(5)
        time.sleep(0.05)  # the FIN crosses loopback while the connection is idle
        # seen closed before sending: a new connection, no error, and still one send
        assert client.infer(b"ok:later").description == "described later"
        assert stand_in.connections == 2 and stand_in.attempts[b"ok:later"] == 1


class TricklingServer:
    """Accepts one connection, reads a request and answers it a byte at a time: `headers_gap_s`
    between the header's bytes, `body_gap_s` between the body's."""

    def __init__(self, headers_gap_s, body_gap_s):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.gaps = headers_gap_s, body_gap_s
        self.stop = threading.Event()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        connection, _ = self.listener.accept()
        with connection:
            connection.recv(1 << 20)
            body = json.dumps(answer("slow")).encode()
            headers = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            try:
                for part, gap_s in zip((headers, body), self.gaps):
                    for byte in part:
                        if self.stop.wait(gap_s):
                            return
                        connection.sendall(bytes([byte]))
            except OSError:
                pass  # the client gave up, as it should

    def close(self):
        self.stop.set()
        self.listener.close()


@pytest.mark.parametrize("gaps", [(0.05, 0.0), (0.0, 0.05)], ids=["headers", "body"])
def test_sync_http_timeout_bounds_the_whole_answer_not_each_read(gaps):
    # The answer trickles a byte every 50 ms, well within the timeout for each read: 4 s or
    # more in all. timeout_s=0.5 is for the whole exchange, the headers or the body.
    server = TricklingServer(*gaps)
    try:
        with Client(server.url, timeout_s=0.5) as client:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                client.infer(b"ok:slow")
            assert time.monotonic() - started < 3.5  # the headers alone trickle for 4 s
    finally:
        server.close()


def test_sync_http_timeout_bounds_the_name_lookup_too(stand_in, monkeypatch):
    # A resolver that hangs (an unreachable name server: 5 s per try by default) must not hold the
    # caller past timeout_s; a name that resolves is still used.
    resolve = socket.getaddrinfo

    def hanging(host, *args, **kwargs):
        if host == "hangs.invalid":
            time.sleep(3)
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    with Client("hangs.invalid:8000", timeout_s=0.3) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            client.infer(b"ok:lookup")
        assert time.monotonic() - started < 1.5
    port = stand_in.url.rsplit(":", 1)[1]
    with Client(f"localhost:{port}", timeout_s=5) as client:
        assert client.infer(b"ok:named").description == "described named"


def test_sync_http_takes_tritonclients_url_forms(stand_in):
    # host:port/ as host:port; a scheme or a port that is no number refused when made
    with Client(stand_in.url + "/", timeout_s=5) as client:
        assert client.infer(b"ok:slash").description == "described slash"
    for client_class in (Client, AsyncClient):
        with pytest.raises(ValueError, match="without the scheme"):
            client_class("http://" + stand_in.url)
    with pytest.raises(ValueError, match="not a number"):
        Client("127.0.0.1:http")


def test_sync_http_paths_carry_the_base_path():
    seen = []

    class Recording(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        with Client(f"127.0.0.1:{server.server_address[1]}/triton/", model_name="mine", timeout_s=None) as client:
            assert client.is_ready()
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["/triton/v2/health/ready", "/triton/v2/models/mine/ready"]


def test_sync_http_client_shared_by_threads(stand_in):
    # Their requests take turns on the one connection: every one answered, none mixed up.
    with Client(stand_in.url, timeout_s=10) as client:
        def ask(thread):
            return [client.infer(f"ok:t{thread}n{number}".encode()).description for number in range(10)]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(4)))
    assert answers == [[f"described t{thread}n{number}" for number in range(10)] for thread in range(4)]


# ---------------------------------------------------------------- the back-off itself
# (the tests above replace it with 0; these hold it to its policy)

def test_backoff_grows_exponentially_with_full_jitter_up_to_the_cap(monkeypatch):
    ceilings = []
    monkeypatch.setattr(client_module.random, "uniform", lambda low, high: ceilings.append((low, high)) or high)
    waits = [client_module.backoff_s(0.5, attempt) for attempt in range(6)]
    assert ceilings == [(0, 0.5), (0, 1.0), (0, 2.0), (0, 4.0), (0, 5.0), (0, 5.0)]  # from 0: full jitter
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert client_module.backoff_s(0.5, 10_000) == client_module.BACKOFF_CAP_S  # no overflow far out


def test_backoff_is_spread_over_the_whole_interval():
    # 2,000 draws in [0, 2): the chance that none falls below 0.2 (or above
    # 1.8) is 0.9**2000; spread, not a constant.
    waits = [client_module.backoff_s(0.5, 2) for _ in range(2000)]
    assert all(0 <= w <= 2.0 for w in waits)
    assert min(waits) < 0.2 and max(waits) > 1.8


def test_backoff_honours_retry_after_and_caps_it(monkeypatch):
    monkeypatch.setattr(client_module.random, "uniform", lambda low, high: low)  # the jitter's least
    assert client_module.backoff_s(0.5, 0, retry_after_s=3) == 3.0  # never sooner than asked
    assert client_module.backoff_s(0.5, 0, retry_after_s=3600) == client_module.RETRY_AFTER_CAP_S
    monkeypatch.setattr(client_module.random, "uniform", lambda low, high: high)
    assert client_module.backoff_s(0.5, 4, retry_after_s=1) == 5.0  # the jitter's longer wait wins


def test_every_retry_after_the_front_sends_is_honoured_whole():
    """A cap under the front's longest cuts its spread waits to one value: clients refused
    in one burst came back in one burst (docs/reliability.md#overload). The C load
    generator caps the same (tests/unit/test_overload_client.py)."""
    from openai_front.shedding import LONGEST_RETRY_AFTER_S
    assert client_module.RETRY_AFTER_CAP_S >= LONGEST_RETRY_AFTER_S


def test_the_clients_back_off_between_resends_with_growing_attempts(stand_in, monkeypatch):
    asked = []
    monkeypatch.setattr(client_module, "backoff_s", lambda base_s, attempt, retry_after_s=None:
                        asked.append((base_s, attempt)) or 0.0)
    with Client(stand_in.url, timeout_s=5, retries=3, retry_backoff_s=0.25) as client:
        with pytest.raises(TritonRequestError):
            client.infer(b"unavailable:down")
    assert asked == [(0.25, 0), (0.25, 1), (0.25, 2)]

    async def many():
        async with AsyncClient(stand_in.url, timeout_s=5, retries=2, retry_backoff_s=0.1) as client:
            return [outcome async for outcome in client.infer_many([b"unavailable:down"])]

    asked.clear()
    asyncio.run(many())
    assert asked == [(0.1, 0), (0.1, 1)]


# ---------------------------------------------------------------- command line

def test_cli_reports_each_failed_image_and_the_others_go_on(stand_in, no_backoff, tmp_path, capsys):
    paths = write_images(tmp_path, [b"ok:a", b"timeout:t", b"drop:d", b"invalid:i", b"ok:b",
                                    b"drop-once:blip"])
    missing = tmp_path / "missing.jpg"
    argv = ["--url", stand_in.url, "--json", "--timeout", "1", "--concurrency", "2"]
    code = cli.main(argv + [str(p) for p in paths[:3]] + [str(missing)] + [str(p) for p in paths[3:]])

    out = capsys.readouterr().out
    lines = json_lines(out)
    assert code == 1, out
    assert sorted(lines) == sorted([p.name for p in paths] + ["missing.jpg"])
    for name in ("00.jpg", "04.jpg", "05.jpg"):
        assert lines[name]["labels"] == ["tabby", "tiger cat"], lines[name]
    assert lines["01.jpg"]["retryable"] is True and "timed out" in lines["01.jpg"]["error"]
    assert lines["02.jpg"]["retryable"] is True and "no answer" in lines["02.jpg"]["error"]
    assert lines["03.jpg"]["retryable"] is False and "not a recognised" in lines["03.jpg"]["error"]
    assert lines["missing.jpg"]["retryable"] is False and "cannot read" in lines["missing.jpg"]["error"]
    # the default --retries 2 resent the dropped image, never the timed-out one
    assert stand_in.attempts[b"drop:d"] == 3 and stand_in.attempts[b"timeout:t"] == 1
    assert cli.EXIT_SOME_FAILED == 1


def test_cli_retries_option(stand_in, no_backoff, tmp_path, capsys):
    paths = write_images(tmp_path, [b"drop-once:blip", b"ok:a"])
    assert cli.main(["--url", stand_in.url, "--json", "--retries", "0"] + [str(p) for p in paths]) == 1
    assert json_lines(capsys.readouterr().out)["00.jpg"]["retryable"] is True
    assert stand_in.attempts[b"drop-once:blip"] == 1


def test_cli_reads_each_image_only_when_it_is_sent(stand_in, tmp_path, monkeypatch, capsys):
    paths = write_images(tmp_path, [f"ok:n{number}".encode() for number in range(12)])
    reads = []
    read_bytes = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: reads.append(self) or read_bytes(self))
    stand_in.on_arrival = lambda: len(reads)

    code = cli.main(["--url", stand_in.url, "--json", "--concurrency", "2"] + [str(p) for p in paths])
    assert code == 0
    assert len(json_lines(capsys.readouterr().out)) == 12 and len(reads) == 12
    # request k (from 0) arrived with at most k + 2 files read: 2 in flight, none read ahead
    assert all(count <= k + 2 for k, count in enumerate(stand_in.arrivals)), stand_in.arrivals
    assert cli.EXIT_OK == 0


def test_cli_exit_code_when_no_image_gets_an_answer(closed_port, no_backoff, tmp_path, capsys):
    paths = write_images(tmp_path, [b"ok:a", b"ok:b"])
    code = cli.main(["--url", f"127.0.0.1:{closed_port}"] + [str(p) for p in paths])
    err = capsys.readouterr().err
    assert code == 3, err
    for path in paths:
        assert f"{path}: error (retryable): no answer" in err
    assert "Is the server running" in err
    assert cli.EXIT_NO_ANSWER == 3


def test_cli_exit_code_when_the_server_refuses_every_image(stand_in, no_backoff, tmp_path, capsys):
    """A server that answers 503 to everything (overload, a model not ready) is up:
    exit 1 with each refusal reported, not 3 ("is the server running?")."""
    paths = write_images(tmp_path, [b"unavailable:a", b"unavailable:b"])
    code = cli.main(["--url", stand_in.url, "--retries", "0"] + [str(p) for p in paths])
    err = capsys.readouterr().err
    assert code == cli.EXIT_SOME_FAILED, err
    assert "Is the server running" not in err


def test_cli_exit_code_when_no_file_can_be_read(no_backoff, tmp_path, capsys):
    """Wrong paths are the caller's mistake, not a server that is down: exit 1."""
    code = cli.main(["--url", "127.0.0.1:9"] + [str(tmp_path / "missing.jpg"), str(tmp_path / "gone.png")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_SOME_FAILED, err
    assert "Is the server running" not in err


# ---------------------------------------------------------------- the adaptive throttle
# (classify_describe/throttle.py; its rule is tested in test_client_throttle.py)

def eager_throttle(min_requests=4):
    """Refuses whenever the rule gives a probability above 0 (rand() is 0); a
    stopped clock, so the counts do not fade during the test."""
    return client_module.AdaptiveThrottle(min_requests=min_requests, rand=lambda: 0.0, clock=lambda: 0.0)


def test_an_overloaded_server_gets_only_what_the_throttle_lets_through(stand_in):
    async def run():
        async with AsyncClient(stand_in.url, throttle=eager_throttle(), timeout_s=5) as client:
            errors = []
            for number in range(10):
                with pytest.raises(TritonRequestError) as caught:
                    await client.infer(f"unavailable:x{number}".encode())
                errors.append(caught.value)
            return errors, client.throttled

    errors, throttled = asyncio.run(run())
    assert sum(stand_in.attempts.values()) == 4  # min_requests reached the server, then none
    assert throttled == 6
    assert all(isinstance(e, client_module.Throttled) and e.retryable and not e.answered for e in errors[4:])
    assert not any(isinstance(e, client_module.Throttled) for e in errors[:4])


@pytest.mark.parametrize("kind", ["ok", "invalid"])
def test_answers_and_bad_requests_count_as_accepted(stand_in, kind):
    # 30 accepted (an answer, or a 400: the server took the request) let 2 x 30 through
    with Client(stand_in.url, throttle=eager_throttle(), timeout_s=5) as client:
        for number in range(30):
            try:
                client.infer(f"{kind}:a{number}".encode())
            except TritonRequestError:
                pass
        for number in range(25):
            with pytest.raises(TritonRequestError) as caught:
                client.infer(f"unavailable:b{number}".encode())
            assert not isinstance(caught.value, client_module.Throttled)
        assert client.throttled == 0
    assert sum(n for image, n in stand_in.attempts.items() if image.startswith(b"unavailable")) == 25


def test_a_throttled_attempt_is_resent_after_back_off(stand_in, no_backoff):
    gate = eager_throttle()
    with Client(stand_in.url, throttle=gate, timeout_s=5, retries=3) as client:
        with pytest.raises(TritonRequestError):
            client.infer(b"unavailable:first")  # 4 attempts sent, none accepted
        assert sum(stand_in.attempts.values()) == 4
        with pytest.raises(client_module.Throttled):
            client.infer(b"ok:later")  # held back here every time, never sent
        # the first attempt, then HELD_BACK_PER_RESEND per resend: held-back attempts use none
        assert client.throttled == 1 + 3 * client_module.HELD_BACK_PER_RESEND
        assert client.retried == 3  # resends of sent attempts only
    assert stand_in.attempts[b"ok:later"] == 0


class ScriptedThrottle:
    """Holds back the attempts whose turn is in `held_back` (0 for the first)."""

    def __init__(self, held_back):
        self.held_back, self.turn, self.accepts = set(held_back), 0, 0

    def allow(self):
        self.turn += 1
        return self.turn - 1 not in self.held_back

    def accepted(self):
        self.accepts += 1


def test_held_back_attempts_do_not_use_the_resends(stand_in, monkeypatch):
    # retries=1: one resend of what the server refused, however many attempts the throttle
    # held back around it; the back-off grows with every attempt, sent or not
    asked = []
    monkeypatch.setattr(client_module, "backoff_s", lambda base_s, attempt, retry_after_s=None:
                        asked.append(attempt) or 0.0)
    gate = ScriptedThrottle(held_back=range(1, 8))
    with Client(stand_in.url, throttle=gate, timeout_s=5, retries=1) as client:
        result = client.infer(b"unavailable-once:sync")
        assert result.labels and client.retried == 1 and client.throttled == 7
    assert stand_in.attempts[b"unavailable-once:sync"] == 2 and gate.accepts == 1
    assert asked == list(range(8))

    async def run():
        async with AsyncClient(stand_in.url, throttle=ScriptedThrottle(held_back=range(1, 8)), timeout_s=5,
                               retries=1) as client:
            result = await client.infer(b"unavailable-once:async")
            return result, client.retried, client.throttled

    asked.clear()
    result, retried, throttled = asyncio.run(run())
    assert result.labels and retried == 1 and throttled == 7
    assert stand_in.attempts[b"unavailable-once:async"] == 2 and asked == list(range(8))


def test_held_back_attempts_are_bounded_by_the_resends(stand_in, no_backoff):
    # retries=0: a held-back attempt is raised at once, as a refusal would be
    with Client(stand_in.url, throttle=ScriptedThrottle(held_back=[0]), timeout_s=5, retries=0) as client:
        with pytest.raises(client_module.Throttled):
            client.infer(b"ok:once")
        assert client.throttled == 1
    assert stand_in.attempts[b"ok:once"] == 0


def test_the_async_clients_held_back_attempts_are_bounded_by_the_resends(stand_in, no_backoff):
    # every attempt held back: the first, then HELD_BACK_PER_RESEND per resend, then Throttled
    async def run():
        async with AsyncClient(stand_in.url, throttle=ScriptedThrottle(held_back=range(1000)), timeout_s=5,
                               retries=2) as client:
            with pytest.raises(client_module.Throttled):
                await client.infer(b"ok:held")
            return client.throttled, client.retried

    throttled, retried = asyncio.run(run())
    assert throttled == 1 + 2 * client_module.HELD_BACK_PER_RESEND and retried == 0
    assert stand_in.attempts[b"ok:held"] == 0


def test_a_refusal_after_the_resends_and_a_held_back_attempt_is_raised(stand_in, no_backoff):
    # retries=1: refused (the resend used), held back (no resend needed), refused again: the
    # server's refusal is what the caller gets, not a third attempt nor Throttled
    def check(error, throttled, retried):
        assert type(error) is TritonRequestError and error.answered and error.retryable
        assert throttled == 1 and retried == 1

    with Client(stand_in.url, throttle=ScriptedThrottle(held_back=[1]), timeout_s=5, retries=1) as client:
        with pytest.raises(TritonRequestError) as caught:
            client.infer(b"unavailable:sync")
        check(caught.value, client.throttled, client.retried)
    assert stand_in.attempts[b"unavailable:sync"] == 2

    async def run():
        async with AsyncClient(stand_in.url, throttle=ScriptedThrottle(held_back=[1]), timeout_s=5,
                               retries=1) as client:
            with pytest.raises(TritonRequestError) as caught:
                await client.infer(b"unavailable:async")
            return caught.value, client.throttled, client.retried

    check(*asyncio.run(run()))
    assert stand_in.attempts[b"unavailable:async"] == 2


def test_the_async_clients_answers_count_as_accepted(stand_in):
    async def run():
        async with AsyncClient(stand_in.url, throttle=eager_throttle(), timeout_s=5) as client:
            for number in range(30):
                await client.infer(f"ok:a{number}".encode())
            for number in range(25):
                with pytest.raises(TritonRequestError) as caught:
                    await client.infer(f"unavailable:b{number}".encode())
                assert not isinstance(caught.value, client_module.Throttled)
            return client.throttled

    assert asyncio.run(run()) == 0


def test_the_throttle_is_on_by_default(stand_in):
    # the default rule (min_requests 20, k 2): past 20 refusals each attempt is refused here
    # with probability about 20/21 or more, so of 40 at most a few more than 20 reach the server
    with Client(stand_in.url, timeout_s=5) as client:
        for number in range(40):
            with pytest.raises(TritonRequestError):
                client.infer(f"unavailable:x{number}".encode())
        assert client.throttled >= 10
    assert sum(stand_in.attempts.values()) <= 30


def test_throttle_false_sends_every_attempt(stand_in):
    with Client(stand_in.url, throttle=False, timeout_s=5) as client:
        for number in range(30):
            with pytest.raises(TritonRequestError):
                client.infer(f"unavailable:x{number}".encode())
        assert client.throttled == 0
    assert sum(stand_in.attempts.values()) == 30


def test_the_readmes_tritonclient_recipe_retries_and_throttles(stand_in):
    """README "Under overload": the snippet for tritonclient users, run as written
    (but for its last lines, which need a real server on 8000)."""
    import numpy as np
    import tritonclient.http as httpclient

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                   if "def infer_with_retries" in block)
    namespace = {}
    exec(snippet.split("\nclient = httpclient")[0], namespace)  # noqa: S102 - our own README
    namespace["throttle"] = eager_throttle()
    client = httpclient.InferenceServerClient(stand_in.url)

    def inputs(image):
        tensor = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image]], dtype=object))
        return [tensor]

    answer = namespace["infer_with_retries"](client, inputs(b"unavailable-once:x"), retries=2, retry_after_s=0)
    assert answer.as_numpy("LABELS")[0][0] in (b"tabby", "tabby")  # the stand-in answers JSON
    assert stand_in.attempts[b"unavailable-once:x"] == 2  # refused once, resent, answered
    for number in range(3):
        namespace["infer_with_retries"](client, inputs(f"ok:{number}".encode()), retries=0)
    for number in range(2):  # a 400 is raised at once and counts as accepted: the server took it
        with pytest.raises(httpclient.InferenceServerException):
            namespace["infer_with_retries"](client, inputs(f"invalid:{number}".encode()), retries=3)
    for number in range(10):
        with pytest.raises(RuntimeError, match="overloaded"):
            namespace["infer_with_retries"](client, inputs(f"unavailable:y{number}".encode()), retries=0,
                                            retry_after_s=0)
    # 6 accepted of 7 sent: the 8th to 13th requests pass too (until 2 x 6 were counted), then
    # (requests - 2 x 6) / (requests + 1) > 0 refuses every further attempt (this throttle
    # refuses whenever the probability is above 0)
    assert sum(stand_in.attempts.values()) == 2 + 3 + 2 + 6
    # held back unsent: no retry used, up to 30 per retry, then given up; no Retry-After floor
    # for what was never sent
    gate, asked, slept = namespace["throttle"], [], []
    allow = gate.allow
    gate.allow = lambda: asked.append(1) or allow()
    namespace["time"] = types.SimpleNamespace(sleep=slept.append)
    namespace["random"] = types.SimpleNamespace(uniform=lambda low, high: low)
    with pytest.raises(RuntimeError, match="held back"):
        namespace["infer_with_retries"](client, inputs(b"ok:held"), retries=2, retry_after_s=1.0)
    assert len(asked) == 1 + 30 * 2 and stand_in.attempts[b"ok:held"] == 0
    assert set(slept) == {0.0}
    # the back-off's exponent is capped: an attempt far past a float's range waits cap_s, no OverflowError
    namespace["throttle"], slept[:] = eager_throttle(), []
    namespace["itertools"] = types.SimpleNamespace(count=lambda: itertools.count(10_000))
    namespace["random"] = types.SimpleNamespace(uniform=lambda low, high: high)
    namespace["infer_with_retries"](client, inputs(b"unavailable-once:late"), retries=1, retry_after_s=0)
    assert slept == [5.0]  # cap_s
