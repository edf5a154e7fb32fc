#!/usr/bin/env bash
# The LiteLLM proxy (the shared LLM gateway: docs/llm-gateway.md) in a venv of
# its own, for tests/integration/test_llm_gateway.py. Kept apart from .venv:
# LiteLLM's ranges for openai, pydantic and aiohttp are not the runtime's.
# usage: install_litellm.sh PYTHON DEST_VENV   (versions.env exported first: `make litellm-gateway`)
set -euo pipefail
cd "$(dirname "$0")/.."

python="$1" dest="$2"
: "${LITELLM_VERSION:?source versions.env first}"

scripts/make_side_venv.sh "$python" "$dest" requirements-litellm.txt
# The proxy starts: its imports (the proxy's own dependencies) resolve. LiteLLM
# fetches a model price list from the internet at import unless told to use
# the copy in its wheel.
LITELLM_LOCAL_MODEL_COST_MAP=True "$dest/bin/litellm" --version
echo "install_litellm: $dest/bin/litellm"
