"""Every client example in the README runs as written, against the test server.

The only edits: the default ports become the session server's free ports, and
`photo.jpg` / `photos/*.jpg` are real photos in a temporary folder. The curl
examples run from the repository root, where their docs/sample/coffee.png is.
"""

import base64
import json
import pathlib
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


PYTHON_EXAMPLES = [block for block in code_blocks("python") if "127.0.0.1:8000" in block]
CLI_EXAMPLES = [line for block in code_blocks("bash") for line in block.splitlines()
                if line.startswith(".venv/bin/python -m classify_describe")]
INFER_URL = re.compile(r"127\.0\.0\.1:8000/v2/models/(\w+)/infer")
CURL_EXAMPLES = {INFER_URL.search(block).group(1): block for block in code_blocks("bash")
                 if INFER_URL.search(block)}


def test_the_readme_has_client_examples():
    assert len(PYTHON_EXAMPLES) >= 2 and len(CLI_EXAMPLES) >= 3
    assert set(CURL_EXAMPLES) == {"classify_and_describe", "describe"}


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


@pytest.mark.parametrize("model", sorted(CURL_EXAMPLES))
def test_curl_example(model, triton, llm):
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", on_test_ports(CURL_EXAMPLES[model], triton)],
                         cwd=REPO, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    outputs = {output["name"]: output for output in json.loads(run.stdout)["outputs"]}
    assert outputs["DESCRIPTION_SOURCE"]["data"] == ["llm"]
    assert outputs["DESCRIPTION"]["data"][0].startswith("Fake answer")
    if model == "classify_and_describe":
        assert outputs["LABELS"]["shape"] == [1, 5] and outputs["LABELS"]["data"][0] == "espresso"
        assert outputs["SCORES"]["datatype"] == "FP32" and len(outputs["SCORES"]["data"]) == 5


def test_base64_in_json_is_not_an_image(triton, photos):
    """Why the README sends the photo in binary: a BYTES element in JSON is a
    string, so base64 reaches the model as base64 text, and is refused."""
    body = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1, 1],
                        "data": [base64.b64encode(photos["coffee"]).decode()]}]}
    request = urllib.request.Request(f"http://{triton.http_url}/v2/models/classify/infer",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    assert "IMAGE" in json.loads(refused.value.read())["error"]
