"""backends/image, steps decode (preprocess), without a server: decoding rules, transform, adapter."""

import io
import json
import pathlib
import struct
import sys

import numpy as np
import pytest
from backend_model import load_model
from classify_describe_server.image_decode import (
    ConfigError,
    ImagePreprocessor,
    InvalidImage,
    PreprocessSettings,
    decode_items,
    jpeg_without_metadata,
    parse_settings,
    wants_view,
)
from PIL import Image, ImageFile

from tools.fake_openai.server import METADATA_KEYS
from tools.model_config import read as read_model_config
from tools.reference import PHOTO_SECRETS, bad_images, jpeg_with_metadata, png_with_header_size, reference_pixels

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "model_repository" / "preprocess" / "config.pbtxt"

pb_utils = sys.modules["triton_python_backend_utils"]  # the fake, installed by conftest.py


@pytest.fixture(autouse=True)
def restore_pillow_guard(monkeypatch):
    # initialize() sets the process-wide Image.MAX_IMAGE_PIXELS; undo it after each test.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


model_module = load_model("image")


# ---------------------------------------------------------------- helpers

def committed_parameters():
    """The `parameters` of the committed config.pbtxt, as Triton hands them to the model."""
    config = read_model_config(CONFIG)
    assert config.parameters, "no parameters found in config.pbtxt"
    return {key: {"string_value": value.string_value} for key, value in config.parameters.items()}


def model_config(parameters=None, dims=(3, 224, 224)):
    return {
        "name": "preprocess",
        "max_batch_size": 8,
        "input": [{"name": "IMAGE", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "PIXELS", "data_type": "TYPE_FP32", "dims": list(dims)}],
        "parameters": committed_parameters() if parameters is None else parameters,
    }


def make_model(config=None):
    model = model_module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config or model_config()), "model_name": "preprocess",
                      "model_version": "1", "model_repository": str(CONFIG.parent)})
    return model


def encode(image, fmt, **options):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def request(*images):
    array = np.array([[data] for data in images], dtype=np.object_)
    return pb_utils.InferenceRequest({"IMAGE": array})


def solid(color, size=(64, 48)):
    return Image.new("RGB", size, color)


def channels(rgb):
    """An RGB colour as the int [3] array the CHW pixels hold per position."""
    return np.asarray(rgb, dtype=int)


@pytest.fixture
def preprocessor():
    return ImagePreprocessor(PreprocessSettings())


# ---------------------------------------------------------------- settings

def test_committed_config_parses_to_the_reference_transform():
    params = {k: v["string_value"] for k, v in committed_parameters().items()}
    assert params.pop("steps") == "decode"
    settings = parse_settings(params)
    assert settings.resize_shorter_side == 256 and settings.crop_size == 224
    assert settings.jpeg_draft is True
    assert settings.min_image_side == 8 and settings.max_pixels == 40_000_000


@pytest.mark.parametrize("params, words", [
    ({"crop_size": "abc"}, "crop_size must be a positive integer"),
    ({"max_pixels": "-5"}, "max_pixels must be a positive integer"),
    ({"jpeg_draft": "yes"}, "jpeg_draft must be true or false"),
    ({"mean": "127,127,127"}, "unknown parameter(s) ['mean']"),  # moved to the classifier
    ({"crop_size": "300"}, "must not exceed resize_shorter_side"),
    ({"resize": "256"}, "unknown parameter(s) ['resize']"),
])
def test_invalid_settings_say_what_to_fix(params, words):
    with pytest.raises(ConfigError) as caught:
        parse_settings(params)
    assert words in str(caught.value)


def test_adapter_fails_load_on_bad_parameter():
    config = model_config(parameters={"steps": {"string_value": "decode"}, "crop_size": {"string_value": "nope"}})
    with pytest.raises(pb_utils.TritonModelException, match="preprocess: parameter crop_size"):
        make_model(config)


def test_adapter_fails_load_when_output_dims_do_not_match_crop():
    with pytest.raises(pb_utils.TritonModelException, match=r"PIXELS must have dims \[3, 224, 224\]"):
        make_model(model_config(dims=(3, 200, 200)))


# ---------------------------------------------------------------- formats and modes

