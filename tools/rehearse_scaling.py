#!/usr/bin/env python3
"""Rehearse the Kubernetes setup on one machine: two replicas behind a load balancer,
one stopped and restarted under load, every request answered.

    make rehearse                       (or: .venv/bin/python -m tools.rehearse_scaling)
    make rehearse REHEARSE_ARGS="--failover-s 300 --capacity-s 60"     (longer)

What it does, all on 127.0.0.1, all stopped by this script (by PID) at the end:
  1. starts the fake OpenAI-compatible upstream (tools/fake_openai) with a fixed
     latency, and two replicas with scripts/serve.sh on free ports, LLM_BASE_URL
     pointing at the fake;
  2. capacity: a closed loop of --concurrency requests straight at replica A for
     --capacity-s seconds -> per-replica throughput and latency;
  3. failover: an open loop at --rate requests/s (default: half of that capacity,
     what one replica must carry while the other restarts) through nginx, a real
     load balancer with a generated config (Debian's nginx; unpacked into
     build/nginx when it is not installed, so no system service is started);
     after --stop-after-s it sends SIGTERM to replica A's PID, waits for it to
     exit, starts it again and waits until it is ready, while the load goes on
     (--drain-s N first takes A out of nginx for N seconds, the order Kubernetes
     uses: endpoint removal, preStop sleep, then SIGTERM);
  4. reports requests sent, answered and failed (expected 0), nginx retries,
     latency before / during / after the restart, and the LLM calls made.
Exit status: 0 when every request was answered, 1 otherwise.

Every request carries a different photo variant and prompt, so no cache
(Triton's response cache, the describe step's own) turns the load into lookups.
"""

import argparse
import asyncio
import io
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from classify_describe.client import AsyncClient
from tools import host
from tools.local_stack import FakeLLM, NotReady, TritonServer, free_port, stop_process
from tools.nginx import find_or_unpack as find_nginx
from tools.nginx import nginx_conf, prepare_workdir

REPO = pathlib.Path(__file__).resolve().parents[1]

FAKE_KEY = "sk-rehearsal-not-a-real-key"


# -- processes -------------------------------------------------------------------

def log(message):
    print(f"rehearse: {message}", flush=True)


