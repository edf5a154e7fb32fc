"""What the OpenAI-compatible front costs: the same requests (a JPEG and a
distinct prompt each) sent to classify_and_describe with tritonclient gRPC
directly and through the front's POST /v1/chat/completions, side by side in
one run, on one server, with the fake LLM at 0 ms.

  1. added latency: one request at a time, blocks of each path in turn;
     p50 (and p99) of each, the difference is what the front adds;
  2. throughput at the ensemble's saturating concurrency: a short sweep of
     the direct path finds it (the smallest concurrency within 5 % of the
     best), then timed windows of each path in turn at that concurrency;
     also the front's own CPU per request (it shares the cores with Triton).

  python -m tools.bench.openai_front [--results docs/results/openai-front-<UTC time>.json]
  (`make bench` measures the same figures on its own server, as a section of its
  one results file: tools/bench/sections.py)
  make bench-openai

Both clients live in this process: grpc.aio for the direct path, one aiohttp
session posting pre-built JSON bodies for the front (what an OpenAI SDK sends,
without the SDK's own client-side cost, which is the same with or without
this front). Targets (issue 14): added p50 <= 2 ms; throughput >= 0.95 of direct.
"""

import argparse
import asyncio
import base64
import datetime
import json
import pathlib
import statistics
import sys
import tempfile
import time

from serving.procfs import cpu_seconds, front_pid
from tools import host
from tools.bench.clients import _drive, _inputs, _percentile
from tools.bench.harness import FakeLLM, Triton, load_average
from tools.bench.inputs import photo_jpegs, prompts

REPO = pathlib.Path(__file__).resolve().parents[2]
SECTION = "## The OpenAI-compatible front"
MODEL = "classify_and_describe"
TARGET_ADDED_P50_MS = 2.0
TARGET_THROUGHPUT_RATIO = 0.95


def log(message):
    print(f"[openai-front bench] {message}", file=sys.stderr, flush=True)


def process_cpu_s(pid):
    seconds = cpu_seconds(pid)
    return float("nan") if seconds is None else seconds  # the front gone: its figure unknown, not 0


class Paths:
    """One request by either path; index picks the image and the prompt."""

    def __init__(self, grpc_url, openai_base_url, images, questions):
        import aiohttp
        import tritonclient.grpc.aio as grpcclient

        self.grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.url = f"{openai_base_url}/chat/completions"
        self.images, self.questions = images, questions
        self.uris = [json.dumps("data:image/jpeg;base64," + base64.b64encode(i).decode()) for i in images]

    async def direct(self, index):
        result = await self.client.infer(MODEL, _inputs(self.grpc, self.images[index % len(self.images)],
                                                        self.questions[index % len(self.questions)]))
        if result.as_numpy("DESCRIPTION_SOURCE")[0][0] != b"llm":
            raise RuntimeError("the describe step fell back")

    def body(self, index):
        # The data: URI is JSON-encoded once per image; only the prompt changes.
        question = json.dumps(self.questions[index % len(self.questions)])
        return (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": [{{"type": "text", "text": {question}}}, '
                f'{{"type": "image_url", "image_url": {{"url": {self.uris[index % len(self.uris)]}}}}}]}}]}}').encode()

    async def front(self, index):
        async with self.session.post(self.url, data=self.body(index),
                                     headers={"Content-Type": "application/json"}) as response:
            answer = await response.json()
        if response.status != 200 or answer["classify_describe"]["description_source"] != "llm":
            raise RuntimeError(f"front answered {response.status}: {str(answer)[:200]}")

    async def close(self):
        await self.client.close()
        await self.session.close()


async def one_at_a_time(paths, block, rounds, offset):
    """Blocks of `block` requests per path in turn, `rounds` times; latencies in ms."""
    latencies = {"direct": [], "front": []}
    index = offset
    for turn in range(rounds):
        order = ("direct", "front") if turn % 2 == 0 else ("front", "direct")
        for name in order:
            call = getattr(paths, name)
            for _ in range(block):
                started = time.perf_counter()
                await call(index)
                latencies[name].append((time.perf_counter() - started) * 1e3)
                index += 1
    return latencies, index