LOSSLESS = ["PNG", "BMP", "GIF", "WEBP-lossless"]


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "WEBP-lossless", "BMP", "GIF"])
def test_every_format_gives_the_colour_it_encodes(preprocessor, fmt):
    color = (200, 100, 40)
    options = {"lossless": True} if fmt == "WEBP-lossless" else {}
    data = encode(solid(color), fmt.split("-")[0], **options)
    pixels = preprocessor(data)
    assert pixels.shape == (3, 224, 224) and pixels.dtype == np.uint8
    tolerance = 0 if fmt in LOSSLESS else 4  # lossy codecs move a solid colour a little
    expected = channels(color).reshape(3, 1, 1)
    assert np.abs(pixels.astype(int) - expected).max() <= tolerance


@pytest.mark.parametrize("mode, fmt", [
    ("L", "PNG"), ("L", "JPEG"), ("LA", "PNG"), ("1", "BMP"), ("P", "PNG"), ("P", "GIF"),
    ("RGBA", "PNG"), ("RGBA", "WEBP"), ("CMYK", "JPEG"), ("I;16", "PNG"),
])
def test_every_mode_becomes_rgb(preprocessor, mode, fmt):
    source = solid((30, 160, 220))
    image = source.convert(mode)
    if mode == "I;16":  # 16-bit grayscale: 0x8080 must scale to 8-bit 128, not clip to 255
        image = Image.fromarray(np.full((48, 64), 0x8080, dtype=np.uint16))
        expected = (128, 128, 128)
    else:
        expected = np.asarray(image.convert("RGB"))[0, 0]
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(image, fmt, **options)
    decoded = preprocessor.decode(data)
    assert decoded.mode == "RGB"
    tolerance = 4 if fmt == "JPEG" else 0
    assert np.abs(np.asarray(decoded, dtype=int)[5, 5] - np.asarray(expected, dtype=int)).max() <= tolerance


def test_palette_png_with_transparency_drops_alpha_without_warning(preprocessor, recwarn):
    image = solid((10, 200, 10)).convert("P")
    data = encode(image, "PNG", transparency=0)
    assert preprocessor.decode(data).mode == "RGB"
    assert not [w for w in recwarn if "ransparency" in str(w.message)]


def test_gif_uses_the_first_frame(preprocessor):
    frames = [solid((255, 0, 0)), solid((0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(data)).n_frames == 2
    pixels = preprocessor(data)
    assert (pixels[:, 100, 100] == channels((255, 0, 0))).all()


@pytest.mark.parametrize("orientation, size, top_left_color", [
    (1, (300, 200), (255, 0, 0)),  # as stored: red left half, blue right half
    (6, (200, 300), (255, 0, 0)),  # rotate 90 clockwise to display: red ends up on top
    (8, (200, 300), (0, 0, 255)),  # rotate 90 counter-clockwise: blue on top
    (3, (300, 200), (0, 0, 255)),  # rotate 180: blue on the left
])
def test_exif_orientation_is_applied(preprocessor, orientation, size, top_left_color):
    image = Image.new("RGB", (300, 200), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 150, 200))
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image, "JPEG", exif=exif, quality=95)
    decoded = preprocessor.decode(data)
    assert decoded.size == size
    assert np.abs(np.asarray(decoded, dtype=int)[10, 10] - top_left_color).max() < 10


def test_transform_matches_the_reference_definition(preprocessor):
    from skimage import data_dir

    data = (pathlib.Path(data_dir) / "chelsea.png").read_bytes()
    assert np.array_equal(preprocessor(data), reference_pixels(data))


@pytest.mark.parametrize("tall", [True, False])
def test_extreme_aspect_ratio_is_cropped_not_blown_up(preprocessor, tall):
    """An 8x4000 strip: red, then an 80 px green band across the middle, then blue.
    The classifier sees the centre square of the shorter side (7 px of green), enlarged,
    never the whole strip squeezed into 224x224 (red, green and blue side by side)."""
    strip = Image.new("RGB", (8, 4000), (0, 0, 255))
    strip.paste((255, 0, 0), (0, 0, 8, 1960))
    strip.paste((0, 255, 0), (0, 1960, 8, 2040))
    if not tall:
        strip = strip.transpose(Image.Transpose.ROTATE_90)
    data = encode(strip, "PNG")
    pixels = preprocessor(data)
    assert pixels.shape == (3, 224, 224)
    assert (pixels == channels((0, 255, 0)).reshape(3, 1, 1)).all(), "only the green centre"
    assert np.array_equal(pixels, reference_pixels(data))


