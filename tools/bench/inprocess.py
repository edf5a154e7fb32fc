"""The classification path without Triton: the in-process limit a server is measured against.

Decode + preprocess + forward per image with the server's own code
(classify_describe_server's image_decode and classifier_runtime) and the
settings of the model repository's configs, in each layout that spends the
machine's cores in one place:

  1xN   one process, N intra-op threads (N = cores), batches as the server's batcher forms them
  Nx1   N processes, one thread each, running side by side (what the server's instances do)

for each runtime whose files exist: TorchScript fp32 (the PyTorch limit, always)
and the runtimes other backends add (see RUNTIMES). The best layout of a runtime
is its limit. Also, per layout, the forward pass alone and the decode alone.
Every layout runs in fresh processes, so each sets its threads exactly as a stub does.

usage: python -m tools.bench.inprocess JPEG... [--runtime torchscript] [--layouts 1x2,2x1]
                                       [--batch-sizes 1,2,4] [--duration-s 2] [--confirm-s 9]
                                       [--model-repository DIR]
prints one JSON object: {"runtime": ..., "layouts": [{"name": "2x1", "e2e": {batch: img/s}, ...}], "best": {...}}
"""

import argparse
import functools
import json
import multiprocessing
import os
import pathlib
import queue
import time

from tools import model_config

REPO = pathlib.Path(__file__).resolve().parents[2]
BARRIER_TIMEOUT_S = 300  # a worker that died leaves the others waiting at most this long


# -- runtimes: name -> how to build a classify(pixels) callable in a worker ---------------------

def _torchscript(repository, threads):

    from classify_describe_server import classifier_runtime as runtime
    model_dir = repository / "classifier"
    # threads: as the torchscript runtime sets torch_num_threads (and one inter-op thread).
    model = runtime.TorchScriptClassifier(torchscript_file(repository), runtime.load_labels(
        model_dir / "labels.txt"), [3, 224, 224], top_k=5, threads=threads)
    return model.classify


def torchscript_file(repository):
    return pathlib.Path(repository) / "classifier/1/model.pt"


def _onnx(model_file):
    """The onnxruntime runtime of classify_describe_server.classifier_runtime on `model_file` of the classifier's version
    folder, with the tensors of the repository's classifier config, or the ones the ONNX config declares
    by default."""
    def build(repository, threads):
        import numpy as np
        from classify_describe_server import classifier_runtime as runtime
        from tritonclient.grpc import model_config_pb2
        config = model_config.read(pathlib.Path(repository) / "classifier/config.pbtxt")
        parameters = config.parameters
        if config.backend == "image" and "runtime" in parameters and \
                parameters["runtime"].string_value == "onnxruntime":
            pixels = config.input[0]
            name, dims, top_k = pixels.name, list(pixels.dims), {o.name: o for o in config.output}["SCORES"].dims[0]
            dtype = np.dtype({model_config_pb2.TYPE_UINT8: np.uint8, model_config_pb2.TYPE_FP32: np.float32}[
                pixels.data_type])
        else:  # the classifier serves another runtime: the graph's own input
            name, dims, dtype, top_k = "PIXELS", [3, 224, 224], np.dtype(np.uint8), 5
        # More than one thread: the session of the server's wide pass, whose workers spin between
        # ops (onnxruntime's default). One that sleeps between ops, as the server's narrow sessions,
        # was a weaker baseline: 1.15x the time per image (docs/benchmarks-method.md#where-the-cpu-goes).
        classifier = runtime.OnnxClassifier(
            pathlib.Path(repository) / "classifier/1" / model_file, name, dims, dtype, "SCORES", "LABELS", top_k,
            intra_op_threads=1, idle_intra_op_threads=threads)
        # classify casts a batch to the config's input type, as in the server.
        return functools.partial(classifier.classify, idle=threads > 1)
    return build


def _onnx_file(model_file):
    def path(repository):
        return pathlib.Path(repository) / "classifier/1" / model_file
    return path


