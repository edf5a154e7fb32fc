"""tools/overload.py's C load generator (tools/overload_client.c): the requests
it builds, its back-off on a refusal, the reading of its attempts, and its
connections as HTTP clients keep them (what is lost and what is not)."""

import base64
import json
import shutil
import socket
import struct
import threading

import pytest
from stand_in_http import StandInHandler, serving_http

from classify_describe.client import QUEUE_REFUSALS
from tools import overload


def test_attempts_into_a_phase():
    lines = ["ok 1500000\n", "refused 2100\n", "refused 900\n", "lost:timeout 30000000\n", "ok 2500000\n", "\n",
             "retry 300\n"]
    admitted, rejected, lost, retries = overload.parse_attempts(lines)
    assert admitted == [1.5, 2.5] and rejected == [0.0021, 0.0009] and lost == ["lost:timeout"] and retries == 1
    figures = overload.summary(40, 10.0, admitted, rejected, lost)
    assert figures["admitted"] == 2 and figures["rejected"] == 2 and figures["lost"] == 1
    assert figures["admitted_per_s"] == 0.2 and figures["rejected_p50_ms"] == 1.5
    assert figures["lost_sample"] == ["lost:timeout"] and figures["lost_by_reason"] == {"lost:timeout": 1}


def test_only_what_ends_within_the_phase_counts_but_every_loss_does():
    lines = ["ok 1000000 900000\n", "ok 1000000 2100000\n", "refused 1000 1500000\n", "refused 1000 2500000\n",
             "lost:timeout 30000000 32000000\n", "retry 1000 33000000\n"]
    admitted, rejected, lost, retries = overload.parse_attempts(lines, window_s=2.0)
    assert admitted == [1.0] and rejected == [0.001] and lost == ["lost:timeout"] and retries == 1


def test_after_a_warm_up_only_what_ends_within_the_measured_window_counts():
    """A 1 s warm-up, then 1.5 s measured: ends at 0.9 s (warm-up) and 2.6 s
    (after) are left out; every answer's end goes to the timeline."""
    lines = ["ok 500000 900000\n", "ok 600000 1200000\n", "ok 700000 2500000\n", "ok 800000 2600000\n",
             "refused 1000 800000\n", "refused 2000 1100000\n", "lost:recv 1000 500000\n"]
    ends = []
    admitted, rejected, lost, retries = overload.parse_attempts(lines, window_s=1.5, warmup_s=1.0, ends=ends)
    assert admitted == [0.6, 0.7] and rejected == [0.002] and lost == ["lost:recv"] and retries == 0
    assert ends == [0.9, 1.2, 2.5, 2.6]


def test_a_timeline_gives_answers_per_second_in_each_step():
    assert overload.timeline([0.1, 4.9, 5.0, 12.0], step_s=5.0) == [0.4, 0.2, 0.2]
    assert overload.timeline([]) == []


