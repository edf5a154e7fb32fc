"""The Makefile's targets that only assemble a command: checked with a stand-in for that command."""

import json
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]

# Writes its arguments and the environment it got, as docker would read them.
FAKE_DOCKER = """#!/usr/bin/env python3
import json, os, sys
json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, open(os.environ["FAKE_DOCKER_OUT"], "w"))
"""


def test_docker_run_passes_every_llm_front_and_trace_setting_by_name_only(tmp_path):
    (tmp_path / "docker").write_text(FAKE_DOCKER)
    (tmp_path / "docker").chmod(0o755)
    settings = {"LLM_BASE_URL": "http://ollama:11434/v1", "LLM_MODEL": "llava", "LLM_API_KEY": "sk-DO-NOT-SHOW-1",
                "LLM_API_KEY_REQUIRED": "false", "LLM_VISION": "off", "OPENAI_FRONT_API_KEY": "sk-DO-NOT-SHOW-2",
                "OPENAI_FRONT_DRAIN_S": "2.5", "TRITON_TRACE_OTLP_ENDPOINT": "http://collector:4318/v1/traces",
                "LLM_API_KEY_FILE": "/home/me/key", "CPU_CORES": "4"}
    run = subprocess.run(["make", "--no-print-directory", "docker-run", "LLM_TIMEOUT_S=20"], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_DOCKER_OUT": str(tmp_path / "out"),
                              **settings})
    assert run.returncode == 0, run.stderr
    seen = json.loads((tmp_path / "out").read_text())
    passed = {seen["argv"][i + 1] for i, arg in enumerate(seen["argv"]) if arg == "-e"}
    wanted = {name for name in settings if not name.endswith("_FILE")} | {"LLM_TIMEOUT_S"}
    assert wanted <= passed
    assert "LLM_API_KEY_FILE" not in passed, "a path on this host means nothing in the container"
    assert all(seen["env"].get(name) == value for name, value in settings.items())  # docker reads the values
    assert seen["env"]["LLM_TIMEOUT_S"] == "20"
    for secret in ("sk-DO-NOT-SHOW-1", "sk-DO-NOT-SHOW-2"):
        assert secret not in run.stdout + run.stderr and secret not in " ".join(seen["argv"])
    assert not {name for name in passed if name.startswith(("LLM_", "OPENAI_FRONT_", "TRITON_TRACE_", "CPU_"))} - wanted, \
        "only variables that are set"
