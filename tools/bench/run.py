"""`make bench` / `make bench-quick`: measure the package with perf_analyzer and
write the report (docs/benchmarks.md) and its plots (docs/plots/*.png).

One run starts its own fake LLM upstream and tritonserver on free loopback
ports (a temp copy of model_repository/, so configs can be swapped for the
tuning sweep), measures every figure side by side on the same machine, stops
both by PID, and prints the targets.

usage: .venv/bin/python -m tools.bench.run --mode full|quick|smoke [--results FILE] [--out FILE] [--plots DIR]

The run's figures go to one results file (JSON); the report and plots are
generated from that file alone, and can be generated again from it without
measuring: .venv/bin/python -m tools.bench.report RESULTS_JSON [--out FILE] [--plots DIR]
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from tools import host, model_config
from tools.bench import clients, harness, inprocess, inputs, report, sections

REPO = harness.REPO

# Every load run is bounded: perf_analyzer by windows x trials (and a timeout),
# the Python clients by their duration. inproc_confirm_s: the in-process best layout and batch
# measured again alone, as long as perf_analyzer's windows x trials (tools/bench/inprocess.py).
MODES = {
    "smoke": dict(window_ms=1000, trials=3, repeats=1, inproc_s=0.3, inproc_batches=(1,), inproc_confirm_s=0.0,
                  limit_c=2, hiding_abba=False, cover_latency_ms=200, cover_base_c=2, cover_max_c=8,
                  describe_n=10, pattern_latency_ms=200, pattern_c=4, pattern_blocks=0, pattern_s=1.5, warmup_s=0.5,
                  classify_sweep=(2,), ensemble_sweep=(2,), ensemble_sweep_latency_ms=200,
                  tuning=("no_batching",), tuning_c=(2,), accuracy_crops=10),
    "quick": dict(window_ms=1500, window_cap_ms=4000, trials=3, repeats=1, inproc_s=1.0, inproc_batches=(1, 2),
                  inproc_confirm_s=4.5,
                  limit_c=8, hiding_abba=False, cover_latency_ms=1000, cover_base_c=4, cover_max_c=128,
                  describe_n=60, pattern_latency_ms=200, pattern_c=16, pattern_blocks=1, pattern_s=4.0, warmup_s=1.0,
                  classify_sweep=(1, 4), ensemble_sweep=(4, 16), ensemble_sweep_latency_ms=200,
                  tuning=(), tuning_c=(), accuracy_crops=100),
    "full": dict(window_ms=3000, trials=3, repeats=3, inproc_s=2.0, inproc_batches=(1, 2, 4), inproc_confirm_s=9.0,
                 limit_c=8, hiding_abba=True, cover_latency_ms=1000, cover_base_c=4, cover_max_c=256,
                 describe_n=300, pattern_latency_ms=200, pattern_c=16, pattern_blocks=2, pattern_s=10.0, warmup_s=2.0,
                 classify_sweep=(1, 2, 4, 8, 16), ensemble_sweep=(1, 4, 16, 32, 64),
                 ensemble_sweep_latency_ms=200,
                 tuning=("shipped", "no_batching", "delay_2ms", "preferred_8", "threads_2", "two_instances"),
                 tuning_c=(4, 8), accuracy_crops=600),
}


def log(message):
    print(f"bench: {message}", file=sys.stderr, flush=True)


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

def measure_limits(ctx, p):
    """Figure 1 and the targets: `classify` and the ensemble (LLM 0 ms) through Triton at the same
    concurrency, with CPU per request by process, against each runtime's in-process limit; in turns,
    the order reversed every other turn so that a drift in the machine's load weighs on both sides."""
    ctx.llm.set_latency(0)
    turns = []
    for number in range(p["repeats"]):
        turn = {}
        for step in ("served", "inprocess") if number % 2 == 0 else ("inprocess", "served"):
            if step == "inprocess":
                turn["inprocess"] = {runtime: measure_inprocess(ctx, runtime, p) for runtime in ctx.runtimes}
                continue
            for key, model in (("classify", "classify"), ("ensemble", "classify_and_describe")):
                turn[key] = ctx.pa_accounted(model, p["limit_c"])
                log(f"{model} c={p['limit_c']}: {turn[key]['throughput']:.1f}/s, p50 {turn[key]['p50_ms']:.1f} ms")
        turns.append(turn)
    # p50 at concurrency 1 (one request at a time: the latency a lone client sees), once per run,
    # between two in-process runs of one image at a time: the host's speed moves by a third within
    # the hour, so the single-image latency it is held against is taken beside it, not in the turns.
    single_image = [measure_single_image(ctx, p)]
    latency_c1 = {}
    for model in ("classify", "classify_and_describe"):
        latency_c1[model] = ctx.pa(model, 1)
        log(f"{model} c=1: p50 {latency_c1[model]['p50_ms']:.1f} ms")
    single_image.append(measure_single_image(ctx, p))
    return {"concurrency": p["limit_c"], "served_runtime": ctx.served_runtime, "turns": turns,
            "latency_c1": latency_c1, "single_image_ms": single_image}