class Started:
    """The processes this script started; stop_all() ends each by its own PID."""

    def __init__(self):
        self.processes = []

    def start(self, name, argv, log_path, **kwargs):
        with open(log_path, "ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        return self.track(name, process)

    def track(self, name, process):
        self.processes.append((name, process))
        return process

    def stop_all(self):
        for _, process in reversed(self.processes):
            stop_process(process)


def http_status(url, timeout=2):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


class Replica:
    def __init__(self, name, started, workdir, llm_url, env_extra):
        self.name = name
        self.started = started
        # Loopback only (Triton listens on 0.0.0.0 by default).
        extra_args = " ".join([os.environ.get("TRITON_EXTRA_ARGS", ""), "--http-address=127.0.0.1",
                               "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"]).strip()
        # The committed model_repository/ as it is; a restart appends to the same log.
        self.server = TritonServer(workdir, {"LLM_BASE_URL": llm_url, "LLM_API_KEY": FAKE_KEY, **env_extra,
                                             "TRITON_EXTRA_ARGS": extra_args},
                                   repository=REPO / "model_repository",
                                   log_path=workdir / f"replica-{name}.log")
        self.http, self.grpc, self.metrics = (self.server.http_port, self.server.grpc_port,
                                              self.server.metrics_port)

    @property
    def process(self):
        return self.server.process

    def start(self):
        self.server.start(wait=False)
        self.started.track(f"replica {self.name}", self.server.process)

    def wait_ready(self):
        try:
            self.server.wait_ready()
        except NotReady as error:
            raise SystemExit(f"rehearse: replica {self.name}: {error}") from None

    def terminate(self):
        """SIGTERM to this replica's PID (serve.sh passes it to its tritonserver)."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)


# -- nginx -------------------------------------------------------------------------

# Inside nginx's `http {}` (tools/nginx.nginx_conf writes the rest).
NGINX_HTTP = """\
    log_format rehearse '$msec $status $request_time "$upstream_addr" "$upstream_status"';
    access_log {dir}/nginx-access.log rehearse;
    client_max_body_size 16m;
    client_body_buffer_size 1m;

    upstream triton {{
        # Passive health check: one failed attempt takes a replica out for 2 s,
        # then one request probes it again.
        server 127.0.0.1:{a} max_fails=1 fail_timeout=2s{a_down};
        server 127.0.0.1:{b} max_fails=1 fail_timeout=2s;
        keepalive 32;
        # Triton waits, up to --exit-timeout-secs, for open HTTP connections to
        # close, idle keep-alive ones included: drop idle ones soon so a
        # stopping replica is not held for the whole timeout.
        keepalive_timeout 4s;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://triton;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            # A stopping Triton resets new requests (on new and kept-alive
            # connections) while it finishes the ones in flight: try the other
            # replica. non_idempotent: POST /infer may be resent; inference is
            # idempotent here (it may cost one extra LLM call).
            proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;
            proxy_next_upstream_tries 2;
            proxy_connect_timeout 1s;
            proxy_read_timeout 60s;
        }}
    }}"""


class Nginx:
    """nginx in the foreground as our child, on a generated config in the work dir."""

    def __init__(self, started, workdir, upstream_ports):
        self.binary = find_nginx()
        self.workdir = workdir
        self.upstream_ports = upstream_ports
        self.port = free_port()
        self.conf = workdir / "nginx.conf"
        prepare_workdir(workdir)
        self.write_conf(a_down=False)
        self.process = started.start("nginx", self.argv(), workdir / "nginx.out")
        deadline = time.monotonic() + 10
        while http_status(f"http://127.0.0.1:{self.port}/v2/health/live") != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"rehearse: nginx did not come up; see {workdir}/nginx-error.log")
            time.sleep(0.1)

    def argv(self, *extra):
        return [self.binary, "-p", str(self.workdir), "-c", str(self.conf),
                "-e", str(self.workdir / "nginx-error.log"), *extra]

    def write_conf(self, a_down):
        self.conf.write_text(nginx_conf(self.workdir, NGINX_HTTP.format(
            dir=self.workdir, a=self.upstream_ports[0], b=self.upstream_ports[1], port=self.port,
            a_down=" down" if a_down else "")))
        check = subprocess.run(self.argv("-t"), capture_output=True, text=True)
        if check.returncode != 0:
            raise SystemExit(f"rehearse: nginx rejected its config:\n{check.stderr}")

    def set_a_down(self, down):
        """What removing a pod from the Service endpoints does: a graceful reload
        (old workers finish their requests, then close their upstream connections)."""
        self.write_conf(a_down=down)
        self.process.send_signal(signal.SIGHUP)


# -- load --------------------------------------------------------------------------

def photo_variants(count):
    """Distinct JPEGs (shifted crops, varying quality) of the scikit-image photos."""
    import skimage.data
    from PIL import Image

    data_dir = pathlib.Path(skimage.data.__file__).parent
    photos = [Image.open(data_dir / f"{name}.png").convert("RGB") for name in ("chelsea", "coffee")]
    variants = []
    for index in range(count):
        photo = photos[index % 2]
        dx, dy = (index // 2) % 13, (index // 26) % 13
        crop = photo.crop((dx, dy, photo.width - 12 + dx, photo.height - 12 + dy))
        buffer = io.BytesIO()
        crop.save(buffer, format="JPEG", quality=80 + (index // 338) % 16)
        variants.append(buffer.getvalue())
    return variants


class Tally:
    def __init__(self):
        self.sent = 0
        self.answered = 0
        self.failures = {}
        self.sources = {}
        self.client_retries = 0
        self.records = []  # (start time, latency ms, ok)

    def add(self, started_at, latency_ms, result=None, error=None):
        self.sent += 1
        if error is None:
            self.answered += 1
            self.sources[result.description_source] = self.sources.get(result.description_source, 0) + 1
        else:
            kind = f"{type(error).__name__}: {str(error)[:120]}"
            self.failures[kind] = self.failures.get(kind, 0) + 1
        self.records.append((started_at, latency_ms, error is None))

    @property
    def failed(self):
        return sum(self.failures.values())


def percentiles(values):
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q):
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"n": len(ordered), "p50_ms": pick(0.50), "p95_ms": pick(0.95), "p99_ms": pick(0.99),
            "max_ms": round(ordered[-1], 1), "mean_ms": round(statistics.fmean(ordered), 1)}


async def one_request(client, tally, image, prompt, retries=0):
    """One request; with `retries`, resend it after a connection-level error only
    (the connection broke before an answer came: e.g. a kept-alive connection the
    load balancer was closing on a reload). An answer from the server, error or
    not, is never resent."""
    import aiohttp

    started_at = time.monotonic()
    for attempt in range(retries + 1):
        try:
            result = await client.infer(image, prompt=prompt)
        except aiohttp.ClientConnectionError as error:
            if attempt < retries:
                tally.client_retries += 1
                continue
            tally.add(started_at, (time.monotonic() - started_at) * 1e3, error=error)
            return
        except Exception as error:  # noqa: BLE001 - every failure counts, whatever its kind
            tally.add(started_at, (time.monotonic() - started_at) * 1e3, error=error)
            return
        tally.add(started_at, (time.monotonic() - started_at) * 1e3, result=result)
        return


async def closed_loop(url, images, concurrency, seconds, tag):
    """`concurrency` workers, each sending its next request when the last is answered.
    throttle=False here and in open_loop: the rehearsal counts what the server
    answers, so every request reaches it."""
    tally = Tally()
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9))
    async with AsyncClient(url, concurrency=concurrency, timeout_s=120, throttle=False) as client:
        async def worker():
            while time.monotonic() < deadline:
                index = next(counter)
                await one_request(client, tally, images[index % len(images)], f"{tag} request {index}: describe it")

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    return tally, elapsed


async def open_loop(url, images, rate, seconds, max_in_flight, tag, during=None, retries=0):
    """Requests start on a fixed schedule (rate/s), whether or not earlier ones are done:
    a restart shows up as latency and failures, not as a slower sender."""
    tally = Tally()
    total = int(rate * seconds)
    async with AsyncClient(url, concurrency=max_in_flight, timeout_s=120, throttle=False) as client:
        side_task = asyncio.ensure_future(during()) if during else None
        started = time.monotonic()
        tasks = []
        for index in range(total):
            delay = started + index / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one_request(
                client, tally, images[index % len(images)], f"{tag} request {index}: describe it",
                retries)))
        await asyncio.gather(*tasks)
        side = await side_task if side_task else None
    return tally, started, side


# -- the rehearsal -----------------------------------------------------------------

def metric_sum(port, name, model):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    prefix = f'{name}{{model="{model}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def compute_queue_us(port):
    """Queue time of the compute models, summed (the HPA's triton_compute_queue_us, either layout)."""
    return sum(metric_sum(port, "nv_inference_queue_duration_us", model) or 0
               for model in ("preprocess", "classifier", "classify_with_view"))


def nginx_retries(access_log):
    retried = 0
    lines = access_log.read_text().splitlines() if access_log.exists() else []
    for line in lines:
        upstreams = line.split('"')[1]
        retried += "," in upstreams
    return len(lines), retried


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity-s", type=float, default=10,
                        help="closed-loop measurement on one replica, per concurrency level")
    parser.add_argument("--concurrency", default="8,16,24",
                        help="closed-loop requests in flight, comma-separated levels (throughput that stops "
                             "growing with concurrency is the replica's capacity)")
    parser.add_argument("--failover-s", type=float, default=60, help="open-loop load through nginx")
    parser.add_argument("--stop-after-s", type=float, default=8, help="SIGTERM replica A this far into the failover load")
    parser.add_argument("--rate", type=float, default=None,
                        help="failover load in requests/s (default: half the measured per-replica throughput)")
    parser.add_argument("--drain-s", type=float, default=0,
                        help="take replica A out of nginx this long before its SIGTERM, as Kubernetes' "
                             "endpoint removal + preStop sleep do (default 0: SIGTERM while it gets "
                             "traffic; nginx retries what it refuses)")
    parser.add_argument("--client-retries", type=int, default=1,
                        help="resend a request whose connection broke before any answer (default 1; "
                             "0 shows what nginx alone covers)")
    parser.add_argument("--llm-latency-ms", type=float, default=300, help="the fake LLM's answer time")
    parser.add_argument("--max-in-flight", type=int, default=64, help="client cap on open-loop requests in flight")
    parser.add_argument("--result-json", type=pathlib.Path, default=REPO / "build/rehearsal/result.json")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir with all logs")
    return parser.parse_args()