# ---------------------------------------------------------------- bad input

BAD_INPUTS = bad_images()


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_invalid_image_with_a_reason(preprocessor, name):
    data, words = BAD_INPUTS[name]
    with pytest.raises(InvalidImage) as caught:
        preprocessor(data)
    assert words in str(caught.value)


def test_max_pixels_is_checked_from_the_header_before_decoding(monkeypatch):
    preprocessor = ImagePreprocessor(PreprocessSettings(max_pixels=10_000))
    data = encode(solid((1, 2, 3), (200, 200)), "PNG")

    def no_decoding(self):
        raise AssertionError("pixels were decoded before the size check")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(InvalidImage, match=r"200x200 = 40000 pixels, more than the 10000 allowed"):
        preprocessor(data)


@pytest.mark.parametrize("size, refused", [((100, 100), False), ((101, 100), True)])
def test_max_pixels_is_the_most_an_image_may_have(size, refused):
    preprocessor = ImagePreprocessor(PreprocessSettings(max_pixels=100 * 100, resize_shorter_side=16, crop_size=16))
    data = encode(solid((1, 2, 3), size), "PNG")
    if refused:
        with pytest.raises(InvalidImage, match=r"101x100 = 10100 pixels, more than the 10000 allowed"):
            preprocessor(data)
    else:
        assert preprocessor(data).shape == (3, 16, 16)


@pytest.mark.parametrize("extra, refused", [(0, False), (1, True)])
def test_max_image_bytes_is_the_most_a_file_may_hold(extra, refused):
    data = encode(solid((1, 2, 3), (16, 16)), "BMP")
    preprocessor = ImagePreprocessor(PreprocessSettings(max_image_bytes=len(data) - extra, resize_shorter_side=16,
                                                        crop_size=16))
    if refused:
        with pytest.raises(InvalidImage, match=f"more than the {len(data) - 1} allowed"):
            preprocessor(data)
    else:
        assert preprocessor(data).shape == (3, 16, 16)


def test_bomb_header_is_rejected_before_decoding(preprocessor, monkeypatch):
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded a bomb"))
    with pytest.raises(InvalidImage, match="pixels"):
        preprocessor(png_with_header_size(50000, 50000))


def test_max_image_bytes():
    preprocessor = ImagePreprocessor(PreprocessSettings(max_image_bytes=100))
    with pytest.raises(InvalidImage, match="more than the 100 allowed"):
        preprocessor(encode(solid((1, 2, 3)), "BMP"))


# ---------------------------------------------------------------- adapter

def test_adapter_batch_mixes_good_and_bad_requests():
    model = make_model()
    good = encode(solid((200, 100, 40)), "PNG")
    bad_names = list(BAD_INPUTS)
    requests = [request(good)] + [request(BAD_INPUTS[name][0]) for name in bad_names] + [request(good, good)]
    responses = model.execute(requests)

    assert len(responses) == len(requests)
    first, *bad, last = responses
    expected = np.broadcast_to(channels((200, 100, 40)).reshape(3, 1, 1), (3, 224, 224))
    assert not first.has_error() and (first.output("PIXELS")[0] == expected).all()
    assert not last.has_error() and last.output("PIXELS").shape == (2, 3, 224, 224)
    for name, response in zip(bad_names, bad):
        assert response.has_error(), name
        assert response.error().code() == pb_utils.TritonError.INVALID_ARG, name
        assert BAD_INPUTS[name][1] in response.error().message(), name


def test_one_bad_image_fails_its_whole_request_only():
    model = make_model()
    good = encode(solid((1, 2, 3)), "PNG")
    responses = model.execute([request(good, b""), request(good)])
    assert responses[0].error().code() == pb_utils.TritonError.INVALID_ARG
    assert not responses[1].has_error()


