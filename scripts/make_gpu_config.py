#!/usr/bin/env python3
"""Generate the classifier's GPU config from its CPU config.

Writes configs/gpu.pbtxt beside the given config.pbtxt (default
model_repository/classifier/config.pbtxt): the same tensors, batching and
warmup, served from the same ONNX file (1/model.onnx, scripts/export_onnx.py)
by Triton's own onnxruntime backend with the TensorRT execution accelerator
(FP16; one optimization profile covers batch 1 to max_batch_size, and a warmup
at max_batch_size is added, so the engine is built at load, not in a request),
one KIND_GPU instance without a rate_limiter, and no Python-backend
parameters. The graph itself normalises the uint8 pixels and names the top-k classes, so the
ensembles need no other change. A classifier switched to another runtime or backend
(runtime "torchscript", README: Bring your own model) keeps its config with one KIND_GPU
instance instead. `tritonserver --model-config-name=gpu`
(deploy/overlays/gpu) loads it instead of config.pbtxt. Run by `make build`
and the Dockerfile; never edit the output.

Usage: python scripts/make_gpu_config.py [CONFIG_PBTXT [OUTPUT]]
"""

import argparse
import pathlib
import sys

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO_ROOT / "model_repository/classifier/config.pbtxt"
HEADER = """\
# GENERATED at build time by scripts/make_gpu_config.py from {source}:
# do not edit; change that file (its comments give the reason for each setting).
# Picked by `tritonserver --model-config-name=gpu` (deploy/overlays/gpu).
# {what}, one KIND_GPU instance and no rate_limiter,
# since on GPU the classifier needs no CPU slot (docs/reliability.md#overload).
# Validated, not yet measured on a GPU; batching stays CPU-tuned: re-measure
# (docs/tuning-classifier.md#on-another-host).
"""
GPU_MODEL_FILE = "model.onnx"  # fp32: TensorRT picks its own precision (FP16 below)
TRT_ENGINE_CACHE = "/tmp/triton-trt-engines"  # an engine takes minutes to build; restarts reuse it


def profile_shapes(config, batch_size):
    """TensorRT's shape list for every input at `batch_size`: "PIXELS:8x3x224x224"."""
    return ",".join(f"{tensor.name}:" + "x".join(str(d) for d in [batch_size, *tensor.dims])
                    for tensor in config.input)


def add_max_batch_warmup(config):
    """Warm up at max_batch_size too (copying the first warmup's inputs), so that no
    request is the first to run the largest batch the dynamic batcher forms."""
    if not config.model_warmup or any(w.batch_size == config.max_batch_size for w in config.model_warmup):
        return
    warmup = config.model_warmup.add()
    warmup.CopyFrom(config.model_warmup[0])
    warmup.name = f"batch_{config.max_batch_size}"
    warmup.batch_size = config.max_batch_size


def gpu_config(cpu_text):
    """The GPU ModelConfig for a CPU config.pbtxt's text."""
    config = text_format.Parse(cpu_text, model_config_pb2.ModelConfig())
    del config.instance_group[:]
    config.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.KIND_GPU)
    runtime = config.parameters["runtime"].string_value if "runtime" in config.parameters else ""
    if config.backend != "image" or runtime != "onnxruntime":
        # The torchscript runtime (a bring-your-own model) or another backend runs on
        # the GPU itself: only the instance kind changes.
        return config
    config.ClearField("backend")
    config.platform = "onnxruntime_onnx"
    config.default_model_filename = GPU_MODEL_FILE
    config.parameters.clear()  # the Python backend's (steps, runtime, model_file, threads); onnxruntime has its own
    tensorrt = config.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
    # Without an explicit profile, TensorRT builds one for the shapes it has seen and
    # rebuilds (seconds to minutes, inside a request) when a larger batch comes: one
    # profile over 1..max_batch_size gives one engine, built by the first warmup.
    preferred = config.dynamic_batching.preferred_batch_size
    tensorrt.parameters.update({
        "precision_mode": "FP16",
        "max_workspace_size_bytes": str(1 << 30),
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": TRT_ENGINE_CACHE,
        "trt_profile_min_shapes": profile_shapes(config, 1),
        "trt_profile_opt_shapes": profile_shapes(config, max(preferred, default=config.max_batch_size)),
        "trt_profile_max_shapes": profile_shapes(config, config.max_batch_size),
    })
    add_max_batch_warmup(config)
    return config


def default_output(source):
    return pathlib.Path(source).parent / "configs" / "gpu.pbtxt"


def write_gpu_config(source, output=None):
    """Write the GPU config for config.pbtxt `source` to `output`; return its path."""
    source = pathlib.Path(source)
    output = pathlib.Path(output) if output else default_output(source)
    config = gpu_config(source.read_text())
    what = ("The same ONNX file in Triton's onnxruntime backend with TensorRT (FP16)" if config.platform
            else f"The same model in backend {config.backend}")
    header = HEADER.format(source=f"{source.parent.name}/{source.name}", what=what)  # the same in the repo and the image
    text = header + text_format.MessageToString(config)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".tmp")
    partial.write_text(text)
    partial.replace(output)  # never a half-written config where Triton looks
    return output


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default=DEFAULT_SOURCE, help="the CPU config.pbtxt")
    parser.add_argument("output", nargs="?", help="default: configs/gpu.pbtxt beside the source")
    args = parser.parse_args(argv)
    print(f"wrote {write_gpu_config(args.source, args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
