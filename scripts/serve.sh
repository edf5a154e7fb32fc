#!/usr/bin/env bash
# Start tritonserver natively on model_repository/, wait until it is ready,
# print where it listens, stream its log, and stop it cleanly on Ctrl-C/TERM.
#
# Environment (all optional):
#   HTTP_PORT=8000 GRPC_PORT=8001 METRICS_PORT=8002
#   OPENAI_PORT=8003      the OpenAI-compatible front (openai_front/; OPENAI_FRONT=0: none)
#   LISTEN_ADDRESS=127.0.0.1  where HTTP, gRPC and metrics listen: this host only;
#                         0.0.0.0 exposes them on every interface (the control
#                         APIs stay restricted, see below)
#   MODEL_REPOSITORY=model_repository
#   READY_TIMEOUT=300 (seconds)          TRITON_EXTRA_ARGS="--log-verbose=1 ..."
#   CPU_CORES=<n>         the cores the instances, threads and rate-limiter slots are sized
#                         for (default: this process's CPU affinity, capped by its cgroup's
#                         quota: `taskset -c 0,1 make run` serves 2); CPU_LAYOUT=0 serves the
#                         configs as written (serving/layout.py, docs/scaling.md#cpu-layout)
#   LLM_BASE_URL, LLM_MODEL, LLM_API_KEY, LLM_API_KEY_FILE: see docs/llm-endpoints.md
#   TRITON_ADMIN_KEY=... or TRITON_ADMIN_KEY_FILE=<file>: the key that model
#                         control, the repository index, shared memory, logging and
#                         trace settings need (header `admin-key: <key>`; gRPC:
#                         `triton-grpc-protocol-admin-key`). Without one a new key is
#                         generated at every start into build/admin-key-<HTTP_PORT> (mode
#                         0600; one per instance: a second `make run` on other ports keeps
#                         the first one's; TRITON_ADMIN_KEY_GENERATED_FILE moves it). Inference, health,
#                         metadata, config and statistics stay open. The restriction
#                         itself is always on: serving/supervise_tritonserver.sh.
#   TRITON_INFERENCE_KEY=... or TRITON_INFERENCE_KEY_FILE=<file>: off by default; with
#                         one, inference too needs header `inference-key: <key>` (gRPC:
#                         `triton-grpc-protocol-inference-key`); the front sends it.
#   TRITON_TRACE_OTLP_ENDPOINT=http://collector:4318/v1/traces  OpenTelemetry traces (off
#                         when unset), TRITON_TRACE_RATE=1000: see serving/supervise_tritonserver.sh
#   STUB_WATCHDOG=1       reload a model whose Python stub process died (0: off);
#                         see serving/supervise_tritonserver.sh and docs/reliability.md
set -euo pipefail
cd "$(dirname "$0")/.."

HTTP_PORT="${HTTP_PORT:-8000}"
GRPC_PORT="${GRPC_PORT:-8001}"
METRICS_PORT="${METRICS_PORT:-8002}"
LISTEN_ADDRESS="${LISTEN_ADDRESS:-127.0.0.1}"
MODEL_REPOSITORY="${MODEL_REPOSITORY:-model_repository}"
READY_TIMEOUT="${READY_TIMEOUT:-300}"

venv_python=.venv/bin/python
triton_home=build/triton/pytriton/tritonserver
backend_dir=build/backends

for needed in "$venv_python" "$triton_home/bin/tritonserver" "$backend_dir/python" \
              "$MODEL_REPOSITORY/classifier/1/model.pt"; do
  [[ -e "$needed" ]] || { echo "serve: $needed is missing; run \`make build\` first" >&2; exit 1; }
done

# The same address the server will bind: a port taken on another interface
# does not stop a loopback server, and one taken on loopback stops 0.0.0.0.
ports=("$HTTP_PORT" "$GRPC_PORT" "$METRICS_PORT")
[[ "${OPENAI_FRONT:-1}" == "0" ]] || ports+=("${OPENAI_PORT:-8003}")
for port in "${ports[@]}"; do
  if ! "$venv_python" -c 'import errno, socket, sys
address, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((address, port))
except OSError as error:
    print(f"serve: port {port} is already in use on {address}; pick free ones, e.g."
          " HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002 OPENAI_PORT=9003 make run" if error.errno == errno.EADDRINUSE
          else f"serve: cannot listen on {address}:{port} (LISTEN_ADDRESS): {error.strerror}", file=sys.stderr)
    sys.exit(1)' "$LISTEN_ADDRESS" "$port"; then
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
  --http-address="$LISTEN_ADDRESS" --grpc-address="$LISTEN_ADDRESS" --metrics-address="$LISTEN_ADDRESS"
  --model-control-mode=explicit --load-model='*'
  --exit-timeout-secs=30
  ${TRITON_EXTRA_ARGS:-}
)
# The supervisor restricts the control APIs; a key it generates goes here, one file per
# instance by its HTTP port (`curl -H "admin-key: $(cat build/admin-key-8000)" ...`), not to a
# shared /tmp.
export TRITON_ADMIN_KEY_GENERATED_FILE="${TRITON_ADMIN_KEY_GENERATED_FILE:-$PWD/build/admin-key-$HTTP_PORT}"

# The admin key and the restricted APIs, the watchdog, the READY line and a
# clean stop on Ctrl-C/TERM are the supervisor's, shared with the container
# (Dockerfile CMD, deploy/).
exec serving/supervise_tritonserver.sh "$triton_home/bin/tritonserver" "${args[@]}"
