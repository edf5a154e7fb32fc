"""Triton adapter for image_decode: IMAGE (encoded bytes) -> PIXELS (FP32 [3,crop,crop]).

Owns the tensor names and every pb_utils call; the decoding rules live in image_decode.py.
"""

import json
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils
from image_decode import ConfigError, ImagePreprocessor, InvalidImage, PreprocessSettings  # noqa: E402
from PIL import Image

INPUT_NAME = "IMAGE"
OUTPUT_NAME = "PIXELS"
LOG_PREFIX = "[image_preprocess]"


def config_parameters(model_config):
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", "preprocess")
        try:
            settings = PreprocessSettings.from_parameters(config_parameters(model_config))
        except ConfigError as error:
            raise pb_utils.TritonModelException(f"{self.model_name} config.pbtxt: {error}") from None

        output = pb_utils.get_output_config_by_name(model_config, OUTPUT_NAME)
        expected = [3, settings.crop_size, settings.crop_size]
        if output is None or list(output["dims"]) != expected:
            raise pb_utils.TritonModelException(
                f"{self.model_name} config.pbtxt: output {OUTPUT_NAME} must have dims {expected} "
                f"(3 x crop_size x crop_size), found {output and list(output['dims'])}"
            )
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        # Pillow's process-wide guard, in case an image slips past our header check
        # (e.g. a format whose header size differs from what it decodes to).
        Image.MAX_IMAGE_PIXELS = settings.max_pixels
        self.preprocessor = ImagePreprocessor(settings)
        pb_utils.Logger.log_info(f"{LOG_PREFIX} {self.model_name} ready: {settings}")

    def execute(self, requests):
        # One response per request, in order; a bad image fails only its own request.
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            images = pb_utils.get_input_tensor_by_name(request, INPUT_NAME).as_numpy()
            # [batch, 1] bytes objects; each request may carry several images.
            pixels = np.stack([self.preprocessor(bytes(item)) for item in images.reshape(-1)])
            tensor = pb_utils.Tensor(OUTPUT_NAME, pixels.astype(self.output_dtype, copy=False))
            return pb_utils.InferenceResponse(output_tensors=[tensor])
        except InvalidImage as error:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
            )
        except Exception:  # a bug, not bad input: log it, keep the traceback off the wire
            pb_utils.Logger.log_error(f"{LOG_PREFIX} unexpected error:\n{traceback.format_exc()}")
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError("internal error while preprocessing IMAGE", pb_utils.TritonError.INTERNAL)
            )

    def finalize(self):
        pb_utils.Logger.log_info(f"{LOG_PREFIX} {self.model_name} unloaded")