def start_replicas(started, workdir, llm_url, report):
    """Replicas A and B, started together and ready, with the describe step's settings as the
    ConfigMap sets them (deploy/base/configmap-llm.yaml)."""
    env_extra = {"LLM_TIMEOUT_S": "15", "LLM_TOTAL_TIMEOUT_S": "25", "LLM_MAX_ATTEMPTS": "2"}
    replicas = [Replica(name, started, workdir, llm_url, env_extra) for name in ("a", "b")]
    boot = time.monotonic()
    for replica in replicas:
        replica.start()
    for replica in replicas:
        replica.wait_ready()
    report["startup_to_ready_s"] = round(time.monotonic() - boot, 1)
    return replicas


def measure_capacity(replica, images, levels, seconds):
    """Closed-loop points straight at one replica (the other idles: on this host they share the CPUs)."""
    url = f"127.0.0.1:{replica.http}"
    asyncio.run(closed_loop(url, images, levels[0], 3, "warmup"))
    points = []
    for level in levels:
        queue_before = compute_queue_us(replica.metrics)
        tally, elapsed = asyncio.run(closed_loop(url, images, level, seconds, f"capacity{level}"))
        queue_after = compute_queue_us(replica.metrics)
        point = {
            "concurrency": level, "seconds": round(elapsed, 1), "sent": tally.sent,
            "answered": tally.answered, "failed": tally.failed,
            "throughput_rps": round(tally.answered / elapsed, 2),
            "latency": percentiles([r[1] for r in tally.records if r[2]]),
            # What the HPA's custom metric reads (deploy/monitoring/prometheus-adapter-values.yaml).
            "compute_queue_ms_per_request": round(
                (queue_after - queue_before) / 1e3 / max(tally.answered, 1), 1),
        }
        points.append(point)
        log(f"one replica, closed loop x{level}: {point['throughput_rps']} req/s, latency {point['latency']}, "
            f"preprocess+classifier queue {point['compute_queue_ms_per_request']} ms/request")
        if tally.failed:
            log(f"capacity phase failures: {tally.failures}")
    return points


