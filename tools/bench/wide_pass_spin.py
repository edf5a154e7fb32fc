"""The wide pass's onnxruntime workers, spinning between ops or asleep, in-process and side by side
(docs/benchmarks-method.md#where-the-cpu-goes).

One process decodes and classifies the bench's photos with the server's own code
(classify_describe_server's image_decode and classifier_runtime's `_onnx_session`) on two sessions of the
served graph with `--threads` intra-op threads: `asleep` (spinning off, as the narrow sessions and,
before 2026-12-06, the wide one and the in-process baseline) and `spinning` (between ops, stopped
when the pass ends: the wide session now). Each round runs both in turn (the order alternating),
in two modes:

  lone          one image, then `--gap-ms` idle, as a lone request finds the server
  back_to_back  images one after another for `--seconds`, as the in-process limit's loop

and records per mode and session the median milliseconds an image (decode + forward) and the
process's CPU milliseconds an image; the result is each figure's median over the rounds and the
per-round ratio spinning / asleep.

    .venv/bin/python -m tools.bench.wide_pass_spin [--rounds 10] [--threads 2] [--results FILE]
"""

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

from tools import host
from tools.bench import inprocess, inputs

REPO = pathlib.Path(__file__).resolve().parents[2]
SESSIONS = {"asleep": False, "spinning": True}


def one_mode(run, images, lone, count, gap_s, seconds):
    """(median ms an image, CPU ms an image) of decode + forward, lone or back to back."""
    times, done = [], 0
    cpu_started, started = time.process_time(), time.perf_counter()
    while (done < count) if lone else (time.perf_counter() - started < seconds):
        begun = time.perf_counter()
        run(images[done % len(images)])
        times.append((time.perf_counter() - begun) * 1e3)
        done += 1
        if lone:
            time.sleep(gap_s)
    return statistics.median(times), (time.process_time() - cpu_started) * 1e3 / done


def measure(args):
    from classify_describe_server import classifier_runtime as runtime
    repository = REPO / "model_repository"
    preprocess = inprocess.preprocessor(repository)
    images = list(inputs.photo_jpegs().values())
    sessions = {name: runtime._onnx_session(repository / "classifier/1/model.onnx", args.threads, spin=spin)
                for name, spin in SESSIONS.items()}
    input_name = sessions["asleep"].get_inputs()[0].name

    def runner(session):
        return lambda jpeg: session.run(None, {input_name: preprocess(jpeg)[None]})

    runs = {name: runner(session) for name, session in sessions.items()}
    for run in runs.values():  # warm-up: the graph's first passes allocate
        for index in range(20):
            run(images[index % len(images)])
    rounds = []
    for number in range(args.rounds):
        order = list(runs) if number % 2 == 0 else list(reversed(runs))
        figures = {}
        for mode, lone in (("lone", True), ("back_to_back", False)):
            for name in order:
                ms, cpu_ms = one_mode(runs[name], images, lone, args.images, args.gap_ms / 1e3, args.seconds)
                figures.setdefault(mode, {})[name] = {"ms": ms, "cpu_ms": cpu_ms}
        rounds.append(figures)
        print(f"wide_pass_spin: round {number + 1}: " + "; ".join(
            f"{mode} " + ", ".join(f"{name} {f['ms']:.2f} ms ({f['cpu_ms']:.2f} CPU)" for name, f in by.items())
            for mode, by in figures.items()), file=sys.stderr, flush=True)
    summary = {}
    for mode in ("lone", "back_to_back"):
        summary[mode] = {name: {key: statistics.median(r[mode][name][key] for r in rounds) for key in ("ms", "cpu_ms")}
                         for name in SESSIONS}
        ratios = [r[mode]["spinning"]["ms"] / r[mode]["asleep"]["ms"] for r in rounds]
        summary[mode]["spinning_over_asleep_ms"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                    "max": max(ratios),
                                                    "rounds_spinning_faster": sum(ratio < 1 for ratio in ratios)}
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": host.describe(), "args": vars(args) | {"results": str(args.results)}, "rounds": rounds,
            "summary": summary}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of both sessions")
    parser.add_argument("--images", type=int, default=100, help="lone images per round and session")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="idle time after each lone image")
    parser.add_argument("--seconds", type=float, default=2.0, help="back-to-back time per round and session")
    parser.add_argument("--results", type=pathlib.Path)
    args = parser.parse_args(argv)
    results = measure(args)
    text = json.dumps(results, indent=1)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text + "\n")
    print(json.dumps(results["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
