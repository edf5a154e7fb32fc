"""Turn a run's results into docs/benchmarks.md (tables) and PNG plots, and
return the headline lines that `make bench` prints."""

import math
import pathlib
import statistics

REPO = pathlib.Path(__file__).resolve().parents[2]


def _median(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def _f(value, digits=1):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def _mark(ok):
    return "met" if ok else "**not met**"


# -- the figures ------------------------------------------------------------------------

def classification_figure(pairs, policy_max_batch=4):
    rows = []
    for pair in pairs:
        inproc = pair["inprocess"]
        allowed = {b: v for b, v in inproc["e2e"].items() if b <= policy_max_batch}
        best_batch = max(allowed, key=allowed.get)
        stats = pair["stats"].get("classifier", {})
        avg_batch = stats["inference_count"] / stats["exec_count"] if stats.get("exec_count") else float("nan")
        rows.append({"triton": pair["triton"]["throughput"], "inproc": allowed[best_batch], "best_batch": best_batch,
                     "forward": max(v for b, v in inproc["forward"].items() if b <= policy_max_batch),
                     "ratio": pair["triton"]["throughput"] / allowed[best_batch], "avg_batch": avg_batch})
    return {"rows": rows, "ratio": _median([r["ratio"] for r in rows])}


def headline(results):
    c = classification_figure(results["classification"], results["meta"].get("policy_max_batch", 4))
    h = results["hiding"]
    d = results["describe"]
    p = results["patterns"]
    hiding_ratio = h.get("ratio") or (h["slow"]["throughput"] / h["fast"]["throughput"]
                                      if h["fast"]["throughput"] else float("nan"))
    ens, two = p["ensemble"], p["two_step"]
    figures = [
        ("1. classify through Triton / in-process TorchScript (throughput)", f"{c['ratio']:.2f}", ">= 0.9",
         c["ratio"] >= 0.9),
        (f"2. ensemble, LLM {h['latency_ms']} ms / LLM 0 ms (throughput at concurrency {h['concurrency']})",
         f"{hiding_ratio:.2f}", ">= 0.9", hiding_ratio >= 0.9),
        ("3. describe model overhead over a direct upstream call (p50)", f"{d['overhead_p50_ms']:.2f} ms", "< 3 ms",
         d["overhead_p50_ms"] < 3.0),
        (f"4. ensemble / two-step client (LLM {p['latency_ms']} ms, concurrency {p['concurrency']})",
         f"throughput {ens['throughput'] / two['throughput']:.2f}x, p50 {_f(ens['p50_ms'], 0)} vs "
         f"{_f(two['p50_ms'], 0)} ms, p99 {_f(ens['p99_ms'], 0)} vs {_f(two['p99_ms'], 0)} ms",
         "throughput >= 1x, lower latency",
         ens["throughput"] >= two["throughput"] and ens["p50_ms"] <= two["p50_ms"]),
    ]
    sweeps = results["sweeps"]
    peak = {name: max(sweeps[name], key=lambda r: r["throughput"]) for name in ("classify", "classify_and_describe")}
    figures.append(("5. concurrency sweeps: peak throughput",
                    f"classify {_f(peak['classify']['throughput'])}/s at c={peak['classify']['concurrency']}; "
                    f"ensemble (LLM {sweeps['ensemble_latency_ms']} ms) "
                    f"{_f(peak['classify_and_describe']['throughput'])}/s at "
                    f"c={peak['classify_and_describe']['concurrency']}", "plots", True))
    return figures, {"classification": c, "hiding_ratio": hiding_ratio}


# -- plots ------------------------------------------------------------------------------------

def _plots(results, plots_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    sweeps = results["sweeps"]
    for name, title in (("classify", "classify (IMAGE -> LABELS, SCORES)"),
                        ("classify_and_describe", f"classify_and_describe (LLM {sweeps['ensemble_latency_ms']} ms)")):
        rows = sweeps[name]
        if not rows:
            continue
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
        fig.tight_layout()
        path = plots_dir / f"sweep_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written[name] = path

    stages = where_time_goes(results)
    if stages:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        left = 0.0
        for label, value, color in stages["segments"]:
            ax.barh([0], [value], left=left, color=color, label=f"{label} {value:.0f} ms")
            left += value
        ax.set_yticks([])
        ax.set_xlabel("ms per request (server-side average, perf_analyzer run of figure 1)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
        ax.set_title(f"classify at concurrency {stages['concurrency']}: where the time goes")
        fig.tight_layout()
        path = plots_dir / "where_time_goes.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written["stages"] = path

    if results.get("tuning"):
        rows = results["tuning"]
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
        fig.tight_layout()
        path = plots_dir / "tuning_classifier.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written["tuning"] = path
    return written


def where_time_goes(results):
    pair = results["classification"][0]
    stats = pair["stats"]
    pre, cls = stats.get("preprocess"), stats.get("classifier")
    if not pre or not cls or not pre["count"] or not cls["count"]:
        return None
    segments = [
        ("preprocess queue", pre["queue_ms"] / pre["count"], "#c6dbef"),
        ("preprocess compute", pre["compute_ms"] / pre["count"], "#4292c6"),
        ("classifier queue", cls["queue_ms"] / cls["count"], "#fdd0a2"),
        ("classifier compute", cls["compute_ms"] / cls["count"], "#f16913"),
    ]
    total = stats.get("classify", {})
    server = total["request_ms"] / total["count"] if total.get("count") else sum(s[1] for s in segments)
    other = max(0.0, server - sum(s[1] for s in segments))
    segments.append(("ensemble + IPC", other, "#bdbdbd"))
    client_extra = max(0.0, pair["triton"]["p50_ms"] - server)
    segments.append(("client + HTTP (p50 - server avg)", client_extra, "#e5e5e5"))
    inproc = pair["inprocess"]
    avg_pre = pre["inference_count"] / pre["exec_count"] if pre["exec_count"] else 1
    avg_cls = cls["inference_count"] / cls["exec_count"] if cls["exec_count"] else 1
    nearest = min(inproc["forward"], key=lambda b: abs(b - avg_cls))
    # Each request of a batch is charged the whole batch's compute: per image = per request / batch.
    closeness = [
        ("preprocess (decode, resize, normalise)", pre["compute_ms"] / pre["count"] / avg_pre, avg_pre,
         1000.0 / inproc["decode"], "batch 1"),
        ("classifier (TorchScript forward + top-5)", cls["compute_ms"] / cls["count"] / avg_cls, avg_cls,
         1000.0 / inproc["forward"][nearest], f"batch {nearest}"),
    ]
    return {"segments": segments, "closeness": closeness, "concurrency": pair["triton"].get("concurrency")
            or results["meta"]["params"]["classify_c"], "server_ms": server}


# -- markdown ---------------------------------------------------------------------------------

def _rel(path, out_path):
    try:
        return str(pathlib.Path(path).resolve().relative_to(out_path.parent.resolve()))
    except ValueError:
        return str(path)


def write(results, out_path, plots_dir):
    out_path = pathlib.Path(out_path)
    plots_dir = pathlib.Path(plots_dir)
    figures, derived = headline(results)
    plots = _plots(results, plots_dir)
    meta = results["meta"]
    params = meta["params"]
    lines = []
    add = lines.append
    load = " / ".join(f"{v:.1f}" for v in meta["load_before"])
    load_after = " / ".join(f"{v:.1f}" for v in meta.get("load_after", (float("nan"),) * 3))
    add("# Benchmarks\n")
    add(f"Produced by `{meta['command']}` (tools/bench/run.py, mode `{meta['mode']}`) on {meta['date']}, "
        f"commit `{meta['commit']}`.\n")
    add(f"- Machine: {meta['machine']}.")
    add(f"- Load: 1/5/15-min load average {load} before the run and {load_after} after; "
        f"{meta['other_servers']} other tritonserver process(es) were running (other engineers' tests on the same "
        "2 cores). Absolute numbers therefore move from run to run; every figure below is a **ratio of two "
        "measurements taken side by side in the same run**, which is what the targets are about.")
    add(f"- Server: Triton {_version('TRITON_VERSION')} (nvidia-pytriton wheel), started by `scripts/serve.sh` on a "
        f"temp copy of `model_repository/` on free loopback ports (ready in {meta.get('server_startup_s', 0):.0f} s), "
        "with `LLM_CACHE_ENABLED=false` and a distinct `PROMPT` per request, so every request is one upstream call. "
        "The LLM upstream is `tools/fake_openai` (latency set through its admin API).")
    add(f"- Load generator: NVIDIA perf_analyzer (tritonclient {_version('PERF_ANALYZER_TRITONCLIENT_VERSION')} "
        f"wheel, `make perf-analyzer`), HTTP, real JPEG bytes (scikit-image chelsea 451x300 and coffee 600x400, "
        f"Pillow quality 85) as `--input-data` JSON; {params['trials']} windows of {params['window_ms']} ms per "
        "point, stability not required (`-s 1000`: the shared machine never stays within 10 %). "
        "Figures 3 and 4 use a Python asyncio client (tritonclient + openai SDK), since perf_analyzer cannot "
        "play the two-step client.")
    add(f"- The whole run took {meta['duration_s']:.0f} s. Reproduce: `make build perf-analyzer && "
        f"{meta['command']}`.\n")
    add("perf_analyzer command lines (the work-dir file names; `<C>` is the concurrency, `<W>` the window: "
        f"{params['window_ms']} ms, or three times the expected latency where that is longer, up to "
        f"{params.get('window_cap_ms', 30000) / 1000:g} s):\n")
    add("```")
    lines.extend(meta.get("perf_analyzer_commands", []))
    add("```\n")

    add("## Headline\n")
    add("| figure | measured | target | |")
    add("| --- | --- | --- | --- |")
    for name, value, target, ok in figures:
        add(f"| {name} | {value} | {target} | {_mark(ok) if target != 'plots' else ''} |")
    add("")

    # 1
    c = derived["classification"]
    add("## 1. Classification: Triton vs in-process TorchScript\n")
    add(f"`classify` (IMAGE bytes in, LABELS/SCORES out) under perf_analyzer at concurrency {params['classify_c']}, "
        "against `tools/bench/inprocess.py`: the same decode/preprocess code (`backends/image_preprocess`) and "
        "classifier code (`backends/torchscript_classifier`) in one process, "
        "with as many torch threads as the classifier's instances use together "
        f"({_threads(results)}), at each batch size up to the largest the server's batcher prefers "
        f"(shipped classifier config: {results['meta'].get('classifier_config', '?')}); the baseline is the best "
        f"of those batch sizes. {params['repeats']} turn(s) of Triton then in-process; the ratio is the median. "
        "Triton runs decode and forward in two processes (preprocess, classifier), the in-process loop runs "
        "them one after the other.\n")
    add("| turn | Triton img/s | server avg batch | in-process e2e img/s (best batch) | forward-only img/s | ratio |")
    add("| --- | --- | --- | --- | --- | --- |")
    for i, row in enumerate(c["rows"], 1):
        add(f"| {i} | {_f(row['triton'])} | {_f(row['avg_batch'], 2)} | {_f(row['inproc'])} (batch "
            f"{row['best_batch']}) | {_f(row['forward'])} | {row['ratio']:.2f} |")
    add("")
    add("In-process rates per batch size (last turn), img/s:\n")
    last = results["classification"][-1]["inprocess"]
    batches = sorted(last["e2e"])
    add("| | " + " | ".join(f"batch {b}" for b in batches) + " |")
    add("| --- |" + " --- |" * len(batches))
    add("| decode + preprocess + forward | " + " | ".join(_f(last["e2e"][b]) for b in batches) + " |")
    add("| forward only | " + " | ".join(_f(last["forward"][b]) for b in batches) + " |")
    add(f"\nDecode + preprocess alone: {_f(last['decode'])} img/s on one core.\n")

    stages = where_time_goes(results)
    if stages:
        add("### Where the time goes, and how close each stage is to this machine\n")
        add("From Triton's statistics API (`/v2/models/stats`) around the Triton run of turn 1: average per request, "
            "in ms.\n")
        add("| segment | ms per request |")
        add("| --- | --- |")
        for label, value, _ in stages["segments"]:
            add(f"| {label} | {_f(value)} |")
        add("")
        add("| stage | Triton compute per image (ms) | avg batch | in-process per image (ms) | in-process / Triton |")
        add("| --- | --- | --- | --- | --- |")
        for label, served, batch, inproc_ms, how in stages["closeness"]:
            add(f"| {label} | {_f(served, 2)} | {_f(batch, 2)} | {_f(inproc_ms, 2)} ({how}) | "
                f"{inproc_ms / served:.2f} |")
        add("")
        if "stages" in plots:
            add(f"![where the time goes]({_rel(plots['stages'], out_path)})\n")

    # 2
    h = results["hiding"]
    add("## 2. The LLM latency is hidden, not paid per request\n")
    add(f"`classify_and_describe` under perf_analyzer with the fake upstream answering after {h['latency_ms']} ms "
        f"and after 0 ms, both at concurrency {h['concurrency']}: chosen by Little's law from the 0 ms throughput "
        f"at concurrency {results['meta']['params']['cover_base_c']} ({_f(h['probe']['throughput'])}/s), so that "
        f"enough requests are in flight to cover {h['latency_ms']} ms.\n")
    add("| LLM latency | throughput (infer/s) | p50 ms | p99 ms | upstream calls / requests | window ms |")
    add("| --- | --- | --- | --- | --- | --- |")
    for run in h.get("turns") or (dict(h["fast"], llm_latency_ms=0), dict(h["slow"], llm_latency_ms=h["latency_ms"])):
        label = f"{run['llm_latency_ms']} ms"
        calls = (run["upstream_calls"] / run["triton_requests"]) if run.get("triton_requests") else float("nan")
        add(f"| {label} | {_f(run['throughput'])} | {_f(run['p50_ms'], 0)} | {_f(run['p99_ms'], 0)} | "
            f"{_f(calls, 2)} | {run.get('window_ms', '')} |")
    add(f"\nRatio (sum of the slow turns' throughput over the fast turns'): **{derived['hiding_ratio']:.2f}** "
        "(target at least 0.9), turns in the order listed. Upstream calls per request near 1.00 show "
        "that no answer came from a cache.\n")

    # 3
    d = results["describe"]
    add("## 3. describe model overhead\n")
    add(f"One request at a time, {d['triton']['count']} of each, interleaved: the `describe` model (LABELS, SCORES, "
        "PROMPT in) against the same chat-completions call made straight to the fake upstream (0 ms) with the openai "
        "SDK, both from Python on this machine.\n")
    add("| path | p50 ms | p99 ms |")
    add("| --- | --- | --- |")
    add(f"| Triton `describe` | {_f(d['triton']['p50_ms'], 2)} | {_f(d['triton']['p99_ms'], 2)} |")
    add(f"| direct upstream call | {_f(d['direct']['p50_ms'], 2)} | {_f(d['direct']['p99_ms'], 2)} |")
    add(f"| **overhead** | **{_f(d['overhead_p50_ms'], 2)}** | {_f(d['overhead_p99_ms'], 2)} |\n")

    # 4
    p = results["patterns"]
    add("## 4. The ensemble vs the two-step client\n")
    order = " ".join(p.get("order", ("ensemble", "two_step")))
    add(f"Same images, distinct prompts, concurrency {p['concurrency']}, {p['duration_s']:.0f} s per turn after a "
        f"warm-up, fake upstream latency {p['latency_ms']} ms, turns in the order {order} in the same run "
        "(the table gives the mean over a pattern's turns). Two-step: the client asks "
        "Triton `classify`, then calls the LLM itself with the openai SDK (the same chat messages the describe "
        "model sends). Ensemble: one `classify_and_describe` request. Both are bound by the classifier on "
        "this CPU, and on loopback the ensemble saves one client round trip and the second request's "
        "serialisation, about a millisecond of a few hundred, so expect the two within the noise here; the "
        "saving grows with the client's network distance (one round trip instead of two).\n")
    add("| pattern | throughput (req/s) | p50 ms | p99 ms | errors |")
    add("| --- | --- | --- | --- | --- |")
    for name in ("ensemble", "two_step"):
        r = p[name]
        add(f"| {name.replace('_', '-')} | {_f(r['throughput'])} | {_f(r['p50_ms'], 0)} | {_f(r['p99_ms'], 0)} | "
            f"{r['errors']} |")
    add("")
    if len(p.get("order", ())) > 2:
        add("Each turn, in the order run (the spread between turns of one pattern is the noise the "
            "difference above has to clear):\n")
        add("| turn | pattern | throughput (req/s) | p50 ms | p99 ms |")
        add("| --- | --- | --- | --- | --- |")
        turns = {name: iter(p[name]["turns"]) for name in ("ensemble", "two_step")}  # each in run order
        for number, name in enumerate(p["order"], 1):
            r = next(turns[name])
            add(f"| {number} | {name.replace('_', '-')} | {_f(r['throughput'])} | {_f(r['p50_ms'], 0)} | "
                f"{_f(r['p99_ms'], 0)} |")
        spread = {name: (min(t["throughput"] for t in p[name]["turns"]), max(t["throughput"] for t in p[name]["turns"]))
                  for name in ("ensemble", "two_step")}
        add("\nThroughput range over the turns: ensemble " + " to ".join(_f(v) for v in spread["ensemble"]) +
            " req/s, two-step " + " to ".join(_f(v) for v in spread["two_step"]) + " req/s.")
        add("")
    if all("cpu_ms_per_request" in p[name] for name in ("ensemble", "two_step")):
        cpu = {name: p[name]["cpu_ms_per_request"] for name in ("ensemble", "two_step")}
        add("Where one request's CPU goes (ms of CPU per request, mean over the turns; from `/proc`, "
            "`harness.cpu_seconds`). The load generator plays the client: in the two-step pattern it makes "
            "the LLM call itself with the openai SDK, which the ensemble does in the `describe` stub:\n")
        add("| where | ensemble | two-step |")
        add("| --- | --- | --- |")
        places = [w for w in ("load generator", "tritonserver", "preprocess stubs", "classifier stubs",
                              "describe stubs", "fake upstream") if any(w in c for c in cpu.values())]
        for where in places:
            add(f"| {where} | {_f(cpu['ensemble'].get(where, 0.0), 2)} | {_f(cpu['two_step'].get(where, 0.0), 2)} |")
        rest = {name: c["machine"] - sum(c.get(w, 0.0) for w in places) for name, c in cpu.items()}
        add(f"| everything else on the machine | {_f(rest['ensemble'], 2)} | {_f(rest['two_step'], 2)} |")
        add(f"| **whole machine** | **{_f(cpu['ensemble']['machine'], 2)}** | **{_f(cpu['two_step']['machine'], 2)}** |")
        moved = cpu["ensemble"].get("describe stubs", 0.0) + cpu["ensemble"].get("tritonserver", 0.0) \
            - cpu["two_step"].get("tritonserver", 0.0)
        add(f"\nThe ensemble moves the LLM call from the client into the server: the server side spends "
            f"{_f(moved, 1)} ms more CPU per request (the `describe` stub and the ensemble's extra step), the "
            f"client {_f(cpu['two_step'].get('load generator', 0.0) - cpu['ensemble'].get('load generator', 0.0), 1)} "
            "ms less. Here client and server share the same cores, so the totals, and the throughputs, come out "
            "about equal. With clients on other machines, a CPU-bound server does that much more work per "
            "request in the ensemble; what it buys is one round trip instead of two, no LLM key, SDK or "
            "prompt template in any client, and the server-side cache, fallback, limits and cost metrics.")
        add("")

    # 5
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

    # tuning
    add("## The tuning behind the shipped classifier config\n")
    if results.get("tuning"):
        concs = sorted({c for row in results["tuning"] for c in row["results"]})
        add("perf_analyzer on `classify` with the classifier's config.pbtxt swapped on the run's temp copy of the "
            "model repository and reloaded (`POST /v2/repository/models/classifier/load`); everything else as "
            "shipped. The forward-pass measurements that led to the shipped values are in "
            "[tuning-classifier.md](tuning-classifier.md).\n")
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
        best = {c: max(results["tuning"], key=lambda row: row["results"][c]["throughput"]) for c in concs}
        shipped = next((row for row in results["tuning"] if row["name"] == "shipped"), None)
        for c, row in best.items():
            if shipped is None:
                break
            gain = row["results"][c]["throughput"] / max(shipped["results"][c]["throughput"], 1e-9)
            verdict = ("the shipped config is the best measured" if row is shipped else
                       f"best measured: {row['label']}, {gain:.2f}x the shipped config's throughput")
            add(f"- Concurrency {c}: {verdict}.")
        add("\nOne run on a shared machine: a gap under about 20 % is within the run-to-run noise seen here; "
            "a config change should rest on repeated runs.\n")
        if "tuning" in plots:
            add(f"![tuning]({_rel(plots['tuning'], out_path)})\n")
    else:
        add("Not measured in this mode (run `make bench`).\n")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("\n".join(lines).rstrip() + "\n")

    head = ["", "bench: headline (" + meta["mode"] + ")"]
    for name, value, target, ok in figures:
        head.append(f"  {name}: {value}" + (f"  [target {target}: {'met' if ok else 'NOT met'}]"
                                            if target != "plots" else ""))
    return "\n".join(head)


def _threads(results):
    return f"{results['meta'].get('torch_threads', '?')} torch thread(s), interop 1"


def _version(name):
    try:
        for line in (REPO / "versions.env").read_text().splitlines():
            if line.startswith(name + "="):
                return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return "?"
