"""Every shipped way of starting the server restricts the control APIs.

For the exact command each path runs (the Dockerfile CMD, the Deployment of
each overlay, the KServe runtime, and scripts/serve.sh as `make run` runs it),
the supervisor is started with a stand-in `tritonserver` that records the
arguments and the environment it receives. Whatever the path, the server must
be told to restrict model-repository, shared-memory, logging and trace over
HTTP and gRPC with a non-empty key; the key must reach the stub watchdog, stay
out of the server's own environment (environment dumps) and out of
everything the supervisor prints. The real server's answers to these flags are
checked in tests/integration/test_restricted_api.py.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from serving import procfs
from tests.test_deploy_manifests import (
    DEPLOY,
    OVERLAYS,
    SUPERVISOR,
    dockerfile_cmd,
    load_docs,
    render,
    server_container,
)
from tools import local_stack

REPO = pathlib.Path(__file__).resolve().parents[1]
RESTRICTED = {"model-repository", "shared-memory", "logging", "trace"}
# What stays open (docs/reliability.md): probes, clients and autoscalers use them.
OPEN = {"inference", "health", "metadata", "model-config", "statistics"}
RESTRICT_FLAGS = ("--http-restricted-api", "--grpc-restricted-protocol")

STAND_IN = """#!{python}
import json, os, signal, sys, time
record = {record!r}
with open(record + ".tmp", "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
os.rename(record + ".tmp", record)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(1)
"""


def write_stand_in(path, record):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STAND_IN.format(python=sys.executable, record=str(record)))
    path.chmod(0o755)


def wait_for(predicate, what, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while True:
        found = predicate()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def environ(pid):
    try:
        raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


class Run:
    """One supervised start: what the stand-in server received, the watchdog's
    environment and everything printed (stdout and stderr)."""

    def __init__(self, command, env, record, log_path):
        self.record_path = record
        self.log_path = log_path
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            wait_for(lambda: record.exists() or process.poll() is not None, "the stand-in server")
            assert record.exists(), f"the server never started:\n{log_path.read_text()}"
            received = json.loads(record.read_text())
            self.argv, self.env = received["argv"], received["env"]
            self.watchdog_env = wait_for(lambda: self._watchdog_env(process.pid), "the stub watchdog")
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # only the group this test started
            except ProcessLookupError:
                pass
        self.output = log_path.read_text()

    @staticmethod
    def _watchdog_env(supervisor_pid):
        for pid in procfs.process_tree(supervisor_pid)[1:]:
            try:
                argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serving.stub_watchdog" in argv:
                return environ(pid)
        return None

    def flag(self, name):
        values = [a.split("=", 1)[1] for a in self.argv if a.startswith(f"{name}=")]
        assert len(values) == 1, f"expected one {name}=... in {self.argv}"
        return values[0]

    def groups(self, name):
        """{frozenset of APIs: (header, key)} of every `name=<apis>:<header>=<key>`."""
        groups = {}
        for value in (a.split("=", 1)[1] for a in self.argv if a.startswith(f"{name}=")):
            apis, _, setting = value.partition(":")
            header, _, key = setting.partition("=")
            groups[frozenset(apis.split(","))] = (header, key)
        return groups

    def restricted_key(self, inference_key=None):
        """The key the server was told to require, after checking that both
        protocols restrict exactly the control APIs with header admin-key, and
        inference with header inference-key when (only when) one was given."""
        keys = set()
        for name in RESTRICT_FLAGS:
            groups = self.groups(name)
            expected = {frozenset(RESTRICTED)} | ({frozenset({"inference"})} if inference_key else set())
            assert set(groups) == expected, f"{name} restricts {groups}; expected {expected}"
            header, key = groups[frozenset(RESTRICTED)]
            assert header == "admin-key" and key, f"{name} has no admin-key=<key>"
            keys.add(key)
            if inference_key:
                assert groups[frozenset({"inference"})] == ("inference-key", inference_key), name
        assert len(keys) == 1, "HTTP and gRPC are restricted with different keys"
        return keys.pop()

    def check_key_handling(self, key, inference_key=None):
        """The key reaches the server (arguments) and the watchdog (environment),
        nothing else: not the server's environment, not the printed output."""
        assert self.restricted_key(inference_key) == key
        assert self.watchdog_env.get("TRITON_ADMIN_KEY") == key, "the watchdog could not reload a model"
        assert "TRITON_ADMIN_KEY" not in self.env, "the key belongs in the server's arguments, not its environment"
        assert key not in "".join(self.env.values())
        assert key not in self.output, "the supervisor printed the key"
        assert "need header 'admin-key'" in self.output


@pytest.fixture
def stand_in(tmp_path):
    """A `tritonserver` first on PATH, as the container's is."""
    bin_dir = tmp_path / "bin"
    write_stand_in(bin_dir / "tritonserver", tmp_path / "received.json")
    return bin_dir


def supervised(command, env, tmp_path, stand_in):
    """Run a container command (supervisor path as in the image) on this machine."""
    assert command[:2] == [SUPERVISOR, "tritonserver"], command[:2]
    command = [str(REPO / "serving/supervise_tritonserver.sh"), *command[1:]]
    # OPENAI_FRONT=0: the front would take port 8003 on every interface; tests/test_serve_script.py covers it.
    env = {"PATH": f"{stand_in}:{os.environ['PATH']}", "TMPDIR": str(tmp_path), "OPENAI_FRONT": "0", **env}
    return Run(command, env, tmp_path / "received.json", tmp_path / "supervisor.log")


def check_generated_key(run, path):
    assert path.exists(), f"no generated key at {path}:\n{run.output}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert len(key) == 64 and int(key, 16) >= 0, "32 random bytes, hex"
    run.check_key_handling(key)
    assert str(path) in run.output, "the log says where the generated key is"
    return key


def container_env(container, *more):
    """The plain `value` environment of a container spec (the ConfigMap's
    entries hold no key and do not matter here)."""
    env = {}
    for entries in (container.get("env", []), *more):
        env.update({e["name"]: e["value"] for e in entries if "value" in e})
    return env


def kserve_command_and_env():
    runtime = load_docs(DEPLOY / "kserve/servingruntime.yaml")[0]["spec"]["containers"][0]
    model = load_docs(DEPLOY / "kserve/inferenceservice.yaml")[0]["spec"]["predictor"]["model"]
    return runtime["args"], container_env(runtime, model.get("env", []))


def shipped_container_paths():
    paths = [("dockerfile", dockerfile_cmd(), {})]
    for overlay in OVERLAYS:
        container = server_container(render(DEPLOY / "overlays" / overlay))
        paths.append((f"deployment-{overlay}", container["args"], container_env(container)))
    paths.append(("kserve", *kserve_command_and_env()))
    return paths


SHIPPED_CONTAINER_PATHS = shipped_container_paths()


@pytest.mark.parametrize("where, command, env", SHIPPED_CONTAINER_PATHS, ids=[p[0] for p in SHIPPED_CONTAINER_PATHS])
def test_every_container_path_restricts_the_control_apis_with_a_generated_key(where, command, env, tmp_path,
                                                                               stand_in):
    """No Secret mounted (the manifests' TRITON_ADMIN_KEY_FILE does not exist here,
    as in a pod without the optional Secret): the supervisor generates a key."""
    run = supervised(command, env, tmp_path, stand_in)
    check_generated_key(run, tmp_path / "triton-admin-key")
    # All interfaces, deliberately: the pod network and published ports need it.
    for name in ("--http-address", "--grpc-address", "--metrics-address"):
        assert run.flag(name) == "0.0.0.0", f"{where}: {name}"
    if "TRITON_ADMIN_KEY_FILE" in env:
        assert f"TRITON_ADMIN_KEY_FILE={env['TRITON_ADMIN_KEY_FILE']} does not exist" in run.output


def test_a_key_file_is_honoured_and_wins_over_the_variable(tmp_path, stand_in):
    """What a mounted Secret gives the pod: the file's key (its newline stripped)."""
    key_file = tmp_path / "admin-key"
    key_file.write_text("adm-from-file-0123456789abcdef\n")
    run = supervised(dockerfile_cmd(), {"TRITON_ADMIN_KEY_FILE": str(key_file),
                                        "TRITON_ADMIN_KEY": "adm-from-env-0123456789abcdef"}, tmp_path, stand_in)
    run.check_key_handling("adm-from-file-0123456789abcdef")
    assert "adm-from-env" not in run.output + "".join(run.env.values())
    assert not (tmp_path / "triton-admin-key").exists(), "nothing is generated when a key is given"


# -- inference: open by default, closed by TRITON_INFERENCE_KEY(_FILE) ---------------

INFERENCE_KEY = "inf-from-env-0123456789abcdef"


def check_inference_key_handling(run, key):
    run.check_key_handling(run.restricted_key(inference_key=key), inference_key=key)
    assert "TRITON_INFERENCE_KEY" not in run.env, "the key belongs in the server's arguments, not its environment"
    assert key not in "".join(run.env.values()) and key not in run.output
    assert "inference needs header 'inference-key'" in run.output


def test_inference_is_open_without_an_inference_key(tmp_path, stand_in):
    run = supervised(dockerfile_cmd(), {"TRITON_ADMIN_KEY": "adm-from-env-0123456789abcdef"}, tmp_path, stand_in)
    run.restricted_key(inference_key=None)  # the control APIs only
    assert "inference is open" in run.output


def test_an_inference_key_from_the_environment_restricts_inference(tmp_path, stand_in):
    run = supervised(dockerfile_cmd(), {"TRITON_ADMIN_KEY": "adm-from-env-0123456789abcdef",
                                        "TRITON_INFERENCE_KEY": INFERENCE_KEY}, tmp_path, stand_in)
    check_inference_key_handling(run, INFERENCE_KEY)
    assert "TRITON_INFERENCE_KEY" not in run.watchdog_env, "the watchdog never infers"


def test_an_inference_key_file_wins_and_a_missing_one_counts_as_unset(tmp_path, stand_in):
    key_file = tmp_path / "inference-key"
    key_file.write_text("inf-from-file-0123456789abcdef\n")
    run = supervised(dockerfile_cmd(), {"TRITON_INFERENCE_KEY_FILE": str(key_file),
                                        "TRITON_INFERENCE_KEY": INFERENCE_KEY}, tmp_path, stand_in)
    check_inference_key_handling(run, "inf-from-file-0123456789abcdef")
    assert INFERENCE_KEY not in run.output + "".join(run.env.values())
    (tmp_path / "received.json").unlink()
    run = supervised(dockerfile_cmd(), {"TRITON_INFERENCE_KEY_FILE": str(tmp_path / "absent")}, tmp_path, stand_in)
    run.restricted_key(inference_key=None)
    assert f"TRITON_INFERENCE_KEY_FILE={tmp_path / 'absent'} does not exist" in run.output
    assert "inference is open" in run.output


@pytest.mark.parametrize("content, message", [("\n", "is empty"), ("two words\n", "spaces or control characters")],
                         ids=["empty", "spaces"])
def test_an_unusable_inference_key_file_stops_the_start(tmp_path, stand_in, content, message):
    key_file = tmp_path / "inference-key"
    key_file.write_text(content)
    status, stderr = refused_start(tmp_path, stand_in, {"TRITON_INFERENCE_KEY_FILE": str(key_file)})
    assert status == 1 and message in stderr


def test_a_key_from_the_environment_is_used_and_kept_from_the_server(tmp_path, stand_in):
    run = supervised(dockerfile_cmd(), {"TRITON_ADMIN_KEY": "adm-from-env-0123456789abcdef"}, tmp_path, stand_in)
    run.check_key_handling("adm-from-env-0123456789abcdef")
    assert not (tmp_path / "triton-admin-key").exists()


def refused_start(tmp_path, stand_in, env):
    """Run the supervisor expecting it to refuse; (status, stderr). Whatever it
    started instead is stopped with its process group."""
    process = subprocess.Popen([str(REPO / "serving/supervise_tritonserver.sh"), *dockerfile_cmd()[1:]],
                               env={"PATH": f"{stand_in}:{os.environ['PATH']}", "TMPDIR": str(tmp_path),
                                    "OPENAI_FRONT": "0", **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        stderr = "(still running after 10 s)"
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # only the group this test started
        except ProcessLookupError:
            pass
    assert not (tmp_path / "received.json").exists(), "the server must not start unrestricted or with a bad key"
    return process.wait(), stderr


@pytest.mark.parametrize("content, message", [("\n", "is empty"), ("two words\n", "spaces or control characters")],
                         ids=["empty", "spaces"])
def test_an_unusable_key_file_stops_the_start(tmp_path, stand_in, content, message):
    key_file = tmp_path / "admin-key"
    key_file.write_text(content)
    status, stderr = refused_start(tmp_path, stand_in, {"TRITON_ADMIN_KEY_FILE": str(key_file)})
    assert status == 1 and message in stderr


def test_an_unwritable_generated_key_file_stops_the_start(tmp_path, stand_in):
    status, stderr = refused_start(tmp_path, stand_in,
                                   {"TRITON_ADMIN_KEY_GENERATED_FILE": str(tmp_path / "missing-dir/key")})
    assert status == 1 and "cannot write the generated admin key" in stderr


# -- scripts/serve.sh, as `make run` runs it ------------------------------------------

def checkout_with_a_stand_in(tmp_path):
    """A copy of the scripts serve.sh needs, in a tree where `make build`'s
    outputs are present and build/triton/.../tritonserver is the stand-in."""
    tree = tmp_path / "checkout"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts/serve.sh", tree / "scripts/serve.sh")
    shutil.copytree(REPO / "serving", tree / "serving", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / ".venv").symlink_to(REPO / ".venv")
    write_stand_in(tree / "build/triton/pytriton/tritonserver/bin/tritonserver", tmp_path / "received.json")
    (tree / "build/backends/python").mkdir(parents=True)
    (tree / "model_repository/classifier/1").mkdir(parents=True)
    (tree / "model_repository/classifier/1/model.pt").touch()
    return tree


def serve(tree, tmp_path, **env):
    ports = {"HTTP_PORT": str(local_stack.free_port()), "GRPC_PORT": str(local_stack.free_port()),
             "METRICS_PORT": str(local_stack.free_port()), "OPENAI_FRONT": "0"}
    return Run([str(tree / "scripts/serve.sh")], {"PATH": os.environ["PATH"], **ports, **env},
               tmp_path / "received.json", tmp_path / "serve.log")


@pytest.mark.parametrize("listen_address", [None, "0.0.0.0"], ids=["default", "LISTEN_ADDRESS=0.0.0.0"])
def test_make_run_restricts_the_control_apis_and_binds_loopback_by_default(tmp_path, listen_address):
    tree = checkout_with_a_stand_in(tmp_path)
    run = serve(tree, tmp_path, **({"LISTEN_ADDRESS": listen_address} if listen_address else {}))
    check_generated_key(run, tree / f"build/admin-key-{run.env['HTTP_PORT']}")
    for name in ("--http-address", "--grpc-address", "--metrics-address"):
        assert run.flag(name) == (listen_address or "127.0.0.1"), name


def test_a_second_make_run_on_other_ports_keeps_the_first_ones_key(tmp_path):
    """The generated key is per instance (its HTTP port in the file's name): a second server
    from the same checkout does not overwrite the key the first one requires."""
    tree = checkout_with_a_stand_in(tmp_path)
    first = serve(tree, tmp_path)
    first_key = check_generated_key(first, tree / f"build/admin-key-{first.env['HTTP_PORT']}")
    (tmp_path / "received.json").unlink()  # what the stand-in recorded of the first
    second = serve(tree, tmp_path)
    second_key = check_generated_key(second, tree / f"build/admin-key-{second.env['HTTP_PORT']}")
    assert first.env["HTTP_PORT"] != second.env["HTTP_PORT"] and first_key != second_key
    assert (tree / f"build/admin-key-{first.env['HTTP_PORT']}").read_text().strip() == first_key


def test_make_run_with_a_key_uses_it(tmp_path):
    tree = checkout_with_a_stand_in(tmp_path)
    run = serve(tree, tmp_path, TRITON_ADMIN_KEY="adm-make-run-0123456789abcdef")
    run.check_key_handling("adm-make-run-0123456789abcdef")
    assert not list((tree / "build").glob("admin-key*"))


def test_the_port_check_binds_the_address_the_server_will(tmp_path):
    """A port held on 127.0.0.2 does not stop a loopback server, and does stop
    one on every interface."""
    tree = checkout_with_a_stand_in(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        refused = subprocess.run([str(tree / "scripts/serve.sh")], capture_output=True, text=True, timeout=60,
                                 env={"PATH": os.environ["PATH"], "HTTP_PORT": port, "GRPC_PORT": "0",
                                      "METRICS_PORT": "0", "LISTEN_ADDRESS": "0.0.0.0", "OPENAI_FRONT": "0"})
        assert refused.returncode == 1 and f"port {port} is already in use on 0.0.0.0" in refused.stderr
        run = serve(tree, tmp_path, HTTP_PORT=port)
    assert run.flag("--http-port") == port and run.flag("--http-address") == "127.0.0.1"