async def stop_and_restart(replica, nginx, args, timeline, load_start):
    """During the failover load: (drain,) SIGTERM replica A, start it again, note when each happened."""
    def now():
        return round(time.monotonic() - load_start, 1)

    await asyncio.sleep(args.stop_after_s)
    if args.drain_s:
        timeline["drained_s"] = now()
        log(f"draining replica A: marked down in nginx, SIGTERM in {args.drain_s} s")
        nginx.set_a_down(True)
        await asyncio.sleep(args.drain_s)
    timeline["sigterm_s"] = now()
    log(f"SIGTERM to replica A (pid {replica.process.pid})")
    status = await asyncio.to_thread(replica.terminate)
    timeline["exited_s"] = now()
    timeline["exit_status"] = status
    timeline["stop_took_s"] = round(timeline["exited_s"] - timeline["sigterm_s"], 1)
    log(f"replica A exited with {status}; starting it again")
    replica.start()
    await asyncio.to_thread(replica.wait_ready)
    timeline["ready_again_s"] = now()
    if args.drain_s:
        nginx.set_a_down(False)
    log("replica A ready again")


def failover(args, started, workdir, replicas, images, rate, llm_port):
    """Open-loop load through nginx while replica A stops and starts again -> (figures, ok)."""
    nginx = Nginx(started, workdir, [r.http for r in replicas])
    timeline = {}
    load_start = time.monotonic()
    log(f"failover: {rate} req/s for {args.failover_s:.0f} s through nginx on 127.0.0.1:{nginx.port}")
    tally, t0, _ = asyncio.run(open_loop(
        f"127.0.0.1:{nginx.port}", images, rate, args.failover_s, args.max_in_flight, "failover",
        during=lambda: stop_and_restart(replicas[0], nginx, args, timeline, load_start),
        retries=args.client_retries))
    stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{llm_port}/_admin/stats", timeout=5))
    nginx_requests, retried = nginx_retries(workdir / "nginx-access.log")

    def window(lo, hi):
        return percentiles([lat for at, lat, good in tally.records if good and lo <= at - t0 < hi])

    end = 10**9
    stop_at = timeline.get("sigterm_s", end)
    exited_at = timeline.get("exited_s", end)
    ready_at = timeline.get("ready_again_s", end)
    figures = {
        "rate_rps": rate, "seconds": args.failover_s, "sent": tally.sent, "answered": tally.answered,
        "failed": tally.failed, "failures": tally.failures, "description_source": tally.sources,
        "client_retries": tally.client_retries,
        "timeline_s": timeline, "nginx_requests": nginx_requests, "nginx_retried_on_other_replica": retried,
        # Windows by when a request started. On this host the replicas share the
        # CPUs: while A stops, B has them all; while A starts again, its model
        # loading and warmup compete with B (on a cluster they would not).
        "latency_before_stop": window(0, stop_at),
        "latency_a_stopping": window(stop_at, exited_at),
        "latency_a_starting": window(exited_at, ready_at),
        "latency_after_restart": window(ready_at, end),
        "llm_calls": stats.get("requests"), "llm_max_in_flight": stats.get("max_in_flight"),
    }
    ok = tally.failed == 0 and tally.sent == tally.answered and "ready_again_s" in timeline
    return figures, ok


