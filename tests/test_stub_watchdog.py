"""serving/stub_watchdog.py on stand-in processes: a "server" whose child
carries a Python stub's command line. The watchdog must reload the model when
that child dies, and must survive a server that answers badly meanwhile."""

import http.client
import http.server
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from serving import procfs
from serving import stub_watchdog as watchdog_module
from serving.procfs import children

REPO = pathlib.Path(__file__).resolve().parents[1]

# argv[0] ends with the stub's name and argv[8] is the instance, as for a real stub.
STAND_IN = ('exec -a /opt/tritonserver/backends/python/triton_python_backend_stub '
            f'{sys.executable} -c "import time; time.sleep(120)" a b c d e detect_0_0 & wait')


class FlakyServer:
    """The repository API, failing the first `failures` index reads with `error`."""

    def __init__(self, failures=0, error=None, counts=(1,)):
        self.failures, self.error, self.reloaded, self.counts = failures, error, [], list(counts)

    def ready_models(self):
        if self.failures:
            self.failures -= 1
            raise self.error
        return {"detect"}

    def instance_counts(self, model):
        return self.counts

    def reload(self, model):
        self.reloaded.append(model)


@pytest.fixture
def server_with_stub():
    server = subprocess.Popen(["bash", "-c", STAND_IN])
    try:
        deadline = time.monotonic() + 10
        while not (stubs := [p for p in children(server.pid) if watchdog_module.stub_instance(p)]):
            assert time.monotonic() < deadline, "the stand-in stub did not start"
            time.sleep(0.05)
        yield server, stubs[0]
    finally:
        for pid in children(server.pid):  # only the stand-in stub this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        server.kill()
        server.wait(10)


def kill_and_reap(server, stub_pid):
    os.kill(stub_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # bash's `wait` reaps it; a zombie counts as dead too
    while watchdog_module.process_state(stub_pid) not in (None, "Z"):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_dead_stub_gets_its_model_reloaded(server_with_stub):
    server, stub = server_with_stub
    api = FlakyServer()
    dog = watchdog_module.Watchdog(server.pid, api)
    assert dog.poll() == [] and dog.known == {stub: "detect_0_0"}
    kill_and_reap(server, stub)
    assert dog.poll() == ["detect"] and api.reloaded == ["detect"]


def test_an_instance_retired_by_a_reload_with_fewer_instances_is_not_a_death(server_with_stub):
    # detect_0_0 gone after a reload that left group 0 without an instance 0: retired, not dead.
    server, stub = server_with_stub
    api = FlakyServer(counts=(0,))
    dog = watchdog_module.Watchdog(server.pid, api)
    dog.poll()
    kill_and_reap(server, stub)
    assert dog.poll() == [] and api.reloaded == []


def test_which_instances_a_served_layout_keeps():
    assert watchdog_module.retained("classify_with_view_0_2", [3])
    assert not watchdog_module.retained("classify_with_view_0_2", [2])
    assert not watchdog_module.retained("classify_with_view_1_0", [3])
    assert watchdog_module.retained("a_b_1_0", [1, 1])


def test_an_answer_cut_short_is_retried_at_the_next_look(server_with_stub):
    server, stub = server_with_stub
    api = FlakyServer(failures=1, error=http.client.IncompleteRead(b"{"))
    dog = watchdog_module.Watchdog(server.pid, api)
    dog.poll()
    kill_and_reap(server, stub)
    assert dog.poll() == [], "the index read failed: nothing reloaded yet"
    assert dog.poll() == ["detect"], "the dead stub was remembered and its model reloaded next time"


def test_an_unexpected_error_does_not_end_the_watch():
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    looks = []

    class Broken(watchdog_module.Watchdog):
        def poll(self):
            looks.append(time.monotonic())
            raise RuntimeError("a bug in one look")

    Broken(server.pid, FlakyServer(), interval_s=0.1).run()  # returns once the server has exited
    server.wait(10)
    assert len(looks) >= 5, "the watchdog kept looking after the first failure"


class Recorder(http.server.BaseHTTPRequestHandler):
    """Records each request's line and admin-key header on its server; answers {"who": <server name>}."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append((self.requestline, self.headers.get("admin-key")))
        body = json.dumps({"who": self.server.name}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def recording_server(name):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.name, server.seen = name, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_repository_api_is_called_directly_even_with_a_proxy_set(monkeypatch):
    """A pod's http_proxy (for the LLM's egress) must not carry the watchdog's calls, with the
    admin key, to the proxy: they go straight to the local server."""
    triton, proxy = recording_server("triton"), recording_server("proxy")
    try:
        for variable in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(variable, f"http://127.0.0.1:{proxy.server_port}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        answer = procfs.http_json(f"http://127.0.0.1:{triton.server_port}/v2/repository/index", {},
                                  headers={"admin-key": "k" * 32})
    finally:
        triton.shutdown()
        proxy.shutdown()
    assert answer == {"who": "triton"}
    assert proxy.seen == []
    assert triton.seen == [("POST /v2/repository/index HTTP/1.1", "k" * 32)]
