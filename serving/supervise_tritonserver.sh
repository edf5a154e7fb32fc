#!/usr/bin/env bash
# Run tritonserver with the Python-stub watchdog and the OpenAI front beside it,
# announce when they are ready, and stop them all cleanly on INT/TERM. If the
# front exits (bad settings at start, or a crash or OOM kill later), the server
# is stopped too and the supervisor exits non-zero, so a container restarts
# instead of staying up with port 8003 dead. The same supervisor runs natively
# (scripts/serve.sh execs it) and in the container (the Dockerfile's CMD and
# deploy/'s args), so a dead stub is reloaded everywhere, not only in `make run`,
# and the control APIs are restricted everywhere (below), not only where someone
# remembered a flag.
#
#   supervise_tritonserver.sh <tritonserver binary> [tritonserver args...]
#
# Control APIs: the server always gets
#   --http-restricted-api=model-repository,shared-memory,logging,trace:admin-key=<key>
#   --grpc-restricted-protocol=<the same>
# so loading a model (with file overrides: Python code that would run next to
# the LLM key), the repository index, shared-memory registration, log and trace
# settings need header `admin-key: <key>` (gRPC: `triton-grpc-protocol-admin-key`).
# Health, metadata, model config and statistics stay open (the OpenAI front reads
# the models' queue time limits from model config); inference too unless
# an inference key is given (below). The admin key, first found wins:
#   TRITON_ADMIN_KEY_FILE       a file holding it (a mounted Kubernetes Secret);
#                               a path that does not exist counts as unset (the
#                               Secret is optional), an empty file is an error
#   TRITON_ADMIN_KEY            the key itself
#   otherwise 32 random bytes (hex), written with mode 0600 to
#   TRITON_ADMIN_KEY_GENERATED_FILE (default ${TMPDIR:-/tmp}/triton-admin-key);
#                               the log names the file, never the key.
# The key goes to the server's arguments (Triton takes it no other way) and to
# the watchdog's environment; TRITON_ADMIN_KEY is removed from the server's own
# environment (so from environment dumps). The arguments are NOT private: any
# local user, not only this one, can read them in /proc/<pid>/cmdline (ps -ef).
# Where that matters: run it in its own PID namespace (a container, or a pod
# without hostPID / shareProcessNamespace: the manifests in deploy/ set neither),
# or mount /proc with hidepid=2 on a shared host (docs/reliability.md).
#
# Inference (off by default, so `make run` on loopback stays simple): with a key in
#   TRITON_INFERENCE_KEY_FILE   (first; a path that does not exist counts as unset)
#   TRITON_INFERENCE_KEY
# the server also gets
#   --http-restricted-api=inference:inference-key=<key>   (and the gRPC twin)
# so /v2/models/*/infer, generate, generate_stream and gRPC ModelInfer and
# ModelStreamInfer need header `inference-key: <key>` (gRPC:
# `triton-grpc-protocol-inference-key`); health and metadata (the probes) stay
# open. The front gets the key in its environment (TRITON_INFERENCE_KEY) and sends
# it; the server's own environment does not hold it. Same rules as the admin key:
# an empty file or a key with spaces stops the start, the log never shows it.
#
# Ports and addresses come from the server's own --http-port/--grpc-port/
# --metrics-port and --http-address/--grpc-address/--metrics-address (Triton's
# defaults otherwise: 8000/8001/8002 on 0.0.0.0). Also (all optional):
#   READY_TIMEOUT=300           seconds to wait for /v2/health/ready before saying so
#   STUB_WATCHDOG=1             0: no watchdog (see serving/stub_watchdog.py)
#   STUB_WATCHDOG_INTERVAL_S=1
#   OPENAI_FRONT=1              0: no OpenAI-compatible front (openai_front/, beside
#                               serving/; needs aiohttp and tritonclient[grpc])
#   OPENAI_PORT=8003            its port, on the HTTP endpoint's address; it talks to
#                               this server's gRPC port. OPENAI_FRONT_API_KEY(_FILE)
#                               and the rest: openai_front/settings.py
# Tracing (docs/tracing.md), off unless an endpoint is given:
#   TRITON_TRACE_OTLP_ENDPOINT  an OTLP/HTTP collector's traces URL, e.g.
#                               http://otel-collector:4318/v1/traces: Triton exports
#                               OpenTelemetry spans there (--trace-config mode=opentelemetry)
#   TRITON_TRACE_RATE=1000      trace every N-th request; a request that carries a W3C
#                               `traceparent` is traced whatever the rate (0: only those)
#   TRITON_TRACE_SERVICE_NAME=classify-describe  the spans' service.name
#                               (both also as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and
#                               OTEL_SERVICE_NAME to the models, for the LLM call's span)
# Stop (INT/TERM), in order and bounded: the front stops accepting, ends its open
# streams at once and lets whole answers finish (OPENAI_FRONT_DRAIN_S, default 5;
# killed FRONT_STOP_GRACE_S=3 after that); only then does tritonserver get TERM,
# so no stream holds a streaming model loaded while it unloads (its own
# --exit-timeout-secs bounds what is left). Streams opened on Triton directly
# (gRPC, generate_stream) end too: just before TERM the supervisor creates
# TRITON_STOPPING_FILE, which the streaming models watch for, and gives them
# STREAMS_STOP_S (2) to end before TERM to tritonserver.
# Exit status: the server's own when it exits, also after INT/TERM (non-zero when
# Triton reports that it could not stop cleanly, e.g. "Exit timeout expired");
# the front's (1 if that was 0) when the front exits first.
# Needs a python3 on PATH (standard library only, but for the front).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
[[ $# -ge 1 ]] || { echo "usage: $0 <tritonserver> [args...]" >&2; exit 2; }

http_port=8000 grpc_port=8001 metrics_port=8002
http_address=0.0.0.0 grpc_address=0.0.0.0 metrics_address=""
for arg in "${@:2}"; do
  case "$arg" in
    --http-port=*) http_port="${arg#*=}" ;;
    --grpc-port=*) grpc_port="${arg#*=}" ;;
    --metrics-port=*) metrics_port="${arg#*=}" ;;
    --http-address=*) http_address="${arg#*=}" ;;
    --grpc-address=*) grpc_address="${arg#*=}" ;;
    --metrics-address=*) metrics_address="${arg#*=}" ;;
  esac
