"""Where the CPU goes per request: by process (tritonserver, each model's stubs,
the fake upstream, the load generator) and, inside each, by step; against what
the same work costs in-process (decode + forward in one Python process).

    .venv/bin/python -m tools.bench.cpu_profile [--models classify,classify_and_describe]
        [--concurrency 4] [--seconds 15] [--rounds 3] [--results FILE] [--repository DIR]

Per model, `rounds` accounting turns, then one profiling turn:
- accounting: perf_analyzer at `concurrency` for `seconds`; CPU seconds of every process from
  /proc/<pid>/stat (utime + stime) before and after, divided by the requests Triton counted for
  the model over the same span. CPU per request does not depend on how busy the machine is
  (other load slows a run, it does not make its requests cost more), so it stays comparable
  where wall-clock rates are noisy. Medians over the turns, with their spread.
- profiling: the same load with `perf record -e cpu-clock` on tritonserver and one instance of
  each model's stubs (perf samples only time on a CPU, by the library it ran in); those shares
  split each process's CPU (from the accounting turns) into steps. A sampler slows what it
  samples, hence a turn apart. (py-spy --native counts a stub blocked in sem_wait as busy.)
- in-process: the same photos decoded and classified (batch 1, one thread) by the same code
  (tools/bench/inprocess.py), CPU seconds per image from time.process_time: the model's own cost.

--repository serves another model repository; default: a copy of model_repository/. Prints a
Markdown table; --results also writes the figures as JSON.

An A/B of a server setting, side by side:

    .venv/bin/python -m tools.bench.cpu_profile --compare CPU_SLOTS=3 [--compare KEY=VALUE ...]

starts a second server (B) with those environment variables (scripts/serve.sh reads CPU_SLOTS,
TRITON_EXTRA_ARGS, ...) beside the default one (A); the accounting turns alternate A B B A ...,
and each pair of turns gives a ratio B / A of throughput and of served CPU per request; the
medians and the spread of those ratios are the result (a drift in the machine's load weighs on
both sides of a pair alike). No profiling turn.
"""

import argparse
import collections
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from serving.procfs import children, model_of, stub_instance, tritonserver_pid
from tools import host
from tools.bench import harness, inprocess, inputs

# Each process's CPU by the library (perf's dso) it ran in, named by what that library does there;
# first match wins. perf's cpu-clock samples count only time on a CPU: waiting is not in them.
DSOS = (
    ("decode + resize (Pillow, libjpeg)", ("_imaging", "libjpeg", "libpng", "libz", "libwebp", "libopenjp")),
    ("forward (onnxruntime)", ("onnxruntime", "libtorch", "libgomp", "libmlas")),
    ("numpy (stack, transpose, casts)", ("_multiarray_umath", "numpy")),
    ("Python interpreter (our code, SDKs, asyncio, pb_utils)", ("libpython",)),
    ("TLS/crypto", ("libssl", "libcrypto")),
    ("stub runtime: IPC, shared memory (stub binary)", ("triton_python_backend_stub", "c_python_backend_utils")),
    ("core: scheduler, ensemble, batcher", ("libtritonserver",)),  # before the binary: its name contains it
    ("HTTP/gRPC front ends (tritonserver binary)", ("tritonserver",)),
    ("Python backend: stub IPC, shared memory", ("libtriton_python",)),
    ("kernel (syscalls, futex, copies)", ("[kernel", "[vdso]")),
    ("libc / libstdc++ (memcpy, malloc, semaphores)", ("libc.so", "libstdc++", "libm.so", "ld-linux", "libgcc")),
)


def log(message):
    print(f"cpu_profile: {message}", file=sys.stderr, flush=True)


def stub_pids(server_pid):
    """{model: [stub pids]} of the running server."""
    out = collections.defaultdict(list)
    for pid in children(server_pid):
        instance = stub_instance(pid)
        if instance is not None:
            out[model_of(instance)].append(pid)
    return dict(out)


def dso_group(dso):
    return next((name for name, needles in DSOS if any(n in dso for n in needles)), "other libraries")


def perf_shares(data_path):
    """`perf report --sort dso` of one process -> ({step: share of its samples}, its top symbols)."""
    def report(sort):
        return subprocess.run(["perf", "report", "-i", str(data_path), "--stdio", "--sort", sort],
                              capture_output=True, text=True, timeout=300).stdout
    counts = collections.Counter()
    for line in report("dso").splitlines():
        parts = line.split()
        if len(parts) >= 2 and not line.startswith("#") and parts[0].endswith("%"):
            counts[dso_group(" ".join(parts[1:]))] += float(parts[0].rstrip("%"))
    total = sum(counts.values()) or 1.0
    top = [" ".join(line.split()) for line in report("dso,sym").splitlines()
           if line.strip() and not line.startswith("#")][:12]
    return {group: value / total for group, value in counts.items()}, top


