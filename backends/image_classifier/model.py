"""Triton adapter for classifier_runtime.py: PIXELS -> LABELS (top-k class names), SCORES (probabilities).

Owns the tensor names and every pb_utils call; the `runtime` parameter (onnxruntime or
torchscript) is read once at load. All requests of a dynamic batch go through one run;
a request with unusable pixels fails alone.
"""

import json
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from busy_board import join_board
from classifier_runtime import ConfigError, Tensors, classify_rows, load, parse_settings
from model_log import Log

INPUT_NAME = "PIXELS"
LABELS_NAME = "LABELS"
SCORES_NAME = "SCORES"


def config_parameters(model_config):
    """config.pbtxt `parameters` as {key: string value}, what parse_settings takes."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = Log(self.model_name)
        model_config = json.loads(args["model_config"])
        try:
            settings = parse_settings(config_parameters(model_config))
            tensors = self._tensors(model_config)
            device = f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else "cpu"
            # In the Python backend "model_repository" is this model's own folder
            # (model_repository/<name>), and pb_utils.get_model_dir() does not exist in 2.51.
            self.classifier = load(settings, args["model_repository"], args["model_version"], tensors, device)
        except ConfigError as error:
            raise pb_utils.TritonModelException(f"{self.model_name}: {error}") from None
        self.board = join_board(self.log)  # the instances holding "cpu" slots: is a core idle? (busy_board.py)
        self.log.info(f"ready: {settings.model_file}, runtime {settings.runtime}, top {self.classifier.top_k}, "
                      f"{self.classifier.details}")

    def _tensors(self, model_config):
        pixels_config = pb_utils.get_input_config_by_name(model_config, INPUT_NAME)
        labels_config = pb_utils.get_output_config_by_name(model_config, LABELS_NAME)
        scores_config = pb_utils.get_output_config_by_name(model_config, SCORES_NAME)
        if pixels_config is None or labels_config is None or scores_config is None:
            raise ConfigError(f"config.pbtxt needs input {INPUT_NAME} and outputs {LABELS_NAME}, {SCORES_NAME}")
        input_shape = tuple(pixels_config["dims"])
        if any(d <= 0 for d in input_shape):
            raise ConfigError(f"input {INPUT_NAME} needs fixed dims for the load-time check, got {list(input_shape)}")
        if labels_config["dims"] != scores_config["dims"] or len(labels_config["dims"]) != 1:
            raise ConfigError(f"outputs {LABELS_NAME} and {SCORES_NAME} must both have dims [k]")
        self.scores_dtype = pb_utils.triton_string_to_numpy(scores_config["data_type"])
        input_dtype = np.dtype(pb_utils.triton_string_to_numpy(pixels_config["data_type"]))
        return Tensors(INPUT_NAME, input_shape, input_dtype, SCORES_NAME, LABELS_NAME, labels_config["dims"][0])

    def execute(self, requests):
        with self.board.executing():
            return self._execute(requests)

    def _execute(self, requests):
        responses = [None] * len(requests)
        batches = []  # (request index, pixels) of the requests that can run
        for index, request in enumerate(requests):
            pixels = pb_utils.get_input_tensor_by_name(request, INPUT_NAME).as_numpy()
            if pixels.dtype.kind == "f" and not np.isfinite(pixels).all():
                responses[index] = _error_response(f"{INPUT_NAME} holds NaN or infinite values", pb_utils.TritonError.INVALID_ARG)
            else:
                batches.append((index, pixels))

        if not batches:
            return responses
        try:
            results = classify_rows(self.classifier, [pixels for _, pixels in batches], idle=self.board.others_busy() == 0)
        except Exception:  # a bug or a runtime failure: the traceback goes to the log, not to the clients
            self.log.error(f"inference failed:\n{traceback.format_exc()}")
            internal = "internal error in the classifier"
            for index, _ in batches:
                responses[index] = _error_response(internal, pb_utils.TritonError.INTERNAL)
            return responses
        for (index, _), (labels, scores) in zip(batches, results):
            responses[index] = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(LABELS_NAME, labels),
                pb_utils.Tensor(SCORES_NAME, scores.astype(self.scores_dtype, copy=False)),
            ])
        return responses

    def finalize(self):
        self.board.close()
        self.log.info("unloaded")


def _error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
