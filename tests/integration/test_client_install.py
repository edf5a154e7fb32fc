"""The client is a pip package: installed from this checkout into a fresh
virtual environment (no repository on its path, only its declared
dependencies), its `classify-describe` console script answers the test
server."""

import pathlib
import subprocess
import uuid
import venv

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # pip's own limit is 600 s (a fresh virtual environment and its dependencies)
def test_pip_install_of_the_client_and_its_console_script(triton, photos, tmp_path):
    env_dir = tmp_path / "client-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin/python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(REPO)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]

    # Only the client got installed: none of the server's packages came with it.
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, check=True).stdout.lower()
    assert "classify-describe==" in listed and "torch==" not in listed and "openai==" not in listed

    image = tmp_path / "coffee.png"
    image.write_bytes(photos["coffee"])
    # A prompt of its own: an answer cached by another test would carry no tokens.
    prompt = f"What is it? ({uuid.uuid4().hex[:8]})"
    done = subprocess.run([str(env_dir / "bin/classify-describe"), str(image), "--url", triton.http_url, "--json",
                           "--prompt", prompt],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"espresso"' in done.stdout.splitlines()[0]
