"""`make bench` / `make bench-quick`: measure the package with perf_analyzer and
write the report (docs/benchmarks.md) and its plots (docs/plots/*.png).

One run starts its own fake LLM upstream and tritonserver on free loopback
ports (a temp copy of model_repository/, so configs can be swapped for the
tuning sweep), measures every figure side by side on the same machine, stops
both by PID, and prints the headline ratios.

usage: .venv/bin/python -m tools.bench.run --mode full|quick|smoke [--out FILE] [--plots DIR]
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

from tools import model_config
from tools.bench import clients, harness, inputs, report

REPO = harness.REPO

# Every load run is bounded: perf_analyzer by windows x trials (and a timeout),
# the Python clients by their duration.
MODES = {
    "smoke": dict(window_ms=1000, trials=3, repeats=1, inproc_s=0.3, inproc_batches="1,2",
                  classify_c=2, hiding_abba=False, cover_latency_ms=200, cover_base_c=2, cover_max_c=8,
                  describe_n=10, pattern_latency_ms=200, pattern_c=4, pattern_blocks=0, pattern_s=1.5, warmup_s=0.5,
                  classify_sweep=(2,), ensemble_sweep=(2,), ensemble_sweep_latency_ms=200,
                  tuning=("no_batching",), tuning_c=(2,)),
    "quick": dict(window_ms=1500, window_cap_ms=4000, trials=3, repeats=1, inproc_s=1.5, inproc_batches="1,2,4",
                  classify_c=4, hiding_abba=True, cover_latency_ms=1000, cover_base_c=4, cover_max_c=128,
                  describe_n=60, pattern_latency_ms=200, pattern_c=16, pattern_blocks=1, pattern_s=4.0, warmup_s=1.0,
                  classify_sweep=(1, 4), ensemble_sweep=(4, 16), ensemble_sweep_latency_ms=200,
                  tuning=(), tuning_c=()),
    "full": dict(window_ms=3000, trials=3, repeats=5, inproc_s=2.0, inproc_batches="1,2,4,8",
                 classify_c=4, hiding_abba=True, cover_latency_ms=1000, cover_base_c=4, cover_max_c=256,
                 describe_n=300, pattern_latency_ms=200, pattern_c=16, pattern_blocks=2, pattern_s=10.0, warmup_s=2.0,
                 classify_sweep=(1, 2, 4, 8, 16), ensemble_sweep=(1, 4, 16, 32, 64),
                 ensemble_sweep_latency_ms=200,
                 tuning=("shipped", "no_batching", "delay_2ms", "preferred_8", "threads_2", "two_instances"),
                 tuning_c=(4, 8)),
}


def log(message):
    print(f"bench: {message}", file=sys.stderr, flush=True)


def machine():
    cpu = platform.processor() or ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kb = int(re.search(r"MemTotal:\s+(\d+)", pathlib.Path("/proc/meminfo").read_text()).group(1))
        mem = f"{mem_kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, AttributeError):
        mem = "RAM unknown"
    return f"{cpu}, {os.cpu_count()} cores, {mem}, {platform.system()} {platform.release()}, no GPU used"


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def other_tritonservers():
    """How many tritonservers this run did not start are running: the load the figures shared the CPU with."""
    try:
        out = subprocess.run(["ps", "-eo", "comm="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.splitlines() if line.strip() == "tritonserver")


# -- the measurements ---------------------------------------------------------------------

def measure_classification(ctx, p):
    """Figure 1: classify through Triton vs the same work in one process; repeated in turns."""
    pairs = []
    for _repeat in range(p["repeats"]):
        before = ctx.triton.stats()
        served = ctx.pa("classify", p["classify_c"])
        delta = harness.stats_delta(before, ctx.triton.stats())
        log(f"classify c={p['classify_c']}: {served['throughput']:.1f} img/s, p50 {served['p50_ms']:.1f} ms")
        inproc = run_inprocess(ctx, p)
        log(f"in-process: {json.dumps(inproc)}")
        pairs.append({"triton": served, "stats": delta, "inprocess": inproc})
    return pairs


def run_inprocess(ctx, p):
    command = [sys.executable, "-m", "tools.bench.inprocess", *map(str, ctx.jpeg_paths),
               "--model-dir", str(ctx.triton.repository / "classifier"), "--batch-sizes", p["inproc_batches"],
               "--duration-s", str(p["inproc_s"]), "--threads", str(ctx.torch_threads)]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["e2e"] = {int(k): v for k, v in result["e2e"].items()}
    result["forward"] = {int(k): v for k, v in result["forward"].items()}
    return result


def concurrency_to_cover(throughput, latency_ms, base, cap):
    """Little's law: requests in flight = throughput x latency. The base concurrency
    (which saturates the CPU at 0 ms) plus 1.5 times that, rounded up to a multiple of 8."""
    needed = base + 1.5 * throughput * latency_ms / 1000.0
    return int(min(cap, 8 * math.ceil(needed / 8)))


def measure_latency_hiding(ctx, p):
    """Figure 2: the ensemble with a slow LLM vs an instant one, same concurrency."""
    ctx.llm.set_latency(0)
    probe = ctx.pa("classify_and_describe", p["cover_base_c"])
    concurrency = concurrency_to_cover(probe["throughput"], p["cover_latency_ms"], p["cover_base_c"],
                                       p["cover_max_c"])
    log(f"ensemble 0 ms at c={p['cover_base_c']}: {probe['throughput']:.1f}/s -> "
        f"concurrency {concurrency} covers {p['cover_latency_ms']} ms")
    # Turns A B (B A): with two repeats, a drift in the machine's load weighs on both sides alike.
    order = (0, p["cover_latency_ms"]) + ((p["cover_latency_ms"], 0) if p["hiding_abba"] else ())
    turns = []
    for latency in order:
        ctx.llm.set_latency(latency)
        llm_before, before = ctx.llm.stats()["requests"], ctx.triton.stats()
        # A window several times the expected latency (queueing included), so that
        # each window counts many completions, not a handful.
        expected_ms = max(1000.0 * concurrency, latency * probe["throughput"] + 1000.0 * p["cover_base_c"]) \
            / max(probe["throughput"], 0.1)
        result = ctx.pa("classify_and_describe", concurrency, expected_ms)
        delta = harness.stats_delta(before, ctx.triton.stats())
        result["upstream_calls"] = ctx.llm.stats()["requests"] - llm_before
        result["triton_requests"] = delta.get("classify_and_describe", {}).get("count", 0)
        result["stats"] = delta
        result["llm_latency_ms"] = latency
        turns.append(result)
        log(f"ensemble {latency} ms at c={concurrency}: {result['throughput']:.1f}/s, p50 {result['p50_ms']:.0f} ms")
    ctx.llm.set_latency(0)
    fast = [t for t in turns if t["llm_latency_ms"] == 0]
    slow = [t for t in turns if t["llm_latency_ms"] != 0]
    ratio = sum(t["throughput"] for t in slow) / max(sum(t["throughput"] for t in fast), 1e-9)
    return {"concurrency": concurrency, "latency_ms": p["cover_latency_ms"], "probe": probe,
            "fast": fast[0], "slow": slow[0], "turns": turns, "ratio": ratio}


def measure_describe_overhead(ctx, p):
    """Figure 3: the describe model over a direct upstream call, one request at a time."""
    ctx.llm.set_latency(0)
    result = clients.describe_overhead(ctx.triton.http_url, ctx.llm.base_url, ctx.prompts, p["describe_n"])
    log(f"describe overhead p50 {result['overhead_p50_ms']:.2f} ms")
    return result


def measure_patterns(ctx, p):
    """Figure 4: the ensemble vs the two-step client, in turns (A B, or blocks of A B B A), same
    images and load. The two differ by a few per cent at most here (both are bound by the
    classifier on 2 cores), less than the drift between turns, hence several blocks."""
    ctx.llm.set_latency(p["pattern_latency_ms"])
    blocks = p["pattern_blocks"]
    order = ("ensemble", "two_step") * (blocks == 0) + ("ensemble", "two_step", "two_step", "ensemble") * blocks
    turns = {"ensemble": [], "two_step": []}
    for pattern in order:
        before = harness.cpu_seconds(ctx.triton.process.pid, ctx.llm.process.pid)
        result = clients.measure(pattern, ctx.triton.http_url, ctx.llm.base_url, ctx.images,
                                 ctx.prompts, p["pattern_c"], p["pattern_s"], p["warmup_s"])
        # CPU per request by where it was spent, over the whole turn: warm-up included.
        after = harness.cpu_seconds(ctx.triton.process.pid, ctx.llm.process.pid)
        result["cpu_ms_per_request"] = {where: (after[where] - before.get(where, 0.0)) * 1e3
                                        / max(1, result["finished_all"]) for where in after}
        turns[pattern].append(result)
        log(f"{pattern} c={p['pattern_c']}: {json.dumps(result)}")
    ctx.llm.set_latency(0)
    results = {}
    for pattern, runs in turns.items():
        results[pattern] = {key: sum(run[key] for run in runs) / len(runs)
                            for key in ("throughput", "p50_ms", "p99_ms", "mean_ms")}
        results[pattern].update(count=sum(run["count"] for run in runs), errors=sum(run["errors"] for run in runs),
                                turns=runs)
        places = {where for run in runs for where in run["cpu_ms_per_request"]}
        results[pattern]["cpu_ms_per_request"] = {
            where: sum(run["cpu_ms_per_request"].get(where, 0.0) for run in runs) / len(runs) for where in places}
    return {"latency_ms": p["pattern_latency_ms"], "concurrency": p["pattern_c"], "duration_s": p["pattern_s"],
            "order": order, **results}


def measure_sweeps(ctx, p):
    """Figure 5: concurrency sweeps of the classify path and of the whole ensemble."""
    sweeps = {"classify": [], "classify_and_describe": [], "ensemble_latency_ms": p["ensemble_sweep_latency_ms"]}
    for name, points in (("classify", p["classify_sweep"]), ("classify_and_describe", p["ensemble_sweep"])):
        if name == "classify_and_describe":
            ctx.llm.set_latency(p["ensemble_sweep_latency_ms"])
        previous = None
        for concurrency in points:
            # Windows several times the expected latency, estimated from the previous point.
            expected_ms = 1000.0 * concurrency / max(previous["throughput"], 0.1) if previous else None
            previous = dict(ctx.pa(name, concurrency, expected_ms), concurrency=concurrency)
            sweeps[name].append(previous)
    ctx.llm.set_latency(0)
    for name in ("classify", "classify_and_describe"):
        log(f"sweep {name}: " + ", ".join(f"c={r['concurrency']} {r['throughput']:.1f}/s" for r in sweeps[name]))
    return sweeps


# Alternatives to the shipped classifier config, as settings; one that turns out
# identical to the shipped file is skipped.
TUNING_VARIANTS = {
    "shipped": {},
    "no_batching": {"batching": False},
    "delay_2ms": {"delay_us": 2000},
    "preferred_8": {"preferred": [8], "delay_us": 10000},
    "threads_2": {"threads": 2},
    "two_instances": {"instances": 2, "threads": 1},
}


def classifier_config(shipped, batching=True, delay_us=None, preferred=None, threads=None, instances=None):
    """A copy of the classifier's config (a ModelConfig) with some scheduling settings replaced."""
    config = type(shipped)()
    config.CopyFrom(shipped)
    if not batching:
        config.ClearField("dynamic_batching")
    if delay_us is not None:
        config.dynamic_batching.max_queue_delay_microseconds = delay_us
    if preferred is not None:
        del config.dynamic_batching.preferred_batch_size[:]
        config.dynamic_batching.preferred_batch_size.extend(preferred)
    if threads is not None:
        config.parameters[thread_parameter(config)].string_value = str(threads)
    if instances is not None:
        for group in config.instance_group:
            group.count = instances
    return config


