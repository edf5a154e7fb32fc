"""scripts/serve.sh (what `make run` runs) says clearly why it cannot start, and
serving/supervise_tritonserver.sh (what serve.sh execs and the container runs)
announces readiness, runs the stub watchdog and forwards TERM."""

import http.server
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from serving import procfs
from tools import local_stack

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_a_taken_port_is_named_with_a_way_out(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([str(REPO / "scripts/serve.sh")], cwd=REPO, capture_output=True,
                             text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "HTTP_PORT": str(port),
                                  "GRPC_PORT": "0", "METRICS_PORT": "0"})
    assert run.returncode == 1
    assert f"port {port} is already in use" in run.stderr
    assert "HTTP_PORT=" in run.stderr


def test_a_taken_openai_port_is_named_too(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([str(REPO / "scripts/serve.sh")], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "HTTP_PORT": "0", "GRPC_PORT": "0", "METRICS_PORT": "0",
                                  "OPENAI_PORT": str(port)})
    assert run.returncode == 1
    assert f"port {port} is already in use" in run.stderr
    assert "OPENAI_PORT=" in run.stderr


def test_a_missing_build_says_to_run_make_build(tmp_path):
    run = subprocess.run([str(REPO / "scripts/serve.sh")], cwd=REPO, capture_output=True,
                         text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "MODEL_REPOSITORY": str(tmp_path)})
    assert run.returncode == 1
    assert "is missing; run `make build` first" in run.stderr


# -- serving/supervise_tritonserver.sh: what serve.sh execs and the container runs --

FAKE_SERVER = r'''
import http.server, signal, sys, threading
flags = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
port = int(flags["http-port"])
marker = sys.argv[1]

class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

# Triton's default is 0.0.0.0; loopback is enough for the supervisor's checks.
server = http.server.HTTPServer((flags.get("http-address", "127.0.0.1"), port), Ready)
def on_term(signum, frame):
    open(marker, "w").write("TERM")
    threading.Thread(target=server.shutdown).start()
signal.signal(signal.SIGTERM, on_term)
server.serve_forever()
sys.exit(3)
'''


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# The front (python3 -m openai_front) needs aiohttp and tritonclient: the venv's
# python3 first on PATH, as serve.sh puts it (the container's system Python has them).
VENV_PATH = f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"


def cmdline(pid):
    """A child's command line, or "" once it has exited (the readiness check
    exits right after printing READY)."""
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


@pytest.mark.parametrize("address_flags, shown, reached", [
    ((), ("0.0.0.0",) * 3, "127.0.0.1"),  # the Dockerfile CMD: Triton's default, every interface
    (("--http-address=127.0.0.2", "--grpc-address=127.0.0.3"), ("127.0.0.2", "127.0.0.3", "127.0.0.2"),
     "127.0.0.2"),  # metrics follow the HTTP address, as in Triton
], ids=["all-interfaces", "given-addresses"])
def test_supervisor_announces_ready_on_the_servers_own_ports_and_forwards_term(tmp_path, address_flags,
                                                                               shown, reached):
    """Run the way the Dockerfile CMD runs it: a server command and its flags,
    nothing from serve.sh. The stand-in server answers /v2/health/ready and
    exits 3 after TERM, which the supervisor passes on as its own status (a
    Triton that could not stop cleanly exits 1: the supervisor must not hide it). The
    READY line names the addresses the server binds; the readiness check and
    the watchdog reach it on loopback when it binds every interface."""
    http_port, openai_port = free_port(), free_port()
    marker = tmp_path / "got_term"
    (tmp_path / "fake_tritonserver.py").write_text(FAKE_SERVER)
    supervisor = subprocess.Popen(
        [str(REPO / "serving/supervise_tritonserver.sh"), sys.executable, str(tmp_path / "fake_tritonserver.py"),
         str(marker), f"--http-port={http_port}", "--grpc-port=7001", "--metrics-port=7002", *address_flags],
        # Started from elsewhere, as in the container (WORKDIR is not the repository):
        # the watchdog (`python3 -m serving.stub_watchdog`) must find its package.
        cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={"PATH": VENV_PATH, "STUB_WATCHDOG_INTERVAL_S": "0.2", "TMPDIR": str(tmp_path),
             "OPENAI_PORT": str(openai_port)})
    # Whatever goes wrong, the test ends: its whole process group (the supervisor,
    # the stand-in and the watchdog, all started here) is killed after 60 s.
    deadline = threading.Timer(60, os.killpg, (supervisor.pid, signal.SIGKILL))
    deadline.start()
    try:
        for line in supervisor.stderr:
            if "READY" in line:
                break
        http_at, grpc_at, metrics_at = shown
        assert f"HTTP {http_at}:{http_port}  gRPC {grpc_at}:7001  metrics http://{metrics_at}:7002/metrics" in line
        assert f"OpenAI http://{http_at}:{openai_port}/v1" in line
        fronts = [pid for pid in procfs.children(supervisor.pid) if "openai_front" in cmdline(pid)]
        assert len(fronts) == 1, "the OpenAI front runs beside the server"
        front_cmdline = cmdline(fronts[0]).split("\0")
        assert front_cmdline[-7:-1] == ["--host", http_at, "--port", str(openai_port), "--triton-grpc-url",
                                      f"{reached if grpc_at == '0.0.0.0' else grpc_at}:7001"]
        health_deadline = time.monotonic() + 30
        while True:  # it listens once its imports are done
            try:
                assert procfs.http_json(f"http://{reached}:{openai_port}/health", timeout=2) == {"status": "ok"}
                break
            except OSError:
                assert time.monotonic() < health_deadline, "the front did not answer /health"
                time.sleep(0.2)
        watchdogs = [pid for pid in procfs.children(supervisor.pid) if "serving.stub_watchdog" in cmdline(pid)]
        assert len(watchdogs) == 1, "the stub watchdog runs beside the server"
        watchdog_cmdline = cmdline(watchdogs[0]).split("\0")
        assert f"{reached}:{http_port}" in watchdog_cmdline, "the watchdog talks to the server's HTTP port"
        time.sleep(1.0)  # past its imports and first looks: still running, not a zombie
        assert procfs.process_state(watchdogs[0]) not in (None, "Z"), "the watchdog died after starting"

        supervisor.send_signal(signal.SIGTERM)
        rest = supervisor.stderr.read()
        assert supervisor.wait(timeout=30) == 3, "the server's own exit status after TERM"
    finally:
        local_stack.stop_process(supervisor)
        deadline.cancel()
    assert marker.read_text() == "TERM", "TERM reaches the server"
    assert "stopped with status 3 (not a clean stop" in rest
    assert "stopping tritonserver" in rest
    assert not pathlib.Path(f"/proc/{watchdogs[0]}").exists(), "the watchdog stops with the server"
    assert not pathlib.Path(f"/proc/{fronts[0]}").exists(), "the front stops with the server"


