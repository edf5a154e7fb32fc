#!/usr/bin/env bash
# The README's test command runs this (via `make test`): unit tests first
# (no server), then the integration tests, which start one real tritonserver
# and the fake LLM upstream themselves, on free ports, and stop them after.
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/hadolint Dockerfile
.venv/bin/ruff check .  # configured in pyproject.toml
# --every-level (tests/conftest.py): each level (tests/*.py, unit, integration,
# long) must have collected tests and passed every one; a level that went
# missing, was deselected or stopped short fails the run. tests/upstreams needs a server
# built from source (about 6 minutes): its own target, `make test-upstreams`.
.venv/bin/python -m pytest tests --ignore=tests/upstreams --every-level "$@"