async def bench(triton, llm, args):
    images = list(photo_jpegs().values())
    questions = prompts(1_000_000)
    paths = Paths(triton.grpc_url, triton.openai_base_url, images, questions)
    front = front_pid(triton.process.pid)
    results = {"target_added_p50_ms": TARGET_ADDED_P50_MS, "target_throughput_ratio": TARGET_THROUGHPUT_RATIO,
               "host": host.describe()}
    try:
        # Warm both paths (channels, connection pools, the models' first requests).
        for index in range(20):
            await paths.direct(index)
            await paths.front(index)
        results["latency"] = await latency_one_at_a_time(paths, args)
        results["sweep_direct_throughput"], saturating = await saturating_concurrency(paths, args)
        results["saturating_concurrency"] = saturating
        results.update(await throughput_windows(paths, args, saturating, front))
    finally:
        await paths.close()
    results["met"] = {"added_p50": results["latency"]["added_p50_ms"] <= TARGET_ADDED_P50_MS,
                      "throughput": results["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO}
    return results


async def latency_one_at_a_time(paths, args):
    log(f"latency: {args.rounds} rounds of {args.block} requests per path, one at a time")
    latencies, _ = await one_at_a_time(paths, args.block, args.rounds, 100)
    latency = {name: {"p50_ms": _percentile(v, 50), "p99_ms": _percentile(v, 99), "mean_ms": statistics.fmean(v),
                      "count": len(v)} for name, v in latencies.items()}
    latency["added_p50_ms"] = latency["front"]["p50_ms"] - latency["direct"]["p50_ms"]
    latency["added_p99_ms"] = latency["front"]["p99_ms"] - latency["direct"]["p99_ms"]
    log(f"  direct p50 {latency['direct']['p50_ms']:.2f} ms, front p50 {latency['front']['p50_ms']:.2f} ms, "
        f"added {latency['added_p50_ms']:.2f} ms")
    return latency


async def saturating_concurrency(paths, args):
    """-> (sweep, concurrency): the direct path's throughput per concurrency of a short sweep, and the
    smallest within 5 % of the best (or --concurrency, without a sweep)."""
    if args.concurrency:
        return {}, args.concurrency
    sweep = {}
    for concurrency in args.sweep:
        run = await _drive(paths.direct, concurrency, args.sweep_s, warmup_s=1.0)
        sweep[concurrency] = run["throughput"]
        log(f"  sweep (direct) c={concurrency}: {run['throughput']:.1f} req/s")
    best = max(sweep.values())
    return sweep, min(c for c, t in sweep.items() if t >= 0.95 * best)


async def throughput_windows(paths, args, saturating, front):
    """Alternating timed windows of each path at `saturating`, with the front's CPU per request."""
    log(f"throughput at concurrency {saturating}: {args.windows} windows of {args.window_s:.0f} s per path")
    windows = []
    for turn in range(args.windows):
        for name in (("direct", "front") if turn % 2 == 0 else ("front", "direct")):
            cpu_before = process_cpu_s(front)
            run = await _drive(getattr(paths, name), saturating, args.window_s, warmup_s=2.0)
            cpu_s = process_cpu_s(front) - cpu_before
            windows.append({"path": name, "throughput": run["throughput"], "p50_ms": run["p50_ms"],
                            "p99_ms": run["p99_ms"], "errors": run["errors"],
                            "front_cpu_ms_per_request": cpu_s * 1e3 / max(run["finished_all"], 1)
                            if name == "front" else None})
            log(f"  {name}: {run['throughput']:.1f} req/s, p50 {run['p50_ms']:.0f} ms, errors {run['errors']}")
    total = {name: sum(w["throughput"] for w in windows if w["path"] == name) for name in ("direct", "front")}
    figures = {"windows": windows,
               "throughput_ratio": total["front"] / total["direct"] if total["direct"] else float("nan"),
               "front_cpu_ms_per_request": statistics.fmean(
                   w["front_cpu_ms_per_request"] for w in windows if w["path"] == "front")}
    log(f"  throughput ratio front/direct: {figures['throughput_ratio']:.3f}; front CPU "
        f"{figures['front_cpu_ms_per_request']:.2f} ms per request")
    return figures


def markdown(results):
    """The section of docs/benchmarks.md for one run's results."""
    latency, windows = results["latency"], results["windows"]
    direct, front = latency["direct"], latency["front"]
    by_path = {name: [w["throughput"] for w in windows if w["path"] == name] for name in ("direct", "front")}
    per_path = len(by_path["front"])
    everything = by_path["direct"] + by_path["front"]
    rows = [
        ("latency p50, one at a time", f"{direct['p50_ms']:.2f} ms", f"{front['p50_ms']:.2f} ms",
         f"**{latency['added_p50_ms']:+.2f} ms**", f"at most +{results['target_added_p50_ms']:g} ms"),
        ("latency p99, one at a time", f"{direct['p99_ms']:.1f} ms", f"{front['p99_ms']:.1f} ms",
         f"{latency['added_p99_ms']:+.1f} ms", ""),
        (f"throughput at concurrency {results['saturating_concurrency']} (sum of {per_path} windows each)",
         f"{sum(by_path['direct']):.1f} req/s", f"{sum(by_path['front']):.1f} req/s",
         f"**{results['throughput_ratio']:.3f}**", f"at least {results['target_throughput_ratio']:g}"),
    ]
    table = "\n".join("| " + " | ".join(row) + " |" for row in
                      [("figure", "direct gRPC", "through the front", "result", "target"), ("---",) * 5, *rows])
    return f"""{SECTION}

The same requests (a JPEG and a distinct prompt each) to `classify_and_describe` through the
front's `POST /v1/chat/completions` and with `tritonclient.grpc.aio` directly, on one server,
fake LLM at 0 ms, side by side in one run: one request at a time in alternating blocks
({direct["count"]} per path), then the direct path's saturating concurrency (the smallest within
5 % of the best of a short sweep), then alternating timed windows of each path there
({per_path} per path). `make bench-openai` measures the same on its own server.

{table}

The front spent {results["front_cpu_ms_per_request"]:.1f} ms of CPU per request (JSON, base64,
HTTP and gRPC), on the same cores as Triton, the fake LLM and the load generator (CPU instruction
sets: {host.isa_text(results.get("host"))}; load average
{results["load_average_before"][0]:.1f} before, {results["load_average_after"][0]:.1f} after). Single
windows moved between {min(everything):.0f} and {max(everything):.0f} req/s, so the throughput
ratio is only as good as the alternation; the one-at-a-time p50s are steadier.
Errors: {sum(w["errors"] for w in windows)}.
"""


# -- as a section of `make bench` (tools/bench/sections.py) --------------------------------------

NAME = "openai_front"
TITLE = "The OpenAI-compatible front"
# Sized per `make bench` mode: smoke runs inside `make test` (seconds), quick and full as in the
# standalone run, which sweeps for the saturating concurrency.
SIZES = {
    "smoke": dict(block=5, rounds=2, concurrency=4, sweep=[], sweep_s=0.0, windows=1, window_s=2.0),
    "quick": dict(block=25, rounds=4, concurrency=None, sweep=[4, 8, 16], sweep_s=4.0, windows=2, window_s=8.0),
    "full": dict(block=50, rounds=6, concurrency=None, sweep=[2, 4, 8, 16, 32], sweep_s=6.0, windows=4,
                 window_s=15.0),
}


def measure(ctx):
    """The front's figures on the run's own server (it starts a front beside Triton) and fake LLM."""
    load_before = load_average()
    results = asyncio.run(bench(ctx.triton, ctx.llm, argparse.Namespace(**SIZES[ctx.mode])))
    results.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   load_average_before=load_before, load_average_after=load_average())
    return results


def render(section):
    return markdown(section).splitlines()


def targets(section):
    from tools.bench.report import Target  # report imports the sections: import it when called

    latency = section["latency"]
    return [
        Target("OpenAI front: added p50 over tritonclient gRPC directly, one at a time", latency["added_p50_ms"],
               section["target_added_p50_ms"], at_most=True, unit=" ms",
               detail=f"{latency['front']['p50_ms']:.2f} vs {latency['direct']['p50_ms']:.2f} ms"),
        Target(f"OpenAI front / direct gRPC throughput (c={section['saturating_concurrency']})",
               section["throughput_ratio"], section["target_throughput_ratio"], digits=3),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=pathlib.Path,
                        default=pathlib.Path("docs/results/openai-front-"
                                             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H%M}.json"))
    parser.add_argument("--block", type=int, default=50, help="requests per block in the latency phase")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per path in the latency phase")
    parser.add_argument("--concurrency", type=int, help="skip the sweep and measure throughput at this concurrency")
    parser.add_argument("--sweep", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--sweep-s", type=float, default=6.0)
    parser.add_argument("--windows", type=int, default=4, help="throughput windows per path")
    parser.add_argument("--window-s", type=float, default=15.0)
    args = parser.parse_args(argv)

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-openai-front-"))
    llm = FakeLLM(workdir, latency_ms=0.0)
    triton = None
    try:
        triton = Triton(workdir, llm.base_url)
        load_before = load_average()
        results = asyncio.run(bench(triton, llm, args))
    finally:
        if triton is not None:
            triton.stop()
        llm.stop()
    results.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="python -m tools.bench.openai_front " + " ".join(argv if argv is not None else sys.argv[1:]),
                   load_average_before=load_before, load_average_after=load_average(),
                   note="2-core shared VM; client, front, Triton and the fake LLM on the same cores")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1, default=float) + "\n")
    log(f"results: {args.results}")
    print(json.dumps({"added_p50_ms": round(results["latency"]["added_p50_ms"], 2),
                      "throughput_ratio": round(results["throughput_ratio"], 3),
                      "saturating_concurrency": results["saturating_concurrency"], "met": results["met"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