def test_a_term_at_any_moment_of_startup_leaves_nothing_running(tmp_path):
    """The trap is set before anything starts, so a TERM while the server and
    the watchdog are being started still stops all of them (a pod deleted
    right after it was created). Nothing of the process group may survive."""
    (tmp_path / "fake_tritonserver.py").write_text(FAKE_SERVER)
    for delay_s in (0.0, 0.1, 0.3):
        http_port = free_port()
        supervisor = subprocess.Popen(
            [str(REPO / "serving/supervise_tritonserver.sh"), sys.executable, str(tmp_path / "fake_tritonserver.py"),
             str(tmp_path / "got_term"), f"--http-port={http_port}"],
            stderr=subprocess.DEVNULL, start_new_session=True,
            env={"PATH": VENV_PATH, "STUB_WATCHDOG_INTERVAL_S": "0.2", "TMPDIR": str(tmp_path),
                 "OPENAI_PORT": str(free_port())})
        time.sleep(delay_s)
        supervisor.send_signal(signal.SIGTERM)
        try:
            supervisor.wait(timeout=30)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.killpg(supervisor.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"TERM {delay_s} s after the start left processes running")
        finally:
            try:
                os.killpg(supervisor.pid, signal.SIGKILL)  # only the group this test started
            except ProcessLookupError:
                pass


def start_supervisor(tmp_path, **env):
    """The supervisor with the stand-in server (its TERM marker at tmp_path/got_term)
    and the real front; (process, http port, front port)."""
    http_port, openai_port = free_port(), free_port()
    (tmp_path / "fake_tritonserver.py").write_text(FAKE_SERVER)
    supervisor = subprocess.Popen(
        [str(REPO / "serving/supervise_tritonserver.sh"), sys.executable, str(tmp_path / "fake_tritonserver.py"),
         str(tmp_path / "got_term"), f"--http-port={http_port}", "--http-address=127.0.0.1",
         "--grpc-address=127.0.0.1", f"--grpc-port={free_port()}", f"--metrics-port={free_port()}"],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={"PATH": VENV_PATH, "STUB_WATCHDOG_INTERVAL_S": "0.2", "TMPDIR": str(tmp_path),
             "OPENAI_PORT": str(openai_port), **env})
    return supervisor, http_port, openai_port


def assert_group_gone(pgid, within_s=10):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError("processes of the supervisor's group are still running")


