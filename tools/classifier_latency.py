"""In-process latency of the classifier runtimes and of the decode, side by side.

The runtimes (same weights, same crops, one thread, batch 1 and the batch sizes the
classifier's dynamic batcher forms): the TorchScript file and the ONNX fp32 and int8
graphs, each with the backend's code for its runtime
(classify_describe_server.classifier_runtime). Each round runs every
runtime once per batch size, in turn, so a neighbour's load on a shared machine
falls on all of them; the figure is the median over rounds of ms per image.

The decode (classify_describe_server.image_decode, the shipped settings): a small JPEG and a
phone-size one (12 MP), with reduced-scale decoding and without.

Adds the run to the JSON file (--results keeps every run: on a shared machine one
run is one sample) and writes the latest run's tables, with the earlier runs' batch-1
medians, into docs/classifier-runtime.md between its latency markers.

usage: python -m tools.classifier_latency [--rounds 15] [--batch-sizes 1,2,4,8]
"""

import argparse
import datetime
import io
import json
import os
import pathlib
import statistics
import time

import numpy as np

from scripts import export_onnx
from tools import docs_section, host

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "model_repository" / "classifier"


def runtimes(threads):
    """name -> classify(pixels uint8 [N,3,224,224]), each as its backend builds it."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    from classify_describe_server import classifier_runtime as runtime
    torchscript = runtime.TorchScriptClassifier(MODEL_DIR / "1/model.pt", runtime.load_labels(MODEL_DIR / "labels.txt"),
                                                [3, 224, 224], top_k=5)

    def onnx(file_name):
        return runtime.OnnxClassifier(MODEL_DIR / "1" / file_name, "PIXELS", [3, 224, 224], np.uint8,
                                  "SCORES", "LABELS", 5, intra_op_threads=threads)

    return {"torchscript": torchscript.classify, "onnx_fp32": onnx("model.onnx").classify,
            "onnx_int8": onnx("model.int8.onnx").classify}


def ms_per_image(step, images, min_s=0.3):
    """One timing: repeat `step` for at least min_s, return ms per image."""
    done, started = 0, time.perf_counter()
    while True:
        step()
        done += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_s:
            return elapsed * 1000 / (done * images)


def side_by_side(steps, rounds):
    """{name: {"median": ms, "min": ms, "max": ms}}; the steps take turns in every round."""
    for step, _ in steps.values():
        step()  # warm: allocate arenas, specialise
        step()
    timings = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, images) in steps.items():
            timings[name].append(ms_per_image(step, images))
    return {name: {"median": statistics.median(t), "min": min(t), "max": max(t)} for name, t in timings.items()}


def jpeg(size):
    from PIL import Image

    photo = export_onnx.load_photo("skimage:chelsea.png").resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    photo.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def measure_forward(threads, batch_sizes, rounds):
    """ms per image of each runtime's forward pass at each batch size, the runtimes taking turns."""
    classify = runtimes(threads)
    crops = export_onnx.evaluation_pixels(max(batch_sizes))
    steps = {f"{name} b{batch}": (lambda fn=fn, batch=batch: fn(crops[:batch]), batch)
             for batch in batch_sizes for name, fn in classify.items()}
    return list(classify), side_by_side(steps, rounds)


def measure_decode(rounds):
    """ms per image of the preprocess: a small JPEG, and a phone photo with and without the reduced-scale decode."""
    from classify_describe_server import image_decode
    drafted = image_decode.ImagePreprocessor(image_decode.PreprocessSettings())
    full = image_decode.ImagePreprocessor(image_decode.PreprocessSettings(jpeg_draft=False))
    small, phone = jpeg((640, 480)), jpeg((4032, 3024))
    return side_by_side({
        "640x480 JPEG": (lambda: drafted(small), 1),
        "4032x3024 JPEG, reduced-scale decode": (lambda: drafted(phone), 1),
        "4032x3024 JPEG, full decode": (lambda: full(phone), 1),
    }, max(3, rounds // 3))


def markdown(results, names, batch_sizes, earlier, results_name):
    """The latency section of docs/classifier-runtime.md."""
    forward, decode = results["forward_ms_per_image"], results["decode_ms_per_image"]
    lines = [
        f"Measured {results['date']} with `{results['command']}`: {results['threads']} thread, median of "
        f"{results['rounds']} rounds in which the runtimes take turns (min-max in brackets), torch "
        f"{results['torch']}, onnxruntime {results['onnxruntime']}, {results['cpus']} cores shared with other work "
        f"(CPU instruction sets: {host.isa_text(results.get('host'))}; load average "
        f"{results['load_average_at_end'][0]:.1f} at the end): compare within the table, not across runs. "
        f"JSON: [{results_name}](results/{results_name}).",
        "",
        "| ms per image | " + " | ".join(f"batch {b}" for b in batch_sizes) + " |",
        "| --- | " + " | ".join("---:" for _ in batch_sizes) + " |",
    ]
    for name in names:
        cells = []
        for batch in batch_sizes:
            t = forward[f"{name} b{batch}"]
            cells.append(f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| decode + crop + resize (preprocess) | ms per image |", "| --- | ---: |"]
    lines += [f"| {name} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) |" for name, t in decode.items()]
    if earlier:
        lines += ["", "Earlier runs, batch 1 medians (ms per image): " + "; ".join(
            f"{run['date']} " + ", ".join(f"{name} {run['forward_ms_per_image'][f'{name} b1']['median']:.1f}"
                                          for name in names)
            for run in earlier) + "."]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=pathlib.Path, default=REPO / "docs/results/classifier-latency.json")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/classifier-runtime.md")
    args = parser.parse_args(argv)

    import onnxruntime
    import torch

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    names, forward = measure_forward(args.threads, batch_sizes, args.rounds)
    decode = measure_decode(args.rounds)
    results = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m tools.classifier_latency"
                   + (f" --rounds {args.rounds}" if args.rounds != 15 else "")
                   + (f" --batch-sizes {args.batch_sizes}" if args.batch_sizes != "1,2,4,8" else "")
                   + (f" --threads {args.threads}" if args.threads != 1 else ""),
        "threads": args.threads, "rounds": args.rounds, "cpus": os.cpu_count(),
        "host": host.describe(), "load_average_at_end": os.getloadavg(),
        "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
        "forward_ms_per_image": forward, "decode_ms_per_image": decode,
        "pixels_bytes_per_image": {"uint8": 3 * 224 * 224, "float32": 4 * 3 * 224 * 224},
    }
    earlier = json.loads(args.results.read_text())["runs"] if args.results.is_file() else []
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"runs": [*earlier, results]}, indent=1) + "\n")

    text = markdown(results, names, batch_sizes, earlier, args.results.name)
    if not args.no_docs:
        docs_section.replace(REPO / "docs/classifier-runtime.md", "latency", text)
    print(text)


if __name__ == "__main__":
    main()
