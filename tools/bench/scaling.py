"""Throughput and memory as the cores grow: the served `classify` and `classify_and_describe` on
the first N cores of this machine (`taskset`, so the server sizes its CPU layout for N: serving/layout.py),
beside the in-process limit on the same N cores (N single-thread processes decoding and classifying
with the server's own code: tools/bench/inprocess.py), in one run. Also the resident memory of
tritonserver and of each model's instances (PSS: shared pages split between the processes that map
them, so the figures add up to what the host gives).

perf_analyzer (the load generator) runs on the server's own N cores by default (--load-cores same), so
every N pays for it alike; on a 2-core machine it cannot have cores of its own at N = 2 anyway.
--load-cores rest gives it the cores the server does not get (a host with cores to spare).

usage: python -m tools.bench.scaling [--cores 1,2] [--load-cores same|rest] [--rounds 2] [--window-ms 3000]
                                     [--results build/bench/scaling.json]
prints a markdown table and writes the JSON.
"""

import argparse
import collections
import json
import os
import pathlib
import statistics
import tempfile
import time

from serving.procfs import children, model_of, process_state, stub_instance, tritonserver_pid
from tools import host
from tools.bench import harness, inprocess, inputs

REPO = pathlib.Path(__file__).resolve().parents[2]
MODELS = ("classify", "classify_and_describe")
IN_PROCESS_RUNTIME = "onnx_fp32"  # what classify_with_view serves (config.pbtxt: model.onnx)


def memory_kib(pid):
    """(Rss, Pss) of a process in KiB from /proc/<pid>/smaps_rollup; None when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["Rss"].split()[0]), int(fields["Pss"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def server_memory(root_pid):
    """{"tritonserver": {...}, "<model>": {instances, rss_mib, pss_mib (each, mean)}, "total_pss_mib"}."""
    server = tritonserver_pid(root_pid)
    groups = collections.defaultdict(list)
    groups["tritonserver"].append(memory_kib(server))
    for pid in children(server):
        instance = stub_instance(pid)
        if instance is not None and process_state(pid) not in (None, "Z"):
            groups[model_of(instance)].append(memory_kib(pid))
    out = {}
    for name, samples in sorted(groups.items()):
        samples = [s for s in samples if s]
        out[name] = {"instances": len(samples), "rss_mib": sum(s[0] for s in samples) / len(samples) / 1024,
                     "pss_mib": sum(s[1] for s in samples) / len(samples) / 1024}
    out["total_pss_mib"] = sum(group["pss_mib"] * group["instances"] for group in out.values())
    return out


def served(workdir, llm, cpus, load_cpus, input_data, window_ms):
    """The best of two concurrencies for each model, on a server pinned to `cpus`, perf_analyzer on
    `load_cpus` (it inherits this process's affinity)."""
    server = harness.TritonServer(workdir, {"LLM_BASE_URL": llm.base_url, "LLM_API_KEY": harness.BENCH_API_KEY,
                                            "LLM_API_KEY_FILE": None, "LLM_CACHE_ENABLED": "false"},
                                  command_prefix=("taskset", "-c", ",".join(map(str, cpus))))
    server.start(timeout_s=600)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, load_cpus)
    try:
        results = {}
        for model in MODELS:
            runs = [harness.perf_analyzer(model, server.http_url, input_data[model], concurrency, workdir,
                                          window_ms=window_ms)
                    for concurrency in (4 * len(cpus), 8 * len(cpus))]
            best = max(runs, key=lambda run: run["throughput"])
            results[model] = {"throughput": best["throughput"], "p50_ms": best["p50_ms"], "p99_ms": best["p99_ms"],
                              "command": best["command"],
                              "concurrencies": {run["command"].split("--concurrency-range ")[1].split()[0]:
                                                run["throughput"] for run in runs}}
        results["memory"] = server_memory(server.process.pid)
        return results
    finally:
        os.sched_setaffinity(0, before)
        server.stop()