def test_a_front_that_cannot_start_stops_the_server_and_fails_the_supervisor(tmp_path):
    """Bad front settings (here OPENAI_FRONT_TIMEOUT_S; likewise an unedited key
    Secret or a missing aiohttp): the front exits at once. The supervisor must not
    go on serving Triton with port 8003 dead: it says so, stops the server and
    exits non-zero, so the container restarts and the pod never becomes Ready."""
    supervisor, _, openai_port = start_supervisor(tmp_path, OPENAI_FRONT_TIMEOUT_S="abc")
    deadline = threading.Timer(60, os.killpg, (supervisor.pid, signal.SIGKILL))
    deadline.start()
    try:
        stderr = supervisor.stderr.read()
        status = supervisor.wait(timeout=60)
    finally:
        local_stack.stop_process(supervisor)
        deadline.cancel()
    assert status == 2, stderr  # the front's own exit status (openai_front: a ConfigError)
    assert "OPENAI_FRONT_TIMEOUT_S='abc' is not a number" in stderr  # the front's reason
    assert f"serve: ERROR: the OpenAI front (port {openai_port}) exited with status 2" in stderr
    assert "READY" not in stderr
    assert (tmp_path / "got_term").read_text() == "TERM", "the server is stopped"
    assert_group_gone(supervisor.pid)


def read_until_ready(supervisor):
    """The supervisor's stderr up to its READY line (the line returned)."""
    for line in supervisor.stderr:
        if "READY" in line:
            return line
    raise AssertionError("the supervisor never said READY")


def test_a_front_that_dies_later_stops_the_server_and_fails_the_supervisor(tmp_path):
    """The front killed after READY (an OOM kill, a crash): the same end, and the
    watchdog stops with the server."""
    supervisor, _, openai_port = start_supervisor(tmp_path)
    deadline = threading.Timer(60, os.killpg, (supervisor.pid, signal.SIGKILL))
    deadline.start()
    try:
        read_until_ready(supervisor)
        # READY means the front answers too.
        assert procfs.http_json(f"http://127.0.0.1:{openai_port}/health", timeout=2) == {"status": "ok"}
        (front,) = [pid for pid in procfs.children(supervisor.pid) if "openai_front" in cmdline(pid)]
        watchdogs = [pid for pid in procfs.children(supervisor.pid) if "serving.stub_watchdog" in cmdline(pid)]
        assert len(watchdogs) == 1
        os.kill(front, signal.SIGKILL)
        rest = supervisor.stderr.read()
        status = supervisor.wait(timeout=30)
    finally:
        local_stack.stop_process(supervisor)
        deadline.cancel()
    assert status == 128 + signal.SIGKILL, rest
    assert f"serve: ERROR: the OpenAI front (port {openai_port}) exited with status 137" in rest
    assert "stopping tritonserver" in rest
    assert (tmp_path / "got_term").read_text() == "TERM", "the server is stopped"
    assert not pathlib.Path(f"/proc/{watchdogs[0]}").exists(), "the watchdog stops with the server"
    assert_group_gone(supervisor.pid)


def run_with_args_dump(tmp_path, **env):
    """The supervisor on a stand-in server that writes its arguments and exits 0:
    (the supervisor's exit status, its stderr, the server's arguments or None)."""
    dump = tmp_path / "args"
    server = tmp_path / "dump_args.py"
    # Its OTEL_* environment goes beside, in args.env: what the models' stubs inherit.
    server.write_text("import json, os, sys\nopen(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))\n"
                      "open(sys.argv[1] + '.env', 'w').write(json.dumps({k: v for k, v in os.environ.items()"
                      " if k.startswith('OTEL_')}))\n")
    result = subprocess.run(
        [str(REPO / "serving/supervise_tritonserver.sh"), sys.executable, str(server), str(dump), "--http-port=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": VENV_PATH, "TMPDIR": str(tmp_path), "STUB_WATCHDOG": "0", "OPENAI_FRONT": "0",
             "TRITON_ADMIN_KEY": "k" * 32, **env})
    return result.returncode, result.stderr, json.loads(dump.read_text()) if dump.exists() else None


