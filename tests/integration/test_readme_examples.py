"""Every client example in the README runs as written, against the test server.

The only edits: the default ports become the session server's free ports, and
`photo.jpg` / `photos/*.jpg` are real photos in a temporary folder.
"""

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


PYTHON_EXAMPLES = [block for block in code_blocks("python") if "127.0.0.1:8000" in block]
CLI_EXAMPLES = [line for block in code_blocks("bash") for line in block.splitlines()
                if line.startswith(".venv/bin/python -m classify_describe")]


def test_the_readme_has_client_examples():
    assert len(PYTHON_EXAMPLES) >= 2 and len(CLI_EXAMPLES) >= 3


@pytest.fixture
def workdir(tmp_path, photos, triton):
    (tmp_path / "photo.jpg").write_bytes(photos["chelsea"])
    (tmp_path / "photos").mkdir()
    for name, data in photos.items():
        (tmp_path / "photos" / f"{name}.jpg").write_bytes(data)
    return tmp_path


def on_test_ports(text, triton):
    return (text.replace("127.0.0.1:8000", triton.http_url)
                .replace("127.0.0.1:8001", triton.grpc_url))


@pytest.mark.parametrize("example", PYTHON_EXAMPLES, ids=lambda e: e.splitlines()[0][:40])
def test_python_example(example, workdir, triton, llm):
    run = subprocess.run([sys.executable, "-c", on_test_ports(example, triton)], cwd=workdir,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "cat" in run.stdout  # the photo is a cat, whichever output the example prints


@pytest.mark.parametrize("command", CLI_EXAMPLES, ids=lambda c: c[38:80])
def test_command_line_example(command, workdir, triton, llm):
    command = on_test_ports(command, triton)
    if "--url" not in command:
        command += f" --url {triton.http_url}"
    command = command.replace(".venv/bin/python", sys.executable)
    run = subprocess.run(command, shell=True, cwd=workdir, env={"PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    if "> results.jsonl" in command:
        assert len((workdir / "results.jsonl").read_text().splitlines()) == 2
    else:
        assert "cat" in run.stdout
