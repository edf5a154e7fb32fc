#!/usr/bin/env bash
# The Python backend stub embeds libpython: it needs a *shared* libpython of
# exactly the venv's Python, and a stub built for that minor version. Say so
# here, before a model fails to load with an opaque stub error.
set -euo pipefail
python_bin="${1:-python3}"

"$python_bin" - <<'PY'
import sys, sysconfig
version = "%d.%d" % sys.version_info[:2]
problems = []
if version not in {"3.10", "3.11", "3.12", "3.13"}:
    problems.append(f"Python {version} has no Triton Python backend stub (3.10 to 3.13 do).")
if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
    problems.append(
        f"{sys.executable} was built without a shared libpython, which the Triton "
        "Python backend stub needs. Use a Python built with --enable-shared "
        "(Debian's python3, or `PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install 3.11`) "
        "and pass it as `make build PYTHON_BIN=/path/to/python3`.")
if problems:
    sys.exit("check_python: " + " ".join(problems))
print(f"check_python: {sys.executable} {sys.version.split()[0]} (shared libpython) OK")
PY
