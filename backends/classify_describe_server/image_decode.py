"""Decode encoded image bytes and turn them into the pixels the classifier expects.

Plain Python (Pillow + numpy), no Triton import: model.py is the adapter. The
pixels go over as uint8 RGB, 0..255: the classifier normalises them itself
((x-127)/128, what the weights were trained with), and uint8 copies a quarter
of float32's bytes between the stub processes. Resize and crop follow TF's
eval preprocessing; a large JPEG is decoded at reduced scale (draft mode).
The measurements and reasons: docs/preprocessing.md.

The same decode also gives the view the describe step shows the LLM: upright,
alpha flattened on white, long side at most view_max_side, JPEG of at most
view_max_bytes. A client's JPEG that is all of that already is sent as it came,
less every byte that decoding does not need (EXIF, GPS, XMP, thumbnails,
comments, trailers: jpeg_without_metadata); any other photo is re-encoded
(make_view). It is made only when asked for (docs/DESIGN.md#the-view).
"""

import dataclasses
import io
import math
import re

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError
from PIL.JpegImagePlugin import JpegImageFile

from . import config
from .config import ConfigError

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")
# What Pillow names a JPEG with more than one picture (MpoImageFile, a JpegImageFile).
JPEG_VARIANTS = ("MPO",)


class InvalidImage(ValueError):
    """The request's image cannot be used; the message is meant for the client."""


@dataclasses.dataclass(frozen=True)
class PreprocessSettings:
    resize_shorter_side: int = 256
    crop_size: int = 224
    max_image_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # width * height read from the header, checked before decoding
    min_image_side: int = 8  # below this there is nothing left to classify
    jpeg_draft: bool = True  # decode large JPEGs at a reduced scale (see the module docstring)
    # The view for the LLM (VIEW): its long side and its JPEG's size at most these.
    view_max_side: int = 768
    view_max_bytes: int = 262144
    view_quality: int = 75  # the first JPEG quality tried (lower ones only to fit view_max_bytes): docs/benchmarks-vision.md

def parse_settings(parameters: dict[str, str]) -> PreprocessSettings:
    """Build settings from config.pbtxt `parameters` ({key: string value}); unknown keys fail."""
    settings = config.parse(PreprocessSettings, parameters)
    if not 1 <= settings.view_quality <= 95:
        raise ConfigError(f"view_quality must be in [1, 95] (Pillow's useful range), got {settings.view_quality}")
    if settings.view_max_bytes < 4096:
        raise ConfigError(f"view_max_bytes must be at least 4096, got {settings.view_max_bytes}")
    if settings.crop_size > settings.resize_shorter_side:
        raise ConfigError(
            f"crop_size ({settings.crop_size}) must not exceed resize_shorter_side "
            f"({settings.resize_shorter_side})"
        )
    return settings


