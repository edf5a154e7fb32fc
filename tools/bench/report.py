"""docs/benchmarks.md and its PNG plots, generated from one run's results file
alone (the JSON that tools/bench/run.py writes): every number, the targets'
verdicts, and the description of what ran come from that file, so the report
can be written again from it without measuring anything:

    .venv/bin/python -m tools.bench.report docs/results/bench.json [--out docs/benchmarks.md] [--plots docs/plots]

How the benchmarks measure and how to read them (the hand-written part) is
docs/benchmarks-method.md, which the report links."""

import argparse
import dataclasses
import json
import math
import pathlib
import statistics

from tools import host
from tools.bench import bentoml_baseline
from tools.bench import sections as extra_sections

REPO = pathlib.Path(__file__).resolve().parents[2]
METHOD_DOC = "benchmarks-method.md"  # beside the report


def _median(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def _f(value, digits=1):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def _mark(ok):
    return "met" if ok else "**not met**"


def load(path):
    """A results file, with the integer keys (batch sizes, concurrencies) JSON turned into strings restored."""
    results = json.loads(pathlib.Path(path).read_text())
    # The file it is read from now, which a committed copy of a run's file may have moved.
    results["meta"]["results_file"] = _repo_path(path)
    for turn in results.get("limits", {}).get("turns", []):
        for runtime in turn.get("inprocess", {}).values():
            for row in runtime["layouts"]:
                for key in ("e2e", "forward", "per_worker_forward"):
                    row[key] = {int(k): v for k, v in row[key].items()}
    for row in results.get("tuning", []):
        row["results"] = {int(k): v for k, v in row["results"].items()}
    return results


# -- targets -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Target:
    """One row of the targets table: `measured` against `threshold` (at least, or at most)."""
    name: str
    measured: float | None  # None: not measured in this run (counts as not met)
    threshold: float
    at_most: bool = False
    unit: str = ""
    detail: str = ""  # the figures the value is made of
    digits: int = 2
    unmet_reason: str = ""  # a condition of the target besides the threshold that failed (then not met)

    @property
    def met(self):
        if self.measured is None or math.isnan(self.measured) or self.unmet_reason:
            return False
        return self.measured <= self.threshold if self.at_most else self.measured >= self.threshold

    def cells(self):
        value = "not measured" if self.measured is None else f"{_f(self.measured, self.digits)}{self.unit}"
        bound = f"{'<=' if self.at_most else '>='} {_f(self.threshold, self.digits)}{self.unit}"
        return value, bound


def limits_figure(results):
    """Per turn: served throughputs, each runtime's in-process limit, and the three ratios; medians."""
    limits = results["limits"]
    served_runtime = limits["served_runtime"]
    rows = []
    for turn in limits["turns"]:
        inproc = turn["inprocess"]
        pytorch = inproc.get("torchscript", {}).get("best", {}).get("throughput")
        own = inproc.get(served_runtime, {}).get("best", {}).get("throughput")
        classify, ensemble = turn["classify"]["throughput"], turn["ensemble"]["throughput"]
        rows.append({"classify": classify, "ensemble": ensemble, "pytorch": pytorch, "own": own,
                     "limits": {name: r["best"] for name, r in inproc.items()},
                     "ensemble_vs_pytorch": ensemble / pytorch if pytorch else float("nan"),
                     "classify_vs_own": classify / own if own else float("nan"),
                     "ensemble_vs_own": ensemble / own if own else float("nan"),
                     "ensemble_vs_classify": ensemble / classify if classify else float("nan")})
    medians = {key: _median([row[key] for row in rows])
               for key in ("classify", "ensemble", "pytorch", "own", "ensemble_vs_pytorch", "classify_vs_own",
                           "ensemble_vs_own", "ensemble_vs_classify")}
    return {"rows": rows, **medians, "served_runtime": served_runtime}


def _turn_ratios(fig, key):
    """The per-turn ratios a target is the median of: the medians beside it need not give it."""
    return "per turn " + ", ".join(_f(row[key], 2) for row in fig["rows"])


def inprocess_latency_ms(results):
    """The in-process single-image latency of the served runtime: decode + forward of one image at
    batch 1 in the layout where it is shortest (one worker's time per image). Measured right before and
    right after the concurrency-1 runs (their mean); results files from before that: the median over
    the turns."""
    beside = results["limits"].get("single_image_ms")
    if beside:
        return min(statistics.mean(run[layout] for run in beside) for layout in beside[0])
    runtime, values = results["limits"]["served_runtime"], []
    for turn in results["limits"]["turns"]:
        layouts = turn["inprocess"].get(runtime, {}).get("layouts", [])
        per_image = [1000.0 * row["processes"] / row["e2e"][1] for row in layouts if row["e2e"].get(1)]
        if per_image:
            values.append(min(per_image))
    return _median(values) if values else None


def serving_overhead_targets(results, fig, own):
    """Issue 21's targets: what serving costs over the same work in-process, from the same run."""
    c = results["limits"]["concurrency"]
    rows = [Target(f"ensemble throughput (LLM 0 ms) / in-process limit of its own runtime ({own})",
                   fig["ensemble_vs_own"] if fig["own"] else None, 0.75,
                   detail=f"medians {_f(fig['ensemble'])} req/s at c={c} vs {_f(fig['own'])} img/s; "
                          f"{_turn_ratios(fig, 'ensemble_vs_own')}")]
    single = inprocess_latency_ms(results)
    for model, label in (("classify", "`classify`"), ("classify_and_describe", "ensemble (LLM 0 ms)")):
        now = results["limits"]["latency_c1"][model]["p50_ms"]
        rows.append(Target(f"p50 / in-process single-image latency ({own}), {label} at concurrency 1",
                           now / single if single else None, 1.3, at_most=True,
                           detail=f"{_f(now)} ms vs {_f(single)} ms" if single else
                           f"{_f(now)} ms; no in-process batch-1 figure in this run"))
    rows.append(bentoml_baseline.target_row(results.get("sections", {}).get(bentoml_baseline.NAME)))
    return rows


def _runtime_name(results, runtime):
    for turn in results["limits"]["turns"]:
        if runtime in turn["inprocess"]:
            return turn["inprocess"][runtime]["description"]
    return runtime


def accuracy_target(accuracy):
    """int8 top-1 agreement with fp32: the lowest over the crop sets measured."""
    name = "int8 top-1 agreement with fp32 (lowest over the crop sets)"
    if not accuracy or "error" in accuracy:
        why = accuracy["error"] if accuracy else "no int8 model in this build"
        return Target(name, None, 0.99, detail=why, digits=3)
    sets = accuracy["sets"]
    detail = "; ".join(f"{s['top1_agreement'] * 100:.1f} % of {s['crops']} crops of at least "
                       f"{s['min_crop_area'] * 100:g} % of a photo (top-5 overlap {s['top5_overlap'] * 100:.1f} %)"
                       for s in sets)
    return Target(name, min(s["top1_agreement"] for s in sets), 0.99, detail=detail, digits=3)


def targets(results):
    """Every target of the run, computed from the results alone."""
    fig = limits_figure(results)
    c = results["limits"]["concurrency"]
    own = _runtime_name(results, fig["served_runtime"])
    rows = [
        Target("ensemble throughput (LLM 0 ms) / in-process PyTorch fp32 limit", fig["ensemble_vs_pytorch"], 1.5,
               detail=f"{_f(fig['ensemble'])} req/s at c={c} vs {_f(fig['pytorch'])} img/s"),
        Target(f"`classify` throughput / in-process limit of its own runtime ({own})", fig["classify_vs_own"], 0.95,
               detail=f"medians {_f(fig['classify'])} img/s at c={c} vs {_f(fig['own'])} img/s; "
                      f"{_turn_ratios(fig, 'classify_vs_own')}"),
        Target("ensemble (LLM 0 ms) / `classify` throughput", fig["ensemble_vs_classify"], 0.9,
               detail=f"{_f(fig['ensemble'])} vs {_f(fig['classify'])} /s at c={c}"),
    ]
    baseline = results.get("baseline", {})
    for model, label in (("classify", "`classify`"), ("classify_and_describe", "ensemble (LLM 0 ms)")):
        now = results["limits"]["latency_c1"][model]["p50_ms"]
        then = baseline.get("p50_c1_ms", {}).get(model)
        rows.append(Target(f"p50 at concurrency 1, {label}: this run / {baseline.get('file', 'no baseline')}",
                           now / then if then else None, 0.7, at_most=True,
                           detail=f"{_f(now)} ms vs {_f(then)} ms" if then else
                           f"{_f(now)} ms; the baseline file has no such figure"))
    rows += serving_overhead_targets(results, fig, own)
    rows.append(accuracy_target(results.get("accuracy")))
    h, d, p = results["hiding"], results["describe"], results["patterns"]
    rows += [
        Target(f"ensemble throughput, LLM {h['latency_ms']} ms / LLM 0 ms (c={h['concurrency']})", h["ratio"], 0.9),
        Target("`describe` p50 overhead over a direct upstream call", d["overhead_p50_ms"], 3.0, at_most=True,
               unit=" ms"),
        Target(f"ensemble / two-step client throughput (LLM {p['latency_ms']} ms, c={p['concurrency']})",
               p["ensemble"]["throughput"] / p["two_step"]["throughput"], 1.0,
               detail=f"p50 {_f(p['ensemble']['p50_ms'], 0)} vs {_f(p['two_step']['p50_ms'], 0)} ms"),
    ]
    for name, module in extra_sections.by_name().items():
        section = results.get("sections", {}).get(name)
        if section and "error" not in section and hasattr(module, "targets"):
            rows += module.targets(section)
    return rows


# -- plots ------------------------------------------------------------------------------------

def _plots(results, plots_dir):
    """Write the report's plots; -> {name: path} of those written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    sweeps = results["sweeps"]
    for name, title in (("classify", "classify (IMAGE -> LABELS, SCORES)"),
                        ("classify_and_describe", f"classify_and_describe (LLM {sweeps['ensemble_latency_ms']} ms)")):
        if sweeps[name]:
            written[name] = _save(plt, _sweep_plot(plt, sweeps[name], title), plots_dir / f"sweep_{name}.png")
    stages = where_time_goes(results)
    if stages:
        written["stages"] = _save(plt, _stages_plot(plt, stages), plots_dir / "where_time_goes.png")
    if results.get("tuning"):
        written["tuning"] = _save(plt, _tuning_plot(plt, results["tuning"]), plots_dir / "tuning_classifier.png")
    return written


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _sweep_plot(plt, rows, title):
    """Throughput and latency against concurrency, side by side."""
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(10, 3.8))
    conc = [r["concurrency"] for r in rows]
    ax_t.plot(conc, [r["throughput"] for r in rows], "o-")
    ax_t.set_xlabel("concurrency")
    ax_t.set_ylabel("throughput (infer/s)")
    ax_t.set_xscale("log", base=2)
    ax_t.set_ylim(bottom=0)
    ax_t.grid(alpha=0.3)
    for key, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
        ax_l.plot(conc, [r[key] for r in rows], style, label=key.replace("_ms", ""))
    ax_l.set_xlabel("concurrency")
    ax_l.set_ylabel("latency (ms)")
    ax_l.set_xscale("log", base=2)
    for ax in (ax_t, ax_l):
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.minorticks_off()
    ax_l.set_ylim(bottom=0)
    ax_l.legend()
    ax_l.grid(alpha=0.3)
    fig.suptitle(f"{title}: perf_analyzer concurrency sweep")
    return fig


def _stages_plot(plt, stages):
    """One stacked bar: where_time_goes()'s segments."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    left = 0.0
    for label, value, color in stages["segments"]:
        ax.barh([0], [value], left=left, color=color, label=f"{label} {value:.0f} ms")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("ms per request (server-side average, perf_analyzer run of figure 1)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
    ax.set_title(f"classify at concurrency {stages['concurrency']}: where the time goes")
    return fig


def _tuning_plot(plt, rows):
    """classify throughput per classifier config, one bar per concurrency."""
    concs = sorted({c for row in rows for c in row["results"]})
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(concs)
    for i, c in enumerate(concs):
        ax.bar([x + i * width for x in range(len(rows))], [row["results"][c]["throughput"] for row in rows],
               width, label=f"concurrency {c}")
    ax.set_xticks([x + width * (len(concs) - 1) / 2 for x in range(len(rows))])
    ax.set_xticklabels([row["name"] for row in rows], rotation=15)
    ax.set_ylabel("classify throughput (img/s)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("classifier config alternatives (perf_analyzer on classify)")
    return fig


def where_time_goes(results):
    """Triton's statistics around the first turn's `classify` run: time per request by segment, and each
    stage's compute per image next to one in-process worker of the served runtime (one thread, as one
    instance has). Steps as the run's classify has them: decode and classify in one stub
    (classify_with_view, the CPU layout) or preprocess then the classifier (older runs, GPU layout)."""
    turn = results["limits"]["turns"][0]
    stats = turn["classify"]["stats"]
    served = turn["inprocess"].get(results["limits"]["served_runtime"])
    single = next((row for row in served["layouts"] if row["threads"] == 1), served["layouts"][0]) if served else None
    one_stub = stats.get(ONE_STUB)
    if one_stub and one_stub["count"] and not stats.get("preprocess", {}).get("count"):
        steps = [("decode + classify", one_stub, "#c6dbef", "#4292c6")]
    else:
        steps = [("preprocess", stats.get("preprocess"), "#c6dbef", "#4292c6"),
                 ("classifier", stats.get("classifier"), "#fdd0a2", "#f16913")]
    if any(not step or not step["count"] for _, step, _, _ in steps):
        return None
    segments = []
    for name, step, queue_color, compute_color in steps:
        segments += [(f"{name} queue", step["queue_ms"] / step["count"], queue_color),
                     (f"{name} compute", step["compute_ms"] / step["count"], compute_color)]
    total = stats.get("classify", {})
    server = total["request_ms"] / total["count"] if total.get("count") else sum(s[1] for s in segments)
    other = max(0.0, server - sum(s[1] for s in segments))
    segments.append(("ensemble + IPC", other, "#bdbdbd"))
    client_extra = max(0.0, turn["classify"]["p50_ms"] - server)
    segments.append(("client + HTTP (p50 - server avg)", client_extra, "#e5e5e5"))
    closeness = []
    if single:
        # Each request of a batch is charged the whole batch's compute: per image = per request / batch.
        def per_image(step):
            batch = step["inference_count"] / step["exec_count"] if step["exec_count"] else 1
            return step["compute_ms"] / step["count"] / batch, batch

        decode_ms = 1000.0 / single["per_worker_decode"]
        if len(steps) == 1:
            served_ms, batch = per_image(steps[0][1])
            nearest = min(single["per_worker_forward"], key=lambda b: abs(b - batch))
            closeness = [("decode + classify (one stub)", served_ms, batch,
                          decode_ms + 1000.0 / single["per_worker_forward"][nearest],
                          f"batch {nearest}, {single['threads']} thread")]
        else:
            (pre_ms, avg_pre), (cls_ms, avg_cls) = per_image(steps[0][1]), per_image(steps[1][1])
            nearest = min(single["per_worker_forward"], key=lambda b: abs(b - avg_cls))
            closeness = [
                ("preprocess (decode, resize, crop)", pre_ms, avg_pre, decode_ms, f"batch 1, {single['threads']} thread"),
                ("classifier (forward + top-5)", cls_ms, avg_cls, 1000.0 / single["per_worker_forward"][nearest],
                 f"batch {nearest}, {single['threads']} thread"),
            ]
    return {"segments": segments, "closeness": closeness, "concurrency": results["limits"]["concurrency"],
            "server_ms": server}


ONE_STUB = "classify_with_view"  # decode + classify in one stub: classify's first step on the CPU
CPU_PLACES = ("load generator", "tritonserver", f"{ONE_STUB} stubs", "preprocess stubs", "classifier stubs",
              "describe stubs", "fake upstream")


def cpu_table(columns):
    """Markdown rows of CPU ms per request by place; columns: {header: {place: ms}}; the rest of the
    machine is what /proc/stat counted beyond the named processes."""
    names = list(columns)
    lines = ["| where | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    places = [w for w in CPU_PLACES if any(w in c for c in columns.values())]
    for where in places:
        lines.append(f"| {where} | " + " | ".join(_f(columns[n].get(where, 0.0), 2) for n in names) + " |")
    server = [w for w in places if w == "tritonserver" or w.endswith(" stubs")]
    lines.append("| *server: tritonserver + stubs* | " + " | ".join(
        f"*{_f(sum(columns[n].get(w, 0.0) for w in server), 2)}*" for n in names) + " |")
    lines.append("| everything else on the machine | " + " | ".join(
        _f(columns[n]["machine"] - sum(columns[n].get(w, 0.0) for w in places), 2) for n in names) + " |")
    lines.append("| **whole machine** | " + " | ".join(f"**{_f(columns[n]['machine'], 2)}**" for n in names) + " |")
    return lines


def _median_cpu(runs):
    places = {where for run in runs for where in run["cpu_ms_per_request"]}
    return {where: _median([run["cpu_ms_per_request"].get(where, 0.0) for run in runs]) for where in places}


# -- markdown ---------------------------------------------------------------------------------

def _rel(path, out_path):
    try:
        return str(pathlib.Path(path).resolve().relative_to(out_path.parent.resolve()))
    except ValueError:
        return str(path)


def write(results, out_path, plots_dir):
    """Write the report and its plots from `results` (a loaded results file); return the headline lines."""
    out_path = pathlib.Path(out_path)
    rows = targets(results)
    plots = _plots(results, pathlib.Path(plots_dir))
    meta = results["meta"]
    lines = []
    add = lines.append
    _header(meta, out_path, add)
    _targets_section(rows, add, meta)
    cpu_line = ensemble_cpu_line(results)
    add(f"\n{cpu_line}\n")

    _limits_section(results, add, plots, out_path)
    _hiding_section(results, add)
    _describe_section(results, add)
    _patterns_section(results, add)
    _sweeps_section(results, add, plots, out_path)
    _tuning_section(results, add, plots, out_path)
    _extra_sections(results, add)
    _commands_section(meta, add)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("\n".join(lines).rstrip() + "\n")

    head = ["", f"bench: targets ({meta['mode']}, {meta.get('results_file', '')}) on {_cpu_text(meta)}"]
    for row in rows:
        value, bound = row.cells()
        head.append(f"  {row.name}: {value}  [target {bound}: {'met' if row.met else 'NOT met'}]")
    head.append(f"  {cpu_line}")
    return "\n".join(head)


def _cpu_text(meta):
    """'MODEL (flags)': the CPU every figure of the run is from."""
    machine = meta.get("host")
    model = host.cpu_name(machine) or meta.get("machine", "an unrecorded CPU")
    return f"{model} ({host.isa_text(machine)})"


def _header(meta, out_path, add):
    """The title, where the report comes from, and the run's machine, load, server and load generator."""
    params = meta["params"]
    versions = meta.get("versions", {})
    load_before = " / ".join(f"{v:.1f}" for v in meta["load_before"])
    load_after = " / ".join(f"{v:.1f}" for v in meta.get("load_after", (float("nan"),) * 3))
    add("# Benchmarks\n")
    add(f"Generated from `{meta.get('results_file', 'the results file')}`, the results of one run of "
        f"`{meta['command']}` (tools/bench/run.py, mode `{meta['mode']}`) on {meta['date']}, commit "
        f"`{meta['commit']}`. Regenerate it from that file: `.venv/bin/python -m tools.bench.report "
        f"{meta.get('results_file', 'RESULTS_JSON')} --out {_repo_path(out_path)}`. How the figures are measured "
        "and how to read them: "
        f"[{METHOD_DOC}]({METHOD_DOC}).\n")
    add(f"- Machine: {meta['machine']}.")
    add(f"- CPU instruction sets (int8 speed and numerics depend on them): {host.isa_text(meta.get('host'))}.")
    add(f"- Load: 1/5/15-min load average {load_before} before the run and {load_after} after; "
        f"{meta['other_servers']} tritonserver process(es) not started by this run were running.")
    add(f"- Server: Triton {versions.get('TRITON_VERSION', '?')}, `scripts/serve.sh` on a temp copy of "
        f"`model_repository/` (ready in {meta.get('server_startup_s', 0):.0f} s), `LLM_CACHE_ENABLED=false`, a "
        "distinct `PROMPT` per request; LLM upstream `tools/fake_openai`. Classifier config: "
        f"{meta.get('classifier_config', '?')}.")
    add(f"- Load generator: perf_analyzer (tritonclient {versions.get('PERF_ANALYZER_TRITONCLIENT_VERSION', '?')} "
        f"wheel), HTTP, JPEG bytes of scikit-image's chelsea and coffee photos; {params['trials']} windows of "
        f"{params['window_ms']} ms per point. Figures 3 and 4: a Python asyncio client.")
    add(f"- The whole run took {meta['duration_s']:.0f} s. Reproduce: `make build perf-analyzer && "
        f"{meta['command']}`.\n")


def _targets_section(rows, add, meta):
    add("## Targets\n")
    add("Computed from this run's results file; ratios are medians over the turns of figure 1, each turn "
        f"measuring both sides back to back. Every figure is from this run, on {_cpu_text(meta)}.\n")
    add("| target | measured | threshold | | from |")
    add("| --- | --- | --- | --- | --- |")
    for row in rows:
        value, bound = row.cells()
        add(f"| {row.name} | {value} | {bound} | {_mark(row.met)} | {row.detail} |")


def _commands_section(meta, add):
    params = meta["params"]
    add("## perf_analyzer command lines\n")
    add(f"`<C>` is the concurrency, `<W>` the window: {params['window_ms']} ms, or three times the expected "
        f"latency where that is longer, up to {params.get('window_cap_ms', 30000) / 1000:g} s.\n")
    add("```")
    for command in meta.get("perf_analyzer_commands", []):
        add(command)
    add("```")


def ensemble_cpu_line(results):
    """One line: the ensemble's CPU per request by stage (figure 1, median over the turns)."""
    cpu = _median_cpu([turn["ensemble"] for turn in results["limits"]["turns"]])
    places = (f"{ONE_STUB} stubs", "classifier stubs", "preprocess stubs", "describe stubs", "tritonserver")
    places = [where for where in places if where in cpu]  # a run has one layout's stubs, not both
    stages = ", ".join(f"{where} {_f(cpu[where])}" for where in places)
    return (f"CPU per ensemble request (LLM 0 ms, figure 1), ms: {_f(sum(cpu.get(w, 0.0) for w in places))} in the "
            f"server's processes ({stages}); perf_analyzer {_f(cpu.get('load generator'))}; whole machine "
            f"{_f(cpu.get('machine'))}.")


def _limits_section(results, add, plots, out_path):
    limits = results["limits"]
    fig = limits_figure(results)
    meta = results["meta"]
    c = limits["concurrency"]
    runtimes = list(fig["rows"][0]["limits"])
    names = {runtime: _runtime_name(results, runtime) for runtime in runtimes}
    first = limits["turns"][0]["inprocess"]
    batches = sorted({b for r in runtimes for row in first[r]["layouts"] for b in row["e2e"]})
    order = (" in turns, Triton first in odd turns and in-process first in even ones" if len(fig["rows"]) > 1
             else ", Triton first")
    add("## 1. Served throughput against the in-process limits\n")
    add(f"`classify` and `classify_and_describe` (fake LLM at 0 ms) under perf_analyzer at concurrency {c}, and "
        "`tools/bench/inprocess.py`: the same preprocess and classifier code with the model repository's settings, "
        f"per runtime, in the layouts {', '.join(meta.get('layouts', []))} (processes x threads) at batch sizes "
        f"{', '.join(map(str, batches))}; a runtime's limit is its best layout and batch size{_confirm_text(limits)}. "
        "The server's "
        f"classifier runs {names.get(fig['served_runtime'], fig['served_runtime'])}. {len(fig['rows'])} turn(s)"
        f"{order}.\n")
    _limits_turns_table(fig, names, add)
    _inprocess_rates_table(limits, names, batches, add)
    _latency_c1_table(results, add)
    _cpu_by_process(limits, add)
    _where_time_goes_section(results, add, plots, out_path)


def _confirm_text(limits):
    """Results files from before the best was measured again have no confirm_s; a run has it on every
    runtime of every turn or on none."""
    confirm_s = {best.get("confirm_s") for turn in limits["turns"] for best in
                 (result["best"] for result in turn["inprocess"].values())}
    if None in confirm_s or not confirm_s:
        return ""
    return (f", measured again alone for {'/'.join(f'{s:g}' for s in sorted(confirm_s))} s once the sweep "
            "picked it (the largest of the sweep's short runs can overstate it; its figure is given beside)")


def _limits_turns_table(fig, names, add):
    runtimes = list(names)
    add("| turn | `classify` img/s | ensemble req/s | " +
        " | ".join(f"{names[r]} limit img/s (layout, batch)" for r in runtimes) +
        " | ensemble / PyTorch | classify / own runtime | ensemble / own runtime | ensemble / classify |")
    add("| --- | --- | --- |" + " --- |" * len(runtimes) + " --- | --- | --- | --- |")
    for number, row in enumerate(fig["rows"], 1):
        add(f"| {number} | {_f(row['classify'])} | {_f(row['ensemble'])} | " +
            " | ".join(_limit_cell(row["limits"][r]) for r in runtimes) +
            f" | {_f(row['ensemble_vs_pytorch'], 2)} | {_f(row['classify_vs_own'], 2)} | "
            f"{_f(row['ensemble_vs_own'], 2)} | {_f(row['ensemble_vs_classify'], 2)} |")
    add("")


def _limit_cell(best):
    sweep = f"; {_f(best['sweep_throughput'])} in the sweep" if "sweep_throughput" in best else ""
    return f"{_f(best['throughput'])} ({best['layout']}, batch {best['batch']}{sweep})"


def _inprocess_rates_table(limits, names, batches, add):
    first = limits["turns"][0]["inprocess"]
    add("In-process rates, img/s (median over the turns): decode + preprocess + forward at each batch size, "
        "the forward pass alone at the best batch size, and the decode + preprocess alone.\n")
    add("| runtime | layout | " + " | ".join(f"batch {b}" for b in batches) + " | forward only | decode only |")
    add("| --- | --- |" + " --- |" * len(batches) + " --- | --- |")
    for runtime in names:
        for index, row in enumerate(first[runtime]["layouts"]):
            same = [turn["inprocess"][runtime]["layouts"][index] for turn in limits["turns"]]
            cells = [_f(_median([r["e2e"].get(b, float("nan")) for r in same])) for b in batches]
            forward = _median([max(r["forward"].values()) for r in same])
            decode = _median([r["decode"] for r in same])
            add(f"| {names[runtime]} | {row['name']} | " + " | ".join(cells) + f" | {_f(forward)} | {_f(decode)} |")
    add("")


def _latency_c1_table(results, add):
    add("### p50 at concurrency 1\n")
    baseline = results.get("baseline", {})
    if baseline.get("missing") or not baseline:
        add(f"No baseline: `{baseline.get('file', '?')}` was not found.\n")
    else:
        add(f"Against `{baseline['file']}` (mode `{baseline['mode']}`, {baseline['date']}, commit "
            f"`{baseline['commit']}`, load average {_f((baseline.get('load_before') or [float('nan')])[0])} "
            "before it).\n")
    add("| model | this run p50 ms | p99 ms | baseline p50 ms | ratio |")
    add("| --- | --- | --- | --- | --- |")
    for model in ("classify", "classify_and_describe"):
        run = results["limits"]["latency_c1"][model]
        then = baseline.get("p50_c1_ms", {}).get(model)
        add(f"| {model} | {_f(run['p50_ms'])} | {_f(run['p99_ms'])} | {_f(then)} | "
            f"{_f(run['p50_ms'] / then, 2) if then else 'n/a'} |")
    add("")
    beside = results["limits"].get("single_image_ms")
    if beside:
        layouts = ", ".join(f"{name} {' then '.join(_f(run[name], 2) for run in beside)}" for name in beside[0])
        add(f"The in-process single-image latency these are held against (issue 21's targets), one image at a "
            f"time at batch 1, right before and right after them, ms per image by layout: {layouts}; "
            f"the shortest layout's mean, {_f(inprocess_latency_ms(results), 2)} ms.\n")


def _cpu_by_process(limits, add):
    c = limits["concurrency"]
    add("### CPU per request, by process\n")
    add("ms of CPU per request over each perf_analyzer run of figure 1 (median over the turns), from `/proc`: "
        "the load generator is perf_analyzer, the whole machine is every process on it.\n")
    columns = {f"`classify` (c={c})": _median_cpu([t["classify"] for t in limits["turns"]]),
               f"ensemble, LLM 0 ms (c={c})": _median_cpu([t["ensemble"] for t in limits["turns"]])}
    for line in cpu_table(columns):
        add(line)
    add("")


def _where_time_goes_section(results, add, plots, out_path):
    stages = where_time_goes(results)
    if stages:
        add("### Where the time goes\n")
        add("Triton's statistics API (`/v2/models/stats`) around the first turn's `classify` run: average per "
            "request, in ms.\n")
        add("| segment | ms per request |")
        add("| --- | --- |")
        for label, value, _ in stages["segments"]:
            add(f"| {label} | {_f(value)} |")
        add("")
        if stages["closeness"]:
            add("| stage | Triton compute per image (ms) | avg batch | one in-process worker per image (ms) | "
                "in-process / Triton |")
            add("| --- | --- | --- | --- | --- |")
            for label, served, batch, inproc_ms, how in stages["closeness"]:
                add(f"| {label} | {_f(served, 2)} | {_f(batch, 2)} | {_f(inproc_ms, 2)} ({how}) | "
                    f"{inproc_ms / served:.2f} |")
            add("")
        if "stages" in plots:
            add(f"![where the time goes]({_rel(plots['stages'], out_path)})\n")


def _hiding_section(results, add):
    h = results["hiding"]
    add("## 2. The LLM latency is hidden, not paid per request\n")
    add(f"`classify_and_describe` with the fake upstream answering after {h['latency_ms']} ms and after 0 ms, "
        f"both at concurrency {h['concurrency']} (Little's law from the 0 ms throughput at concurrency "
        f"{results['meta']['params']['cover_base_c']}: {_f(h['probe']['throughput'])}/s).\n")
    if h.get("wanted_latency_ms", h["latency_ms"]) != h["latency_ms"]:
        add(f"The run asks for {h['wanted_latency_ms']} ms; covering that would take more requests in flight than "
            f"{h['in_flight_cap']}, the smallest queue a step admits (perf_analyzer sends them all at once, and "
            "admission control refuses a burst beyond a step's queue by design), so the latency is the longest "
            "that this many in flight can hide.\n")
    add("| LLM latency | throughput (infer/s) | p50 ms | p99 ms | upstream calls / requests | window ms |")
    add("| --- | --- | --- | --- | --- | --- |")
    for run in h["turns"]:
        calls = (run["upstream_calls"] / run["triton_requests"]) if run.get("triton_requests") else float("nan")
        add(f"| {run['llm_latency_ms']} ms | {_f(run['throughput'])} | {_f(run['p50_ms'], 0)} | "
            f"{_f(run['p99_ms'], 0)} | {_f(calls, 2)} | {run.get('window_ms', '')} |")
    add(f"\nRatio (slow turns' throughput over the fast turns'): **{h['ratio']:.2f}**, turns in the order "
        "listed.\n")


def _describe_section(results, add):
    d = results["describe"]
    add("## 3. describe model overhead\n")
    add(f"One request at a time, {d['triton']['count']} of each, interleaved: the `describe` model against the "
        "same chat-completions call made straight to the fake upstream (0 ms) with the openai SDK.\n")
    add("| path | p50 ms | p99 ms |")
    add("| --- | --- | --- |")
    add(f"| Triton `describe` | {_f(d['triton']['p50_ms'], 2)} | {_f(d['triton']['p99_ms'], 2)} |")
    add(f"| direct upstream call | {_f(d['direct']['p50_ms'], 2)} | {_f(d['direct']['p99_ms'], 2)} |")
    add(f"| **overhead** | **{_f(d['overhead_p50_ms'], 2)}** | {_f(d['overhead_p99_ms'], 2)} |\n")


def _patterns_section(results, add):
    p = results["patterns"]
    add("## 4. The ensemble vs the two-step client\n")
    add(f"Concurrency {p['concurrency']}, {p['duration_s']:.0f} s per turn after a warm-up, fake upstream latency "
        f"{p['latency_ms']} ms, turns in the order {' '.join(p['order'])}; the table gives the mean over a "
        "pattern's turns. Two-step: `classify`, then the client calls the LLM with the openai SDK. Ensemble: one "
        "`classify_and_describe` request.\n")
    add("| pattern | throughput (req/s) | p50 ms | p99 ms | errors |")
    add("| --- | --- | --- | --- | --- |")
    for name in ("ensemble", "two_step"):
        r = p[name]
        add(f"| {name.replace('_', '-')} | {_f(r['throughput'])} | {_f(r['p50_ms'], 0)} | {_f(r['p99_ms'], 0)} | "
            f"{r['errors']} |")
    add("")
    if len(p["order"]) > 2:
        add("Each turn, in the order run:\n")
        add("| turn | pattern | throughput (req/s) | p50 ms | p99 ms |")
        add("| --- | --- | --- | --- | --- |")
        turns = {name: iter(p[name]["turns"]) for name in ("ensemble", "two_step")}  # each in run order
        for number, name in enumerate(p["order"], 1):
            r = next(turns[name])
            add(f"| {number} | {name.replace('_', '-')} | {_f(r['throughput'])} | {_f(r['p50_ms'], 0)} | "
                f"{_f(r['p99_ms'], 0)} |")
        add("")
    add("CPU per request by process (ms, mean over the turns, warm-up included; the load generator is the "
        "Python client, which in the two-step pattern also makes the LLM call):\n")
    for line in cpu_table({"ensemble": p["ensemble"]["cpu_ms_per_request"],
                           "two-step": p["two_step"]["cpu_ms_per_request"]}):
        add(line)
    add("")


def _sweeps_section(results, add, plots, out_path):
    sweeps = results["sweeps"]
    add("## 5. Concurrency sweeps\n")
    for name, title in (("classify", "classify"),
                        ("classify_and_describe", f"classify_and_describe, LLM {sweeps['ensemble_latency_ms']} ms")):
        add(f"### {title}\n")
        add("| concurrency | throughput (infer/s) | p50 ms | p90 ms | p99 ms | server queue ms | server compute ms |")
        add("| --- | --- | --- | --- | --- | --- | --- |")
        for r in sweeps[name]:
            add(f"| {r['concurrency']} | {_f(r['throughput'])} | {_f(r['p50_ms'])} | {_f(r['p90_ms'])} | "
                f"{_f(r['p99_ms'])} | {_f(r['server_queue_ms'])} | {_f(r['server_compute_ms'])} |")
        add("")
        if name in plots:
            add(f"![{title} sweep]({_rel(plots[name], out_path)})\n")


def _tuning_section(results, add, plots, out_path):
    add("## 6. Classifier config alternatives\n")
    if not results.get("tuning"):
        add(f"Not measured in mode `{results['meta']['mode']}` (`make bench` measures them).\n")
        return
    concs = sorted({c for row in results["tuning"] for c in row["results"]})
    add("perf_analyzer on `classify` with the classifier's config.pbtxt swapped on the run's temp copy of the "
        "model repository and reloaded; everything else as shipped.\n")
    add("| config | " + " | ".join(f"c={c}: img/s, p50 / p99 ms, avg batch" for c in concs) + " |")
    add("| --- |" + " --- |" * len(concs))
    for row in results["tuning"]:
        cells = []
        for c in concs:
            r = row["results"][c]
            cells.append(f"{_f(r['throughput'])}, {_f(r['p50_ms'], 0)} / {_f(r['p99_ms'], 0)}, "
                         f"{_f(r['avg_batch'], 2)}")
        add(f"| {row['label']} | " + " | ".join(cells) + " |")
    add("")
    shipped = next((row for row in results["tuning"] if row["name"] == "shipped"), None)
    if shipped is not None:
        for c in concs:
            best = max(results["tuning"], key=lambda row: row["results"][c]["throughput"])
            gain = best["results"][c]["throughput"] / max(shipped["results"][c]["throughput"], 1e-9)
            verdict = ("the shipped config is the best measured" if best is shipped else
                       f"best measured: {best['label']}, {gain:.2f}x the shipped config's throughput")
            add(f"- Concurrency {c}: {verdict}.")
        add("")
    if "tuning" in plots:
        add(f"![tuning]({_rel(plots['tuning'], out_path)})\n")


def _extra_sections(results, add):
    modules = extra_sections.by_name()
    for name, section in results.get("sections", {}).items():
        module = modules.get(name)
        if module is not None and "error" not in section:
            for line in module.render(section):  # its own "## " heading first
                add(line)
            add("")
            continue
        add(f"## {getattr(module, 'TITLE', name)}\n")
        if "error" in section:
            add(f"Not measured: the section failed ({section['error']}).\n")
        else:
            add(f"Measured, but no module `{name}` is listed in tools/bench/sections.py to render it.\n")


def _repo_path(path):
    path = pathlib.Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def version(name):
    """A version from versions.env (recorded in the results file's meta at run time)."""
    try:
        for line in (REPO / "versions.env").read_text().splitlines():
            if line.startswith(name + "="):
                return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return "?"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the benchmark report and plots from a results file, "
                                     "without measuring anything.")
    parser.add_argument("results", type=pathlib.Path, help="a results file of tools/bench/run.py")
    parser.add_argument("--out", type=pathlib.Path, help="the report (default: the one the run wrote)")
    parser.add_argument("--plots", type=pathlib.Path, help="plot folder (default: plots/ beside the report)")
    args = parser.parse_args(argv)
    results = load(args.results)
    out = args.out or REPO / results["meta"].get("report_file", "build/bench/benchmarks.md")
    print(write(results, out, args.plots or out.parent / "plots"))


if __name__ == "__main__":
    main()
