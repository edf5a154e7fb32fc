"""A real OpenAI-compatible LLM server that nobody here wrote: llama-cpp-python's server
(build/llamacpp-venv, `make llamacpp-server`) serving SmolLM2-135M-Instruct, a text-only
model, started as a local user would (a base URL, no key). One llama server and one Triton
per session; tests that stop or key a server start their own llama server."""

import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tools.local_stack import NotReady, TritonServer, free_port, log_tail, stop_process

REPO = pathlib.Path(__file__).resolve().parents[2]
VENV = REPO / "build/llamacpp-venv"
MODEL = VENV / "models/smollm2-135m-instruct.gguf"
MODEL_NAME = "smollm2-135m-instruct"  # what the server calls it (--model_alias) and LLM_MODEL asks for
READY_TIMEOUT_S = 120


class LlamaServer:
    """`python -m llama_cpp.server` on a free loopback port, stopped by its PID."""

    def __init__(self, workdir, api_key=None):
        self.port = free_port()
        self.log_path = pathlib.Path(workdir) / f"llama-server-{self.port}.log"
        command = [str(VENV / "bin/python"), "-m", "llama_cpp.server", "--model", str(MODEL),
                   "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                   "--n_ctx", "2048", "--n_threads", "1"]
        if api_key:
            command += ["--api_key", api_key]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def _wait_ready(self):
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NotReady(f"llama server exited with {self.process.returncode}:\n{log_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers (401 with --api_key): ready
            except OSError:
                time.sleep(0.3)
        raise NotReady(f"llama server not ready after {READY_TIMEOUT_S}s:\n{log_tail(self.log_path)}")

    def stop(self):
        stop_process(self.process, grace_s=10)


@pytest.fixture(scope="session", autouse=True)
def built():
    if not MODEL.is_file():
        pytest.fail("build/llamacpp-venv is missing: run `make llamacpp-server` (make test-llamacpp does)")


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    server = LlamaServer(tmp_path_factory.mktemp("llama"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def triton(llama, tmp_path_factory):
    """The server as a user points it at a local LLM: its base URL and model, no key."""
    workdir = tmp_path_factory.mktemp("triton")
    server = TritonServer(workdir, {"LLM_BASE_URL": llama.base_url, "LLM_MODEL": MODEL_NAME, "LLM_API_KEY": None,
                                    "LLM_API_KEY_FILE": None, "LLM_TIMEOUT_S": "60", "LLM_TOTAL_TIMEOUT_S": "120",
                                    "LLM_MAX_TOKENS": "48"})
    try:
        server.start(timeout_s=300)
    except NotReady as error:
        pytest.fail(str(error))
    yield server
    server.stop()
    print(f"\ntritonserver log: {server.log_path}", file=sys.stderr)
