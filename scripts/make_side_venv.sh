#!/usr/bin/env bash
# A venv of its own, made anew, for a tool kept apart from .venv (BentoML, the
# LiteLLM proxy: their dependencies are not the runtime's). pip expands the
# requirements file's ${VAR} pins from the environment (versions.env exported).
# usage: make_side_venv.sh PYTHON DEST_VENV REQUIREMENTS   (paths from the repo root)
set -euo pipefail
cd "$(dirname "$0")/.."

python="$1" dest="$2" requirements="$3"

rm -rf "$dest"
"$python" -m venv "$dest"
"$dest/bin/python" -m pip install --quiet --upgrade pip
"$dest/bin/python" -m pip install --quiet -r "$requirements"
