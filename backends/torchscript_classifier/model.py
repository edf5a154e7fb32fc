"""Triton adapter for classifier.py: PIXELS (RGB 0..255) -> LABELS (top-k class names), SCORES (probabilities).

Owns the tensor names and every pb_utils call. All requests of a dynamic batch go through
one forward pass; a request with unusable pixels fails alone.
"""

import json
import os
import traceback

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from classifier import ConfigError, TorchScriptClassifier, load_labels, parse_settings

INPUT_NAME = "PIXELS"
LABELS_NAME = "LABELS"
SCORES_NAME = "SCORES"


def config_parameters(model_config):
    """config.pbtxt `parameters` as {key: string value}, what parse_settings takes."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = _Log(self.model_name)
        model_config = json.loads(args["model_config"])
        try:
            self.classifier = self._load(args, model_config)
        except ConfigError as error:
            raise pb_utils.TritonModelException(f"{self.model_name}: {error}") from None
        self.log.info(
            f"ready: {len(self.classifier.labels)} classes, "
            f"top {self.classifier.top_k}, device {self.classifier.device}, {torch.get_num_threads()} threads"
        )

    def _load(self, args, model_config):
        settings = parse_settings(config_parameters(model_config))
        # A model that sets few threads should not have torch's pool take every core:
        # on a small CPU the preprocess model and the server need some too.
        torch.set_num_threads(settings.torch_num_threads)
        try:
            torch.set_num_interop_threads(1)  # only one op runs at a time in a traced forward
        except RuntimeError:
            pass  # already set in this process; harmless

        pixels_config = pb_utils.get_input_config_by_name(model_config, INPUT_NAME)
        labels_config = pb_utils.get_output_config_by_name(model_config, LABELS_NAME)
        scores_config = pb_utils.get_output_config_by_name(model_config, SCORES_NAME)
        if pixels_config is None or labels_config is None or scores_config is None:
            raise ConfigError(f"config.pbtxt needs input {INPUT_NAME} and outputs {LABELS_NAME}, {SCORES_NAME}")
        input_shape = list(pixels_config["dims"])
        if any(d <= 0 for d in input_shape):
            raise ConfigError(f"input {INPUT_NAME} needs fixed dims for the load-time check, got {input_shape}")
        if labels_config["dims"] != scores_config["dims"] or len(labels_config["dims"]) != 1:
            raise ConfigError(f"outputs {LABELS_NAME} and {SCORES_NAME} must both have dims [k]")
        k = labels_config["dims"][0]
        top_k = settings.top_k if k == -1 else k
        self.scores_dtype = pb_utils.triton_string_to_numpy(scores_config["data_type"])

        # In the Python backend "model_repository" is this model's own folder
        # (model_repository/<name>), and pb_utils.get_model_dir() does not exist in 2.51.
        model_dir = args["model_repository"]
        version_dir = os.path.join(model_dir, args["model_version"])
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        labels = load_labels(os.path.join(model_dir, settings.labels_file))
        return TorchScriptClassifier(
            os.path.join(version_dir, settings.model_file), labels, input_shape, top_k, device,
            mean=settings.mean, std=settings.std,
        )

    def execute(self, requests):
        responses = [None] * len(requests)
        batches = []  # (request index, pixels) of the requests that can run
        for index, request in enumerate(requests):
            pixels = pb_utils.get_input_tensor_by_name(request, INPUT_NAME).as_numpy()
            if pixels.dtype.kind == "f" and not np.isfinite(pixels).all():
                responses[index] = _error_response(f"{INPUT_NAME} holds NaN or infinite values", pb_utils.TritonError.INVALID_ARG)
            else:
                batches.append((index, pixels))

        if batches:
            try:
                labels, scores = self.classifier.classify(np.concatenate([pixels for _, pixels in batches]))
            except Exception:  # a bug or a device failure: the traceback goes to the log, not to the clients
                self.log.error(f"forward failed:\n{traceback.format_exc()}")
                internal = "internal error in the classifier forward pass"
                for index, _ in batches:
                    responses[index] = _error_response(internal, pb_utils.TritonError.INTERNAL)
                return responses
            start = 0
            for index, pixels in batches:
                end = start + len(pixels)
                responses[index] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(LABELS_NAME, labels[start:end]),
                    pb_utils.Tensor(SCORES_NAME, scores[start:end].astype(self.scores_dtype, copy=False)),
                ])
                start = end
        return responses

    def finalize(self):
        self.log.info("unloaded")


def _error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class _Log:
    """pb_utils.Logger with "[<model name>] " in front: the server log interleaves every model."""

    def __init__(self, model_name):
        self.prefix = f"[{model_name}] "

    def info(self, message):
        pb_utils.Logger.log_info(self.prefix + message)

    def warn(self, message):
        pb_utils.Logger.log_warn(self.prefix + message)

    def error(self, message):
        pb_utils.Logger.log_error(self.prefix + message)
