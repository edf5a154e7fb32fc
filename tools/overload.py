"""Bounded overload run (`make overload`; docs/reliability.md#overload).

First finds the saturating concurrency: the fewest virtual users (8, 16, 32,
...) whose throughput is within 5 % of the best seen (`--saturation N` skips
the sweep). Then keeps that many users sending classify_and_describe requests
over gRPC for `--phase-s` seconds, then `--factor` times as many. Each user waits
for its answer; on UNAVAILABLE (a queue policy refused it) it backs off the
way classify_describe's clients do (exponential with full jitter) and sends
again. Per attempt it records: admitted (answered) latency, rejection latency,
or lost (any other error, or no answer within `--timeout-s`).

Verdict (exit 1 if any fails): at overload, the admitted p99 is at most
`--max-p99-ratio` x the p99 at saturation, rejections are answered within
`--max-reject-ms` (p99), and nothing is lost.

The load generator (`--load-generator`): `c` (default) is
tools/overload_client.c, compiled here with `cc -O2`: one epoll thread, one
keep-alive HTTP/1.1 connection per user to /v2/models/<ensemble>/infer, the
refusal being HTTP 503 with the same message; it costs the shared cores little,
so the refusal latency it sees is the server's. `python` is the earlier
generator: tritonclient.grpc.aio, all users in this process; at 1,280 users it
was the bottleneck (its refusal latency was mostly its own queue).

Without --grpc-url it starts, on loopback and free ports, the fake LLM
upstream and one tritonserver (tools/local_stack.py) and stops both by PID.
"""

import argparse
import asyncio
import itertools
import json
import pathlib
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from classify_describe.client import backoff_s  # the clients' own back-off
from tools import host
from tools.local_stack import FakeLLM, TritonServer

REPO = pathlib.Path(__file__).resolve().parents[1]
C_SOURCE = REPO / "tools/overload_client.c"

ENSEMBLE = "classify_and_describe"
# A queue policy's refusal; any other error (UNAVAILABLE included: a model
# unloading, the LLM step failing with on_failure=error) is a lost request.
REFUSED = "Exceeds maximum queue size"


async def python_phase(url, image, users, seconds, timeout_s, backoff_base_s):
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    admitted, rejected, lost = [], [], []
    deadline = time.monotonic() + seconds
    tag = f"{random.getrandbits(32):08x}"
    sent = itertools.count()

    async def user():
        attempt = 0
        while time.monotonic() < deadline:
            tensor = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[image]], dtype=np.object_))
            # A new prompt each time: the describe step's answer cache would
            # otherwise hide the LLM's latency.
            prompt = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
            prompt.set_data_from_numpy(np.array([[f"What is it? ({tag}-{next(sent)})".encode()]], dtype=np.object_))
            started = time.monotonic()
            try:
                await client.infer(ENSEMBLE, [tensor, prompt], client_timeout=timeout_s)
                admitted.append(time.monotonic() - started)
                attempt = 0
            except grpcclient.InferenceServerException as error:
                elapsed = time.monotonic() - started
                if str(error.status()) == "StatusCode.UNAVAILABLE" and REFUSED in str(error.message()):
                    rejected.append(elapsed)
                    await asyncio.sleep(backoff_s(backoff_base_s, attempt))
                    attempt += 1
                else:
                    lost.append(f"{error.status()}: {error.message()[:160]}")

    started = time.monotonic()
    try:
        await asyncio.gather(*(user() for _ in range(users)))
    finally:
        await client.close()
    # Requests sent before the deadline finish after it: rates are per second
    # of the whole phase, drain included.
    return summary(users, round(time.monotonic() - started, 1), admitted, rejected, lost)


def summary(users, seconds, admitted, rejected, lost):
    """A phase's figures from its attempts' latencies (s) and its lost requests' reasons."""
    return {"users": users, "seconds": seconds, "admitted": len(admitted), "rejected": len(rejected),
            "lost": len(lost), "lost_sample": lost[:3],
            "admitted_per_s": round(len(admitted) / seconds, 1),
            "admitted_p50_ms": percentile_ms(admitted, 50), "admitted_p99_ms": percentile_ms(admitted, 99),
            "rejected_p50_ms": percentile_ms(rejected, 50), "rejected_p99_ms": percentile_ms(rejected, 99)}


def parse_attempts(lines):
    """tools/overload_client.c's lines ("ok|refused|lost:<why> <microseconds>")
    -> (admitted, rejected latencies in s, lost reasons)."""
    admitted, rejected, lost = [], [], []
    for line in lines:
        outcome, _, micros = line.strip().partition(" ")
        if outcome == "ok":
            admitted.append(int(micros) / 1e6)
        elif outcome == "refused":
            rejected.append(int(micros) / 1e6)
        elif outcome:
            lost.append(outcome)
    return admitted, rejected, lost


def compile_c_client(workdir):
    binary = pathlib.Path(workdir) / "overload_client"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("overload: no C compiler (cc) for tools/overload_client.c; or --load-generator python")
    subprocess.run([compiler, "-O2", "-o", str(binary), str(C_SOURCE)], check=True)
    return binary


def c_phase(binary, http_url, image_path, users, seconds, timeout_s, backoff_base_s):
    """One phase driven by tools/overload_client.c (HTTP); the same figures as python_phase."""
    host_name, port = http_url.rsplit(":", 1)
    with tempfile.NamedTemporaryFile("r", suffix=".attempts") as out:
        started, cpu_before = time.monotonic(), children_cpu_s()
        subprocess.run([str(binary), host_name, port, ENSEMBLE, str(users), str(seconds),
                        str(backoff_base_s * 1000), str(timeout_s * 1000), str(image_path), out.name],
                       check=True, timeout=seconds + timeout_s + 60)
        elapsed = round(time.monotonic() - started, 1)
        figures = summary(users, elapsed, *parse_attempts(out))
    # What the load generator cost the shared cores (1.0 = one core all the time).
    figures["load_generator_cpu_share"] = round((children_cpu_s() - cpu_before) / elapsed, 3)
    return figures


