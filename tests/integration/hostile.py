"""Helpers of tests/integration/test_hostile_clients.py: valid traffic that runs
beside a hostile client and must keep getting its correct answer, raw HTTP
requests to Triton built byte by byte (so a body can trickle, stall, lie about
its length or come compressed), a gzip bomb built without compressing a
gigabyte, and the server's memory from /proc."""

import contextlib
import http.client
import json
import struct
import threading
import time
import zlib

from serving.procfs import process_tree, rss_mb, stub_instance, tritonserver_pid

from .public_models import COFFEE_TOP1
from .raw_infer import GrpcInfer, bytes_tensor, element, http_infer

VALID_LATENCY_LIMIT_S = 5.0  # a valid request beside a hostile one, on 2 busy cores


class Beside:
    """Valid classify requests (HTTP and gRPC in turn) in a thread while a
    hostile client does its worst; each must be answered, top-1 'espresso'."""

    def __init__(self, triton, photo):
        self.triton, self.photo = triton, photo
        self.answers, self.problems = [], []  # (protocol, seconds), what went wrong
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        grpc = GrpcInfer(self.triton.grpc_url)
        try:
            while not self._stop.is_set():
                for protocol in ("http", "grpc"):
                    inputs = [bytes_tensor("IMAGE", [[self.photo]])]
                    started = time.monotonic()
                    if protocol == "http":
                        answer = http_infer(self.triton.http_url, "classify", inputs, timeout_s=30)
                    else:
                        answer = grpc("classify", inputs, timeout_s=30)
                    took = time.monotonic() - started
                    top1 = answer.outputs["LABELS"].reshape(-1)[0] if answer.ok else None
                    if top1 != COFFEE_TOP1:
                        self.problems.append(f"{protocol}: {answer.code} {answer.message[:200]} top1={top1!r}")
                    self.answers.append((protocol, took))
                time.sleep(0.05)
        finally:
            grpc.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)

    def wait_answers(self, count, timeout_s=30):
        """Until `count` more valid answers came (the hostile client is still at it)."""
        target, deadline = len(self.answers) + count, time.monotonic() + timeout_s
        while len(self.answers) < target and time.monotonic() < deadline and not self.problems:
            time.sleep(0.02)

    def check(self, at_least=2):
        assert not self.problems, self.problems
        assert len(self.answers) >= at_least, f"only {len(self.answers)} valid answers beside"
        slowest = max(took for _, took in self.answers)
        assert slowest < VALID_LATENCY_LIMIT_S, f"a valid request took {slowest:.1f} s beside a hostile one"


# -- raw HTTP to Triton -----------------------------------------------------------

def classify_request(photo):
    """(head, body) of POST /v2/models/classify/infer: the photo as binary data,
    LABELS asked for as JSON, so the answer is one JSON document."""
    head = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1, 1],
                                   "parameters": {"binary_data_size": 4 + len(photo)}}],
                       "outputs": [{"name": "LABELS"}]}).encode()
    return head, head + element(photo)


def open_infer(url, model, content_length, head_length=None, headers=None, timeout_s=30):
    """An HTTPConnection with the request head sent and no body yet."""
    host, port = url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    connection.putrequest("POST", f"/v2/models/{model}/infer")
    connection.putheader("Content-Length", str(content_length))
    if head_length is not None:
        connection.putheader("Inference-Header-Content-Length", str(head_length))
    for name, value in (headers or {}).items():
        connection.putheader(name, value)
    connection.endheaders()
    return connection


def read_answer(connection):
    """(status, decoded JSON or the text) of the response on `connection`."""
    response = connection.getresponse()
    text = response.read()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text.decode(errors="replace")


def top1(answer):
    status, body = answer
    assert status == 200, answer
    return body["outputs"][0]["data"][0]


# -- a gzip bomb --------------------------------------------------------------

def gzip_bomb(prefix, filler_mib, suffix=b""):
    """A gzip member that inflates to prefix + filler_mib MiB of b"A" + suffix,
    in about 1 KB per MiB. Each MiB is compressed after a full flush, so its
    compressed form is the same bytes every time: one compression, repeated."""
    block = b"A" * (1 << 20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeated = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    last = compressor.compress(suffix) + compressor.flush(zlib.Z_FINISH)
    crc = zlib.crc32(prefix)
    for _ in range(filler_mib):
        crc = zlib.crc32(block, crc)
    crc = zlib.crc32(suffix, crc)
    size = len(prefix) + filler_mib * len(block) + len(suffix)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + first + repeated * filler_mib + last + struct.pack("<II", crc, size & 0xFFFFFFFF)


# -- the server's memory ---------------------------------------------------------

def status_kb(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _command(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


class Memory:
    """RSS of every process of the server (supervisor, tritonserver, its stubs,
    the front) and tritonserver's own peak (VmHWM), in MB."""

    def __init__(self, triton):
        self.root = triton.process.pid
        self.server = tritonserver_pid(self.root)

    def total_mb(self):
        return rss_mb(self.root)

    def by_process(self):
        """{name: MB}: each process of the server by what it is (a stub by its
        instance, others by their command), so a growth names who grew."""
        rows = {}
        for pid in process_tree(self.root):
            name = stub_instance(pid) or _command(pid) or str(pid)
            rows[name] = rows.get(name, 0.0) + status_kb(pid, "VmRSS") / 1024
        return {name: round(mb, 1) for name, mb in rows.items()}

    def growth_by_process(self):
        """{name: MB grown since start_by_process was taken}, largest first."""
        now = self.by_process()
        grown = {name: round(mb - self.start_by_process.get(name, 0.0), 1) for name, mb in now.items()}
        return dict(sorted(grown.items(), key=lambda row: -row[1]))

    def server_peak_mb(self):
        return round(status_kb(self.server, "VmHWM") / 1024, 1)

    def server_rss_mb(self):
        return round(status_kb(self.server, "VmRSS") / 1024, 1)

    def processes(self):
        return len(process_tree(self.root))

    @contextlib.contextmanager
    def sampled(self, every_s=0.05):
        """tritonserver's highest RSS seen while the block runs (VmHWM is a peak since start)."""
        seen = {"max_mb": self.server_rss_mb()}
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                seen["max_mb"] = max(seen["max_mb"], self.server_rss_mb())
                time.sleep(every_s)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            stop.set()
            thread.join(5)