class ImagePreprocessor:
    """bytes -> uint8 RGB [3, crop, crop] (0..255, not normalised). Build once, call per image."""

    def __init__(self, settings):
        self.settings = settings

    def __call__(self, data):
        return self.pixels(self.decode(data))

    def with_view(self, data):
        """bytes -> (the pixels, the view's JPEG bytes) from one decode."""
        stored, stored_size = self._load(data)
        image = _upright(stored)
        view = None
        if image is stored:  # upright as stored: the client's own JPEG may be the view
            view = jpeg_as_view(data, stored, stored_size, self.settings)
        return self.pixels(_to_rgb(image)), view or make_view(image, self.settings)

    def pixels(self, image):
        """Upright RGB PIL image -> uint8 [3, crop, crop]."""
        crop = self.settings.crop_size
        side = min(image.size) * crop / self.settings.resize_shorter_side
        left = (image.width - side) / 2
        top = (image.height - side) / 2
        image = image.resize((crop, crop), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
        return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)

    def decode(self, data):
        """Encoded bytes -> upright RGB PIL image, or InvalidImage saying what is wrong."""
        return _to_rgb(self.decode_upright(data))

    def decode_upright(self, data):
        """Encoded bytes -> upright PIL image in its own mode (alpha kept), or InvalidImage."""
        return _upright(self._load(data)[0])

    def _load(self, data):
        """Encoded bytes -> (the PIL image loaded as stored, not yet turned upright; its size in
        the header, before any reduced-scale decode), or InvalidImage saying what is wrong."""
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

        if image.format not in SUPPORTED_FORMATS + JPEG_VARIANTS:
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
        if isinstance(image, JpegImageFile) and limits.jpeg_draft:
            # The size at which the shorter side is resize_shorter_side; draft() keeps
            # each side at least this, so it scales only images 2x larger or more.
            scale = limits.resize_shorter_side / min(width, height)
            if scale < 0.5:
                image.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
        try:
            image.load()  # GIF and other animations: the first frame is the one loaded
            return image, (width, height)
        except Image.DecompressionBombError as error:
            raise InvalidImage(f"IMAGE is too large: {error}") from None
        except (OSError, SyntaxError, ValueError) as error:
            # Truncated or corrupt pixel data: Pillow reports "image file is truncated" etc.
            raise InvalidImage(f"IMAGE {image.format} data is corrupt or truncated: {error}") from None


def _upright(image):
    """A loaded image turned as its EXIF orientation says: the same object when it is upright
    already (no copy of the pixels, which exif_transpose would make), a new one otherwise."""
    try:
        # What exif_transpose reads (EXIF, or XMP's tiff:Orientation); 1 is upright.
        if image.getexif().get(ExifTags.Base.Orientation, 1) == 1:
            return image
        return ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError) as error:
        raise InvalidImage(f"IMAGE {image.format} metadata cannot be read: {error}") from None


def wants_view(declared, requested_names, view_name):
    """Whether a request gets the view: its model's config declares the output `view_name`, and
    the request names it or names none (Triton's requested_output_names() is then None: all)."""
    return declared and (requested_names is None or view_name in requested_names)


def decode_items(preprocessor, images, view, vision_off=False):
    """One request's images (encoded bytes, [batch, 1]) -> (pixels uint8 [n, 3, crop, crop], the
    views object [n, 1] of JPEG bytes, or None without `view`); InvalidImage if any is unusable.

    The view costs an encode: made only when `view` (the request asks for it: an ensemble asks for
    what its steps map, classify does not, classify_and_describe does), and never with
    `vision_off` (LLM_VISION=off for the whole server): each view is then b"", and describe says
    so in USAGE (docs/DESIGN.md#the-view).
    """
    items = [bytes(item) for item in np.asarray(images).reshape(-1)]
    if not view:
        return np.stack([preprocessor(item) for item in items]), None
    pairs = [(preprocessor(item), b"") if vision_off else preprocessor.with_view(item) for item in items]
    return np.stack([pixels for pixels, _ in pairs]), np.array([[jpeg] for _, jpeg in pairs], dtype=np.object_)


