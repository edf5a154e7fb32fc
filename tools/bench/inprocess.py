"""The classification path without Triton: decode + preprocess + TorchScript
forward in one process, with the same code (backends/image_preprocess,
backends/torchscript_classifier), the same settings as the shipped configs and
the same torch threads, at the batch sizes the server's dynamic batcher forms.
Also the forward pass alone. It runs in its own process so that its torch
threads are set exactly as in the classifier model's stub.

usage: python -m tools.bench.inprocess JPEG... --batch-sizes 1,2,4 --duration-s 5 [--threads 2]
prints one JSON object: {"e2e": {batch: img/s}, "forward": {batch: img/s}, ...}
"""

import argparse
import json
import pathlib
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


def _rate(step, images_per_step, duration_s, min_steps=3):
    step()  # warm: the profiling executor specialises on the first runs of a shape
    step()
    done, started = 0, time.perf_counter()
    while True:
        step()
        done += 1
        elapsed = time.perf_counter() - started
        if elapsed >= duration_s and done >= min_steps:
            return done * images_per_step / elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jpegs", nargs="+", type=pathlib.Path)
    parser.add_argument("--model-dir", type=pathlib.Path, default=REPO / "model_repository/classifier")
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from tools.backend_code import load

    TorchScriptClassifier = load("torchscript_classifier", "classifier").TorchScriptClassifier
    load_labels = load("torchscript_classifier", "classifier").load_labels
    image_decode = load("image_preprocess", "image_decode")
    ImagePreprocessor, PreprocessSettings = image_decode.ImagePreprocessor, image_decode.PreprocessSettings

    # As backends/torchscript_classifier/model.py does with torch_num_threads.
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    preprocess = ImagePreprocessor(PreprocessSettings())  # the defaults are the shipped config's values
    classifier = TorchScriptClassifier(args.model_dir / "1/model.pt", load_labels(args.model_dir / "labels.txt"),
                                       [3, 224, 224], top_k=5)
    images = [path.read_bytes() for path in args.jpegs]

    result = {"threads": args.threads, "e2e": {}, "forward": {}, "decode": None}
    cursor = [0]

    def next_images(count):
        picked = [images[(cursor[0] + i) % len(images)] for i in range(count)]
        cursor[0] += count
        return picked

    result["decode"] = _rate(lambda: preprocess(next_images(1)[0]), 1, args.duration_s / 2)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        def e2e(batch=batch):
            pixels = np.stack([preprocess(image) for image in next_images(batch)])
            classifier.classify(pixels)
        pixels = np.stack([preprocess(image) for image in next_images(batch)])
        result["e2e"][batch] = _rate(e2e, batch, args.duration_s)
        result["forward"][batch] = _rate(lambda pixels=pixels: classifier.classify(pixels), batch, args.duration_s)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