def children_cpu_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def percentile_ms(values, q):
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def saturating_users(drive, args):
    """(users, sweep): the fewest users within 5 % of the best throughput."""
    sweep, users = [], args.min_users
    while users <= args.max_users:
        sweep.append(drive(users, args.sweep_s))
        best = max(r["admitted_per_s"] for r in sweep)
        # Two steps past the best without gaining: throughput has levelled off.
        if len(sweep) >= 3 and max(r["admitted_per_s"] for r in sweep[-2:]) < best * 1.02 \
                and sweep[-3]["admitted_per_s"] >= best * 0.95:
            break
        users *= 2
    best = max(r["admitted_per_s"] for r in sweep)
    return next(r["users"] for r in sweep if r["admitted_per_s"] >= 0.95 * best), sweep


def driver(args, grpc_url, http_url, image_path, workdir):
    """drive(users, seconds) -> a phase's figures, with the chosen load generator."""
    if args.load_generator == "python":
        image = pathlib.Path(image_path).read_bytes()
        return lambda users, seconds: asyncio.run(
            python_phase(grpc_url, image, users, seconds, args.timeout_s, args.backoff_s))
    binary = compile_c_client(workdir)
    return lambda users, seconds: c_phase(binary, http_url, image_path, users, seconds,
                                          args.timeout_s, args.backoff_s)


def run(drive, args):
    sweep = None
    users = args.saturation
    if users is None:
        users, sweep = saturating_users(drive, args)
    saturation = drive(users, args.phase_s)
    overload = drive(users * args.factor, args.phase_s)
    return {"sweep": sweep, "saturation": saturation, "overload": overload,
            "verdict": judge(saturation, overload, args)}


def judge(saturation, overload, args):
    problems = []
    if not saturation["admitted"] or not overload["admitted"]:
        return ["no request was answered in a phase"]
    ratio = overload["admitted_p99_ms"] / saturation["admitted_p99_ms"]
    if ratio > args.max_p99_ratio:
        problems.append(f"admitted p99 at overload is {ratio:.2f}x the p99 at saturation "
                        f"(limit {args.max_p99_ratio}x)")
    if overload["rejected"] == 0:
        problems.append("nothing was refused at overload: no admission control")
    elif overload["rejected_p99_ms"] > args.max_reject_ms:
        problems.append(f"rejections p99 {overload['rejected_p99_ms']} ms (limit {args.max_reject_ms} ms)")
    for name, result in (("saturation", saturation), ("overload", overload)):
        if result["lost"]:
            problems.append(f"{result['lost']} request(s) lost at {name}: {result['lost_sample']}")
    return problems


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", help="an already running server (default: start one); with --http-url")
    parser.add_argument("--http-url", help="the same server's HTTP endpoint (the C load generator's)")
    parser.add_argument("--load-generator", choices=("c", "python"), default="c",
                        help="c: tools/overload_client.c over HTTP (default); python: tritonclient gRPC")
    parser.add_argument("--saturation", type=int, help="users that saturate the ensemble (default: measure)")
    parser.add_argument("--min-users", type=int, default=8, help="the sweep starts here")
    parser.add_argument("--sweep-s", type=float, default=6, help="seconds per step of the saturation sweep")
    parser.add_argument("--max-users", type=int, default=512, help="the sweep stops here")
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--phase-s", type=float, default=30)
    parser.add_argument("--llm-latency-ms", type=float, default=1000,
                        help="the fake LLM's latency (1 s: the describe step holds requests like a real LLM)")
    parser.add_argument("--timeout-s", type=float, default=30)
    parser.add_argument("--backoff-s", type=float, default=0.5, help="as the client's retry_backoff_s")
    parser.add_argument("--max-p99-ratio", type=float, default=3.0)
    parser.add_argument("--max-reject-ms", type=float, default=50.0)
    parser.add_argument("--results", type=pathlib.Path)
    return parser.parse_args(argv)


def on_own_server(args, image_path, workdir):
    llm = FakeLLM(pathlib.Path(workdir) / "fake_llm.log", latency_ms=args.llm_latency_ms)
    server = TritonServer(workdir, {"LLM_BASE_URL": llm.base_url, "LLM_API_KEY": "sk-overload"})
    try:
        server.start()
        results = run(driver(args, server.grpc_url, server.http_url, image_path, workdir), args)
        results["server_ready_after"] = server.is_ready()
        if not results["server_ready_after"]:
            results["verdict"].append("server not ready after the run")
        return results
    finally:
        server.stop()
        llm.stop()


def main(argv=None):
    args = parse_args(argv)
    import skimage.data

    image_path = pathlib.Path(skimage.data.__file__).parent / "coffee.png"
    with tempfile.TemporaryDirectory(prefix="overload-") as workdir:
        if args.grpc_url:
            results = run(driver(args, args.grpc_url, args.http_url, image_path, workdir), args)
        else:
            results = on_own_server(args, image_path, workdir)
    results["host"] = host.describe()
    results["settings"] = {k: v for k, v in vars(args).items() if k not in ("results", "grpc_url", "http_url")}
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text + "\n")
    return 1 if results["verdict"] else 0


if __name__ == "__main__":
    sys.exit(main())
