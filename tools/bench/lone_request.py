"""Where a lone request's time goes: Triton's own trace of every request
(`--trace-config level=TIMESTAMPS`, rate 1) while perf_analyzer sends one at
a time, split by step (docs/benchmarks-method.md#a-lone-requests-time).

    .venv/bin/python -m tools.bench.lone_request [--model classify_and_describe] [--seconds 12]
        [--results FILE]

One server (scripts/serve.sh on a copy of model_repository/, the fake
upstream answering at once, the answer cache off), perf_analyzer at
concurrency 1 on the bench's photos, then the trace file read: per request of
the model, the time from one timestamp to the next for the request itself and
for each step of an ensemble, medians over the requests past the first quarter
(the warm-up). A step that answers through its response sender (the describe
step: execute() hands the request to its asyncio loop and returns) ends its
compute when execute returns; the time to its answer (the LLM call, the
response sent) is then the ensemble's "after the last step" row.

Tracing every request costs time of its own (a few tens of microseconds a
timestamp): read the rows against each other, and the p50 against `make
bench`'s without tracing.
"""

import argparse
import collections
import json
import pathlib
import statistics
import sys
import tempfile

from tools import host
from tools.bench import harness, inputs

# (row, from timestamp, to timestamp) of a step's own request.
STEP_SPANS = (
    ("queue (request start to compute start)", "REQUEST_START", "COMPUTE_START"),
    ("inputs to the stub", "COMPUTE_START", "COMPUTE_INPUT_END"),
    ("execute()", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
    ("outputs back", "COMPUTE_OUTPUT_START", "COMPUTE_END"),
    ("compute end to request end", "COMPUTE_END", "REQUEST_END"),
)


# A request traced from its HTTP read to its answer has these.
WHOLE = {"HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "REQUEST_END", "HTTP_SEND_END"}


def merge_entries(entries):
    """{trace id: {"model_name", "parent_id", "ts": {name: ns}}}: Triton 2.51 writes a trace
    as several entries sharing its id (one with the model, one per timestamp)."""
    traces = collections.defaultdict(lambda: {"ts": {}})
    for entry in entries:
        trace = traces[entry["id"]]
        for key in ("model_name", "parent_id"):
            if key in entry:
                trace[key] = entry[key]
        for stamp in entry.get("timestamps", []):
            trace["ts"].setdefault(stamp["name"], stamp["ns"])
    return dict(traces)


def request_rows(traces, model):
    """One {row: ns} per traced HTTP request of `model`, in id order: its HTTP read, its
    steps (an ensemble's, in the order they started) and its answer."""
    steps_of = collections.defaultdict(list)
    for trace in traces.values():
        if trace.get("parent_id"):
            steps_of[trace["parent_id"]].append(trace)
    rows = []
    for trace_id, trace in sorted(traces.items()):
        ts = trace["ts"]
        if trace.get("model_name") != model or trace.get("parent_id") or not WHOLE.issubset(ts):
            continue  # another model's, a step's, or cut short (the server stopped mid-request)
        row = {"HTTP: body read": ts["HTTP_RECV_END"] - ts["HTTP_RECV_START"],
               "HTTP read to request start": ts["REQUEST_START"] - ts["HTTP_RECV_END"]}
        steps = sorted(steps_of[trace_id], key=lambda step: step["ts"]["REQUEST_START"])
        if not steps:  # a model served alone: its own spans
            steps, last_end = [dict(trace, model_name=model)], None
        else:
            last_end = ts["REQUEST_START"]
        for step in steps:
            st = step["ts"]
            if last_end is not None:
                # Negative when the step's request began before the previous step's ended
                # (Triton passes an output on before the step that made it has finished).
                row[f"{step['model_name']}: since the previous step ended"] = st["REQUEST_START"] - last_end
            for name, start, end in STEP_SPANS:
                if start in st and end in st:
                    row[f"{step['model_name']}: {name}"] = st[end] - st[start]
            if last_end is not None:
                last_end = st["REQUEST_END"]
        if last_end is not None:
            row["after the last step (its answer, the ensemble's end)"] = ts["REQUEST_END"] - last_end
        row["request end to HTTP answer sent"] = ts["HTTP_SEND_END"] - ts["REQUEST_END"]
        row["total (HTTP read start to answer sent)"] = ts["HTTP_SEND_END"] - ts["HTTP_RECV_START"]
        rows.append(row)
    return rows


def medians_ms(rows, skip_share=0.25):
    """{row: median ms} over the rows past the first `skip_share` (the warm-up)."""
    kept = rows[int(len(rows) * skip_share):]
    names = list(dict.fromkeys(name for row in kept for name in row))
    return {name: round(statistics.median(row[name] for row in kept if name in row) / 1e6, 3) for name in names}


def read_trace(path):
    text = pathlib.Path(path).read_text()
    try:
        return json.loads(text)
    except ValueError:  # written in several arrays (log-frequency > 0): one list
        return [entry for chunk in text.replace("][", "]\n[").splitlines() if chunk.strip()
                for entry in json.loads(chunk)]


def measure(model, seconds, workdir):
    workdir = pathlib.Path(workdir)
    trace = workdir / "trace.json"
    llm = harness.FakeLLM(workdir)
    extra = " ".join(f"--trace-config {setting}" for setting in (
        f"triton,file={trace}", "rate=1", "level=TIMESTAMPS", "triton,log-frequency=0"))
    server = harness.Triton(workdir, llm.base_url, {"LLM_CACHE_ENABLED": "false", "TRITON_EXTRA_ARGS": extra})
    try:
        paths = inputs.write_input_data(workdir, inputs.photo_jpegs())
        window_ms = max(1000, int(seconds * 1000 / 3))
        figures = harness.perf_analyzer(model, server.http_url, paths[model], 1, workdir, window_ms=window_ms, trials=3)
    finally:
        server.stop()  # the trace file is written whole at exit (log-frequency 0)
        llm.stop()
    rows = request_rows(merge_entries(read_trace(trace)), model)
    return {"model": model, "concurrency": 1, "requests_traced": len(rows),
            "perf_analyzer_p50_ms": figures.get("p50_ms"), "throughput": figures.get("throughput"),
            "p50_ms_by_step": medians_ms(rows)}


def table(results):
    lines = ["| step | p50 (ms) |", "| --- | --- |"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in results["p50_ms_by_step"].items()]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="classify_and_describe")
    parser.add_argument("--seconds", type=float, default=12.0, help="perf_analyzer's three windows together")
    parser.add_argument("--results", type=pathlib.Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lone-request-") as workdir:
        results = measure(args.model, args.seconds, workdir)
    results["host"] = host.describe()
    print(table(results))
    print(f"perf_analyzer p50 {results['perf_analyzer_p50_ms']} ms over {results['requests_traced']} traced requests",
          file=sys.stderr)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
