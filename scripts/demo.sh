#!/usr/bin/env bash
# `make demo`: a first answer in one command. Starts the server as `make run`
# does (scripts/serve.sh), sends the sample photo through the
# classify_and_describe ensemble with the repository's own client
# (python -m classify_describe), prints the labels and the description, and
# stops the server it started, by its PID, also on Ctrl-C or a failure.
#
# Environment (all optional):
#   DEMO_IMAGE=docs/sample/coffee.png   DEMO_PROMPT="a question about it"
#   HTTP_PORT=8000 GRPC_PORT=8001 METRICS_PORT=8002  on 127.0.0.1; a taken port
#                         fails at once, naming it
#   DEMO_LOG=build/demo-tritonserver.log   the server's log (shown on failure)
#   READY_TIMEOUT=300     seconds to wait for the server's READY line
#   LLM_BASE_URL, LLM_MODEL, LLM_API_KEY, LLM_API_KEY_FILE: as for `make run`
#                         (docs/llm-endpoints.md); without them the description
#                         is a fallback composed from the labels
set -euo pipefail
cd "$(dirname "$0")/.."

image="${DEMO_IMAGE:-docs/sample/coffee.png}"
log="${DEMO_LOG:-build/demo-tritonserver.log}"
ready_timeout="${READY_TIMEOUT:-300}"
export HTTP_PORT="${HTTP_PORT:-8000}" GRPC_PORT="${GRPC_PORT:-8001}" METRICS_PORT="${METRICS_PORT:-8002}"
# The demo's one request goes through tritonclient; the OpenAI front (port 8003) stays off.
export OPENAI_FRONT="${OPENAI_FRONT:-0}"
export LISTEN_ADDRESS=127.0.0.1  # only this script's client talks to it
# A key file of its own: a `make run` beside the demo keeps its build/admin-key-<port>.
export TRITON_ADMIN_KEY_GENERATED_FILE="${TRITON_ADMIN_KEY_GENERATED_FILE:-$PWD/build/demo-admin-key}"

[[ -r "$image" ]] || { echo "demo: cannot read $image (DEMO_IMAGE)" >&2; exit 1; }

server_pid=""
finish() {
  local status=$?
  trap - EXIT INT TERM
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    # serve.sh execs the supervisor: TERM makes it stop tritonserver and the
    # stub watchdog and wait for both (in-flight requests get up to 30 s).
    echo "demo: stopping the server (pid $server_pid)" >&2
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  (( status == 0 )) || echo "demo: failed (exit status $status); the server's log is $log" >&2
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$(dirname "$log")"
: > "$log"  # emptied here, not by the background job: an old READY line must not count
echo "demo: starting tritonserver on 127.0.0.1 (HTTP $HTTP_PORT, gRPC $GRPC_PORT," \
     "metrics $METRICS_PORT); log: $log" >&2
scripts/serve.sh >> "$log" 2>&1 &
server_pid=$!
echo "demo: server pid $server_pid; waiting for it to load the models (READY)" >&2

deadline=$((SECONDS + ready_timeout))
until grep -q '^serve: READY' "$log"; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "demo: the server exited before it was ready:" >&2
    tail -n 20 "$log" | sed 's/^/  /' >&2
    if grep -q 'already in use' "$log"; then
      echo "demo: the same variables move the demo: HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002 make demo" >&2
    fi
    server_pid=""
    exit 1
  fi
  if (( SECONDS >= deadline )); then
    echo "demo: the server was not ready after ${ready_timeout}s (READY_TIMEOUT); its last lines:" >&2
    tail -n 20 "$log" | sed 's/^/  /' >&2
    exit 1
  fi
  sleep 0.5
done

client=(.venv/bin/python -m classify_describe "$image" --url "127.0.0.1:$HTTP_PORT")
[[ -z "${DEMO_PROMPT:-}" ]] || client+=(--prompt "$DEMO_PROMPT")
echo "demo: ready; sending $image through classify_and_describe:" >&2
echo "demo: ${client[*]}" >&2
output="$("${client[@]}")"
printf '%s\n' "$output"

if grep -q 'description (fallback)' <<<"$output"; then
  cat <<'EOF'

demo: that description is a fallback composed from the labels (reason above), not an
      LLM's answer. Point the describe step at an OpenAI-compatible endpoint with
      LLM_BASE_URL and LLM_API_KEY (presets: docs/llm-endpoints.md), e.g.
        LLM_API_KEY=sk-... make demo
        LLM_BASE_URL=https://api.deepseek.com/v1 LLM_MODEL=deepseek-chat LLM_API_KEY=... make demo
        LLM_BASE_URL=http://127.0.0.1:11434/v1 LLM_MODEL=llama3.1 make demo   # local Ollama, no key
      The same variables configure `make run`.
EOF
fi
echo
echo "demo: done. \`make run\` keeps a server up for your own requests (README: Send a request)."