def rehearse(args, workdir, report):
    """Both phases; True when every failover request was answered and A came back."""
    started = Started()
    try:
        try:
            llm = FakeLLM(workdir / "fake-llm.log", args.llm_latency_ms)
        except NotReady as error:
            raise SystemExit(f"rehearse: {error}") from None
        started.track("fake LLM", llm.process)
        replicas = start_replicas(started, workdir, llm.base_url, report)
        log(f"replicas ready in {report['startup_to_ready_s']} s: A http {replicas[0].http}, "
            f"B http {replicas[1].http}; fake LLM {llm.base_url} ({args.llm_latency_ms:.0f} ms); logs in {workdir}")
        images = photo_variants(2000)
        levels = [int(level) for level in args.concurrency.split(",")]
        report["capacity_one_replica"] = measure_capacity(replicas[0], images, levels, args.capacity_s)
        throughput = max(point["throughput_rps"] for point in report["capacity_one_replica"])
        rate = args.rate or max(1.0, round(throughput / 2, 1))
        report["failover"], ok = failover(args, started, workdir, replicas, images, rate, llm.port)
        return ok
    finally:
        started.stop_all()


def main():
    args = parse_args()
    for needed in (".venv/bin/python", "build/backends/python", "model_repository/classifier/1/model.pt"):
        if not (REPO / needed).exists():
            raise SystemExit(f"rehearse: {needed} is missing; run `make build` first")

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="rehearse-"))
    report = {"host": {**host.describe(), "cpus": os.cpu_count(),
                       "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
              "settings": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}}
    ok = False
    try:
        ok = rehearse(args, workdir, report)
    finally:
        report["ok"] = ok
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(report, indent=2) + "\n")
        if args.keep_logs or not ok:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print(json.dumps(report, indent=2))
    if "failover" not in report:
        return 1
    failover = report["failover"]
    throughput = max(point["throughput_rps"] for point in report["capacity_one_replica"])
    print(f"\nrehearse: requests sent {failover['sent']}, answered {failover['answered']}, "
          f"failed {failover['failed']} (expected 0); nginx resent {failover['nginx_retried_on_other_replica']} "
          f"to the other replica, the client resent {failover['client_retries']}; per-replica throughput "
          f"{throughput:.1f} req/s "
          f"-> {args.result_json.relative_to(REPO) if args.result_json.is_relative_to(REPO) else args.result_json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