def in_process(jpeg_paths, cpus, duration_s):
    """N single-thread processes on `cpus` (they inherit this process's affinity)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        row = inprocess.measure_layout(IN_PROCESS_RUNTIME, REPO / "model_repository", jpeg_paths, len(cpus), 1, [1],
                                       duration_s, e2e_only=True)
    finally:
        os.sched_setaffinity(0, before)
    return row["e2e"][1]


def measure(core_counts, load_cores, window_ms, duration_s, rounds):
    """`rounds` rounds over the core counts, in reverse order every other round, each served run
    between two in-process runs on the same cores (this host's speed moves within minutes: only
    figures taken side by side compare); a core count's figures are the medians over the rounds."""
    available = sorted(os.sched_getaffinity(0))
    if max(core_counts) + (load_cores == "rest") > len(available):
        raise SystemExit(f"asked for {max(core_counts)} cores{' and one for the load' if load_cores == 'rest' else ''}, "
                         f"this process may use {len(available)}")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench_scaling_"))
    jpegs = inputs.photo_jpegs()
    jpeg_paths = inputs.write_jpegs(workdir, jpegs)
    input_data = inputs.write_input_data(workdir, jpegs)
    llm = harness.FakeLLM(workdir)
    runs = []
    try:
        for number in range(rounds):
            for cores in core_counts if number % 2 == 0 else core_counts[::-1]:
                cpus = available[:cores]
                load_cpus = cpus if load_cores == "same" else available[cores:]
                limit = in_process(jpeg_paths, cpus, duration_s)
                server = served(workdir / f"round{number}_cores{cores}", llm, cpus, load_cpus, input_data, window_ms)
                limit = (limit + in_process(jpeg_paths, cpus, duration_s)) / 2
                runs.append({"round": number, "cores": cores, "cpus": cpus, "load_cpus": load_cpus,
                             "in_process": limit, **server})
    finally:
        llm.stop()
    rows = []
    for cores in core_counts:
        mine = [run for run in runs if run["cores"] == cores]
        row = {"cores": cores, "in_process": statistics.median(run["in_process"] for run in mine),
               "memory": mine[-1]["memory"]}
        for model in MODELS:
            row[model] = {key: statistics.median(run[model][key] for run in mine)
                          for key in ("throughput", "p50_ms", "p99_ms")}
        row["ratios"] = {model: statistics.median(run[model]["throughput"] / run["in_process"] for run in mine)
                         for model in MODELS}
        rows.append(row)
    scaling = {}
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        scaling = {model: last[model]["throughput"] / first[model]["throughput"] for model in MODELS}
        scaling["in_process"] = last["in_process"] / first["in_process"]
    return {"host": host.describe(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "window_ms": window_ms, "rounds": rounds, "in_process_runtime": IN_PROCESS_RUNTIME, "load_cores": load_cores,
            "rows": rows, "runs": runs, "scaling": scaling,
            "command": f"python -m tools.bench.scaling --cores {','.join(map(str, core_counts))} "
                       f"--load-cores {load_cores} --rounds {rounds}"}


def table(results):
    lines = [f"{host.summary(results['host'])}; `{results['command']}`, {results['when']}", "",
             "| cores | in-process img/s | classify req/s (ratio) | ensemble req/s (ratio) | per core: classify, "
             "ensemble | PSS: server total, classify_with_view each |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in results["rows"]:
        memory = row["memory"]
        view = memory.get("classify_with_view", {})
        lines.append(
            f"| {row['cores']} | {row['in_process']:.1f} | {row['classify']['throughput']:.1f} "
            f"({row['ratios']['classify']:.2f}) | {row['classify_and_describe']['throughput']:.1f} "
            f"({row['ratios']['classify_and_describe']:.2f}) | {row['classify']['throughput'] / row['cores']:.1f}, "
            f"{row['classify_and_describe']['throughput'] / row['cores']:.1f} | {memory['total_pss_mib']:.0f} MiB, "
            f"{view.get('pss_mib', 0):.0f} MiB x {view.get('instances', 0)} |")
    if results["scaling"]:
        s = results["scaling"]
        lines += ["", f"From {results['rows'][0]['cores']} to {results['rows'][-1]['cores']} cores: classify "
                      f"{s['classify']:.2f}x, ensemble {s['classify_and_describe']:.2f}x, in-process {s['in_process']:.2f}x."]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", default="1,2", help="core counts, comma-separated (the first N of this affinity)")
    parser.add_argument("--load-cores", choices=("same", "rest"), default="same",
                        help="perf_analyzer on the server's cores, or on the others")
    parser.add_argument("--window-ms", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=5.0, help="the in-process loop's time per core count")
    parser.add_argument("--results", type=pathlib.Path, default=REPO / "build/bench/scaling.json")
    args = parser.parse_args(argv)
    if not harness.PERF_ANALYZER.exists():
        raise SystemExit(f"bench: {harness.PERF_ANALYZER} is missing; run `make perf-analyzer`")
    results = measure([int(n) for n in args.cores.split(",")], args.load_cores, args.window_ms, args.duration_s,
                      args.rounds)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"\nresults: {args.results}")


if __name__ == "__main__":
    main()
