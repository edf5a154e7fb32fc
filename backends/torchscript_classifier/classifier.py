"""Run any TorchScript image classifier and keep the top-k classes.

Plain Python (torch + numpy), no Triton import: model.py is the adapter.

Pixels arrive as preprocess hands them over, RGB 0..255 (uint8, or the same values
as float32), and are normalised here with the mean and std the model was trained
with, (x - mean) / std per channel, in float32 before the forward pass.
"""

import dataclasses
import math
import pathlib

import numpy as np
import torch


class ConfigError(ValueError):
    """A config.pbtxt parameter or a model file is wrong; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ClassifierSettings:
    model_file: str = "model.pt"  # inside the version folder (model_repository/<model>/<version>/)
    labels_file: str = "labels.txt"  # relative to the model folder, one class name per line
    torch_num_threads: int = 1
    top_k: int = 5  # used only when the outputs' dims are -1; otherwise the dims decide
    # EfficientNet-Lite's TF transform (backends/image_preprocess/image_decode.py says why);
    # torchvision-style models want 123.675,116.28,103.53 and 58.395,57.12,57.375.
    mean: tuple = (127.0, 127.0, 127.0)  # per RGB channel, 0..255 pixel units
    std: tuple = (128.0, 128.0, 128.0)


def parse_settings(parameters: dict[str, str]) -> ClassifierSettings:
    """Build settings from config.pbtxt `parameters` ({key: string value}); unknown keys fail."""
    known = {field.name for field in dataclasses.fields(ClassifierSettings)}
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; known: {sorted(known)}")
    values = {}
    for name in ("model_file", "labels_file"):
        if name in parameters:
            if not parameters[name].strip():
                raise ConfigError(f"parameter {name} must not be empty")
            values[name] = parameters[name].strip()
    for name in ("torch_num_threads", "top_k"):
        if name in parameters:
            try:
                values[name] = int(parameters[name])
            except ValueError:
                raise ConfigError(f"parameter {name} must be a positive integer, got {parameters[name]!r}") from None
            if values[name] <= 0:
                raise ConfigError(f"parameter {name} must be a positive integer, got {parameters[name]!r}")
    for name in ("mean", "std"):
        if name in parameters:
            values[name] = _parse_triple(name, parameters[name])
    if any(s <= 0 for s in values.get("std", ())):
        raise ConfigError(f"std values must be > 0, got {values['std']}")
    return ClassifierSettings(**values)


def _parse_triple(name, raw):
    try:
        values = tuple(float(part) for part in str(raw).split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"parameter {name} must be three comma-separated numbers (R,G,B), got {raw!r}")
    return values


def load_labels(path):
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"labels file {path} not found (set parameter labels_file, or run scripts/export_classifier.py)")
    labels = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    if not labels or not all(labels):
        raise ConfigError(f"labels file {path} must hold one non-empty class name per line")
    return labels


class TorchScriptClassifier:
    """Loads the model once, checks it against the labels, then classifies batches."""

    def __init__(self, model_path, labels, input_shape, top_k, device="cpu", mean=(127.0,) * 3, std=(128.0,) * 3):
        model_path = pathlib.Path(model_path)
        if not model_path.is_file():
            raise ConfigError(f"model file {model_path} not found (set parameter model_file, or run scripts/export_classifier.py)")
        self.device = torch.device(device)
        self.model = torch.jit.load(str(model_path), map_location=self.device).eval()
        channels = input_shape[0]
        if len(mean) != channels or len(std) != channels:
            raise ConfigError(f"mean and std need one value per input channel ({channels})")
        # Shaped [1, C, 1, 1] so they broadcast over the NCHW batch.
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).reshape(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).reshape(1, -1, 1, 1)
        self.labels = np.array([label.encode("utf-8") for label in labels], dtype=np.object_)
        # One dry forward: proves the file runs on this input shape and tells how many
        # classes it has, so a labels/model mismatch fails at load, not on a request.
        with torch.inference_mode():
            logits = self.model(torch.zeros((1, *input_shape), device=self.device))
        if logits.ndim != 2 or logits.shape[0] != 1:
            raise ConfigError(f"{model_path.name} must return logits [batch, classes], got {list(logits.shape)}")
        num_classes = logits.shape[1]
        if num_classes != len(labels):
            raise ConfigError(
                f"{model_path.name} has {num_classes} outputs but the labels file has {len(labels)} lines; "
                "they must match one label per class index"
            )
        if not 0 < top_k <= num_classes:
            raise ConfigError(f"top_k {top_k} must be between 1 and the {num_classes} classes")
        self.top_k = top_k

    def classify(self, pixels):
        """pixels uint8 or float32 [N, C, H, W], 0..255 -> (labels object [N, k] of bytes, scores float32 [N, k])."""
        with torch.inference_mode():
            normalised = (torch.from_numpy(pixels).to(self.device).float() - self.mean) / self.std
            logits = self.model(normalised)
            probs = torch.softmax(logits.float(), dim=1)
            scores, indices = probs.topk(self.top_k, dim=1)
        return self.labels[indices.cpu().numpy()], scores.cpu().numpy().astype(np.float32)