done
metrics_address="${metrics_address:-$http_address}"  # Triton's own default
# Where this host reaches the HTTP endpoint (the watchdog, the READY check).
case "$http_address" in
  0.0.0.0) http_host=127.0.0.1 ;;
  ::) http_host="[::1]" ;;
  *:*) http_host="[$http_address]" ;;
  *) http_host="$http_address" ;;
esac

# The stop's waits in whole seconds, for bash's integer arithmetic in shut_down: the front takes any
# positive number for OPENAI_FRONT_DRAIN_S (2.5, 1e1), so each is read here, once, and rounded up.
# A bad value stops the start with its name, not the stop half-way (the front told, tritonserver not).
stop_waits="$(python3 - <<'PY'
import math, os, sys
waits = []
for name, default, positive in (("OPENAI_FRONT_DRAIN_S", "5", True), ("FRONT_STOP_GRACE_S", "3", False),
                                ("STREAMS_STOP_S", "2", False)):
    raw = os.environ.get(name, "").strip() or default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    # At most a day: bash's integers wrap past 2**63 (a 1e19 would be a negative wait, a kill at once).
    if not (0 < value if positive else 0 <= value) or not value <= 86400:
        sys.exit(f"serve: {name}={raw!r} must be a {'positive' if positive else 'non-negative'} number of seconds, "
                 "at most 86400")
    waits.append(str(math.ceil(value)))
print(*waits)
PY
)" || exit 1
read -r front_drain_s front_grace_s streams_stop_s <<< "$stop_waits"

