#!/usr/bin/env bash
# Start tritonserver natively on model_repository/, wait until it is ready,
# print where it listens, stream its log, and stop it cleanly on Ctrl-C/TERM.
#
# Environment (all optional):
#   HTTP_PORT=8000 GRPC_PORT=8001 METRICS_PORT=8002
#   MODEL_REPOSITORY=model_repository
#   READY_TIMEOUT=300 (seconds)          TRITON_EXTRA_ARGS="--log-verbose=1 ..."
#   LLM_BASE_URL, LLM_MODEL, LLM_API_KEY, LLM_API_KEY_FILE: see docs/llm-endpoints.md
#   TRITON_ADMIN_KEY=...  restrict model control, the repository index and shared
#                         memory (HTTP and gRPC) to callers sending header
#                         `admin-key: <key>` (gRPC: `triton-grpc-protocol-admin-key`);
#                         inference, health, metadata stay open
#   STUB_WATCHDOG=1       reload a model whose Python stub process died (0: off);
#                         see scripts/supervise_tritonserver.sh and docs/reliability.md
set -euo pipefail
cd "$(dirname "$0")/.."

HTTP_PORT="${HTTP_PORT:-8000}"
GRPC_PORT="${GRPC_PORT:-8001}"
METRICS_PORT="${METRICS_PORT:-8002}"
MODEL_REPOSITORY="${MODEL_REPOSITORY:-model_repository}"
READY_TIMEOUT="${READY_TIMEOUT:-300}"

venv_python=.venv/bin/python
triton_home=build/triton/pytriton/tritonserver
backend_dir=build/backends

for needed in "$venv_python" "$triton_home/bin/tritonserver" "$backend_dir/python" \
              "$MODEL_REPOSITORY/classifier/1/model.pt"; do
  [[ -e "$needed" ]] || { echo "serve: $needed is missing; run \`make build\` first" >&2; exit 1; }
done

for port in "$HTTP_PORT" "$GRPC_PORT" "$METRICS_PORT"; do
  if ! "$venv_python" -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))' "$port" 2>/dev/null; then
    echo "serve: port $port is already in use; pick free ones, e.g." \
         "HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002 make run" >&2
    exit 1
  fi
done

# The stub embeds libpython and finds sys.prefix through the python3 on PATH:
# the venv's bin/ goes first, and the venv Python's own libpython directory
# goes first on LD_LIBRARY_PATH (else the system libpython is picked and
# `import openai` fails inside the model). See ../shared/NOTES.md.
python_libdir="$("$venv_python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
export PATH="$PWD/.venv/bin:$PATH"
export LD_LIBRARY_PATH="$python_libdir:$PWD/build/triton/nvidia_pytriton.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# shellcheck disable=SC2206  # word splitting of extra args is intended
args=(
  --model-repository="$(realpath "$MODEL_REPOSITORY")"
  --backend-directory="$PWD/$backend_dir"
  --http-port="$HTTP_PORT" --grpc-port="$GRPC_PORT" --metrics-port="$METRICS_PORT"
  --model-control-mode=explicit --load-model='*'
  --exit-timeout-secs=30
  ${TRITON_EXTRA_ARGS:-}
)
if [[ -n "${TRITON_ADMIN_KEY:-}" ]]; then
  # Format checked against the 2.51 binary: <apis>:<header>=<value>. The key is
  # never echoed (it is visible in this host's process list, like any argument).
  args+=("--http-restricted-api=model-repository,shared-memory:admin-key=$TRITON_ADMIN_KEY"
         "--grpc-restricted-protocol=model-repository,shared-memory:admin-key=$TRITON_ADMIN_KEY")
  echo "serve: model-repository and shared-memory APIs need header 'admin-key' (TRITON_ADMIN_KEY)" >&2
fi

# The watchdog, the READY line and a clean stop on Ctrl-C/TERM are the
# supervisor's, shared with the container (Dockerfile CMD, deploy/).
exec scripts/supervise_tritonserver.sh "$triton_home/bin/tritonserver" "${args[@]}"
