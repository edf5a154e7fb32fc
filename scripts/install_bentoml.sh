#!/usr/bin/env bash
# BentoML in a venv of its own, for `make bench`'s baseline (a BentoML service of
# the same job: tools/bench/bentoml_service.py). Kept apart from .venv: BentoML's
# own dependencies (starlette, uvicorn, pydantic, OpenTelemetry) are not the
# runtime's, and nothing that ships imports it.
# usage: install_bentoml.sh PYTHON DEST_VENV   (versions.env exported first: `make bentoml-baseline`)
set -euo pipefail
cd "$(dirname "$0")/.."

python="$1" dest="$2"
: "${BENTOML_VERSION:?source versions.env first}"

scripts/make_side_venv.sh "$python" "$dest" requirements-bentoml.txt
# The service runs the backends' own decode and classifier runtime (their package, editable).
"$dest/bin/python" -m pip install --quiet --no-deps --editable ./backends
# The service's imports resolve, with the versions the runtime pins.
"$dest/bin/python" - <<'PY'
import os

import bentoml, classify_describe_server.image_decode, numpy, onnxruntime, openai, PIL

for module, pin in ((bentoml, "BENTOML_VERSION"), (numpy, "NUMPY_VERSION"), (PIL, "PILLOW_VERSION"),
                    (onnxruntime, "ONNXRUNTIME_VERSION"), (openai, "OPENAI_VERSION")):
    assert module.__version__ == os.environ[pin], f"{module.__name__} {module.__version__}, versions.env {pin}"
openai.DefaultAioHttpClient()  # the aiohttp extra is there (the describe step's transport)
PY
echo "install_bentoml: $dest/bin/bentoml"
