"""Start and stop the local stack on free loopback ports: the fake LLM upstream
(tools/fake_openai) and tritonserver via scripts/serve.sh; everything is
stopped by its PID, never by name (other servers may run on this machine).

One implementation shared by the integration tests (tests/integration/
conftest.py), the benchmarks (tools/bench/), `make soak`, `make rehearse` and
`make overload`. The /proc and HTTP helpers it
uses ship in the image with the stub watchdog (serving/procfs.py)."""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from serving.procfs import http_json

REPO = pathlib.Path(__file__).resolve().parents[1]
SERVE_SH = REPO / "scripts/serve.sh"
READY_TIMEOUT_S = 300


class NotReady(RuntimeError):
    """A process we started exited or did not come up in time; the message
    carries its log tail, so the caller can report it as it is."""


# -- small helpers ------------------------------------------------------------------

_HANDED_OUT = set()


def free_port():
    """A loopback port nothing listens on, never one this process handed out before:
    the kernel may give the same free port to two probes in a row, and a server
    told to use it twice (gRPC and metrics) refuses to start."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def log_tail(path, lines=60):
    # Used while reporting another failure: a missing log must not hide that one.
    try:
        return "\n".join(pathlib.Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_process(process, grace_s=60):
    """Stop one process we started, by its PID: TERM, then KILL after a grace
    period (tritonserver drains for up to --exit-timeout-secs=30). Returns its
    exit status."""
    if process is None:
        return None
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


# -- the processes ----------------------------------------------------------------------

def _wait_listening(port, process, log_path, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise NotReady(f"{what} exited with {process.returncode}:\n{log_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise NotReady(f"nothing listened on {port} after {timeout_s}s ({what}):\n"
                               f"{log_tail(log_path)}") from None
            time.sleep(0.1)


class FakeLLM:
    """tools/fake_openai as its own process, listening when the constructor
    returns; driven through its admin API (mode, latency, stats, reset)."""

    def __init__(self, log_path, latency_ms=0.0, ready_timeout_s=30, chunk_ms=0.0):
        self.port = free_port()
        self.log_path = pathlib.Path(log_path)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tools.fake_openai", "--host", "127.0.0.1",
                 "--port", str(self.port), "--latency-ms", str(latency_ms), "--chunk-ms", str(chunk_ms)],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_listening(self.port, self.process, self.log_path, ready_timeout_s, "fake LLM")
        except NotReady:
            self.stop()
            raise

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def admin(self, path, payload=None, timeout=10):
        return http_json(f"http://127.0.0.1:{self.port}/_admin/{path}", payload, timeout=timeout)

    def stop(self):
        stop_process(self.process, grace_s=10)


class TritonServer:
    """scripts/serve.sh on free loopback ports, as `make run` starts it.

    repository: None for a copy of the committed model_repository/ (built by
    `make build`) in workdir, so callers may edit configs or add versions
    without touching the tree; else a directory used as it is.
    env: added to os.environ (LLM_BASE_URL, LLM_API_KEY, ...); a None value
    removes that variable. The ports stay the same for the handle's life, so
    start() after stop() is a restart on the same ports.

    The control APIs are always restricted (serving/supervise_tritonserver.sh).
    Each server gets its own random TRITON_ADMIN_KEY unless env gives one, or
    gives TRITON_ADMIN_KEY=None: then the supervisor generates it into
    TRITON_ADMIN_KEY_GENERATED_FILE (default <workdir>/admin-key, never the
    build/admin-key-<port> of a `make run` on this checkout). `admin_headers` and
    `grpc_admin_headers` carry it for load, unload and the like."""

    def __init__(self, workdir, env=None, repository=None, log_path=None, command_prefix=()):
        self.workdir = pathlib.Path(workdir)
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.openai_port = free_port()  # the OpenAI-compatible front the supervisor starts beside it
        if repository is None:
            repository = self.workdir / "model_repository"
            if not repository.exists():
                shutil.copytree(REPO / "model_repository", repository)
        self.repository = pathlib.Path(repository)
        self.log_path = pathlib.Path(log_path) if log_path else self.workdir / "tritonserver.log"
        self.extra_env = {"LISTEN_ADDRESS": "127.0.0.1",
                          "TRITON_ADMIN_KEY": "adm-" + os.urandom(16).hex(), "TRITON_ADMIN_KEY_FILE": None,
                          "TRITON_ADMIN_KEY_GENERATED_FILE": str(self.workdir / "admin-key"), **(env or {})}
        self.command_prefix = list(command_prefix)
        self.process = None
        self._log_start = 0  # where this start's part of the log begins

    @property
    def env(self):
        env = dict(os.environ, HTTP_PORT=str(self.http_port), GRPC_PORT=str(self.grpc_port),
                   METRICS_PORT=str(self.metrics_port), OPENAI_PORT=str(self.openai_port),
                   MODEL_REPOSITORY=str(self.repository))
        for key, value in self.extra_env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    @property
    def admin_key(self):
        """The key the server requires, found as the supervisor finds it."""
        env = self.env
        key_file = env.get("TRITON_ADMIN_KEY_FILE")
        if key_file and os.path.exists(key_file):
            return pathlib.Path(key_file).read_text().strip()
        if env.get("TRITON_ADMIN_KEY"):
            return env["TRITON_ADMIN_KEY"]
        return pathlib.Path(env["TRITON_ADMIN_KEY_GENERATED_FILE"]).read_text().strip()

    @property
    def admin_headers(self):
        return {"admin-key": self.admin_key}

    @property
    def grpc_admin_headers(self):
        """Over gRPC Triton expects the header with its prefix."""
        return {"triton-grpc-protocol-admin-key": self.admin_key}

    @property
    def http_url(self):
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self):
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def openai_base_url(self):
        return f"http://127.0.0.1:{self.openai_port}/v1"

    @property
    def metrics_url(self):
        return f"127.0.0.1:{self.metrics_port}"

    def start(self, wait=True, timeout_s=READY_TIMEOUT_S, log_path=None):
        """Start serve.sh (its log appended to log_path, default self.log_path);
        with wait, return the seconds until ready or raise NotReady."""
        if log_path is not None:
            self.log_path = pathlib.Path(log_path)
        started = time.monotonic()
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen([*self.command_prefix, str(SERVE_SH)], cwd=REPO,
                                            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready(deadline=started + timeout_s)
            return time.monotonic() - started
        return None

    def wait_ready(self, deadline=None):
        """Until /v2/health/ready answers 200 and the supervisor has said READY (after the CPU
        layout's reloads). A server that exits or misses the deadline is stopped, so no caller
        leaves one running."""
        if deadline is None:
            deadline = time.monotonic() + READY_TIMEOUT_S
        while not (self.is_ready() and self.said_ready()):
            if self.process.poll() is not None:
                raise NotReady(f"tritonserver exited with {self.process.returncode} (log {self.log_path}):\n"
                               f"{log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise NotReady(f"tritonserver on {self.http_url} not ready in time (log {self.log_path}):\n"
                               f"{log_tail(self.log_path)}")
            time.sleep(0.25)

    def said_ready(self):
        """Whether this start's log holds the supervisor's READY line."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return b"serve: READY" in log.read()

    def is_ready(self):
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=5) as r:
                return r.status == 200
        except OSError:  # refused, reset, timed out, or an HTTPError (503 while loading)
            return False

    def metrics(self):
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=10) as r:
            return r.read().decode()

    def log(self):
        return self.log_path.read_text(errors="replace")

    def stop(self):
        return stop_process(self.process)