server_pid="" watchdog_pid="" front_pid="" server_status=0 TRITON_STOPPING_FILE=""
# Wait for child $1 at most $2 seconds, then KILL it.
wait_bounded() {
  local pid="$1" deadline=$(( SECONDS + $2 ))
  while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "serve: pid $pid did not stop within $2 s; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}
shut_down() {
  trap - INT TERM
  # The watchdog reloads nothing from now on, and once the server is gone it
  # stops any stub process left running (see serving/stub_watchdog.py).
  [[ -z "$watchdog_pid" ]] || kill -USR1 "$watchdog_pid" 2>/dev/null || true
  # Streams opened on Triton directly end once they see this file (within the
  # streaming models' cancel_poll_s); they must be gone before TERM, because a
  # model being unloaded can no longer end them (measured: Triton then waited out
  # its whole exit timeout). The front's own stop below runs meanwhile.
  local streams_told=$SECONDS
  [[ -z "${TRITON_STOPPING_FILE:-}" ]] || : > "$TRITON_STOPPING_FILE" 2>/dev/null || true
  # The front first, and waited for: its open streams hold Triton's streaming
  # model, which Triton cannot unload while a stream lives.
  if [[ -n "$front_pid" ]]; then
    kill -TERM "$front_pid" 2>/dev/null || true
    wait_bounded "$front_pid" $(( front_drain_s + front_grace_s ))
    front_pid=""
  fi
  if [[ -n "$server_pid" ]]; then
    while (( SECONDS - streams_told < streams_stop_s )) && kill -0 "$server_pid" 2>/dev/null; do sleep 0.1; done
    echo "serve: stopping tritonserver (pid $server_pid)" >&2
    kill -TERM "$server_pid" 2>/dev/null || true
    server_status=0
    wait "$server_pid" 2>/dev/null || server_status=$?
    (( server_status == 0 )) || echo "serve: tritonserver stopped with status $server_status (not a clean stop; its log says why)" >&2
  fi
  [[ -z "$watchdog_pid" ]] || wait "$watchdog_pid" 2>/dev/null || true
  [[ -z "${TRITON_STOPPING_FILE:-}" ]] || rm -f "$TRITON_STOPPING_FILE"
}
stop() {
  shut_down
  exit "$server_status"
}
# Set before anything starts: a TERM that comes early still stops what did start.
trap stop INT TERM

# -- the keys ------------------------------------------------------------------
# read_key NAME: the key from the file ${NAME}_FILE (when that path exists) or
# the variable ${NAME}, into $key and where it came from into $key_source; both
# empty when neither is given. An empty file stops the start.
read_key() {
  local name="$1" file_var="${1}_FILE"
  local path="${!file_var:-}"
  key="" key_source=""
  if [[ -n "$path" && -e "$path" ]]; then
    if ! key="$(<"$path")"; then
      echo "serve: cannot read $file_var=$path" >&2
      exit 1
    fi
    key="${key#"${key%%[![:space:]]*}"}"  # a trailing newline is not part of it
    key="${key%"${key##*[![:space:]]}"}"
    [[ -n "$key" ]] || { echo "serve: $file_var=$path is empty" >&2; exit 1; }
    key_source="from $file_var ($path)"
  elif [[ -n "${!name:-}" ]]; then
    key="${!name}"
    key_source="from $name"
  fi
}
# check_key WHAT: sent as an HTTP/gRPC header value: printable, no spaces.
check_key() {
  [[ "$key" =~ ^[[:graph:]]+$ ]] || { echo "serve: the $1 ($key_source) has spaces or control characters" >&2; exit 1; }
  (( ${#key} >= 16 )) || echo "serve: WARNING: the $1 ($key_source) is shorter than 16 characters" >&2
}

read_key TRITON_ADMIN_KEY
admin_key="$key"
if [[ -z "$admin_key" ]]; then
  [[ -z "${TRITON_ADMIN_KEY_FILE:-}" ]] || \
    echo "serve: TRITON_ADMIN_KEY_FILE=$TRITON_ADMIN_KEY_FILE does not exist; generating a key" >&2
  key_file="${TRITON_ADMIN_KEY_GENERATED_FILE:-${TMPDIR:-/tmp}/triton-admin-key}"
  admin_key="$(od -An -vtx1 -N32 /dev/urandom | tr -d ' \n')"
  # mktemp creates the file with mode 0600 next to the target, and the rename
  # replaces whatever was there (a link included) instead of writing through it.
  # mv -T: a directory planted at that path is an error, not a place to write into.
  if ! tmp_key_file="$(mktemp "$key_file.XXXXXX")" \
     || ! printf '%s\n' "$admin_key" > "$tmp_key_file" || ! mv -fT "$tmp_key_file" "$key_file"; then
    [[ -z "${tmp_key_file:-}" ]] || rm -f "$tmp_key_file"  # it holds the key
    echo "serve: cannot write the generated admin key to $key_file; set TRITON_ADMIN_KEY_GENERATED_FILE" \
         "to a writable path, or give a key (TRITON_ADMIN_KEY_FILE or TRITON_ADMIN_KEY)" >&2
    exit 1
  fi
  key="$admin_key" key_source="generated, in $key_file (mode 0600)"
fi
check_key "admin key"
unset TRITON_ADMIN_KEY
restricted=model-repository,shared-memory,logging,trace
set -- "$@" "--http-restricted-api=$restricted:admin-key=$admin_key" \
            "--grpc-restricted-protocol=$restricted:admin-key=$admin_key"
echo "serve: the ${restricted//,/, } APIs need header 'admin-key' (gRPC:" \
     "'triton-grpc-protocol-admin-key'); the key is $key_source" >&2

# A second group with its own header: a client that may infer is not an admin.
read_key TRITON_INFERENCE_KEY
inference_key="$key"
unset TRITON_INFERENCE_KEY
if [[ -n "$inference_key" ]]; then
  check_key "inference key"
  set -- "$@" "--http-restricted-api=inference:inference-key=$inference_key" \
              "--grpc-restricted-protocol=inference:inference-key=$inference_key"
  echo "serve: inference needs header 'inference-key' (gRPC: 'triton-grpc-protocol-inference-key');" \
       "the key is $key_source" >&2
else
  [[ -z "${TRITON_INFERENCE_KEY_FILE:-}" ]] || \
    echo "serve: TRITON_INFERENCE_KEY_FILE=$TRITON_INFERENCE_KEY_FILE does not exist (the Secret is optional)" >&2
  echo "serve: inference is open to whoever reaches the HTTP and gRPC ports (TRITON_INFERENCE_KEY_FILE" \
       "or TRITON_INFERENCE_KEY restricts it)" >&2
fi

# -- tracing ------------------------------------------------------------------
# Set at start only: Triton cannot change OpenTelemetry settings while it runs,
# and the trace API that could is restricted above anyway.
if [[ -n "${TRITON_TRACE_OTLP_ENDPOINT:-}" ]]; then
  [[ "$TRITON_TRACE_OTLP_ENDPOINT" =~ ^https?://[^[:space:],]+$ ]] || {
    echo "serve: TRITON_TRACE_OTLP_ENDPOINT must be an http(s):// URL (an OTLP/HTTP collector's" \
         "traces URL, e.g. http://otel-collector:4318/v1/traces)" >&2; exit 1; }
  trace_rate="${TRITON_TRACE_RATE:-1000}"
  [[ "$trace_rate" =~ ^[0-9]+$ ]] || { echo "serve: TRITON_TRACE_RATE must be a whole number (0: only requests with a traceparent)" >&2; exit 1; }
  # TIMESTAMPS is the only level OpenTelemetry mode has; count=-1: never stop tracing.
  set -- "$@" --trace-config=mode=opentelemetry --trace-config=level=TIMESTAMPS --trace-config=count=-1 \
              "--trace-config=rate=$trace_rate" "--trace-config=opentelemetry,url=$TRITON_TRACE_OTLP_ENDPOINT" \
              "--trace-config=opentelemetry,resource=service.name=${TRITON_TRACE_SERVICE_NAME:-classify-describe}"
  trace_host="${TRITON_TRACE_OTLP_ENDPOINT#*://}" trace_host="${trace_host%%[/?#]*}"
  # The host only: a URL's user, path or query may hold a collector's token.
  others=""
  (( trace_rate == 0 )) || others=" and 1 in $trace_rate of the others"
  echo "serve: tracing on: OpenTelemetry spans to ${trace_host##*@}; traced: requests with a traceparent$others" >&2
  # The describe step's span for the LLM call (backends/classify_describe_server/llm_span.py):
  # the models' Python stubs inherit tritonserver's environment, where the
  # OpenTelemetry SDK finds the same collector and service name.
  export OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="$TRITON_TRACE_OTLP_ENDPOINT" \
         OTEL_SERVICE_NAME="${TRITON_TRACE_SERVICE_NAME:-classify-describe}"
else
  # Unset means no tracing here, for the LLM call's span too.
  unset OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
fi

# -- the CPU layout (serving/layout.py) ----------------------------------------
# Instances, threads and "cpu" slots from the cores this server is given (CPU_CORES, else the
# CPU affinity capped by the cgroup's quota). The rate limiter's slots go on the command line
# unless the caller set --rate-limit itself; once the server is ready the sized models are
# reloaded as the rule says (before READY). CPU_LAYOUT=0 serves the configs as written; so does
# a --model-config-name (the GPU layout), which the rule does not size.
apply_layout=0
if [[ "${CPU_LAYOUT:-1}" != "0" ]] && ! [[ " ${*:2}" == *" --model-config-name="* ]]; then
  layout_args="$(PYTHONPATH="$(dirname "$here")" python3 -m serving.layout server-args)" || exit 1
  # shellcheck disable=SC2206  # the flags are words without spaces
  [[ " ${*:2}" == *" --rate-limit="* ]] || set -- "$@" $layout_args
  apply_layout=1
fi

# Where the supervisor tells the streaming models that the server is stopping.
export TRITON_STOPPING_FILE="${TMPDIR:-/tmp}/triton-stopping.$$"
rm -f "$TRITON_STOPPING_FILE"
# glibc's malloc for the server, its stubs and the front: by default memory freed at the top of a
# heap goes back to the kernel at once (128 KiB trim threshold) and blocks over 128 KiB are mmap'd
# and unmapped, so each request faults its buffers in again (a decoded photo: about 200 page
# faults, 0.3 ms of kernel time; the front's 622 KB body, its JSON and its image: 12 % of its CPU
# in page faults and zeroing). Kept up to 32 MiB a process, and blocks under 8 MiB from the heap;
# measured in docs/benchmarks-method.md#where-the-cpu-goes. A GLIBC_TUNABLES of the caller's own wins.
malloc_tunables="${GLIBC_TUNABLES:-glibc.malloc.mmap_threshold=8388608:glibc.malloc.trim_threshold=33554432}"
GLIBC_TUNABLES="$malloc_tunables" "$@" &
server_pid=$!

if [[ "${STUB_WATCHDOG:-1}" != "0" ]]; then
  TRITON_ADMIN_KEY="$admin_key" PYTHONPATH="$(dirname "$here")" python3 -m serving.stub_watchdog --server-pid "$server_pid" \
    --http-url "$http_host:$http_port" --interval-s "${STUB_WATCHDOG_INTERVAL_S:-1}" &
  watchdog_pid=$!
fi

where="HTTP $http_address:$http_port  gRPC $grpc_address:$grpc_port  metrics http://$metrics_address:$metrics_port/metrics"
if [[ "${OPENAI_FRONT:-1}" != "0" ]]; then
  # The OpenAI-compatible front (openai_front/) on the HTTP endpoint's address,
  # talking to this server over gRPC; it stops with the server (stop() above).
  case "$grpc_address" in
    0.0.0.0) grpc_host=127.0.0.1 ;;
    ::) grpc_host="[::1]" ;;
    *:*) grpc_host="[$grpc_address]" ;;
    *) grpc_host="$grpc_address" ;;
  esac
  GLIBC_TUNABLES="$malloc_tunables" TRITON_INFERENCE_KEY="$inference_key" PYTHONPATH="$(dirname "$here")" python3 -m openai_front --host "$http_address" --port "${OPENAI_PORT:-8003}" \
    --triton-grpc-url "$grpc_host:$grpc_port" &
  front_pid=$!
  where="$where  OpenAI http://$http_address:${OPENAI_PORT:-8003}/v1"
  front_health="http://$http_host:${OPENAI_PORT:-8003}/health"
fi

# READY once the server is ready, runs the CPU layout, and the front (if any) answers.
TRITON_ADMIN_KEY="$admin_key" PYTHONPATH="$(dirname "$here")" \
python3 - "$http_host" "$http_port" "${READY_TIMEOUT:-300}" "$server_pid" "$where" "${front_health:-}" "$apply_layout" <<'PY' &
import os, sys, time, urllib.request
host, http, timeout, pid, where, front_health, apply_layout = sys.argv[1:]
urls = [f"http://{host}:{http}/v2/health/ready"] + ([front_health] if front_health else [])
deadline = time.monotonic() + float(timeout)
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a pod's http_proxy
while time.monotonic() < deadline:
    try:
        os.kill(int(pid), 0)
    except OSError:
        sys.exit(0)  # the server exited; its own log says why
    try:
        while urls:
            with direct.open(urls[0], timeout=2) as r:
                if r.status != 200:
                    break
            if apply_layout == "1" and urls[0].endswith("/v2/health/ready"):
                from serving import layout
                chosen = layout.host_layout()
                print(f"serve: CPU layout for {chosen.cores} core(s) ({chosen.source}): "
                      + ", ".join(f"{name} {model.count}" for name, model in chosen.models().items())
                      + f" instances, {chosen.cpu_slots} 'cpu' slots", file=sys.stderr, flush=True)
                layout.apply(chosen, f"{host}:{http}", os.environ.get("TRITON_ADMIN_KEY"), server_pid=int(pid),
                             log=lambda line: print(f"serve: {line}", file=sys.stderr, flush=True))
                apply_layout = "0"
                continue  # ready again after the reloads
            urls.pop(0)
        if not urls:
            print(f"\nserve: READY  {where}  (Ctrl-C or TERM stops)\n", file=sys.stderr, flush=True)
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
print(f"serve: not ready after {timeout}s; see the log above", file=sys.stderr)
PY

set +e
# Watch the server and the front. Polled: `wait -n` misses a job that ended
# before it was called (a front that fails at start). bash reaps its children
# at once, so kill -0 fails as soon as one has exited; the sleep runs in the
# background so that a TERM is handled at once.
while kill -0 "$server_pid" 2>/dev/null; do
  if [[ -n "$front_pid" ]] && ! kill -0 "$front_pid" 2>/dev/null; then
    wait "$front_pid"
    front_status=$?
    front_pid=""
    echo "serve: ERROR: the OpenAI front (port ${OPENAI_PORT:-8003}) exited with status $front_status;" \
         "its log above says why. Stopping tritonserver so that the container restarts" \
         "(OPENAI_FRONT=0 runs the server without the front)." >&2
    shut_down
    exit $(( front_status == 0 ? 1 : front_status ))
  fi
  sleep 1 &
  wait $!
done
wait "$server_pid"
status=$?
[[ -n "$watchdog_pid" ]] && wait "$watchdog_pid" 2>/dev/null
[[ -n "$front_pid" ]] && kill -TERM "$front_pid" 2>/dev/null && wait "$front_pid" 2>/dev/null
rm -f "$TRITON_STOPPING_FILE"
echo "serve: tritonserver exited with status $status" >&2
exit "$status"