def measure_single_image(ctx, p):
    """One worker's time per image (decode + forward) at batch 1 of the served runtime, in the layout
    where it is shortest: {layout: ms}."""
    per_image = {}
    for processes, threads in ctx.layouts:
        row = inprocess.measure_layout(ctx.served_runtime, ctx.triton.repository, ctx.jpeg_paths, processes,
                                       threads, [1], p["inproc_s"], e2e_only=True)
        per_image[row["name"]] = 1000.0 * processes / row["e2e"][1]
    log("in-process, one image at a time: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in per_image.items()))
    return per_image


def measure_inprocess(ctx, runtime, p):
    batches = [b for b in p["inproc_batches"] if b <= ctx.policy_max_batch] or [1]
    result = inprocess.measure(runtime, ctx.triton.repository, ctx.jpeg_paths, ctx.layouts, batches,
                               p["inproc_s"], p["inproc_confirm_s"])
    log(f"in-process {runtime}: " + ", ".join(
        f"{row['name']} " + "/".join(f"{row['e2e'][b]:.1f}" for b in batches) for row in result["layouts"])
        + f" img/s at batch {'/'.join(map(str, batches))}; best {result['best']['layout']} "
        f"batch {result['best']['batch']}, {result['best']['throughput']:.1f} img/s"
        + (f" when measured again alone for {p['inproc_confirm_s']:g} s" if p["inproc_confirm_s"] else ""))
    return result


def concurrency_to_cover(throughput, latency_ms, base, cap):
    """Little's law: requests in flight = throughput x latency. The base concurrency
    (which saturates the CPU at 0 ms) plus 1.5 times that, rounded up to a multiple of 8."""
    needed = base + 1.5 * throughput * latency_ms / 1000.0
    return int(min(cap, 8 * math.ceil(needed / 8)))


def queue_limit(repository, throughput=math.inf):
    """The largest burst the ensemble's steps admit: perf_analyzer starts all its requests at
    once, and admission control refuses past a step's max_queue_size, and past its time limit
    (default_timeout_microseconds) what `throughput` per second cannot start within it."""
    limits = []
    ensemble = model_config.read(repository / "classify_and_describe" / "config.pbtxt")
    for step in (step.model_name for step in ensemble.ensemble_scheduling.step):
        policy = model_config.read(repository / step / "config.pbtxt").dynamic_batching.default_queue_policy
        if policy.max_queue_size:
            limits.append(policy.max_queue_size)
        if policy.default_timeout_microseconds and math.isfinite(throughput):
            limits.append(math.floor(policy.default_timeout_microseconds / 1e6 * throughput))
    return min(limits, default=math.inf)


def latency_to_cover(throughput, latency_ms, base, cap):
    """The LLM latency figure 2 can hide at concurrency `cap` or less: `latency_ms`, or, where the
    concurrency that covers it would pass the cap, the longest whole 100 ms that fits."""
    if concurrency_to_cover(throughput, latency_ms, base, math.inf) <= cap:
        return latency_ms
    return max(100, 100 * math.floor((cap - base) / 1.5 / max(throughput, 0.1) * 1000.0 / 100))


def measure_latency_hiding(ctx, p):
    """Figure 2: the ensemble with a slow LLM vs an instant one, same concurrency."""
    ctx.llm.set_latency(0)
    probe = ctx.pa("classify_and_describe", p["cover_base_c"])
    cap = min(p["cover_max_c"], queue_limit(ctx.triton.repository, probe["throughput"]))
    latency_ms = latency_to_cover(probe["throughput"], p["cover_latency_ms"], p["cover_base_c"], cap)
    concurrency = concurrency_to_cover(probe["throughput"], latency_ms, p["cover_base_c"], cap)
    log(f"ensemble 0 ms at c={p['cover_base_c']}: {probe['throughput']:.1f}/s -> "
        f"concurrency {concurrency} covers {latency_ms} ms (at most {cap} in flight)")
    # Turns A B (B A): with two repeats, a drift in the machine's load weighs on both sides alike.
    order = (0, latency_ms) + ((latency_ms, 0) if p["hiding_abba"] else ())
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
    return {"concurrency": concurrency, "latency_ms": latency_ms, "wanted_latency_ms": p["cover_latency_ms"],
            "in_flight_cap": cap, "probe": probe,
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


# The per-instance thread count parameter of each runtime of the classifier backend (backends/image).
THREAD_PARAMETERS = {"torchscript": "torch_num_threads", "onnxruntime": "intra_op_threads"}


def thread_parameter(config):
    return THREAD_PARAMETERS[config.parameters["runtime"].string_value]


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


def forward_model(repository, ensemble="classify"):
    """The model that runs `classify`'s forward pass on the CPU: the step (through nested ensembles)
    whose config names a classifier runtime; classify_with_view, preprocess and the classifier in one stub."""
    for step in model_config.read(repository / ensemble / "config.pbtxt").ensemble_scheduling.step:
        config = model_config.read(repository / step.model_name / "config.pbtxt")
        if "runtime" in config.parameters:
            return step.model_name
        if config.platform == "ensemble":
            return forward_model(repository, step.model_name)
    raise ValueError(f"no step of {ensemble} names a classifier runtime")


def measure_tuning(ctx, p):
    """The sweep behind the shipped config of the model doing the forward pass: alternatives on the temp repository."""
    model = forward_model(ctx.triton.repository)
    config_path = ctx.triton.repository / model / "config.pbtxt"
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
                ctx.triton.load(model)
            row = {"name": name, "label": label, "results": {}}
            for concurrency in p["tuning_c"]:
                before = ctx.triton.stats()
                result = ctx.pa("classify", concurrency)
                delta = harness.stats_delta(before, ctx.triton.stats()).get(model, {})
                result["avg_batch"] = (delta.get("inference_count", 0) / delta["exec_count"]
                                       if delta.get("exec_count") else float("nan"))
                row["results"][concurrency] = result
            log(f"tuning {name}: " + ", ".join(f"c={c} {r['throughput']:.1f}/s p50 {r['p50_ms']:.0f} ms"
                                               for c, r in row["results"].items()))
            rows.append(row)
    finally:
        if config_path.read_text() != shipped_text:
            config_path.write_text(shipped_text)
            ctx.triton.load(model)
    return rows


def measure_accuracy(ctx, p):
    """int8 against fp32: top-1 agreement and top-5 overlap on random crops of photos the int8
    calibration never saw, at each crop-size range tools/classifier_accuracy.py measures (its
    int8_vs_fp32, run here so the figure belongs to this run); None when the build has no int8 graph."""
    if not {"onnx_fp32", "onnx_int8"} <= set(ctx.runtimes):
        return None
    try:
        from tools import classifier_accuracy
    except ImportError as exc:
        return {"error": f"tools/classifier_accuracy.py is not in this build ({exc})"}
    sets = []
    for min_area in classifier_accuracy.MIN_AREAS:
        measured = classifier_accuracy.int8_vs_fp32(p["accuracy_crops"], min_area)
        sets.append({key: measured[key] for key in ("crops", "min_crop_area", "seed", "top1_agreement",
                                                      "top5_overlap", "photos")})
        log(f"int8 vs fp32 on {measured['crops']} crops (min area {min_area}): top-1 agreement "
            f"{measured['top1_agreement']:.3f}, top-5 overlap {measured['top5_overlap']:.3f}")
    return {"sets": sets}


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

    def pa_accounted(self, model, concurrency):
        """A perf_analyzer run with the CPU it cost, per request, by process: tritonserver, each
        model's stubs, the fake upstream, perf_analyzer (the load generator) and the whole machine.
        Requests are those Triton counted for `model` over the run, warm-up windows included, as
        the CPU is."""
        before = harness.cpu_seconds(self.triton.process.pid, self.llm.process.pid)
        children_before, stats_before = harness.children_cpu_seconds(), self.triton.stats()
        result = self.pa(model, concurrency)
        after = harness.cpu_seconds(self.triton.process.pid, self.llm.process.pid)
        after["load generator"] = harness.children_cpu_seconds() - children_before
        before["load generator"] = 0.0
        result["stats"] = harness.stats_delta(stats_before, self.triton.stats())
        requests = result["stats"].get(model, {}).get("count", 0)
        result["requests"] = requests
        result["cpu_ms_per_request"] = {where: (after[where] - before.get(where, 0.0)) * 1e3 / max(1, requests)
                                        for where in after}
        return result


# "Today's" figures the p50 target compares with: the results file of a run on the build
# before the ONNX runtime (TorchScript classifier, float32 pixels between the steps).
BASELINE = REPO / "docs/results/bench-2026-11-30-torchscript-quick.json"


def default_paths(mode):
    """(report, plots, results): full mode writes the committed ones."""
    if mode == "full":
        return REPO / "docs/benchmarks.md", REPO / "docs/plots", REPO / "docs/results/bench.json"
    folder = REPO / f"build/bench/{mode}"
    return folder / "benchmarks.md", folder / "plots", folder / "results.json"


def baseline_summary(path):
    """What the targets need from an earlier run's results file, with where it came from."""
    path = pathlib.Path(path)
    if not path.is_file():
        return {"file": _display_path(path), "missing": True}
    earlier = json.loads(path.read_text())
    latency = earlier.get("limits", {}).get("latency_c1", {})
    return {"file": _display_path(path), "date": earlier["meta"]["date"], "commit": earlier["meta"]["commit"],
            "mode": earlier["meta"]["mode"], "load_before": earlier["meta"].get("load_before"),
            "p50_c1_ms": {model: run["p50_ms"] for model, run in latency.items()}}


def _display_path(path):
    path = pathlib.Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def measure_sections(ctx):
    out = {}
    for module in sections.modules():
        # Each section starts from the fake upstream as it started (0 ms, whole answers), whatever
        # latency, chunking or fault the figures before it left set.
        ctx.llm.reset()
        try:
            out[module.NAME] = module.measure(ctx)
        except Exception as exc:  # noqa: BLE001 - one section's failure is reported, not the run's
            log(f"section {module.NAME} failed: {exc}")
            out[module.NAME] = {"error": f"{type(exc).__name__}: {exc}"}
    ctx.llm.reset()
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--out", type=pathlib.Path, help="the report (default: docs/benchmarks.md for full, "
                        "build/bench/<mode>/benchmarks.md otherwise)")
    parser.add_argument("--plots", type=pathlib.Path, help="plot folder (default: docs/plots for full)")
    parser.add_argument("--results", type=pathlib.Path, help="the run's results file, which the report is "
                        "generated from (default: docs/results/bench.json for full, build/bench/<mode>/ otherwise)")
    parser.add_argument("--baseline", type=pathlib.Path, default=BASELINE,
                        help="an earlier run's results file: 'today's' p50 at concurrency 1 for the targets")
    parser.add_argument("--keep-workdir", action="store_true")
    return parser.parse_args(argv)


def run_meta(mode, params, results_path, out):
    """What the report says about the run before it measures: when, where, on what, with what."""
    machine = host.describe()
    return {"mode": mode, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{host.summary(machine)}, no GPU used", "host": machine, "cores": os.cpu_count(),
            "commit": git_commit(),
            "load_before": harness.load_average(), "other_servers": other_tritonservers(), "params": params,
            "command": {"full": "make bench", "quick": "make bench-quick"}.get(
                mode, f"python -m tools.bench.run --mode {mode}"),
            "results_file": _display_path(results_path), "report_file": _display_path(out),
            "versions": {name: report.version(name) for name in ("TRITON_VERSION", "PERF_ANALYZER_TRITONCLIENT_VERSION",
                                                                  "TORCH_VERSION")}}


def prepare_inputs(ctx, workdir):
    """The photos (as bytes and as files), the prompts, perf_analyzer's input data and the in-process layouts."""
    jpegs = inputs.photo_jpegs()
    ctx.images = [jpegs[name] for name in inputs.PHOTOS]
    ctx.jpeg_paths = inputs.write_jpegs(workdir, jpegs)
    ctx.prompts = inputs.prompts(100_000)
    ctx.input_data = inputs.write_input_data(workdir, jpegs)
    ctx.layouts = inprocess.default_layouts()


def start_server(ctx, meta):
    """The run's tritonserver, with the backend's own LLM cache switched off (every request carries a
    distinct prompt: each request is one real upstream call); notes its classifier config and runtimes."""
    ctx.triton = harness.Triton(ctx.workdir, ctx.llm.base_url, extra_env={"LLM_CACHE_ENABLED": "false"})
    meta["server_startup_s"] = ctx.triton.startup_s
    shipped_config = model_config.read(ctx.triton.repository / "classifier/config.pbtxt")
    meta["classifier_config"] = describe_classifier_config(shipped_config)
    ctx.policy_max_batch = max(shipped_config.dynamic_batching.preferred_batch_size, default=1)
    meta["policy_max_batch"] = ctx.policy_max_batch
    ctx.served_runtime = inprocess.served_runtime(ctx.triton.repository)
    ctx.runtimes = inprocess.available_runtimes(ctx.triton.repository)
    meta["layouts"] = [f"{processes}x{threads}" for processes, threads in ctx.layouts]
    log(f"tritonserver ready in {ctx.triton.startup_s:.0f}s on {ctx.triton.http_url}; classifier runtime "
        f"{ctx.served_runtime}; in-process runtimes {', '.join(ctx.runtimes)}")


def measure_all(ctx, params, results):
    results["limits"] = measure_limits(ctx, params)
    results["hiding"] = measure_latency_hiding(ctx, params)
    results["describe"] = measure_describe_overhead(ctx, params)
    results["patterns"] = measure_patterns(ctx, params)
    results["sweeps"] = measure_sweeps(ctx, params)
    results["tuning"] = measure_tuning(ctx, params) if params["tuning"] else []
    results["accuracy"] = measure_accuracy(ctx, params)
    results["sections"] = measure_sections(ctx)


def main(argv=None):
    args = parse_args(argv)
    if not harness.PERF_ANALYZER.exists():
        sys.exit(f"bench: {harness.PERF_ANALYZER} is missing; run `make perf-analyzer`")

    mode, params = args.mode, MODES[args.mode]
    default_out, default_plots, default_results = default_paths(mode)
    out, plots, results_path = args.out or default_out, args.plots or default_plots, args.results or default_results
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"bench_{mode}_"))
    ctx = Context(mode, workdir, params)
    started = time.monotonic()
    meta = run_meta(mode, params, results_path, out)
    log(f"mode {mode}, work dir {workdir}, load average {meta['load_before'][0]:.1f}, "
        f"{meta['other_servers']} other tritonserver(s) running")
    prepare_inputs(ctx, workdir)

    ctx.llm = harness.FakeLLM(workdir)
    ctx.triton = None
    results = {"meta": meta, "baseline": baseline_summary(args.baseline)}
    try:
        start_server(ctx, meta)
        measure_all(ctx, params, results)
    finally:
        if ctx.triton is not None:
            ctx.triton.stop()
        ctx.llm.stop()
    meta["load_after"] = harness.load_average()
    meta["duration_s"] = time.monotonic() - started
    meta["perf_analyzer_commands"] = sorted(ctx.commands)

    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    # The report is written from the file just saved, as `python -m tools.bench.report` would.
    print(report.write(report.load(results_path), out, plots))
    log(f"results {meta['results_file']}, report {meta['report_file']}, plots in {_display_path(plots)}, "
        f"{meta['duration_s']:.0f}s in all")
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
