"""The upstreams every path is tried against, each as a user points the server at it (a
base URL and a model; no key for a local one): the fake upstream (tools/fake_openai, OpenAI's
behaviour), the LiteLLM proxy in front of it (tests/support/litellm_gateway.py), and a real
OpenAI-compatible server nobody here wrote, llama-cpp-python's (build/llamacpp-venv, `make
llamacpp-server`) serving SmolLM2-135M-Instruct, a text-only model. One upstream and one Triton
per kind; tests that stop or key an upstream start their own."""

import asyncio
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tests.support.litellm_gateway import MODEL as GATEWAY_MODEL
from tests.support.litellm_gateway import Gateway
from tools.fake_openai.server import FakeOpenAI
from tools.local_stack import FakeLLM, NotReady, TritonServer, free_port, log_tail, stop_process

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


# What each upstream gives where they differ (docs/llm-endpoints.md#local-servers), the model
# asked for, and the key it takes: the local ones none, the gateway its clients' (master) key.
MASTER_KEY = "sk-gateway-master-" + uuid.uuid4().hex[:12]
# A wrong key and a stream cut mid-way read as each says them: LiteLLM answers a wrong key with
# 400, and ends its own stream cleanly, without a finish, when its upstream's is cut.
EXPECTED = {
    "fake": {"vision": True, "stream_usage_estimated": False, "model": MODEL_NAME, "key": None,
             "wrong_key": "authentication_failed_http_401", "cut": ("connection_error",)},
    "litellm": {"vision": True, "stream_usage_estimated": False, "model": GATEWAY_MODEL, "key": MASTER_KEY,
                "wrong_key": "bad_request_http_400", "cut": ("malformed_response",)},
    "llamacpp": {"vision": False, "stream_usage_estimated": True, "model": MODEL_NAME, "key": None,
                 "wrong_key": "authentication_failed_http_401", "cut": ("connection_error", "timeout")},
}


class Upstream:
    """One kind's session upstream, and fresh ones for a test that keys or stops its own."""

    def __init__(self, kind, workdir):
        self.kind, self.workdir = kind, workdir
        self.expected = EXPECTED[kind]
        if kind == "llamacpp" and not MODEL.is_file():
            pytest.fail("build/llamacpp-venv is missing: run `make llamacpp-server` (make test-upstreams does)")
        self.model, self.key = self.expected["model"], self.expected["key"]
        self.server = LlamaServer(workdir) if kind == "llamacpp" else FakeLLM(workdir / "fake_llm.log")
        self.gateway = Gateway(workdir, self.server.base_url, MASTER_KEY, "sk-provider") if kind == "litellm" else None
        self.base_url = (self.gateway or self.server).base_url

    def stop(self):
        if self.gateway is not None:
            self.gateway.stop()
        self.server.stop()

    async def start_own(self, api_key=None, goes_away=False):
        """(base URL, cut: what ends its stream mid-way, close) of an upstream of the test's own;
        with api_key, one that refuses any other key; with goes_away, one whose stream ends when
        cut() is called (llama: the process killed) or after a few chunks (the fake drops it)."""
        if self.kind == "llamacpp":
            server = await asyncio.to_thread(LlamaServer, self.workdir, api_key)
            return server.base_url, server.process.kill, server.stop  # our own llama server, by its PID
        fake = FakeOpenAI(port=0, latency_ms=0, chunk_ms=20)
        await fake.start()
        fake.set_mode("401" if api_key and self.kind == "fake" else "cut" if goes_away else "ok", cut_after=3,
                      answer_words=200)
        if self.kind == "fake":
            return fake.base_url, lambda: None, fake.stop
        workdir = self.workdir / f"own-{uuid.uuid4().hex[:6]}"
        workdir.mkdir()
        gateway = await asyncio.to_thread(Gateway, workdir, fake.base_url, api_key or MASTER_KEY, "sk-provider")

        async def close():
            await asyncio.to_thread(gateway.stop)
            await fake.stop()
        return gateway.base_url, lambda: None, close


@pytest.fixture(scope="module", params=list(EXPECTED))
def upstream(request, tmp_path_factory):
    up = Upstream(request.param, tmp_path_factory.mktemp(request.param))
    yield up
    up.stop()


@pytest.fixture(scope="module")
def triton(upstream, tmp_path_factory):
    """The server as a user points it at a local LLM: its base URL and model, no key."""
    workdir = tmp_path_factory.mktemp("triton")
    server = TritonServer(workdir, {"LLM_BASE_URL": upstream.base_url, "LLM_MODEL": upstream.model,
                                    "LLM_API_KEY": upstream.key,
                                    "LLM_API_KEY_FILE": None, "LLM_TIMEOUT_S": "60", "LLM_TOTAL_TIMEOUT_S": "120",
                                    "LLM_MAX_TOKENS": "48"})
    try:
        server.start(timeout_s=300)
    except NotReady as error:
        pytest.fail(str(error))
    yield server
    server.stop()
    print(f"\ntritonserver log: {server.log_path}", file=sys.stderr)