def test_tracing_is_off_without_an_endpoint_and_on_with_one(tmp_path):
    # An OTEL endpoint left in the environment does not switch the LLM-call spans on alone.
    status, _, args = run_with_args_dump(tmp_path, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://elsewhere:4318/v1/traces")
    assert status == 0 and not [a for a in args if a.startswith("--trace")]
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in server_env(tmp_path), "no LLM-call spans either"
    status, stderr, args = run_with_args_dump(
        tmp_path, TRITON_TRACE_OTLP_ENDPOINT="http://user:token@collector:4318/v1/traces?key=secret",
        TRITON_TRACE_RATE="0")
    assert status == 0, stderr
    assert [a for a in args if a.startswith("--trace")] == [
        "--trace-config=mode=opentelemetry", "--trace-config=level=TIMESTAMPS", "--trace-config=count=-1",
        "--trace-config=rate=0", "--trace-config=opentelemetry,url=http://user:token@collector:4318/v1/traces?key=secret",
        "--trace-config=opentelemetry,resource=service.name=classify-describe"]
    assert "tracing on: OpenTelemetry spans to collector:4318; traced: requests with a traceparent\n" in stderr
    assert "token" not in stderr and "secret" not in stderr, "the log names the host only"
    # The describe step's LLM-call span goes to the same collector, under the same service name.
    assert server_env(tmp_path) == {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://user:token@collector:4318/v1/traces?key=secret",
        "OTEL_SERVICE_NAME": "classify-describe"}


def server_env(tmp_path):
    """The OTEL_* environment the stand-in server of run_with_args_dump ran with."""
    return json.loads((tmp_path / "args.env").read_text())


@pytest.mark.parametrize("env, says", [
    ({"TRITON_TRACE_OTLP_ENDPOINT": "collector:4318"}, "TRITON_TRACE_OTLP_ENDPOINT must be an http(s):// URL"),
    ({"TRITON_TRACE_OTLP_ENDPOINT": "http://c:4318/v1/traces", "TRITON_TRACE_RATE": "1e3"},
     "TRITON_TRACE_RATE must be a whole number"),
])
def test_bad_trace_settings_stop_the_start_with_the_reason(tmp_path, env, says):
    status, stderr, args = run_with_args_dump(tmp_path, **env)
    assert status == 1 and says in stderr and args is None, stderr


class ProxyStandIn(http.server.BaseHTTPRequestHandler):
    """What a pod's http_proxy would be: records every request it gets and answers 502."""

    def do_GET(self):
        self.server.seen.append(self.requestline)
        self.send_response(502)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_readiness_check_goes_direct_with_a_proxy_set(tmp_path):
    """http_proxy set for the LLM's egress: the readiness check (and the watchdog) must still reach
    the server and the front on loopback, not the proxy."""
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ProxyStandIn)
    proxy.seen = []
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    proxy_url = f"http://127.0.0.1:{proxy.server_port}"
    supervisor, _, _ = start_supervisor(tmp_path, http_proxy=proxy_url, HTTP_PROXY=proxy_url, READY_TIMEOUT="20")
    deadline = threading.Timer(60, os.killpg, (supervisor.pid, signal.SIGKILL))
    deadline.start()
    try:
        for line in supervisor.stderr:
            if "READY" in line or "not ready after" in line:
                break
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(timeout=30)
    finally:
        local_stack.stop_process(supervisor)
        deadline.cancel()
        proxy.shutdown()
    assert "READY" in line, line
    assert proxy.seen == []


@pytest.mark.parametrize("env, says", [
    ({"OPENAI_FRONT_DRAIN_S": "abc"}, "OPENAI_FRONT_DRAIN_S='abc' must be a positive number of seconds"),
    ({"OPENAI_FRONT_DRAIN_S": "0"}, "OPENAI_FRONT_DRAIN_S='0' must be a positive number of seconds"),
    ({"FRONT_STOP_GRACE_S": "-1"}, "FRONT_STOP_GRACE_S='-1' must be a non-negative number of seconds"),
    ({"STREAMS_STOP_S": "inf"}, "STREAMS_STOP_S='inf' must be a non-negative number of seconds"),
    ({"OPENAI_FRONT_DRAIN_S": "1e19"}, "OPENAI_FRONT_DRAIN_S='1e19' must be a positive number of seconds, at most 86400"),
])
def test_bad_stop_waits_stop_the_start_with_the_reason(tmp_path, env, says):
    status, stderr, args = run_with_args_dump(tmp_path, **env)
    assert status == 1 and says in stderr and args is None, stderr


def test_stop_waits_that_are_not_whole_seconds_still_stop_everything(tmp_path):
    """The front takes any positive number of seconds for its drain (1e1, 2.5): the supervisor's stop,
    in bash integers, must not die half-way, with the front told and tritonserver never."""
    supervisor, _, _ = start_supervisor(tmp_path, OPENAI_FRONT_DRAIN_S="1e1", FRONT_STOP_GRACE_S="0.5",
                                        STREAMS_STOP_S="0.5")
    deadline = threading.Timer(60, os.killpg, (supervisor.pid, signal.SIGKILL))
    deadline.start()
    try:
        read_until_ready(supervisor)
        supervisor.send_signal(signal.SIGTERM)
        rest = supervisor.stderr.read()
        status = supervisor.wait(timeout=30)
    finally:
        local_stack.stop_process(supervisor)
        deadline.cancel()
    assert status == 3, rest  # the stand-in server's own status after TERM
    assert (tmp_path / "got_term").read_text() == "TERM", "the server is stopped"
    assert_group_gone(supervisor.pid)