def test_unexpected_failure_is_internal_without_traceback(monkeypatch, fake_pb_utils_module):
    model = make_model()
    monkeypatch.setattr(model, "preprocessor", lambda data: 1 / 0)
    responses = model.execute([request(b"x")])
    error = responses[0].error()
    assert error.code() == pb_utils.TritonError.INTERNAL
    assert "Traceback" not in error.message() and "ZeroDivision" not in error.message()
    assert any("ZeroDivisionError" in message for level, message in pb_utils.Logger.records if level == "error")


def test_adapter_sets_pillow_bomb_guard():
    make_model()
    assert Image.MAX_IMAGE_PIXELS == 40_000_000


def test_warmup_file_is_a_length_prefixed_jpeg(preprocessor):
    raw = (CONFIG.parent / "warmup" / "chelsea_320.jpeg.raw").read_bytes()
    (length,) = struct.unpack("<I", raw[:4])
    assert length == len(raw) - 4
    assert Image.open(io.BytesIO(raw[4:])).format == "JPEG"
    assert preprocessor(raw[4:]).shape == (3, 224, 224)
    assert "chelsea_320.jpeg.raw" in CONFIG.read_text()


# ---------------------------------------------------------------- 16-bit grayscale

def float_reference_to_8bit(image):
    """The 16/32-bit grayscale rule written out in float64: scale to 0..255 by 65535
    (or by 255 when no value exceeds it), round half up, clip."""
    array = np.asarray(image, dtype=np.float64)
    top = 65535.0 if image.mode.startswith("I;16") or array.max() > 255 else 255.0
    return np.clip(array / top * 255.0 + 0.5, 0, 255).astype(np.uint8)


def every_16bit_value():
    return np.arange(65536, dtype=np.uint16).reshape(256, 256)


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I", "I-small", "F"])
def test_16bit_and_32bit_grayscale_scale_like_the_float_reference(preprocessor, mode):
    values = every_16bit_value()
    if mode == "I;16":  # what a 16-bit grayscale PNG decodes to
        decoded = preprocessor.decode(encode(Image.fromarray(values), "PNG"))
        source = Image.fromarray(values)
    else:  # modes no supported format yields today, converted by the same rule
        from classify_describe_server.image_decode import _to_rgb

        if mode == "I;16B":
            source = Image.frombytes("I;16B", (256, 256), values.astype(">u2").tobytes())
        elif mode == "I":
            source = Image.fromarray(values.astype(np.int32) - 1000)  # negatives clip to 0
        elif mode == "I-small":
            source = Image.fromarray((values % 256).astype(np.int32))  # max 255: scaled by 255
        else:
            source = Image.fromarray(values.astype(np.float32) + 0.25)
        decoded = _to_rgb(source)
    assert decoded.mode == "RGB"
    expected = float_reference_to_8bit(source)
    for channel in range(3):
        assert np.abs(np.asarray(decoded, dtype=int)[..., channel] - expected).max() <= 1


def test_16bit_decode_keeps_transient_memory_small(preprocessor):
    """A float64 copy of a 16-bit image is 8 bytes a pixel, about 1 GB with its
    temporaries at the 40 MP limit; the conversion must stay well under 1 byte a pixel
    of Python-visible memory (numpy arrays are traced, Pillow's own buffers are not)."""
    import tracemalloc

    width, height = 3000, 2000
    gradient = (np.arange(width * height, dtype=np.uint32) % 65536).astype(np.uint16)
    data = encode(Image.fromarray(gradient.reshape(height, width)), "PNG", compress_level=1)
    del gradient
    tracemalloc.start()
    try:
        decoded = preprocessor.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoded.size == (width, height) and decoded.mode == "RGB"
    assert peak < width * height // 4, f"peak {peak / 1e6:.1f} MB for {width * height / 1e6:.0f} MP"


# ---------------------------------------------------------------- reduced-scale JPEG decoding

@pytest.fixture(scope="module")
def phone_photo():
    """chelsea.png scaled to 4032x3024 (12 MP, a phone camera's size) as a JPEG."""
    from skimage import data_dir

    photo = Image.open(pathlib.Path(data_dir) / "chelsea.png").convert("RGB")
    return encode(photo.resize((4032, 3024), Image.Resampling.BICUBIC), "JPEG", quality=90)