def account(server, llm, model, input_data, concurrency, seconds, workdir):
    """One accounting turn: {where: ms of CPU per request}, requests, throughput."""
    before = harness.cpu_seconds(server.process.pid, llm.process.pid)
    children_before, stats_before = harness.children_cpu_seconds(), server.stats()
    result = harness.perf_analyzer(model, server.http_url, input_data, concurrency, workdir,
                                   window_ms=int(seconds * 1000 / 3), trials=3)
    after = harness.cpu_seconds(server.process.pid, llm.process.pid)
    after["load generator"] = harness.children_cpu_seconds() - children_before
    before["load generator"] = 0.0
    requests = harness.stats_delta(stats_before, server.stats()).get(model, {}).get("count", 0)
    spent = {where: (after[where] - before.get(where, 0.0)) * 1e3 / max(1, requests) for where in after}
    spent["served (tritonserver + stubs)"] = sum(v for k, v in spent.items() if k == "tritonserver" or
                                                 k.endswith(" stubs"))
    return {"requests": requests, "throughput": result["throughput"], "p50_ms": result["p50_ms"],
            "cpu_ms_per_request": spent}


def profile(server, model, input_data, concurrency, seconds, workdir):
    """One profiling turn under the same load: `perf record -e cpu-clock` (every thread) on
    tritonserver and on one instance of each model's stubs -> {"shares": {process: {step: share}},
    "top_symbols": {process: [...]}}."""
    if not shutil.which("perf"):  # linux-perf is not in the venv: the split by process alone then
        log("perf is not installed: CPU by process only, not by step")
        return {"shares": {}, "top_symbols": {}}
    server_pid = tritonserver_pid(server.process.pid)
    processes = {"tritonserver": server_pid}
    processes.update({f"{stub_model} stubs": pids[0] for stub_model, pids in stub_pids(server_pid).items()})
    duration = max(3, int(seconds))
    recorders = {}
    for name, pid in processes.items():
        path = workdir / f"perf_{model}_{pid}.data"
        recorders[name] = (path, subprocess.Popen(
            ["perf", "record", "-e", "cpu-clock", "-F", "499", "-o", str(path), "-p", str(pid),
             "--", "sleep", str(duration)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    harness.perf_analyzer(model, server.http_url, input_data, concurrency, workdir,
                          window_ms=int(duration * 1000 / 3), trials=3)
    out = {"shares": {}, "top_symbols": {}}
    for name, (path, recorder) in recorders.items():
        recorder.wait(timeout=duration + 120)
        if path.is_file():
            out["shares"][name], out["top_symbols"][name] = perf_shares(path)
    return out


def inprocess_cpu(repository, jpeg_paths, images=200):
    """CPU ms per image of decode, and of forward at batch 1 with one thread, in this process."""
    import numpy as np

    preprocess = inprocess.preprocessor(repository)
    runtime = inprocess.served_runtime(repository)
    classify = inprocess.RUNTIMES[runtime][2](repository, 1)
    photos = [pathlib.Path(p).read_bytes() for p in jpeg_paths]
    classify(np.stack([preprocess(photos[0])]))  # warm
    started = time.process_time()
    pixels = [preprocess(photos[i % len(photos)]) for i in range(images)]
    decode = time.process_time() - started
    started = time.process_time()
    for one in pixels:
        classify(one[None])
    forward = time.process_time() - started
    return {"runtime": runtime, "images": images, "decode_ms": decode * 1e3 / images,
            "forward_ms": forward * 1e3 / images, "total_ms": (decode + forward) * 1e3 / images}


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(turns):
    places = sorted({k for t in turns for k in t["cpu_ms_per_request"]})
    return {"cpu_ms_per_request": {k: spread([t["cpu_ms_per_request"].get(k, 0.0) for t in turns]) for k in places},
            "throughput": spread([t["throughput"] for t in turns]),
            "requests": sum(t["requests"] for t in turns)}


def markdown(results):
    lines = [f"CPU ms per request, median (min-max) of {results['args']['rounds']} turns of "
             f"{results['args']['seconds']} s at concurrency {results['args']['concurrency']}, on "
             f"{host.summary(results['host'])}; {host.isa_text(results['host'])}", ""]
    own = results["inprocess"]
    lines.append(f"In-process ({own['runtime']}, batch 1, 1 thread): decode {own['decode_ms']:.2f} + forward "
                 f"{own['forward_ms']:.2f} = {own['total_ms']:.2f} ms per image")
    for model, data in results["models"].items():
        cpu = data["summary"]["cpu_ms_per_request"]
        served = cpu["served (tritonserver + stubs)"]["median"]
        lines += ["", f"### {model} ({data['summary']['requests']} requests; served / in-process "
                  f"{served / own['total_ms']:.2f})", "", "| process | step | ms per request | share of served |",
                  "| --- | --- | --- | --- |"]
        shares = data["profile"]
        for where in sorted(cpu, key=lambda k: -cpu[k]["median"]):
            s = cpu[where]
            lines.append(f"| {where} | all | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | "
                         f"{s['median'] / served:.0%} |")
            steps = shares["shares"].get(where)
            for step, share in sorted((steps or {}).items(), key=lambda kv: -kv[1]):
                lines.append(f"| | {step} | {share * s['median']:.2f} | {share * s['median'] / served:.0%} |")
    return "\n".join(lines)


def compare(args, workdir, input_data, results):
    """A against B (args.compare's environment), turns alternating A B B A; per-pair ratios B / A."""
    llm = harness.FakeLLM(workdir)
    servers = {}
    try:
        extra = dict(item.split("=", 1) for item in args.compare)
        for name, env in (("A", {}), ("B", extra)):
            (workdir / name).mkdir()
            if args.repository:
                shutil.copytree(args.repository, workdir / name / "model_repository")
            servers[name] = harness.Triton(workdir / name, llm.base_url, extra_env={"LLM_CACHE_ENABLED": "false",
                                                                                   **env})
        results["compare"] = {"B": extra}
        for model in args.models.split(","):
            for server in servers.values():  # warm-up
                harness.perf_analyzer(model, server.http_url, input_data[model], args.concurrency, workdir,
                                      window_ms=1000, trials=3)
            turns = {"A": [], "B": []}
            for number in range(args.rounds):
                for name in ("A", "B") if number % 2 == 0 else ("B", "A"):
                    turns[name].append(account(servers[name], llm, model, input_data[model], args.concurrency,
                                               args.seconds, workdir))
                    log(f"{model} {name}: {turns[name][-1]['throughput']:.1f}/s, served "
                        f"{turns[name][-1]['cpu_ms_per_request']['served (tritonserver + stubs)']:.2f} ms CPU")
            served = "served (tritonserver + stubs)"
            ratios = {"throughput": [b["throughput"] / a["throughput"] for a, b in zip(turns["A"], turns["B"])],
                      "served_cpu": [b["cpu_ms_per_request"][served] / a["cpu_ms_per_request"][served]
                                     for a, b in zip(turns["A"], turns["B"])],
                      "p50": [b["p50_ms"] / a["p50_ms"] for a, b in zip(turns["A"], turns["B"])]}
            results["models"][model] = {"A": summarise(turns["A"]), "B": summarise(turns["B"]), "turns": turns,
                                        "b_over_a": {key: spread(values) for key, values in ratios.items()}}
    finally:
        for server in servers.values():
            server.stop()
        llm.stop()
    lines = [f"B = {' '.join(args.compare)} against A = defaults; {args.rounds} turns each of {args.seconds} s "
             f"at concurrency {args.concurrency}, on {host.summary(results['host'])}; "
             f"{host.isa_text(results['host'])}", "",
             "| model | B / A throughput | B / A served CPU per request | B / A p50 | A served CPU ms | "
             "B served CPU ms |", "| --- | --- | --- | --- | --- | --- |"]
    for model, data in results["models"].items():
        r = data["b_over_a"]
        cells = [f"{r[k]['median']:.3f} ({r[k]['min']:.3f}-{r[k]['max']:.3f})" for k in ("throughput", "served_cpu",
                                                                                          "p50")]
        a, b = (data[n]["cpu_ms_per_request"]["served (tritonserver + stubs)"]["median"] for n in ("A", "B"))
        lines.append(f"| {model} | {' | '.join(cells)} | {a:.2f} | {b:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="classify,classify_and_describe")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repository", type=pathlib.Path, help="default: a copy of model_repository/")
    parser.add_argument("--results", type=pathlib.Path)
    parser.add_argument("--compare", action="append", metavar="KEY=VALUE",
                        help="A/B: a second server with this environment variable (repeatable)")
    args = parser.parse_args(argv)
    results = {"host": host.describe(), "args": {k: str(v) if isinstance(v, pathlib.Path) else v
                                                 for k, v in vars(args).items()}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="cpu_profile_") as tmp:
        workdir = pathlib.Path(tmp)
        jpegs = inputs.photo_jpegs()
        input_data = inputs.write_input_data(workdir, jpegs)
        jpeg_paths = inputs.write_jpegs(workdir, jpegs)
        if args.compare:
            text = compare(args, workdir, input_data, results)
            return finish(args, results, text)
        if args.repository:
            shutil.copytree(args.repository, workdir / "model_repository")
        llm = harness.FakeLLM(workdir)
        server = None
        try:
            server = harness.Triton(workdir, llm.base_url, extra_env={"LLM_CACHE_ENABLED": "false"})
            results["inprocess"] = inprocess_cpu(server.repository, jpeg_paths)
            log(f"in-process: {results['inprocess']}")
            for model in args.models.split(","):
                harness.perf_analyzer(model, server.http_url, input_data[model], args.concurrency, workdir,
                                      window_ms=1000, trials=3)  # warm-up
                turns = []
                for _ in range(args.rounds):
                    turns.append(account(server, llm, model, input_data[model], args.concurrency, args.seconds,
                                         workdir))
                    log(f"{model}: {json.dumps(turns[-1])}")
                shares = profile(server, model, input_data[model], args.concurrency, args.seconds, workdir)
                results["models"][model] = {"turns": turns, "summary": summarise(turns), "profile": shares}
        finally:
            if server is not None:
                server.stop()
            llm.stop()
    return finish(args, results, markdown(results))


def finish(args, results, text):
    print(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
