"""Triton adapter for preprocess and classifier in one stub: IMAGE (encoded bytes) -> LABELS, SCORES,
and VIEW (the JPEG the describe step shows the LLM) when a request asks for it.

The CPU layout of classify_with_view: the same decode (image_decode.decode_items, preprocess's) and the
same forward pass (classifier_runtime.classify_rows, the classifier's) as the two-model ensemble, without
the hop between two stubs and the copy of the pixels through tritonserver (docs/benchmarks-method.md: classify
answered 1.09x the requests a second on 2 cores, side by side). The weights and labels are the classifier
model's own folder (parameter classifier_model), its newest version as Triton serves it, so a model brought
to classifier/ is served here too once this model is reloaded. A bad image fails only its own request, as
in preprocess.
"""

import dataclasses
import json
import os
import pathlib
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image

import error_contract as contract
from busy_board import join_board
from classifier_runtime import ConfigError as ClassifierConfigError
from classifier_runtime import Tensors, classify_rows, load
from classifier_runtime import parse_settings as classifier_settings
from image_decode import ConfigError as DecodeConfigError
from image_decode import ImagePreprocessor, InvalidImage, PreprocessSettings, decode_items, wants_view
from image_decode import parse_settings as decode_settings
from model_log import Log

INPUT_NAME = "IMAGE"
LABELS_NAME = "LABELS"
SCORES_NAME = "SCORES"
VIEW_NAME = "VIEW"
CLASSIFIER_MODEL = "classifier_model"  # the parameter naming the classifier's folder in the repository
DECODE_KEYS = frozenset(field.name for field in dataclasses.fields(PreprocessSettings))


def split_parameters(parameters):
    """config.pbtxt `parameters` -> (decode's, the classifier runtime's, the classifier's folder name):
    preprocess's keys go to the decode, the rest to the classifier runtime, as in their own configs."""
    classifier = {key: value for key, value in parameters.items() if key not in DECODE_KEYS}
    folder = classifier.pop(CLASSIFIER_MODEL, "classifier").strip()
    if not folder or "/" in folder or folder in (".", ".."):
        raise DecodeConfigError(f"parameter {CLASSIFIER_MODEL} must name a model folder of the repository, got {folder!r}")
    return {key: value for key, value in parameters.items() if key in DECODE_KEYS}, classifier, folder