def test_large_jpeg_decodes_at_reduced_scale_but_never_below_the_resize(preprocessor, phone_photo):
    decoded = preprocessor.decode(phone_photo)
    assert decoded.size == (504, 378)  # 1/8: the shorter side stays above resize_shorter_side (256)
    full = ImagePreprocessor(PreprocessSettings(jpeg_draft=False)).decode(phone_photo)
    assert full.size == (4032, 3024)


@pytest.mark.parametrize("size, fmt", [((511, 400), "JPEG"), ((2000, 1500), "PNG")])
def test_small_jpegs_and_other_formats_decode_in_full(preprocessor, size, fmt):
    # 511 px: half of it would fall under 256; PNG has no reduced-scale decoding.
    assert preprocessor.decode(encode(solid((9, 99, 199), size), fmt)).size == size


def test_reduced_scale_pixels_match_the_full_decode(preprocessor, phone_photo):
    drafted = preprocessor(phone_photo).astype(int)
    full = ImagePreprocessor(PreprocessSettings(jpeg_draft=False))(phone_photo).astype(int)
    # The DCT-domain downscale differs from bicubic over the full image by a grey level or two;
    # the classifier's top-5 is the same (tests/unit/test_image_classifier.py).
    assert np.abs(drafted - full).mean() < 2.0


@pytest.fixture(scope="module")
def phone_photo_mpo(phone_photo):
    """The same photo with a second, smaller picture after it (MPF, as many phones and
    cameras write): Pillow opens it as format "MPO", a JpegImageFile subclass."""
    primary = Image.open(io.BytesIO(phone_photo))
    data = encode(primary, "MPO", save_all=True, append_images=[solid((0, 0, 200), (640, 480))], quality=90)
    opened = Image.open(io.BytesIO(data))
    assert opened.format == "MPO" and getattr(opened, "n_frames", 1) == 2
    return data


def test_a_multi_picture_jpeg_is_a_jpeg_decoded_at_reduced_scale(preprocessor, phone_photo, phone_photo_mpo):
    decoded = preprocessor.decode(phone_photo_mpo)
    assert decoded.size == (504, 378)  # reduced scale, as for the plain JPEG
    full = ImagePreprocessor(PreprocessSettings(jpeg_draft=False)).decode(phone_photo_mpo)
    assert full.size == (4032, 3024)  # the first picture, not the small one after it
    # The pixels are those of the first picture, as the plain JPEG gives them.
    assert np.abs(preprocessor(phone_photo_mpo).astype(int) - preprocessor(phone_photo).astype(int)).mean() < 2.0


# ---------------------------------------------------------------- the view (what the LLM is shown)

def view_of(data, **settings):
    pixels, view = ImagePreprocessor(PreprocessSettings(**settings)).with_view(data)
    assert pixels.shape == (3, 224, 224)
    return Image.open(io.BytesIO(view)), view


def test_the_view_is_a_jpeg_with_its_long_side_bounded_and_the_aspect_kept():
    image, view = view_of(encode(solid((30, 160, 90), (2000, 1000)), "PNG"))
    assert image.format == "JPEG" and image.size == (768, 384) and len(view) <= 262144
    small, _ = view_of(encode(solid((30, 160, 90), (300, 200)), "PNG"))
    assert small.size == (300, 200)  # never blown up


@pytest.mark.parametrize("orientation, size, top_left_color", [
    (6, (200, 300), (255, 0, 0)),
    (8, (200, 300), (0, 0, 255)),
    (3, (300, 200), (0, 0, 255)),
])
def test_the_view_is_upright(orientation, size, top_left_color):
    image = Image.new("RGB", (300, 200), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 150, 200))
    exif = Image.Exif()
    exif[0x0112] = orientation
    view, _ = view_of(encode(image, "JPEG", exif=exif, quality=95))
    assert view.size == size and view.getexif().get(0x0112) in (None, 1)
    assert np.abs(np.asarray(view.convert("RGB"), dtype=int)[10, 10] - top_left_color).max() < 12