# name: (what it is, the file it needs, the worker-side loader: (repository, threads) -> classify(pixels))
RUNTIMES = {
    "torchscript": ("PyTorch TorchScript fp32", torchscript_file, _torchscript),
    "onnx_fp32": ("ONNX Runtime fp32", _onnx_file("model.onnx"), _onnx("model.onnx")),
    "onnx_int8": ("ONNX Runtime int8", _onnx_file("model.int8.onnx"), _onnx("model.int8.onnx")),
}


def available_runtimes(repository):
    """The runtimes whose model files this repository has, in RUNTIMES order."""
    return [name for name, (_, needs, _) in RUNTIMES.items() if needs(repository).is_file()]


def served_runtime(repository):
    """The runtime the repository's `classifier` model serves with."""
    config = model_config.read(pathlib.Path(repository) / "classifier/config.pbtxt")
    if config.backend == "image":
        from classify_describe_server import classifier_runtime, image_steps

        parameters = {key: value.string_value for key, value in config.parameters.items()}
        settings = classifier_runtime.parse_settings(image_steps.split_parameters(parameters)[2])
        if settings.runtime == "torchscript":
            return "torchscript"
        for name, (_, needs, _) in RUNTIMES.items():
            if name.startswith("onnx") and needs(repository).name == settings.model_file:
                return name
    raise ValueError(f"no in-process runtime for the classifier's backend {config.backend!r}")


def preprocessor(repository):
    """classify_describe_server.image_decode with the settings of the repository's preprocess config."""
    from classify_describe_server import image_decode, image_steps

    config = model_config.read(pathlib.Path(repository) / "preprocess/config.pbtxt")
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    return image_decode.ImagePreprocessor(image_decode.parse_settings(image_steps.split_parameters(parameters)[1]))


# -- one worker process ---------------------------------------------------------------------------

def _rate(step, images_per_step, duration_s, min_steps=3):
    done, started = 0, time.perf_counter()
    while True:
        step()
        done += 1
        elapsed = time.perf_counter() - started
        if elapsed >= duration_s and done >= min_steps:
            return done * images_per_step / elapsed


