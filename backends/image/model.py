"""Triton adapter for the image steps; parameter `steps` picks what a model does:

- "decode":          IMAGE (encoded bytes) -> PIXELS ([3, crop, crop]) and VIEW when asked (preprocess)
- "classify":        PIXELS -> LABELS (top-k class names), SCORES (classifier)
- "decode,classify": IMAGE -> LABELS, SCORES and VIEW when asked, in one stub (classify_with_view):
                     no hop between two stubs and no copy of the pixels through tritonserver
                     (docs/benchmarks-method.md). Its weights and labels are those of the classifier's
                     folder (parameter classifier_model), its newest version as Triton serves it.

Owns the tensor names and every pb_utils call; the rules live in classify_describe_server
(image_decode, classifier_runtime). A request that cannot be used fails alone, in the error contract.
"""

import json
import os
import pathlib
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils
from classify_describe_server import error_contract as contract
from classify_describe_server.busy_board import join_board
from classify_describe_server.classifier_runtime import Tensors, classify_rows, load
from classify_describe_server.classifier_runtime import parse_settings as classifier_settings
from classify_describe_server.config import ConfigError, model_parameters
from classify_describe_server.image_decode import ImagePreprocessor, InvalidImage, decode_items, wants_view
from classify_describe_server.image_decode import parse_settings as decode_settings
from classify_describe_server.image_steps import newest_version, split_parameters
from classify_describe_server.model_log import Log
from classify_describe_server.settings import vision_off
from PIL import Image