class StandInTriton(StandInHandler):
    """Triton's HTTP infer endpoint as the C client sees it: the binary tensor
    extension read and checked; every other request refused as a full queue."""

    prompts = []
    shed = False  # True: refuse everything as the shedding proxy does (503, Retry-After: 1)

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        header_length = int(self.headers["Inference-Header-Content-Length"])
        inputs = json.loads(body[:header_length])["inputs"]
        image_size, prompt_size = (i["parameters"]["binary_data_size"] for i in inputs)
        assert self.path == "/v2/models/classify_and_describe/infer"
        assert struct.unpack("<I", body[header_length:header_length + 4])[0] == image_size - 4 == 5
        prompt = body[header_length + image_size:]
        assert len(prompt) == prompt_size and struct.unpack("<I", prompt[:4])[0] == prompt_size - 4
        self.prompts.append(prompt[4:].decode())
        refused = self.shed or len(self.prompts) % 2 == 0
        # Triton's queue policy refuses with two texts (full; waited past its time limit): both are refusals.
        queue_refusal = QUEUE_REFUSALS[len(self.prompts) // 2 % 2]
        message = "Exceeds the in-flight limit of the proxy (1)" if self.shed else queue_refusal
        self.answer(503 if refused else 200, {"error": message} if refused else {"outputs": []},
                    [("Retry-After", "1")] if self.shed else ())


def run_c_client(tmp_path, handler, users, seconds, backoff_base_s, throttle_k=0.0):
    (tmp_path / "photo").write_bytes(b"photo")
    with serving_http(handler) as address:
        return overload.c_phase(overload.compile_c_client(tmp_path), address, tmp_path / "photo",
                                users=users, seconds=seconds, timeout_s=5, backoff_base_s=backoff_base_s,
                                throttle_k=throttle_k)


needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


@needs_cc
def test_the_c_client_against_a_stand_in(tmp_path):
    StandInTriton.prompts = []
    figures = run_c_client(tmp_path, StandInTriton, users=4, seconds=1.0, backoff_base_s=0.01)
    assert figures["lost"] == 0, figures["lost_sample"]
    assert figures["admitted"] > 10 and figures["rejected"] > 10
    # Each user's last attempt may end after the phase: not counted in its figures.
    assert len(StandInTriton.prompts) - 4 <= figures["admitted"] + figures["rejected"] <= len(StandInTriton.prompts)
    assert len(set(StandInTriton.prompts)) == len(StandInTriton.prompts)  # a new prompt every time
    assert all(p.startswith("What is it? (") for p in StandInTriton.prompts)


class ShedStandIn(StandInTriton):
    prompts = []
    shed = True


@needs_cc
@pytest.mark.parametrize("backoff_base_s", [0.01, 0])
def test_the_proxys_refusal_is_a_refusal_and_retry_after_is_honoured_unless_resending_at_once(tmp_path,
                                                                                              backoff_base_s):
    ShedStandIn.prompts = []
    figures = run_c_client(tmp_path, ShedStandIn, users=1, seconds=2.5, backoff_base_s=backoff_base_s)
    assert figures["lost"] == 0 and figures["admitted"] == 0, figures["lost_sample"]
    if backoff_base_s:
        # Retry-After: 1 over 2.5 s: attempts at about 0, 1 and 2 s (a slow
        # machine makes fewer); a back-off of 0.01 s alone would make hundreds.
        assert 1 <= len(ShedStandIn.prompts) <= 3
    else:
        assert len(ShedStandIn.prompts) > 10  # resends at once: Retry-After ignored


class StandInFront(StandInHandler):
    """The OpenAI front's chat completions as the C client's openai mode sees it:
    the body parsed as JSON, the photo decoded from its data URI; every other
    request refused as the front sheds (503, service_unavailable, Retry-After: 1)."""

    prompts, photos = [], []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions" and body["model"] == "classify_and_describe"
        (image, text), = [message["content"] for message in body["messages"]]
        prefix = "data:image/png;base64,"
        assert image["type"] == "image_url" and image["image_url"]["url"].startswith(prefix)
        self.photos.append(base64.b64decode(image["image_url"]["url"][len(prefix):], validate=True))
        self.prompts.append(text["text"])
        refused = len(self.prompts) % 2 == 0
        self.answer(503 if refused else 200, {"error": {"code": "service_unavailable"}} if refused else {"choices": []},
                    [("Retry-After", "1")] if refused else ())


@needs_cc
@pytest.mark.parametrize("photo", [b"photo", b"photo!", b"photo!!"], ids=["pad2", "pad1", "pad0"])
def test_the_c_clients_openai_mode_sends_the_photo_as_a_data_uri_and_honours_the_fronts_retry_after(tmp_path,
                                                                                                   photo):
    """Every base64 padding case decodes to the very photo; a refusal (every second
    request) waits its Retry-After of 1 s: ok, refused, a second, ok, refused: at most 4 requests in
    1.5 s for the one user (hundreds with its 0.01 s back-off alone)."""
    StandInFront.prompts, StandInFront.photos = [], []
    (tmp_path / "photo").write_bytes(photo)
    with serving_http(StandInFront) as address:
        figures = overload.c_phase(overload.compile_c_client(tmp_path), address, tmp_path / "photo", users=1,
                                   seconds=1.5, timeout_s=5, backoff_base_s=0.01, openai=True)
    assert figures["lost"] == 0, figures["lost_sample"]
    assert StandInFront.photos and set(StandInFront.photos) == {photo}
    assert all(p.startswith("What is it? (") for p in StandInFront.prompts)
    assert 2 <= len(StandInFront.prompts) <= 4 and figures["admitted"] >= 1 and figures["rejected"] >= 1


class RawServer:
    """A loopback server that hands each accepted connection to `serve(conn, number)`
    in its own thread: the misbehaviours http.server cannot show (answers before the
    body, resets, connections closed between requests)."""

    def __init__(self, serve):
        self.serve, self.connections = serve, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, conn, number):
        with conn:
            try:
                self.serve(conn, number)
            except OSError:
                pass  # the client went: its side is what the test looks at

    def close(self):
        self.listener.close()