def _worker(job, barrier, results):
    """Build the runtime, then time each step in lockstep with the layout's other workers."""
    import numpy as np

    try:
        repository = pathlib.Path(job["repository"])
        preprocess = preprocessor(repository)
        classify = RUNTIMES[job["runtime"]][2](repository, job["threads"])
        images = [pathlib.Path(path).read_bytes() for path in job["jpegs"]]
        cursor = [job["index"]]  # workers start on different photos, as concurrent requests do

        def next_images(count):
            picked = [images[(cursor[0] + i) % len(images)] for i in range(count)]
            cursor[0] += count
            return picked

        def timed(step, batch, duration_s):
            step()  # warm: the profiling executor specialises on the first runs of a shape
            step()
            barrier.wait(BARRIER_TIMEOUT_S)
            return _rate(step, batch, duration_s)

        e2e_only = job.get("e2e_only", False)  # the limit measured again: its decode and forward alone unused
        out = {"decode": None if e2e_only else timed(lambda: preprocess(next_images(1)[0]), 1, job["duration_s"] / 2),
               "e2e": {}, "forward": {}}
        for batch in job["batch_sizes"]:
            def e2e(batch=batch):
                classify(np.stack([preprocess(image) for image in next_images(batch)]))
            pixels = np.stack([preprocess(image) for image in next_images(batch)])
            out["e2e"][batch] = timed(e2e, batch, job["duration_s"])
            if not e2e_only:
                out["forward"][batch] = timed(lambda pixels=pixels: classify(pixels), batch, job["duration_s"])
        results.put(out)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the measurement
        barrier.abort()
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def measure_layout(runtime, repository, jpegs, processes, threads, batch_sizes, duration_s, e2e_only=False):
    """`processes` workers of `threads` threads each, side by side; rates summed over the workers.
    `e2e_only`: decode + forward only, without the decode alone and the forward alone."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state inherited
    barrier, results = context.Barrier(processes), context.Queue()
    job = dict(runtime=runtime, repository=str(repository), jpegs=[str(p) for p in jpegs], threads=threads,
               batch_sizes=list(batch_sizes), duration_s=duration_s, e2e_only=e2e_only)
    workers = [context.Process(target=_worker, args=(dict(job, index=index), barrier, results), daemon=True)
               for index in range(processes)]
    for worker in workers:
        worker.start()
    try:
        outs, deadline = [], time.monotonic() + BARRIER_TIMEOUT_S + 60 * duration_s
        while len(outs) < processes:
            try:
                outs.append(results.get(timeout=1))
            except queue.Empty:
                # A worker killed outright (out of memory, a crash in native code) reports nothing.
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"a worker exited with {dead[0]}" if dead else "timed out"
                    raise RuntimeError(f"in-process {runtime} {processes}x{threads}: {why}") from None
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
    errors = [out["error"] for out in outs if "error" in out]
    if errors:
        # The cause, not the barrier it broke for the others (whichever reported first).
        cause = next((e for e in errors if not e.startswith("BrokenBarrierError")), errors[0])
        raise RuntimeError(f"in-process {runtime} {processes}x{threads}: {cause}")
    total = lambda key, batch: sum(out[key][batch] for out in outs)  # noqa: E731
    row = {"name": f"{processes}x{threads}", "processes": processes, "threads": threads,
           "e2e": {b: total("e2e", b) for b in batch_sizes}}
    if e2e_only:
        return row
    return {**row,
            "forward": {b: total("forward", b) for b in batch_sizes},
            "decode": sum(out["decode"] for out in outs),
            # One worker's own rate: what one server instance with these threads could do alone.
            "per_worker_forward": {b: total("forward", b) / processes for b in batch_sizes},
            "per_worker_decode": sum(out["decode"] for out in outs) / processes}


def measure(runtime, repository, jpegs, layouts, batch_sizes, duration_s, confirm_s=0.0):
    """Every layout of one runtime, and the best (layout, batch size) by decode + preprocess + forward.

    With `confirm_s`, the best is measured again, alone, for that long, and that run is its
    throughput: the largest of several short, noisy runs overstates what its layout does (the
    winner's curse), while the server it is held against is measured once. The sweep's own
    figure stays in "sweep_throughput"."""
    rows = [measure_layout(runtime, repository, jpegs, processes, threads, batch_sizes, duration_s)
            for processes, threads in layouts]
    best_row, best_batch = max(((row, b) for row in rows for b in row["e2e"]), key=lambda rb: rb[0]["e2e"][rb[1]])
    best = {"layout": best_row["name"], "batch": best_batch, "throughput": best_row["e2e"][best_batch]}
    if confirm_s:
        again = measure_layout(runtime, repository, jpegs, best_row["processes"], best_row["threads"], [best_batch],
                               confirm_s, e2e_only=True)
        best.update(throughput=again["e2e"][best_batch], sweep_throughput=best["throughput"], confirm_s=confirm_s)
    return {"runtime": runtime, "description": RUNTIMES[runtime][0], "duration_s": duration_s, "layouts": rows,
            "best": best}


def default_layouts(cores=None):
    cores = cores or os.cpu_count() or 1
    return [(1, cores), (cores, 1)] if cores > 1 else [(1, 1)]


def parse_layouts(text):
    """'1x2,2x1' -> [(1, 2), (2, 1)] (processes x threads)."""
    return [tuple(int(part) for part in item.split("x")) for item in text.split(",") if item]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jpegs", nargs="+", type=pathlib.Path)
    parser.add_argument("--runtime", choices=sorted(RUNTIMES), default="torchscript")
    parser.add_argument("--model-repository", type=pathlib.Path, default=REPO / "model_repository")
    parser.add_argument("--layouts", type=parse_layouts, default=None,
                        help="processes x threads, comma-separated (default: 1xN,Nx1 for N cores)")
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--confirm-s", type=float, default=0.0,
                        help="measure the best layout and batch again for this long; that run is its throughput")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(json.dumps(measure(args.runtime, args.model_repository, args.jpegs, args.layouts or default_layouts(),
                             batch_sizes, args.duration_s, args.confirm_s)))


if __name__ == "__main__":
    main()
