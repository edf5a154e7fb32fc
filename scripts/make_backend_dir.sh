#!/usr/bin/env bash
# Assemble the backend directory tritonserver is started with:
#   <dir>/python/         Triton's Python backend + the stub for the venv's Python
#   <dir>/<our backend>/  links to backends/<name> (model.py and its Triton I/O; the rest is the installed package)
# usage: make_backend_dir.sh TRITON_HOME BACKEND_DIR VENV_PYTHON NAME...
set -euo pipefail
cd "$(dirname "$0")/.."

triton_home="$1" backend_dir="$2" venv_python="$3"
shift 3

py_version="$("$venv_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
stub="$triton_home/python_backend_stubs/$py_version/triton_python_backend_stub"
[[ -x "$stub" ]] || { echo "make_backend_dir: no stub for Python $py_version at $stub" >&2; exit 1; }

rm -rf "$backend_dir"
mkdir -p "$backend_dir/python"
cp "$triton_home/backends/python/libtriton_python.so" \
   "$triton_home/backends/python/triton_python_backend_utils.py" \
   "$stub" "$backend_dir/python/"
for name in "$@"; do
  ln -s "$PWD/backends/$name" "$backend_dir/$name"
done
echo "make_backend_dir: $backend_dir (stub for Python $py_version; backends: $*)"
