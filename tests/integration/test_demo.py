"""`make demo` (scripts/demo.sh) as a newcomer runs it: it starts its own
server, answers for the sample photo, and leaves nothing running, whether it
ends normally, on Ctrl-C or because a port is taken."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from serving.procfs import process_state, process_tree
from tools.local_stack import free_port

from .conftest import REPO, TEST_API_KEY

DEMO = REPO / "scripts/demo.sh"
RUN_TIMEOUT_S = 360  # a first server start on the 2-core machine takes ~30 s
# Each test waits up to RUN_TIMEOUT_S for the demo's server, then up to 120 s for it to stop.
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 240)


def demo_env(tmp_path, fake_llm, **extra):
    env = dict(os.environ, HTTP_PORT=str(free_port()), GRPC_PORT=str(free_port()),
               METRICS_PORT=str(free_port()), DEMO_LOG=str(tmp_path / "tritonserver.log"),
               TRITON_ADMIN_KEY_GENERATED_FILE=str(tmp_path / "admin-key"),
               LLM_BASE_URL=fake_llm.base_url, LLM_API_KEY=TEST_API_KEY)
    env.update(extra)
    for name in ("TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE", "MODEL_REPOSITORY", "DEMO_IMAGE", "DEMO_PROMPT"):
        env.pop(name, None)
    return env


def server_pid_in(stderr):
    match = re.search(r"demo: server pid (\d+)", stderr)
    assert match, stderr
    return int(match.group(1))


def assert_nothing_left(pids, env):
    for pid in pids:  # a zombie has exited; its new parent (init) reaps it in its own time
        assert process_state(pid) in (None, "Z"), f"pid {pid} still running after the demo"
    for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT"):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", int(env[name]))) != 0, f"{name} still answers"


def test_the_demo_classifies_describes_and_stops_its_server(tmp_path, llm):
    env = demo_env(tmp_path, llm)
    run = subprocess.run([str(DEMO)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr + (tmp_path / "tritonserver.log").read_text()

    lines = run.stdout.splitlines()
    assert lines[0] == "docs/sample/coffee.png"
    labels = [re.fullmatch(r"\s+\d+\.\d%\s+(.+)", line) for line in lines[1:6]]
    assert all(labels), run.stdout  # five "  62.3%  label" lines
    assert labels[0].group(1) == "espresso", run.stdout  # the top label
    assert "description (llm): Fake answer" in run.stdout
    assert "fallback" not in run.stdout
    assert llm.admin("stats")["answered_ok"] == 1

    server_pid = server_pid_in(run.stderr)
    assert f"demo: stopping the server (pid {server_pid})" in run.stderr
    assert_nothing_left([server_pid], env)
    log = (tmp_path / "tritonserver.log").read_text()
    assert "serve: READY" in log
    assert TEST_API_KEY not in run.stdout + run.stderr + log


# A terminal's Ctrl-C finds SIGINT at its default action. A test run started in the background
# of a script (`cmd &`, `nohup cmd &`) inherits SIGINT ignored, and bash can neither trap nor
# reset a signal ignored when it started: the demo would then sleep through the Ctrl-C and
# exit 0 (seen on 2026-12-03 under `(nohup bash .ci/run &)`). So the demo is exec'd with the
# terminal's default restored, whatever the runner ignores.
AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.argv[1], sys.argv[1:])")


def test_ctrl_c_stops_the_server_it_started(tmp_path, llm):
    """Ctrl-C reaches the terminal's whole process group: the demo, its client
    and the server. The demo's trap still stops the server and waits for it."""
    llm.admin("mode", {"mode": "ok", "latency_ms": 15000})  # a request stays in flight
    env = demo_env(tmp_path, llm)
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        demo = subprocess.Popen([sys.executable, "-c", AS_FROM_A_TERMINAL, str(DEMO)], cwd=tmp_path, env=env,
                                stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while llm.admin("stats")["in_flight"] < 1:
            assert demo.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, "the demo's request never reached the LLM"
            time.sleep(0.5)
        stderr = (tmp_path / "stderr").read_text()
        server_pid = server_pid_in(stderr)
        started = process_tree(server_pid)  # the supervisor, tritonserver, stubs, watchdog
        assert len(started) >= 3, started

        os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(120) == 130
    finally:
        if demo.poll() is None:  # only if the assertions above failed
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert f"demo: stopping the server (pid {server_pid})" in stderr
    assert "demo: failed (exit status 130)" in stderr
    assert_nothing_left(started, env)


def test_a_taken_port_fails_at_once_and_names_it(tmp_path, fake_llm):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = demo_env(tmp_path, fake_llm, HTTP_PORT=str(port))
        # A previous run's log: its READY line must not pass for this server's.
        (tmp_path / "tritonserver.log").write_text("serve: READY  HTTP 127.0.0.1:8000\n")
        started = time.monotonic()
        run = subprocess.run([str(DEMO)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
    assert run.returncode == 1
    assert time.monotonic() - started < 30
    assert "demo: the server exited before it was ready" in run.stderr
    assert f"port {port} is already in use on 127.0.0.1" in run.stderr
    assert "HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002 make demo" in run.stderr
