"""Which image steps a model of backends/image runs (its `steps` parameter) and how its other
parameters divide between the decode and the classifier; read the same way by the backend and
by the tools that rebuild a model in-process."""

import dataclasses
import pathlib

from .config import ConfigError
from .image_decode import PreprocessSettings

STEPS = "steps"
STEP_CHOICES = ("decode", "classify", "decode,classify")
CLASSIFIER_MODEL = "classifier_model"  # decode,classify: the classifier's folder in the repository
DECODE_KEYS = frozenset(field.name for field in dataclasses.fields(PreprocessSettings))


def split_parameters(parameters):
    """config.pbtxt `parameters` -> (steps, decode's, the classifier runtime's, the classifier's folder or None)."""
    parameters = dict(parameters)
    raw = parameters.pop(STEPS, None)
    steps = ",".join(part.strip() for part in (raw or "").split(","))
    if steps not in STEP_CHOICES:
        found = "is missing" if raw is None else f"is {raw!r}"
        raise ConfigError(f"parameter {STEPS} {found}: it must be one of {', '.join(repr(c) for c in STEP_CHOICES)}")
    # A single step takes every key: an unknown one fails in its own parser.
    if steps == "decode":
        return steps, parameters, {}, None
    if steps == "classify":
        return steps, {}, parameters, None
    decode = {key: value for key, value in parameters.items() if key in DECODE_KEYS}
    classifier = {key: value for key, value in parameters.items() if key not in DECODE_KEYS}
    folder = classifier.pop(CLASSIFIER_MODEL, "classifier").strip()
    if not folder or "/" in folder or folder in (".", ".."):
        raise ConfigError(f"parameter {CLASSIFIER_MODEL} must name a model folder of the repository, got {folder!r}")
    return steps, decode, classifier, folder


def newest_version(model_dir, model_file):
    """The classifier version decode,classify serves: the highest numbered version folder of model_dir
    that holds model_file, what Triton serves of the classifier itself (the default policy, latest: 1)."""
    model_dir = pathlib.Path(model_dir)
    versions = [int(entry.name) for entry in model_dir.iterdir() if entry.name.isdigit() and entry.is_dir()
                and (entry / model_file).is_file()] if model_dir.is_dir() else []
    if not versions:
        raise ConfigError(f"no version folder of {model_dir} holds {model_file} (set parameter model_file, "
                          "or run scripts/export_onnx.py)")
    return max(versions)