def make_view(image, settings):
    """An upright decoded image -> JPEG bytes for the LLM: alpha flattened on
    white (a transparent background reads as white, not as the colour hidden
    under it), long side at most view_max_side (aspect kept), at most
    view_max_bytes (lower quality first, then smaller)."""
    image = _flatten_on_white(image)
    side = settings.view_max_side
    if max(image.size) > side:
        scale = side / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        # reducing_gap: a cheap integer pre-shrink first, then the filter on the rest.
        image = image.resize(size, Image.Resampling.BICUBIC, reducing_gap=2.0)
    quality = settings.view_quality
    while True:
        out = io.BytesIO()
        # comment b"": Pillow would copy the photo's own JPEG comment (im.info) into the view.
        image.save(out, "JPEG", quality=quality, comment=b"")
        if out.tell() <= settings.view_max_bytes:
            return out.getvalue()
        if quality > 50:
            quality = max(50, quality - 15)
        else:  # still too large at quality 50: a smaller picture, not a worse one
            image = image.resize((max(1, image.width * 3 // 4), max(1, image.height * 3 // 4)),
                                 Image.Resampling.BICUBIC)


def jpeg_as_view(data, image, stored_size, settings):
    """The client's JPEG as the view where it is one already: a plain JPEG (not MPO), RGB or
    grey, upright as stored (the caller checks), long side at most view_max_side, at most
    view_max_bytes once stripped to what decoding needs. None otherwise: make_view re-encodes.

    Sent as it came, the LLM sees the photo without a second lossy encode, and the encode's
    CPU is saved (docs/benchmarks-vision.md); its metadata is not sent (jpeg_without_metadata)."""
    if image.format != "JPEG" or image.mode not in ("RGB", "L") or max(stored_size) > settings.view_max_side:
        return None
    view = jpeg_without_metadata(data)
    return view if view is not None and len(view) <= settings.view_max_bytes else None


# What a decoder needs, kept: quantisation and Huffman tables, restart interval, the frame
# header of baseline, extended and progressive Huffman JPEGs (what every vision API reads),
# Adobe's APP14 header (it says how the colours were transformed).
_JPEG_TABLES = {0xDB, 0xC4, 0xDD}
_JPEG_FRAMES = {0xC0, 0xC1, 0xC2}
_APP14, _ADOBE = 0xEE, b"Adobe"
# Left out: every other APPn (JFIF's with its thumbnail, which can show what a crop cut away;
# EXIF with GPS and the camera's serial; XMP, ICC profiles, IPTC, makers' notes), comments,
# and anything after the end of the image (a phone's motion video, depth maps). The view
# re-encoded by make_view has none of these either.
_JPEG_METADATA = set(range(0xE0, 0xF0)) | {0xFE}
_SOS, _EOI = 0xDA, 0xD9
# Where a scan's entropy-coded data ends: the next marker that is not a stuffed 0xFF00 or a
# restart marker (the last 0xFF before its code, fill bytes before it staying in the scan).
_NEXT_MARKER = re.compile(rb"\xff(?=[^\x00\xd0-\xd7\xff])")


def jpeg_without_metadata(data):
    """A JPEG's bytes with only the segments decoding needs, its compressed data untouched (the
    same pixels, no second encode); None for anything the walk does not know: a frame type other
    than the three kept, a precision other than 8 bits, a segment running past the end."""
    if data[:2] != b"\xff\xd8":
        return None
    out = [b"\xff\xd8"]
    pos, end, frame = 2, len(data), False
    while True:
        if pos >= end or data[pos] != 0xFF:
            return None
        while pos < end and data[pos] == 0xFF:  # a marker may be preceded by fill bytes
            pos += 1
        if pos >= end:
            return None
        code = data[pos]
        pos += 1  # data[pos - 2] is the marker's last 0xFF, data[pos - 1] its code
        if code == _EOI:
            out.append(b"\xff\xd9")
            return b"".join(out) if frame else None
        if pos + 2 > end:
            return None
        length = int.from_bytes(data[pos:pos + 2], "big")
        segment_end = pos + length
        if length < 2 or segment_end > end:
            return None
        if code == _SOS:
            scan_end = _NEXT_MARKER.search(data, segment_end)
            if scan_end is None or not frame:
                return None
            out.append(data[pos - 2:scan_end.start()])
            pos = scan_end.start()
            continue
        if code in _JPEG_FRAMES:
            if frame or length < 8 or data[pos + 2] != 8:  # one frame, 8-bit samples
                return None
            frame = keep = True
        else:
            keep = code in _JPEG_TABLES or (code == _APP14 and data.startswith(_ADOBE, pos + 2, segment_end))
            if not keep and code not in _JPEG_METADATA:  # arithmetic, lossless, hierarchical, unknown
                return None
        if keep:
            out.append(data[pos - 2:segment_end])
        pos = segment_end


def _flatten_on_white(image):
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return _to_rgb(image)


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
