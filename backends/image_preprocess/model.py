"""Triton adapter for image_decode: IMAGE (encoded bytes) -> PIXELS (FP32 [3,crop,crop]),
and VIEW (the JPEG the describe step shows the LLM) when a request asks for it.

Owns the tensor names and every pb_utils call; the decoding rules live in image_decode.py.
A refused IMAGE is answered in the error contract (error_contract.py, a link to openai_describe's).
"""

import json
import os
import traceback

import triton_python_backend_utils as pb_utils
from PIL import Image

import error_contract as contract
from busy_board import join_board
from image_decode import ConfigError, ImagePreprocessor, InvalidImage, decode_items, parse_settings, wants_view
from model_log import Log

INPUT_NAME = "IMAGE"
OUTPUT_NAME = "PIXELS"
VIEW_NAME = "VIEW"


def config_parameters(model_config):
    """config.pbtxt `parameters` as {key: string value}, what parse_settings takes."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = Log(self.model_name)
        model_config = json.loads(args["model_config"])
        try:
            settings = self._load(model_config)
        except ConfigError as error:
            raise pb_utils.TritonModelException(f"{self.model_name}: {error}") from None
        # A decode holds a "cpu" slot: a classifier pass must not take this core as idle (busy_board.py).
        self.board = join_board(self.log)
        self.log.info(f"ready: {settings}")

    def _load(self, model_config):
        settings = parse_settings(config_parameters(model_config))
        output = pb_utils.get_output_config_by_name(model_config, OUTPUT_NAME)
        expected = [3, settings.crop_size, settings.crop_size]
        if output is None or list(output["dims"]) != expected:
            raise ConfigError(
                f"output {OUTPUT_NAME} must have dims {expected} "
                f"(3 x crop_size x crop_size), found {output and list(output['dims'])}"
            )
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        # Pillow's process-wide guard, in case an image slips past our header check
        # (e.g. a format whose header size differs from what it decodes to).
        Image.MAX_IMAGE_PIXELS = settings.max_pixels
        self.preprocessor = ImagePreprocessor(settings)
        # VIEW only for a request that asks for it, and never encoded with LLM_VISION=off (decode_items).
        self.has_view = pb_utils.get_output_config_by_name(model_config, VIEW_NAME) is not None
        self.vision_off = os.environ.get("LLM_VISION", "").strip().lower() == "off"
        return settings

    def execute(self, requests):
        # One response per request, in order; a bad image fails only its own request.
        with self.board.executing():
            return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            # Each request may carry several images.
            images = pb_utils.get_input_tensor_by_name(request, INPUT_NAME).as_numpy()
            view = wants_view(self.has_view, request.requested_output_names(), VIEW_NAME)
            pixels, views = decode_items(self.preprocessor, images, view, self.vision_off)
            outputs = [pb_utils.Tensor(OUTPUT_NAME, pixels.astype(self.output_dtype, copy=False))]
            if views is not None:
                outputs.append(pb_utils.Tensor(VIEW_NAME, views))
            return pb_utils.InferenceResponse(output_tensors=outputs)
        except InvalidImage as error:
            return _error_response(contract.tagged(contract.INVALID_INPUT, str(error), INPUT_NAME),
                                   pb_utils.TritonError.INVALID_ARG)
        except Exception:  # a bug, not bad input: the traceback goes to the log, not to the client
            self.log.error(f"unexpected error:\n{traceback.format_exc()}")
            return _error_response(contract.tagged(contract.INTERNAL, "internal error while preprocessing IMAGE"),
                                   pb_utils.TritonError.INTERNAL)

    def finalize(self):
        self.board.close()
        self.log.info("unloaded")


def _error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