def read_head(conn, heads=None):
    """A request's headers -> what of its Content-Length is still to come; None when the
    client closed. `heads`: a list the headers are added to."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    if heads is not None:
        heads.append(head)
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
                 .split(b":")[1])
    return length - len(rest)


def read_request(conn):
    """A whole request (headers and body); False when the client closed."""
    left = read_head(conn)
    if left is None:
        return False
    while left > 0:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return False
        left -= len(chunk)
    return True


def answer(conn, status=503, *headers):
    body = json.dumps({"error": "Exceeds the in-flight limit of the proxy (1)"} if status == 503
                      else {"outputs": []}).encode()
    conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
                 % (status, len(body), b"".join(h + b"\r\n" for h in headers)) + body)


def c_phase_against(tmp_path, serve, photo=b"photo", seconds=1.0, backoff_base_s=0, timeout_s=5, users=1,
                    expect=False):
    (tmp_path / "photo").write_bytes(photo)
    server = RawServer(serve)
    try:
        figures = overload.c_phase(overload.compile_c_client(tmp_path), f"127.0.0.1:{server.port}",
                                   tmp_path / "photo", users=users, seconds=seconds, timeout_s=timeout_s,
                                   backoff_base_s=backoff_base_s, expect=expect)
    finally:
        server.close()
    return figures, server


@needs_cc
def test_a_refusal_sent_before_the_body_was_read_counts_though_the_connection_was_then_reset(tmp_path):
    """The server answers from the headers and resets the connection while the
    client is still writing a 16 MB body (more than the socket buffers hold;
    SO_LINGER 0: a reset, at once): the client's send fails, and the refusal
    waiting in its socket is read (an early response, RFC 9112 9.5): refused,
    not lost:send."""
    def refuse_then_reset(conn, number):
        read_head(conn)
        answer(conn, 503)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    figures, _ = c_phase_against(tmp_path, refuse_then_reset, photo=b"p" * (16 << 20))
    assert figures["lost"] == 0, figures["lost_by_reason"]
    assert figures["rejected"] >= 1 and figures["retried"] == 0


def answer_once_per_connection(close_how):
    """Each connection: its first request answered (200, kept alive), the next one
    read and then the connection closed without a byte of an answer."""
    def serve(conn, number):
        if read_request(conn):
            answer(conn, 200)
        if read_request(conn):
            close_how(conn)
    return serve


def reset(conn):
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@needs_cc
@pytest.mark.parametrize("close_how", [lambda conn: None, reset], ids=["fin", "reset"])
def test_a_kept_alive_connection_closed_before_any_answer_is_retried_on_a_new_one(tmp_path, close_how):
    figures, server = c_phase_against(tmp_path, answer_once_per_connection(close_how))
    assert figures["lost"] == 0, figures["lost_by_reason"]
    assert figures["admitted"] >= 2 and figures["retried"] >= 1
    assert server.connections >= figures["retried"] + 1  # each retry on a new connection


@needs_cc
def test_a_new_connection_closed_before_any_answer_is_lost_not_retried(tmp_path):
    """The retry is for the race on a kept-alive connection only: a server that
    closes every connection unanswered loses every request."""
    figures, _ = c_phase_against(tmp_path, lambda conn, number: read_request(conn), seconds=0.5)
    assert figures["lost"] >= 1 and figures["retried"] == 0 and figures["admitted"] == 0
    assert set(figures["lost_by_reason"]) == {"lost:closed"}


@needs_cc
def test_connection_close_in_an_answer_ends_the_connection(tmp_path):
    """The server says Connection: close and reads nothing more (it closes a moment
    later): the next attempt goes on a new connection, not into the closing one."""
    def answer_and_close(conn, number):
        read_request(conn)
        answer(conn, 200, b"Connection: close")
        threading.Event().wait(0.3)

    figures, _ = c_phase_against(tmp_path, answer_and_close)
    assert figures["lost"] == 0 and figures["retried"] == 0, figures
    assert figures["admitted"] >= 2


@needs_cc
def test_a_kept_alive_connection_closed_while_the_user_waited_is_replaced_before_use(tmp_path):
    """Refused with Retry-After: 1, then the server closes the idle connection (its
    keep-alive timeout): the user checks it before its next attempt and connects
    anew, neither a retry nor a loss."""
    def refuse_then_idle_close(conn, number):
        read_request(conn)
        answer(conn, 503, b"Retry-After: 1")
        threading.Event().wait(0.2)

    figures, _ = c_phase_against(tmp_path, refuse_then_idle_close, seconds=2.5, backoff_base_s=0.01)
    assert figures["lost"] == 0 and figures["retried"] == 0, figures
    assert figures["rejected"] >= 2


@needs_cc
def test_a_timeout_names_the_step_it_was_stuck_in(tmp_path):
    def never_answer(conn, number):
        read_request(conn)
        threading.Event().wait(3)

    figures, _ = c_phase_against(tmp_path, never_answer, seconds=0.2, timeout_s=0.5)
    assert figures["lost_by_reason"] == {"lost:timeout:unanswered:new": 1}


class FullStandIn(StandInTriton):
    """Every request refused as a full queue (503), none answered."""

    prompts = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.prompts.append(self.path)
        self.answer(503, {"error": QUEUE_REFUSALS[0]})


@needs_cc
@pytest.mark.parametrize("throttle_k", [0.0, 2.0])
def test_the_c_clients_throttle_keeps_refused_attempts_at_home(tmp_path, throttle_k):
    # Backing off from 1 ms, 4 users make about 40 attempts in the second: without the throttle
    # every one reaches the server; with it, past the 20 requests of classify_describe's
    # min_requests, nearly all are refused unsent (the probability is then 20/21 and up).
    FullStandIn.prompts = []
    figures = run_c_client(tmp_path, FullStandIn, users=4, seconds=1.0, backoff_base_s=0.001, throttle_k=throttle_k)
    sent = len(FullStandIn.prompts)
    assert figures["lost"] == 0 and figures["admitted"] == 0
    if throttle_k:
        assert 20 <= sent <= 27 and figures["throttled"] >= 10
    else:
        assert "throttled" not in figures and sent >= 35


def test_the_c_throttle_has_the_python_clients_defaults():
    from classify_describe import throttle

    source = overload.C_SOURCE.read_text()
    assert f"#define THROTTLE_WINDOW_S {throttle.WINDOW_S}\n" in source
    assert f"#define THROTTLE_MIN_REQUESTS {float(throttle.MIN_REQUESTS)}\n" in source
    assert overload.main.__module__ and throttle.DEFAULT_K == 2.0


def test_the_c_users_honour_retry_after_as_the_python_clients_do():
    from classify_describe import client

    assert f"#define RETRY_AFTER_CAP_S {client.RETRY_AFTER_CAP_S} " in overload.C_SOURCE.read_text()


@needs_cc
def test_the_c_clients_throttle_lets_through_what_the_server_takes(tmp_path):
    # Half refused, half answered: requests stay about 2 x accepts, so (nearly) nothing is held back.
    StandInTriton.prompts = []
    figures = run_c_client(tmp_path, StandInTriton, users=4, seconds=1.0, backoff_base_s=0.01, throttle_k=2.0)
    # (Not 0: requests are counted when sent and accepts when answered, so answers still on their
    # way and the window's fading tip the rule above 0 now and then, more on a loaded machine.)
    assert figures["admitted"] > 10 and figures["throttled"] < figures["admitted"]


EXPECT = b"\r\nExpect: 100-continue"


@needs_cc
def test_with_expect_a_refusal_before_the_body_keeps_the_body_unsent_and_the_connection_is_dropped(tmp_path):
    """The server refuses each request from its headers (no Connection: close) and then reads
    what comes: nothing, and the client's close. Each attempt asks on a new connection,
    whose headers say Expect: 100-continue; no byte of a body was ever sent."""
    heads, after = [], []

    def refuse_from_the_headers(conn, number):
        left = read_head(conn, heads)
        answer(conn, 503)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        after.append((left, data))

    figures, server = c_phase_against(tmp_path, refuse_from_the_headers, photo=b"p" * 100_000, seconds=0.5,
                                      expect=True)
    assert figures["lost"] == 0 and figures["retried"] == 0, figures["lost_by_reason"]
    assert figures["rejected"] >= 1 and all(EXPECT in head for head in heads)
    assert after and all(left > 100_000 and data == b"" for left, data in after), \
        "nothing after the headers: no body, and no next request on the same connection"
    assert server.connections >= len(after) >= figures["rejected"]


@needs_cc
def test_with_expect_the_body_goes_on_100_continue_and_the_connection_is_kept(tmp_path):
    """The server reads the headers, checks that nothing follows them for 0.1 s (the body
    waits), sends 100 Continue, reads the body, answers. The first answer comes well within
    the 0.8 s phase; a client that let its body wait for its 1 s fallback instead of the
    100 would answer nothing within it (a generous margin: an exchange on loopback takes ms)."""
    heads, early = [], []

    def continue_then_answer(conn, number):
        while (left := read_head(conn, heads)) is not None:
            conn.settimeout(0.1)
            try:
                early.append(conn.recv(65536))
            except TimeoutError:
                pass
            conn.settimeout(None)
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            while left > 0:
                chunk = conn.recv(min(left, 1 << 20))
                if not chunk:
                    return
                left -= len(chunk)
            answer(conn, 200)

    figures, server = c_phase_against(tmp_path, continue_then_answer, seconds=0.8, expect=True)
    assert figures["lost"] == 0 and figures["admitted"] >= 1, figures
    assert early == [] and all(EXPECT in head for head in heads)
    assert server.connections == 1, "answered after its body: the connection is kept"


@needs_cc
def test_with_expect_a_server_that_ignores_it_gets_the_body_after_a_second_and_a_late_100_is_skipped(tmp_path):
    """A server that never asks (it waits for the body as older servers do) gets it after the
    client's 1 s fallback; it then sends 100 Continue before its answer (a late interim
    answer), which the client reads past to the answer: ok, not lost:unparsed."""
    def late_continue(conn, number):
        while read_request(conn):
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            answer(conn, 200)

    figures, _ = c_phase_against(tmp_path, late_continue, seconds=1.5, expect=True)
    assert figures["lost"] == 0 and figures["admitted"] >= 1, figures["lost_by_reason"]
