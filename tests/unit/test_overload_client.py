"""tools/overload.py's C load generator (tools/overload_client.c): the requests
it builds, its back-off on a refusal, and the reading of its attempts."""

import base64
import http.server
import json
import shutil
import struct
import threading

import pytest

from tools import overload


def test_attempts_into_a_phase():
    lines = ["ok 1500000\n", "refused 2100\n", "refused 900\n", "lost:timeout 30000000\n", "ok 2500000\n", "\n"]
    admitted, rejected, lost = overload.parse_attempts(lines)
    assert admitted == [1.5, 2.5] and rejected == [0.0021, 0.0009] and lost == ["lost:timeout"]
    figures = overload.summary(40, 10.0, admitted, rejected, lost)
    assert figures["admitted"] == 2 and figures["rejected"] == 2 and figures["lost"] == 1
    assert figures["admitted_per_s"] == 0.2 and figures["rejected_p50_ms"] == 1.5
    assert figures["lost_sample"] == ["lost:timeout"]


def test_only_what_ends_within_the_phase_counts_but_every_loss_does():
    lines = ["ok 1000000 900000\n", "ok 1000000 2100000\n", "refused 1000 1500000\n", "refused 1000 2500000\n",
             "lost:timeout 30000000 32000000\n"]
    admitted, rejected, lost = overload.parse_attempts(lines, window_s=2.0)
    assert admitted == [1.0] and rejected == [0.001] and lost == ["lost:timeout"]


class StandInTriton(http.server.BaseHTTPRequestHandler):
    """Triton's HTTP infer endpoint as the C client sees it: the binary tensor
    extension read and checked; every other request refused as a full queue."""

    protocol_version = "HTTP/1.1"  # keep-alive, as Triton
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
        message = "Exceeds the in-flight limit of the proxy (1)" if self.shed else overload.REFUSED
        answer = json.dumps({"error": message} if refused else {"outputs": []}).encode()
        self.send_response(503 if refused else 200)
        if self.shed:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def run_c_client(tmp_path, handler, users, seconds, backoff_base_s):
    (tmp_path / "photo").write_bytes(b"photo")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        binary = overload.compile_c_client(tmp_path)
        return overload.c_phase(binary, f"127.0.0.1:{server.server_address[1]}", tmp_path / "photo",
                                users=users, seconds=seconds, timeout_s=5, backoff_base_s=backoff_base_s)
    finally:
        server.shutdown()
        server.server_close()


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


class StandInFront(http.server.BaseHTTPRequestHandler):
    """The OpenAI front's chat completions as the C client's openai mode sees it:
    the body parsed as JSON, the photo decoded from its data URI; every other
    request refused as the front sheds (503, service_unavailable, Retry-After: 1)."""

    protocol_version = "HTTP/1.1"
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
        answer = json.dumps({"error": {"code": "service_unavailable"}} if refused else {"choices": []}).encode()
        self.send_response(503 if refused else 200)
        if refused:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@needs_cc
@pytest.mark.parametrize("photo", [b"photo", b"photo!", b"photo!!"], ids=["pad2", "pad1", "pad0"])
def test_the_c_clients_openai_mode_sends_the_photo_as_a_data_uri_and_honours_the_fronts_retry_after(tmp_path,
                                                                                                   photo):
    """Every base64 padding case decodes to the very photo; a refusal (every second
    request) waits its Retry-After of 1 s: ok, refused, a second, ok, refused: at most 4 requests in
    1.5 s for the one user (hundreds with its 0.01 s back-off alone)."""
    StandInFront.prompts, StandInFront.photos = [], []
    (tmp_path / "photo").write_bytes(photo)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandInFront)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        figures = overload.c_phase(overload.compile_c_client(tmp_path), f"127.0.0.1:{server.server_address[1]}",
                                   tmp_path / "photo", users=1, seconds=1.5, timeout_s=5, backoff_base_s=0.01,
                                   openai=True)
    finally:
        server.shutdown()
        server.server_close()
    assert figures["lost"] == 0, figures["lost_sample"]
    assert StandInFront.photos and set(StandInFront.photos) == {photo}
    assert all(p.startswith("What is it? (") for p in StandInFront.prompts)
    assert 2 <= len(StandInFront.prompts) <= 4 and figures["admitted"] >= 1 and figures["rejected"] >= 1
