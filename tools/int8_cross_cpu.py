"""Does the int8 graph give the same answers on CPUs without VNNI? Runs the
classifier's graphs on evaluation crops natively and under qemu's user-mode
emulation of AVX2-only CPUs (Intel Haswell, AMD EPYC Rome: no AVX-512, no VNNI,
so ONNX Runtime takes its VPMADDUBSW kernels, the ones that saturate on a
full-range int8 graph), and compares the scores and labels.

The build's graph (7-bit weights, scripts/export_onnx.py) must match this CPU's
answers bit for bit up to float rounding in the fp32 head; --graph points at any
other graph (a full-range one shows the saturation).

Needs qemu-user (Debian: apt-get install qemu-user; `make int8-cpus` installs it).
Emulation is slow (about 8 s per crop): the default 12 crops take a few minutes per CPU.

usage: python -m tools.int8_cross_cpu [--crops 12] [--cpus Haswell,EPYC-Rome] [--graph PATH]
                                      [--results docs/results/int8-cross-cpu.json]
"""

import argparse
import datetime
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from scripts import export_onnx
from tools import host

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "model_repository" / "classifier" / "1"
# Float rounding in the fp32 head (Gemm, softmax) differs between AVX-512 and AVX2
# kernels; a saturated int16 sum moves scores by 1e-2 to 1e-1.
SAME_SCORES_ATOL = 1e-5
# What each emulated model lacks (qemu-user passes the host's CPU description through).
EMULATED = {"Haswell": "Intel Haswell: AVX2, FMA; no AVX-512, no VNNI",
            "EPYC-Rome": "AMD EPYC Rome (Zen 2): AVX2, FMA; no AVX-512, no VNNI"}


def run_here(graph, crops, out):
    """Scores and labels of `graph` on the first `crops` evaluation crops, saved to `out`."""
    pixels = export_onnx.evaluation_pixels(crops)
    scores, labels = export_onnx.run(export_onnx.session(str(graph)), pixels)
    np.savez(out, scores=scores, labels=labels.astype(str))


def run_emulated(cpu, graph, crops, out):
    command = ["qemu-x86_64", "-cpu", cpu, sys.executable, "-m", "tools.int8_cross_cpu", "--worker",
               "--graph", str(graph), "--crops", str(crops), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{cpu}: {done.stderr[-2000:]}")


def compare(reference, other):
    a, b = np.load(reference), np.load(other)
    return {"max_score_diff": float(np.abs(a["scores"] - b["scores"]).max()),
            "top1_changed": int((a["labels"][:, 0] != b["labels"][:, 0]).sum()),
            "labels_equal": bool((a["labels"] == b["labels"]).all())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crops", type=int, default=12)
    parser.add_argument("--cpus", default="Haswell,EPYC-Rome", help="qemu -cpu models (qemu-x86_64 -cpu help)")
    parser.add_argument("--graph", type=pathlib.Path, default=MODEL_DIR / "model.int8.onnx")
    parser.add_argument("--results", type=pathlib.Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_here(args.graph, args.crops, args.out)
        return 0
    if shutil.which("qemu-x86_64") is None:
        raise SystemExit("qemu-x86_64 not found: apt-get install qemu-user (or make int8-cpus)")

    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "python -m tools.int8_cross_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
               "graph": str(args.graph.relative_to(REPO) if args.graph.is_relative_to(REPO) else args.graph),
               "largest_int8_weight": export_onnx.largest_int8_weight(args.graph),
               "crops": args.crops, "native": host.describe(), "emulated": {}}
    with tempfile.TemporaryDirectory() as scratch:
        native = pathlib.Path(scratch) / "native.npz"
        run_here(args.graph, args.crops, native)
        for cpu in args.cpus.split(","):
            emulated = pathlib.Path(scratch) / f"{cpu}.npz"
            run_emulated(cpu, args.graph, args.crops, emulated)
            results["emulated"][cpu] = {"cpu": EMULATED.get(cpu, cpu), **compare(native, emulated)}
            print(f"{cpu}: {results['emulated'][cpu]}", flush=True)
    same = all(r["labels_equal"] and r["max_score_diff"] <= SAME_SCORES_ATOL for r in results["emulated"].values())
    results["same_answers_on_every_cpu"] = same
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "native"}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