def classifier_instances(config):
    return sum(group.count for group in config.instance_group) or 1


def classifier_threads(config):
    key = thread_parameter(config)
    # `in` first: reading a missing key of a protobuf map would add it, and a backend refuses unknown parameters.
    return int(config.parameters[key].string_value or 1) if key in config.parameters else 1


# The per-instance thread count parameter of each classifier backend.
THREAD_PARAMETERS = {"torchscript_classifier": "torch_num_threads", "onnx_classifier": "intra_op_threads"}


def thread_parameter(config):
    return THREAD_PARAMETERS[config.backend]


def describe_classifier_config(config):
    """'dynamic batching, preferred [2, 4], delay 0 ms, 2 instance(s) x 1 thread(s)'."""
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        preferred = ", ".join(map(str, batching.preferred_batch_size)) or "any"
        policy = (f"dynamic batching, preferred [{preferred}], "
                  f"delay {batching.max_queue_delay_microseconds / 1000:g} ms")
    else:
        policy = "no dynamic batching"
    return f"{policy}, {classifier_instances(config)} instance(s) x {classifier_threads(config)} thread(s)"


def measure_tuning(ctx, p):
    """The sweep behind the shipped classifier config: alternatives on the temp repository."""
    config_path = ctx.triton.repository / "classifier/config.pbtxt"
    shipped_text = config_path.read_text()
    shipped = model_config.parse(shipped_text)
    rows = []
    try:
        for name in p["tuning"]:
            config = classifier_config(shipped, **TUNING_VARIANTS[name])
            if name != "shipped" and config == shipped:
                log(f"tuning {name}: the same as the shipped config, skipped")
                continue
            label = describe_classifier_config(config) + (" (shipped)" if config == shipped else "")
            text = shipped_text if config == shipped else model_config.render(config)
            if config_path.read_text() != text:
                config_path.write_text(text)
                ctx.triton.load("classifier")
            row = {"name": name, "label": label, "results": {}}
            for concurrency in p["tuning_c"]:
                before = ctx.triton.stats()
                result = ctx.pa("classify", concurrency)
                delta = harness.stats_delta(before, ctx.triton.stats()).get("classifier", {})
                result["avg_batch"] = (delta.get("inference_count", 0) / delta["exec_count"]
                                       if delta.get("exec_count") else float("nan"))
                row["results"][concurrency] = result
            log(f"tuning {name}: " + ", ".join(f"c={c} {r['throughput']:.1f}/s p50 {r['p50_ms']:.0f} ms"
                                               for c, r in row["results"].items()))
            rows.append(row)
    finally:
        if config_path.read_text() != shipped_text:
            config_path.write_text(shipped_text)
            ctx.triton.load("classifier")
    return rows


