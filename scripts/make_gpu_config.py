#!/usr/bin/env python3
"""Generate the classifier's GPU config from its CPU config.

Writes configs/gpu.pbtxt beside the given config.pbtxt (default
model_repository/classifier/config.pbtxt): the same ModelConfig with
instance_group replaced by one KIND_GPU instance without a rate_limiter.
`tritonserver --model-config-name=gpu` (deploy/overlays/gpu) loads it instead
of config.pbtxt. Run by `make build` and the Dockerfile; never edit the output.

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
# Picked by `tritonserver --model-config-name=gpu` (deploy/overlays/gpu). Only
# instance_group differs: one KIND_GPU instance per visible GPU and no rate_limiter,
# since on GPU the classifier needs no CPU slot (docs/reliability.md#overload).
# Batching stays CPU-tuned: re-measure (docs/tuning-classifier.md#on-another-host).
"""


def gpu_config(cpu_text):
    """The GPU ModelConfig for a CPU config.pbtxt's text."""
    config = text_format.Parse(cpu_text, model_config_pb2.ModelConfig())
    del config.instance_group[:]
    config.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.KIND_GPU)
    return config


def default_output(source):
    return pathlib.Path(source).parent / "configs" / "gpu.pbtxt"


def write_gpu_config(source, output=None):
    """Write the GPU config for config.pbtxt `source` to `output`; return its path."""
    source = pathlib.Path(source)
    output = pathlib.Path(output) if output else default_output(source)
    header = HEADER.format(source=f"{source.parent.name}/{source.name}")  # the same in the repo and the image
    text = header + text_format.MessageToString(gpu_config(source.read_text()))
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