@pytest.mark.parametrize("mode, fmt", [("RGBA", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("RGBA", "WEBP")])
def test_the_view_flattens_alpha_on_white(mode, fmt):
    image = Image.new("RGBA", (120, 80), (200, 0, 0, 0))  # transparent, red hidden underneath
    image.paste((0, 0, 200, 255), (60, 0, 120, 80))       # opaque blue right half
    if mode == "LA":
        image = image.convert("LA")
    elif mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
        image.info["transparency"] = image.getpixel((0, 0))
    options = {"lossless": True} if fmt == "WEBP" else {}
    view, _ = view_of(encode(image, fmt, **options))
    pixels = np.asarray(view.convert("RGB"), dtype=int)
    assert np.abs(pixels[40, 10] - (255, 255, 255)).max() < 12  # the transparent half is white
    if mode != "LA":
        assert np.abs(pixels[40, 100] - (0, 0, 200)).max() < 12


def test_the_view_fits_its_byte_bound():
    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (700, 700, 3), dtype=np.uint8))
    image, view = view_of(encode(noise, "PNG"), view_max_bytes=40000)
    assert len(view) <= 40000 and image.width == image.height  # lower quality, then smaller: aspect kept


def assert_no_metadata(view):
    assert not [secret for secret in PHOTO_SECRETS if secret in view]
    image = Image.open(io.BytesIO(view))
    assert not [key for key in METADATA_KEYS if key in image.info] and not image.getexif()
    assert view.endswith(b"\xff\xd9")  # nothing after the end of the image


def decoded(data):
    return np.asarray(Image.open(io.BytesIO(data)))


@pytest.mark.parametrize("options", [{}, {"progressive": True}, {"restart_marker_blocks": 2}, {"subsampling": 0},
                                     {"mode": "L"}, {"size": (768, 300)}],
                         ids=["baseline", "progressive", "restart-markers", "4:4:4", "grey", "at-the-bound"])
def test_a_jpeg_that_is_a_view_already_is_sent_as_it_came_less_its_metadata(options):
    """Upright, RGB or grey, within view_max_side and view_max_bytes: the client's own compressed
    data, not a second lossy encode; every metadata segment and the trailer are left out."""
    data = jpeg_with_metadata(**options)
    image, view = view_of(data)
    assert_no_metadata(view)
    assert np.array_equal(decoded(view), decoded(data))  # the very pixels the client sent
    assert view == jpeg_without_metadata(data) and len(view) < len(data)
    assert image.mode == Image.open(io.BytesIO(data)).mode


@pytest.mark.parametrize("case", ["rotated", "too-wide", "too-many-bytes", "cmyk", "png"])
def test_a_photo_that_is_not_a_view_already_is_re_encoded_without_its_metadata(case):
    data = {"rotated": lambda: rotate_exif(jpeg_with_metadata((400, 300)), 6),
            "too-wide": lambda: jpeg_with_metadata((1000, 600)),
            "too-many-bytes": lambda: jpeg_with_metadata((600, 400)),
            "cmyk": lambda: jpeg_with_metadata(mode="CMYK"),
            "png": lambda: encode(solid((30, 90, 200), (300, 200)), "PNG",
                                  pnginfo=png_text("Comment", PHOTO_SECRETS[3].decode()))}[case]()
    settings = {"view_max_bytes": 4096} if case == "too-many-bytes" else {}
    image, view = view_of(data, **settings)
    assert_no_metadata(view)
    assert view != jpeg_without_metadata(data) and image.mode == "RGB"
    # too-wide: from the classifier's half-scale decode (docs/DESIGN.md#the-view)
    expected = {"rotated": (300, 400), "too-wide": (500, 300), "cmyk": (640, 480), "png": (300, 200)}
    if case in expected:
        assert image.size == expected[case]
    else:
        assert len(view) <= 4096


def rotate_exif(data, orientation):
    image = Image.open(io.BytesIO(data))
    exif = image.getexif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", exif=exif, quality=90, xmp=image.info["xmp"])


def png_text(key, value):
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text(key, value)
    return info