# -- the run ------------------------------------------------------------------------------------

class Context:
    def __init__(self, mode, workdir, params):
        self.mode, self.workdir, self.params = mode, pathlib.Path(workdir), params
        self.commands = set()

    def pa(self, model, concurrency, expected_latency_ms=None):
        window_ms = self.params["window_ms"]
        if expected_latency_ms:
            cap = self.params.get("window_cap_ms", 30_000)
            window_ms = int(min(cap, max(window_ms, 3 * expected_latency_ms)))
        result = harness.perf_analyzer(model, self.triton.http_url, self.input_data[model], concurrency,
                                       self.workdir, window_ms=window_ms, trials=self.params["trials"])
        result["window_ms"] = window_ms
        command = result["command"].replace(self.triton.http_url, "127.0.0.1:<HTTP_PORT>")
        command = re.sub(r"--concurrency-range \d+", "--concurrency-range <C>", command)
        command = re.sub(r"--measurement-interval \d+", "--measurement-interval <W>", command)
        self.commands.add(re.sub(r"-f \S+", "-f result.csv", command))
        return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--out", type=pathlib.Path, help="the report (default: docs/benchmarks.md for full, "
                        "build/bench/<mode>/benchmarks.md otherwise)")
    parser.add_argument("--plots", type=pathlib.Path, help="plot folder (default: docs/plots for full)")
    parser.add_argument("--results", type=pathlib.Path, help="also write the raw results as JSON here")
    parser.add_argument("--keep-workdir", action="store_true")
    parser.add_argument("--render", type=pathlib.Path, metavar="RESULTS_JSON",
                        help="measure nothing: write the report and plots again from a run's --results file")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads(args.render.read_text())
        _int_keys(results)
        mode = results["meta"]["mode"]
        out = args.out or (REPO / "docs/benchmarks.md" if mode == "full" else REPO / f"build/bench/{mode}/benchmarks.md")
        print(report.write(results, out, args.plots or (REPO / "docs/plots" if mode == "full" else out.parent / "plots")))
        return
    if not harness.PERF_ANALYZER.exists():
        sys.exit(f"bench: {harness.PERF_ANALYZER} is missing; run `make perf-analyzer`")

    mode, params = args.mode, MODES[args.mode]
    out = args.out or (REPO / "docs/benchmarks.md" if mode == "full" else REPO / f"build/bench/{mode}/benchmarks.md")
    plots = args.plots or (REPO / "docs/plots" if mode == "full" else out.parent / "plots")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"bench_{mode}_"))
    ctx = Context(mode, workdir, params)
    started = time.monotonic()
    meta = {"mode": mode, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "commit": git_commit(), "load_before": harness.load_average(),
            "other_servers": other_tritonservers(), "params": params,
            "command": {"full": "make bench", "quick": "make bench-quick"}.get(mode,
                                                                               f"tools/bench/run.py --mode {mode}")}
    log(f"mode {mode}, work dir {workdir}, load average {meta['load_before'][0]:.1f}, "
        f"{meta['other_servers']} other tritonserver(s) running")
    jpegs = inputs.photo_jpegs()
    ctx.images = [jpegs[name] for name in inputs.PHOTOS]
    ctx.jpeg_paths = []
    for name, data in jpegs.items():
        path = workdir / f"{name}.jpg"
        path.write_bytes(data)
        ctx.jpeg_paths.append(path)
    ctx.prompts = inputs.prompts(100_000)
    ctx.input_data = inputs.write_input_data(workdir, jpegs)
    ctx.torch_threads = 2

    ctx.llm = harness.FakeLLM(workdir)
    ctx.triton = None
    results = {"meta": meta}
    try:
        # The backend's own LLM cache is switched off, and every request carries a
        # distinct prompt: each request is one real upstream call.
        ctx.triton = harness.Triton(workdir, ctx.llm.base_url, extra_env={"LLM_CACHE_ENABLED": "false"})
        meta["server_startup_s"] = ctx.triton.startup_s
        shipped_config = model_config.read(ctx.triton.repository / "classifier/config.pbtxt")
        # The in-process baseline gets as many torch threads as all classifier
        # instances use together: the same compute, spent in one process.
        ctx.torch_threads = classifier_threads(shipped_config) * classifier_instances(shipped_config)
        meta["torch_threads"] = ctx.torch_threads
        meta["classifier_config"] = describe_classifier_config(shipped_config)
        meta["policy_max_batch"] = max(shipped_config.dynamic_batching.preferred_batch_size, default=1)
        log(f"tritonserver ready in {ctx.triton.startup_s:.0f}s on {ctx.triton.http_url}")
        results["classification"] = measure_classification(ctx, params)
        results["hiding"] = measure_latency_hiding(ctx, params)
        results["describe"] = measure_describe_overhead(ctx, params)
        results["patterns"] = measure_patterns(ctx, params)
        results["sweeps"] = measure_sweeps(ctx, params)
        results["tuning"] = measure_tuning(ctx, params) if params["tuning"] else []
    finally:
        if ctx.triton is not None:
            ctx.triton.stop()
        ctx.llm.stop()
    meta["load_after"] = harness.load_average()
    meta["duration_s"] = time.monotonic() - started
    meta["perf_analyzer_commands"] = sorted(ctx.commands)

    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1, default=str))
    headline = report.write(results, out, plots)
    print(headline)
    log(f"report {out.relative_to(REPO) if out.is_relative_to(REPO) else out}, plots in {plots}, "
        f"{meta['duration_s']:.0f}s in all")
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def _int_keys(results):
    """JSON turned the integer keys (batch sizes, concurrencies) into strings."""
    for pair in results.get("classification", []):
        for key in ("e2e", "forward"):
            pair["inprocess"][key] = {int(k): v for k, v in pair["inprocess"][key].items()}
    for row in results.get("tuning", []):
        row["results"] = {int(k): v for k, v in row["results"].items()}


if __name__ == "__main__":
    main()