def newest_version(model_dir, model_file):
    """The classifier version this model serves: the highest numbered version folder of model_dir that
    holds model_file, what Triton serves of the classifier itself (the default policy, latest: 1).
    Not this model's own version: classify_with_view has only 1/, a new classifier/2/ is in model_dir."""
    model_dir = pathlib.Path(model_dir)
    versions = [int(entry.name) for entry in model_dir.iterdir() if entry.name.isdigit() and entry.is_dir()
                and (entry / model_file).is_file()] if model_dir.is_dir() else []
    if not versions:
        raise ClassifierConfigError(f"no version folder of {model_dir} holds {model_file} (set parameter model_file, "
                                    "or run scripts/export_onnx.py)")
    return max(versions)


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = Log(self.model_name)
        model_config = json.loads(args["model_config"])
        parameters = {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}
        try:
            decode_parameters, classifier_parameters, folder = split_parameters(parameters)
            decode = decode_settings(decode_parameters)
            settings = classifier_settings(classifier_parameters)
            # In the Python backend "model_repository" is this model's own folder (model_repository/<name>).
            classifier_dir = pathlib.Path(args["model_repository"]).parent / folder
            version = newest_version(classifier_dir, settings.model_file)
            self.classifier = load(settings, classifier_dir, version, self._tensors(model_config, decode))
        except (DecodeConfigError, ClassifierConfigError) as error:
            raise pb_utils.TritonModelException(f"{self.model_name}: {error}") from None
        self.board = join_board(self.log)
        Image.MAX_IMAGE_PIXELS = decode.max_pixels  # Pillow's process-wide guard, as in preprocess
        self.preprocessor = ImagePreprocessor(decode)
        # VIEW only for a request that asks for it, and never encoded with LLM_VISION=off (decode_items).
        self.has_view = pb_utils.get_output_config_by_name(model_config, VIEW_NAME) is not None
        self.vision_off = os.environ.get("LLM_VISION", "").strip().lower() == "off"
        self.log.info(f"ready: {decode}; {classifier_dir.name}/{version}/{settings.model_file}, "
                      f"runtime {settings.runtime}, {self.classifier.details}")

    def _tensors(self, model_config, decode):
        labels = pb_utils.get_output_config_by_name(model_config, LABELS_NAME)
        scores = pb_utils.get_output_config_by_name(model_config, SCORES_NAME)
        if labels is None or scores is None or labels["dims"] != scores["dims"] or len(labels["dims"]) != 1:
            raise ClassifierConfigError(f"outputs {LABELS_NAME} and {SCORES_NAME} must both have dims [k]")
        self.scores_dtype = pb_utils.triton_string_to_numpy(scores["data_type"])
        # The pixels never leave this process: uint8 [3, crop, crop], what the classifier model takes.
        return Tensors("PIXELS", (3, decode.crop_size, decode.crop_size), np.dtype(np.uint8),
                       SCORES_NAME, LABELS_NAME, labels["dims"][0])

    def execute(self, requests):
        with self.board.executing():  # the decode too: it keeps a core as busy as a forward pass
            return self._execute(requests)

    def _execute(self, requests):
        # Decode each request (a bad image fails alone), then one forward pass over every good one.
        responses = [None] * len(requests)
        decoded = []  # (request index, pixels [n, 3, crop, crop], views or None)
        for index, request in enumerate(requests):
            try:
                decoded.append((index, *self._decode(request)))
            except InvalidImage as error:
                responses[index] = _error_response(contract.tagged(contract.INVALID_INPUT, str(error), INPUT_NAME),
                                                   pb_utils.TritonError.INVALID_ARG)
            except Exception:  # a bug, not bad input: the traceback goes to the log, not to the client
                self.log.error(f"unexpected error while decoding:\n{traceback.format_exc()}")
                responses[index] = _error_response(contract.tagged(contract.INTERNAL, "internal error while preprocessing IMAGE"),
                                                   pb_utils.TritonError.INTERNAL)
        if not decoded:
            return responses
        try:
            results = self._classify([pixels for _, pixels, _ in decoded])
        except Exception:  # a bug or a runtime failure: the traceback goes to the log, not to the clients
            self.log.error(f"inference failed:\n{traceback.format_exc()}")
            for index, _, _ in decoded:
                responses[index] = _error_response(contract.tagged(contract.INTERNAL, "internal error in the classifier"),
                                                   pb_utils.TritonError.INTERNAL)
            return responses
        for (index, _, views), (labels, scores) in zip(decoded, results):
            outputs = [pb_utils.Tensor(LABELS_NAME, labels),
                       pb_utils.Tensor(SCORES_NAME, scores.astype(self.scores_dtype, copy=False))]
            if views is not None:
                outputs.append(pb_utils.Tensor(VIEW_NAME, views))
            responses[index] = pb_utils.InferenceResponse(output_tensors=outputs)
        return responses

    def _classify(self, batches):
        # Asked as late as possible: a neighbour that started while this one decoded counts.
        return classify_rows(self.classifier, batches, idle=self.board.others_busy() == 0)

    def _decode(self, request):
        """-> (pixels [n, 3, crop, crop], the views [n, 1] or None when the request does not ask for VIEW)."""
        images = pb_utils.get_input_tensor_by_name(request, INPUT_NAME).as_numpy()
        view = wants_view(self.has_view, request.requested_output_names(), VIEW_NAME)
        return decode_items(self.preprocessor, images, view, self.vision_off)

    def finalize(self):
        self.board.close()
        self.log.info("unloaded")


def _error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
