"""scripts/serve.sh (what `make run` runs) says clearly why it cannot start."""

import pathlib
import socket
import subprocess

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


def test_a_missing_build_says_to_run_make_build(tmp_path):
    run = subprocess.run([str(REPO / "scripts/serve.sh")], cwd=REPO, capture_output=True,
                         text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "MODEL_REPOSITORY": str(tmp_path)})
    assert run.returncode == 1
    assert "is missing; run `make build` first" in run.stderr