def test_jpeg_without_metadata_refuses_what_it_does_not_know():
    data = jpeg_with_metadata((64, 48))
    frame = data.index(b"\xff\xc0")
    assert jpeg_without_metadata(data[:frame] + b"\xff\xc9" + data[frame + 2:]) is None  # arithmetic coding
    assert jpeg_without_metadata(data[:frame + 4] + b"\x0c" + data[frame + 5:]) is None  # 12-bit samples
    assert jpeg_without_metadata(data.replace(b"\xff\xd9", b"")) is None  # no end of image
    assert jpeg_without_metadata(encode(solid((1, 2, 3), (64, 48)), "PNG")) is None
    # Every cut and 2,000 corrupted bytes: an answer or None, never an exception; an answer is a whole JPEG.
    rng = np.random.default_rng(3)
    corrupted = [data[:cut] for cut in range(len(data))]
    for at in rng.integers(0, len(data), 2000):
        corrupted.append(data[:at] + bytes([rng.integers(0, 256)]) + data[at + 1:])
    for candidate in corrupted:
        stripped = jpeg_without_metadata(candidate)
        assert stripped is None or (stripped.startswith(b"\xff\xd8") and stripped.endswith(b"\xff\xd9"))


def view_model(monkeypatch, vision=None):
    if vision is None:
        monkeypatch.delenv("LLM_VISION", raising=False)
    else:
        monkeypatch.setenv("LLM_VISION", vision)
    config = model_config()
    config["output"].append({"name": "VIEW", "data_type": "TYPE_STRING", "dims": [1]})
    return make_model(config)


def asking(names, *images):
    array = np.array([[data] for data in images], dtype=np.object_)
    return pb_utils.InferenceRequest({"IMAGE": array}, requested_output_names=names)


def test_the_adapter_makes_the_view_only_when_asked(monkeypatch):
    model = view_model(monkeypatch)
    photo = encode(solid((10, 200, 10), (1000, 500)), "PNG")
    with_view, without, every = model.execute([asking(["PIXELS", "VIEW"], photo, photo), asking(["PIXELS"], photo),
                                               asking(None, photo)])
    views = with_view.output("VIEW")
    assert views.shape == (2, 1) and Image.open(io.BytesIO(views[1][0])).size == (768, 384)
    assert without.output("VIEW") is None and without.output("PIXELS").shape == (1, 3, 224, 224)
    assert every.output("VIEW") is not None


def test_llm_vision_off_makes_no_view(monkeypatch):
    model = view_model(monkeypatch, "off")
    [response] = model.execute([asking(["PIXELS", "VIEW"], encode(solid((1, 2, 3)), "PNG"))])
    assert response.output("VIEW").tolist() == [[b""]]


@pytest.mark.parametrize("declared, names, expected", [
    (True, ["PIXELS", "VIEW"], True), (True, ["PIXELS"], False), (True, None, True),  # None: named none, gets all
    (False, ["PIXELS", "VIEW"], False), (False, None, False),
])
def test_a_request_gets_the_view_when_its_config_declares_it_and_it_asks(declared, names, expected):
    assert wants_view(declared, names, "VIEW") is expected


def test_decode_items_makes_the_views_only_when_asked_and_encodes_none_with_vision_off(preprocessor, monkeypatch):
    """decode_items serves preprocess and classify_with_view: the same pixels whatever the view;
    views [n, 1] of JPEG when asked, b"" without an encode when vision is off, None otherwise."""
    photos = [encode(solid((10, 200, 10), (1000, 500)), "PNG"), encode(solid((200, 10, 10), (300, 600)), "JPEG")]
    images = np.array([[photo] for photo in photos], dtype=np.object_)
    alone = np.stack([preprocessor(photo) for photo in photos])
    pixels, views = decode_items(preprocessor, images, view=False)
    assert views is None and np.array_equal(pixels, alone) and pixels.dtype == np.uint8
    pixels, views = decode_items(preprocessor, images, view=True)
    assert np.array_equal(pixels, alone) and views.shape == (2, 1) and views.dtype == np.object_
    assert [Image.open(io.BytesIO(view)).size for view in views[:, 0]] == [(768, 384), (300, 600)]
    monkeypatch.setattr(preprocessor, "with_view", lambda data: pytest.fail("a view encoded with vision off"))
    pixels, views = decode_items(preprocessor, images, view=True, vision_off=True)
    assert np.array_equal(pixels, alone) and views.tolist() == [[b""], [b""]]
    with pytest.raises(InvalidImage):
        decode_items(preprocessor, np.array([[photos[0]], [b"junk"]], dtype=np.object_), view=False)
