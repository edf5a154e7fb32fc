"""Benchmark inputs: real JPEG bytes (scikit-image's chelsea.png and coffee.png
re-encoded with Pillow) and perf_analyzer --input-data JSON files.

perf_analyzer's JSON format for a BYTES/TYPE_STRING tensor given as base64
(perf_analyzer docs/input_data.md): each element is a 4-byte little-endian
length followed by its bytes, and it is that whole buffer that is base64-encoded;
"shape" gives the dims after the batch dim.
"""

import base64
import io
import json
import pathlib
import struct

PHOTOS = ("chelsea", "coffee")  # 451x300 and 600x400
JPEG_QUALITY = 85


def photo_jpegs():
    """{name: JPEG bytes} of the scikit-image photos, at their own sizes."""
    import skimage.data
    from PIL import Image

    data_dir = pathlib.Path(skimage.data.__file__).parent
    jpegs = {}
    for name in PHOTOS:
        with Image.open(data_dir / f"{name}.png") as image:
            buffer = io.BytesIO()
            image.convert("RGB").save(buffer, "JPEG", quality=JPEG_QUALITY)
        jpegs[name] = buffer.getvalue()
    return jpegs


def prompts(count):
    """Distinct prompts, so no two requests of a run share an LLM request (and a cache entry)."""
    questions = ("What is shown here?", "Describe the scene in one sentence.",
                 "Is this photo taken indoors?", "What colours dominate?")
    return [f"[{index}] {questions[index % len(questions)]}" for index in range(count)]


def _bytes_tensor(value):
    return {"content": {"b64": base64.b64encode(struct.pack("<I", len(value)) + value).decode("ascii")},
            "shape": [1]}


def write_jpegs(workdir, jpegs):
    """The photos as files in workdir (<name>.jpg), for the in-process loop; returns their paths."""
    paths = []
    for name, data in jpegs.items():
        paths.append(pathlib.Path(workdir) / f"{name}.jpg")
        paths[-1].write_bytes(data)
    return paths


def write_input_data(workdir, jpegs, ensemble_entries=256):
    """perf_analyzer input files: classify.json (IMAGE only, the photos in turn) and
    classify_and_describe.json (IMAGE + a distinct PROMPT per entry); returns their paths."""
    workdir = pathlib.Path(workdir)
    images = [jpegs[name] for name in PHOTOS]
    classify = {"data": [{"IMAGE": _bytes_tensor(image)} for image in images]}
    ensemble = {"data": [{"IMAGE": _bytes_tensor(images[index % len(images)]), "PROMPT": [prompt]}
                         for index, prompt in enumerate(prompts(ensemble_entries))]}
    paths = {"classify": workdir / "classify.json", "classify_and_describe": workdir / "classify_and_describe.json"}
    paths["classify"].write_text(json.dumps(classify))
    paths["classify_and_describe"].write_text(json.dumps(ensemble))
    return paths
