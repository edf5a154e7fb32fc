#!/usr/bin/env bash
# Run tritonserver with the Python-stub watchdog beside it, announce when it is
# ready, and stop both cleanly on INT/TERM. The same supervisor runs natively
# (scripts/serve.sh execs it) and in the container (the Dockerfile's CMD and
# deploy/'s args), so a dead stub is reloaded everywhere, not only in `make run`.
#
#   supervise_tritonserver.sh <tritonserver binary> [tritonserver args...]
#
# Ports come from the server's own --http-port/--grpc-port/--metrics-port
# (Triton's defaults otherwise). Environment (all optional):
#   READY_TIMEOUT=300           seconds to wait for /v2/health/ready before saying so
#   STUB_WATCHDOG=1             0: no watchdog (see scripts/hardening_watchdog.py)
#   STUB_WATCHDOG_INTERVAL_S=1
#   TRITON_ADMIN_KEY            sent by the watchdog's reloads when the server
#                               restricts the model-repository API with it
# Needs a python3 on PATH (standard library only).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
[[ $# -ge 1 ]] || { echo "usage: $0 <tritonserver> [args...]" >&2; exit 2; }

http_port=8000 grpc_port=8001 metrics_port=8002
for arg in "${@:2}"; do
  case "$arg" in
    --http-port=*) http_port="${arg#*=}" ;;
    --grpc-port=*) grpc_port="${arg#*=}" ;;
    --metrics-port=*) metrics_port="${arg#*=}" ;;
  esac
done

server_pid="" watchdog_pid=""
stop() {
  trap - INT TERM
  # The watchdog reloads nothing from now on, and once the server is gone it
  # stops any stub process left running (see scripts/hardening_watchdog.py).
  [[ -z "$watchdog_pid" ]] || kill -USR1 "$watchdog_pid" 2>/dev/null || true
  if [[ -n "$server_pid" ]]; then
    echo "serve: stopping tritonserver (pid $server_pid)" >&2
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  [[ -z "$watchdog_pid" ]] || wait "$watchdog_pid" 2>/dev/null || true
  exit 0
}
# Set before anything starts: a TERM that comes early still stops what did start.
trap stop INT TERM

"$@" &
server_pid=$!

if [[ "${STUB_WATCHDOG:-1}" != "0" ]]; then
  python3 "$here/hardening_watchdog.py" --server-pid "$server_pid" \
    --http-url "127.0.0.1:$http_port" --interval-s "${STUB_WATCHDOG_INTERVAL_S:-1}" &
  watchdog_pid=$!
fi

python3 - "$http_port" "$grpc_port" "$metrics_port" "${READY_TIMEOUT:-300}" "$server_pid" <<'PY' &
import os, sys, time, urllib.request
http, grpc, metrics, timeout, pid = sys.argv[1:]
deadline = time.monotonic() + float(timeout)
while time.monotonic() < deadline:
    try:
        os.kill(int(pid), 0)
    except OSError:
        sys.exit(0)  # the server exited; its own log says why
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as r:
            if r.status == 200:
                print(f"\nserve: READY  HTTP 127.0.0.1:{http}  gRPC 127.0.0.1:{grpc}  "
                      f"metrics http://127.0.0.1:{metrics}/metrics  (Ctrl-C or TERM stops)\n",
                      file=sys.stderr, flush=True)
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
print(f"serve: not ready after {timeout}s; see the log above", file=sys.stderr)
PY

set +e
wait "$server_pid"
status=$?
[[ -n "$watchdog_pid" ]] && wait "$watchdog_pid" 2>/dev/null
echo "serve: tritonserver exited with status $status" >&2
exit "$status"