IMAGE_NAME = "IMAGE"
PIXELS_NAME = "PIXELS"
LABELS_NAME = "LABELS"
SCORES_NAME = "SCORES"
VIEW_NAME = "VIEW"


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = Log(self.model_name, pb_utils.Logger)
        model_config = json.loads(args["model_config"])
        self.preprocessor = self.classifier = None
        self.details = []  # what each step loaded, for the ready line
        try:
            self.steps, decode_parameters, classifier_parameters, folder = split_parameters(model_parameters(model_config))
            if self.steps != "classify":
                self._load_decode(model_config, decode_settings(decode_parameters))
            if self.steps != "decode":
                self._load_classifier(args, model_config, classifier_settings(classifier_parameters), folder)
        except ConfigError as error:
            raise pb_utils.TritonModelException(f"{self.model_name}: {error}") from None
        # The instances holding "cpu" slots: is a core idle? A decode counts, it keeps a core as busy as a pass.
        self.board = join_board(self.log)
        self.log.info("ready: " + "; ".join(self.details) + f" (steps {self.steps})")

    def _load_decode(self, model_config, settings):
        self.details.append(str(settings))
        if self.steps == "decode":
            output = pb_utils.get_output_config_by_name(model_config, PIXELS_NAME)
            expected = [3, settings.crop_size, settings.crop_size]
            if output is None or list(output["dims"]) != expected:
                raise ConfigError(f"output {PIXELS_NAME} must have dims {expected} "
                                  f"(3 x crop_size x crop_size), found {output and list(output['dims'])}")
            self.pixels_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        # Pillow's process-wide guard, in case an image slips past our header check
        # (a format whose header size differs from what it decodes to).
        Image.MAX_IMAGE_PIXELS = settings.max_pixels
        self.preprocessor = ImagePreprocessor(settings)
        self.crop_size = settings.crop_size
        # VIEW only for a request that asks for it, and never encoded with LLM_VISION=off (decode_items).
        self.has_view = pb_utils.get_output_config_by_name(model_config, VIEW_NAME) is not None
        self.vision_off = vision_off(os.environ)

    def _load_classifier(self, args, model_config, settings, folder):
        tensors = self._tensors(model_config)
        if folder is None:
            # In the Python backend "model_repository" is this model's own folder
            # (model_repository/<name>), and pb_utils.get_model_dir() does not exist in 2.51.
            model_dir, version = pathlib.Path(args["model_repository"]), args["model_version"]
        else:
            model_dir = pathlib.Path(args["model_repository"]).parent / folder
            version = newest_version(model_dir, settings.model_file)
        device = f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else "cpu"
        self.classifier = load(settings, model_dir, version, tensors, device)
        served = settings.model_file if folder is None else f"{model_dir.name}/{version}/{settings.model_file}"
        self.details.append(f"{served}, runtime {settings.runtime}, top {self.classifier.top_k}, "
                            f"{self.classifier.details}")

    def _tensors(self, model_config):
        labels = pb_utils.get_output_config_by_name(model_config, LABELS_NAME)
        scores = pb_utils.get_output_config_by_name(model_config, SCORES_NAME)
        if labels is None or scores is None:
            raise ConfigError(f"config.pbtxt needs outputs {LABELS_NAME} and {SCORES_NAME}")
        if labels["dims"] != scores["dims"] or len(labels["dims"]) != 1:
            raise ConfigError(f"outputs {LABELS_NAME} and {SCORES_NAME} must both have dims [k]")
        self.scores_dtype = pb_utils.triton_string_to_numpy(scores["data_type"])
        if self.steps == "decode,classify":
            # The pixels never leave this process: uint8 [3, crop, crop], what the classifier model takes.
            return Tensors(PIXELS_NAME, (3, self.crop_size, self.crop_size), np.dtype(np.uint8),
                           SCORES_NAME, LABELS_NAME, labels["dims"][0])
        pixels = pb_utils.get_input_config_by_name(model_config, PIXELS_NAME)
        if pixels is None:
            raise ConfigError(f"config.pbtxt needs input {PIXELS_NAME}")
        shape = tuple(pixels["dims"])
        if any(d <= 0 for d in shape):
            raise ConfigError(f"input {PIXELS_NAME} needs fixed dims for the load-time check, got {list(shape)}")
        dtype = np.dtype(pb_utils.triton_string_to_numpy(pixels["data_type"]))
        return Tensors(PIXELS_NAME, shape, dtype, SCORES_NAME, LABELS_NAME, labels["dims"][0])

    def execute(self, requests):
        with self.board.executing():
            return self._execute(requests)

    def _execute(self, requests):
        # Read each request (a bad one fails alone), then one forward pass over every good one.
        responses = [None] * len(requests)
        ready = []  # (request index, pixels [n, 3, crop, crop], views or None)
        for index, request in enumerate(requests):
            try:
                ready.append((index, *self._read(request)))
            except InvalidImage as error:
                responses[index] = _error_response(contract.tagged(contract.INVALID_INPUT, str(error), IMAGE_NAME),
                                                   pb_utils.TritonError.INVALID_ARG)
            except _InvalidPixels as error:
                responses[index] = _error_response(contract.tagged(contract.INVALID_INPUT, str(error), PIXELS_NAME),
                                                   pb_utils.TritonError.INVALID_ARG)
            except Exception:  # a bug, not bad input: the traceback goes to the log, not to the client
                self.log.error(f"unexpected error while decoding:\n{traceback.format_exc()}")
                responses[index] = _error_response(contract.tagged(contract.INTERNAL, "internal error while preprocessing IMAGE"),
                                                   pb_utils.TritonError.INTERNAL)
        if not ready:
            return responses
        if self.classifier is None:
            for index, pixels, views in ready:
                responses[index] = _response([pb_utils.Tensor(PIXELS_NAME, pixels.astype(self.pixels_dtype, copy=False))], views)
            return responses
        try:
            # Asked as late as possible: a neighbour that started while this one decoded counts.
            results = classify_rows(self.classifier, [pixels for _, pixels, _ in ready], idle=self.board.others_busy() == 0)
        except Exception:  # a bug or a runtime failure: the traceback goes to the log, not to the clients
            self.log.error(f"inference failed:\n{traceback.format_exc()}")
            for index, _, _ in ready:
                responses[index] = _error_response(contract.tagged(contract.INTERNAL, "internal error in the classifier"),
                                                   pb_utils.TritonError.INTERNAL)
            return responses
        for (index, _, views), (labels, scores) in zip(ready, results):
            responses[index] = _response([pb_utils.Tensor(LABELS_NAME, labels),
                                          pb_utils.Tensor(SCORES_NAME, scores.astype(self.scores_dtype, copy=False))], views)
        return responses

    def _read(self, request):
        """-> (pixels [n, 3, crop, crop], the views [n, 1] or None when the request does not ask for VIEW)."""
        if self.preprocessor is None:
            pixels = pb_utils.get_input_tensor_by_name(request, PIXELS_NAME).as_numpy()
            if pixels.dtype.kind == "f" and not np.isfinite(pixels).all():
                raise _InvalidPixels(f"{PIXELS_NAME} holds NaN or infinite values")
            return pixels, None
        images = pb_utils.get_input_tensor_by_name(request, IMAGE_NAME).as_numpy()
        view = wants_view(self.has_view, request.requested_output_names(), VIEW_NAME)
        return decode_items(self.preprocessor, images, view, self.vision_off)

    def finalize(self):
        self.board.close()
        self.log.info("unloaded")


class _InvalidPixels(ValueError):
    """PIXELS sent straight to a classify step that no model could have made."""


def _response(outputs, views):
    if views is not None:
        outputs.append(pb_utils.Tensor(VIEW_NAME, views))
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
