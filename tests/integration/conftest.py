"""One real tritonserver per test session, on free ports, on the committed
model_repository/, started by the same scripts/serve.sh users run; its LLM
step points at the fake OpenAI-compatible upstream in tests/fake_openai."""

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# Scanned for in every log, output and metric: it must never show up.
TEST_API_KEY = "sk-test-DO-NOT-LEAK-7f3a9c2e51"
SERVER_READY_TIMEOUT_S = 300


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_json(url, payload=None, timeout=10):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"},
        method="GET" if data is None else "POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else None


def log_tail(path, lines=60):
    text = pathlib.Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def stop_process(process, grace_s=60):
    """Stop one process we started, by its PID: TERM, then KILL after a grace period."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@dataclass
class FakeLLM:
    """Handle on the fake upstream process; drive it through its admin API."""

    port: int
    process: subprocess.Popen
    log_path: pathlib.Path

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def admin(self, path, payload=None):
        return http_json(f"http://127.0.0.1:{self.port}/_admin/{path}", payload)


@dataclass
class TritonServer:
    repository: pathlib.Path
    http_url: str
    grpc_url: str
    metrics_url: str
    log_path: pathlib.Path
    process: subprocess.Popen

    def is_ready(self):
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self):
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=10) as r:
            return r.read().decode()

    def log(self):
        return self.log_path.read_text(errors="replace")


def wait_for_port(port, process, log_path, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"process exited with {process.returncode}:\n{log_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"nothing listened on {port} after {timeout_s}s:\n{log_tail(log_path)}")


@pytest.fixture(scope="session")
def fake_llm(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("fake_llm") / "fake_llm.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.fake_openai", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, process, log_path, timeout_s=30)
        yield FakeLLM(port, process, log_path)
    finally:
        stop_process(process, grace_s=10)


@contextlib.contextmanager
def running_triton(workdir, fake_llm, extra_env=None, command_prefix=()):
    """Start scripts/serve.sh on free ports and a copy of the committed
    model_repository/ (built by `make build`), so tests may add a model
    version without touching the tree; stop it by its PID afterwards."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log_path = workdir / "tritonserver.log"
    repository = workdir / "model_repository"
    shutil.copytree(REPO / "model_repository", repository)
    env = dict(os.environ,
               HTTP_PORT=str(http_port), GRPC_PORT=str(grpc_port), METRICS_PORT=str(metrics_port),
               MODEL_REPOSITORY=str(repository),
               LLM_BASE_URL=fake_llm.base_url, LLM_API_KEY=TEST_API_KEY, **(extra_env or {}))
    with open(log_path, "w") as log:
        process = subprocess.Popen([*command_prefix, str(REPO / "scripts/serve.sh")], cwd=REPO,
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
    server = TritonServer(repository, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                          f"127.0.0.1:{metrics_port}", log_path, process)
    try:
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while not server.is_ready():
            if process.poll() is not None:
                pytest.fail(f"tritonserver exited with {process.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"tritonserver not ready after {SERVER_READY_TIMEOUT_S}s:\n"
                            f"{log_tail(log_path)}")
            time.sleep(0.5)
        yield server
    finally:
        stop_process(process)
        print(f"\ntritonserver log: {log_path}")


@pytest.fixture(scope="session")
def triton(fake_llm, tmp_path_factory):
    """The one server of the session, as `make run` starts it."""
    with running_triton(tmp_path_factory.mktemp("triton"), fake_llm) as server:
        yield server


@pytest.fixture(scope="session")
def test_api_key():
    return TEST_API_KEY


@pytest.fixture
def llm(fake_llm):
    """The fake upstream, reset to answering "ok" before and after the test."""
    fake_llm.admin("reset", {})
    yield fake_llm
    fake_llm.admin("reset", {})


@pytest.fixture(scope="session")
def photos():
    """Real photos that ship with scikit-image, as encoded bytes."""
    import skimage.data

    data_dir = pathlib.Path(skimage.data.__file__).parent
    return {name: (data_dir / f"{name}.png").read_bytes() for name in ("chelsea", "coffee")}
