"""`classify` before and after the runtime change, through one real server, side by side.

"before": the data path the repository had until the ONNX runtime: preprocess sends
FP32 pixels (602 KB an image) and decodes every JPEG in full, and the TorchScript
classifier runs the network (it now normalises where preprocess did; the arithmetic
is the same). "after": the committed `classify` (uint8 pixels, reduced-scale JPEG
decoding, ONNX Runtime fp32). Both load side by side in one server on a copy of the
model repository, with the committed batching and instance settings; requests go
one at a time (concurrency 1), alternating between the two in rounds, over HTTP.

usage: python -m tools.classify_before_after [--rounds 6] [--requests 40]
prints per photo the p50 latency of each and the ratio, and writes --results JSON.
"""

import argparse
import datetime
import io
import json
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np

from tools import host, model_config
from tools.local_stack import TritonServer

REPO = pathlib.Path(__file__).resolve().parents[1]


def before_models(repository):
    """preprocess_before, classifier_before and classify_before beside the committed models."""
    preprocess = model_config.read(repository / "preprocess" / "config.pbtxt")
    preprocess.name = "preprocess_before"
    preprocess.output[0].data_type = model_config.model_config_pb2.TYPE_FP32
    preprocess.parameters["jpeg_draft"].string_value = "false"
    classifier = model_config.read(repository / "classifier" / "config.pbtxt")
    classifier.name = "classifier_before"
    classifier.input[0].data_type = model_config.model_config_pb2.TYPE_FP32
    classifier.parameters.clear()
    for key, value in {"runtime": "torchscript", "model_file": "model.pt", "labels_file": "labels.txt",
                       "torch_num_threads": "1"}.items():
        classifier.parameters[key].string_value = value
    for warmup in classifier.model_warmup:
        for tensor in warmup.inputs.values():
            tensor.data_type = model_config.model_config_pb2.TYPE_FP32
    ensemble = model_config.read(repository / "classify" / "config.pbtxt")
    ensemble.name = "classify_before"
    ensemble.ensemble_scheduling.step[0].model_name = "preprocess_before"
    ensemble.ensemble_scheduling.step[1].model_name = "classifier_before"
    for config, folder in ((preprocess, "preprocess"), (classifier, "classifier"), (ensemble, "classify")):
        target = repository / config.name
        (target / "1").mkdir(parents=True)
        source = repository / folder
        for item in source.iterdir():  # model files, labels, warmup data: linked, not copied
            if item.name not in ("config.pbtxt", "1", "configs"):
                os.symlink(item, target / item.name)
        for item in (source / "1").iterdir():
            os.symlink(item, target / "1" / item.name)
        (target / "config.pbtxt").write_text(model_config.render(config))
    return ["preprocess_before", "classifier_before", "classify_before"]


def photos():
    from PIL import Image
    from skimage import data_dir

    chelsea = Image.open(pathlib.Path(data_dir) / "chelsea.png").convert("RGB")

    def jpeg(size):
        buffer = io.BytesIO()
        chelsea.resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
        return buffer.getvalue()

    return {"coffee.png 600x400": (pathlib.Path(data_dir) / "coffee.png").read_bytes(),
            "JPEG 640x480": jpeg((640, 480)), "JPEG 4032x3024 (12 MP)": jpeg((4032, 3024))}


def latencies(client, model, image, count):
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image]], dtype=object))
    taken = []
    for _ in range(count):
        started = time.perf_counter()
        client.infer(model, [tensor])
        taken.append((time.perf_counter() - started) * 1000)
    return taken


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=40, help="per model, photo and round")
    parser.add_argument("--results", type=pathlib.Path, default=REPO / "docs/results/classify-before-after.json")
    args = parser.parse_args(argv)

    import tritonclient.http as httpclient

    server = TritonServer(pathlib.Path(tempfile.mkdtemp(prefix="before_after_")), {})
    before_models(server.repository)
    server.start(timeout_s=300)
    try:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
        for name in ("preprocess_before", "classifier_before", "classify_before"):
            client.load_model(name, headers=server.admin_headers)
        images = photos()
        taken = {(photo, model): [] for photo in images for model in ("classify_before", "classify")}
        for image in images.values():  # warm both paths on every size
            for model in ("classify_before", "classify"):
                latencies(client, model, image, 3)
        for _ in range(args.rounds):
            for photo, image in images.items():
                for model in ("classify_before", "classify"):
                    taken[photo, model] += latencies(client, model, image, args.requests)
        load = os.getloadavg()[0]
    finally:
        server.stop()

    rows = {photo: {"before_p50_ms": statistics.median(taken[photo, "classify_before"]),
                    "after_p50_ms": statistics.median(taken[photo, "classify"])} for photo in images}
    for row in rows.values():
        row["after_over_before"] = row["after_p50_ms"] / row["before_p50_ms"]
    results = {"date": datetime.date.today().isoformat(), "command": "python -m tools.classify_before_after",
               "rounds": args.rounds, "requests_per_round": args.requests, "load_average_at_end": load,
               "host": host.describe(), "p50": rows}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(f"classify p50 at concurrency 1, {args.rounds} rounds x {args.requests} requests each, load average {load:.1f}")
    for photo, row in rows.items():
        print(f"  {photo}: before {row['before_p50_ms']:.1f} ms, after {row['after_p50_ms']:.1f} ms, "
              f"after/before {row['after_over_before']:.2f}")


if __name__ == "__main__":
    main()
