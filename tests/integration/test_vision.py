"""The describe step sees the photo, through the real server on every
path: the classify_and_describe ensemble over HTTP and gRPC, and the
classify_and_describe_stream model (gRPC stream and HTTP generate_stream). The
fake upstream (tools/fake_openai) decodes each image part it gets, so each
test checks what the LLM was shown: a JPEG, long side bounded with the aspect
kept, EXIF orientation applied, alpha flattened on white, no metadata; a JPEG
that is all that already as the client sent it."""

import base64
import hashlib
import io
import json
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from classify_describe_server import image_decode
from PIL import Image

from tools.bench import inprocess
from tools.reference import PHOTO_SECRETS, jpeg_with_metadata

from .conftest import STARTS_ITS_OWN_SERVER, running_triton
from .public_models import REPO
from .test_streaming import grpc_stream, http_stream

VIEW_MAX_SIDE = 768  # preprocess's default (classify_describe_server/image_decode.py)


def rotated_jpeg():
    """A 1600x1000 JPEG stored sideways (EXIF orientation 6): displayed, it is
    1000x1600 with red on top (the stored left half) and blue below."""
    image = Image.new("RGB", (1600, 1000), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 800, 1000))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif, quality=90)
    return out.getvalue()


def transparent_png():
    """900x300, transparent left third (green hidden under it), opaque black elsewhere."""
    image = Image.new("RGBA", (900, 300), (0, 255, 0, 0))
    image.paste((0, 0, 0, 255), (300, 0, 900, 300))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def unique(text):
    return f"{text} [{uuid.uuid4().hex[:8]}]"


def infer(triton, protocol, photo, prompt, parameters=None):
    module = httpclient if protocol == "http" else grpcclient
    client = (httpclient.InferenceServerClient(triton.http_url, network_timeout=120) if protocol == "http"
              else grpcclient.InferenceServerClient(triton.grpc_url))
    image = module.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[photo]], dtype=np.object_))
    question = module.InferInput("PROMPT", [1, 1], "BYTES")
    question.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    result = client.infer("classify_and_describe", [image, question], parameters=parameters)
    return json.loads(result.as_numpy("USAGE")[0][0]), result.as_numpy("DESCRIPTION")[0][0].decode()


def stream(triton, protocol, photo, prompt):
    if protocol == "grpc":
        image = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
        image.set_data_from_numpy(np.array([[photo]], dtype=np.object_))
        question = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
        question.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
        got = grpc_stream(triton.grpc_url, "classify_and_describe_stream", [image, question])
    else:
        got = http_stream(triton.http_url, "classify_and_describe_stream",
                          {"IMAGE": [base64.b64encode(photo).decode()], "PROMPT": [prompt]})
    assert got.error is None, got.error
    return json.loads(got.last["USAGE"]), got.text


def last_image(llm):
    images = llm.admin("stats")["images"][-1]
    assert len(images) == 1, images
    return images[0]


PATHS = [("ensemble", "http"), ("ensemble", "grpc"), ("stream", "grpc"), ("stream", "http")]


def ask(triton, path, photo, prompt):
    kind, protocol = path
    return (infer if kind == "ensemble" else stream)(triton, protocol, photo, prompt)


@pytest.mark.parametrize("path", PATHS, ids=["-".join(p) for p in PATHS])
def test_the_llm_sees_the_photo_upright_and_bounded(triton, llm, path):
    usage, _ = ask(triton, path, rotated_jpeg(), unique("Which way up?"))
    assert usage["vision"] is True and usage["vision_skipped_reason"] is None
    seen = last_image(llm)
    assert (seen["format"], seen["detail"]) == ("JPEG", "low")
    # Upright (1000x1600 displayed), long side bounded, aspect kept: 480x768.
    assert (seen["width"], seen["height"]) == (480, VIEW_MAX_SIDE)
    assert np.abs(np.array(seen["corner_rgb"]) - (255, 0, 0)).max() < 16  # red on top: orientation applied
    assert seen["metadata"] == []  # re-encoded: the orientation applied, not sent
    body = llm.admin("stats")["bodies"][-1]
    text = body["messages"][-1]["content"][0]["text"]
    assert "ImageNet image classifier" in text  # the labels are there, as grounding
    assert usage["prompt_tokens"] >= 85  # the image's tokens, as the upstream counts them


@pytest.mark.parametrize("path", PATHS, ids=["-".join(p) for p in PATHS])
def test_a_photo_that_is_a_view_already_reaches_the_llm_as_sent_without_its_metadata(triton, llm, path):
    """A phone's upright JPEG within the view's bounds: the LLM gets the client's own compressed
    data (no second lossy encode), and none of its EXIF, GPS, XMP, ICC, IPTC, comment or trailer."""
    photo = jpeg_with_metadata((640, 480))
    ask(triton, path, photo, unique("As sent?"))
    seen = last_image(llm)
    stripped = image_decode.jpeg_without_metadata(photo)  # unit-tested apart
    assert seen["sha256"] == hashlib.sha256(stripped).hexdigest()
    assert (seen["format"], seen["width"], seen["height"], seen["metadata"]) == ("JPEG", 640, 480, [])
    assert seen["bytes"] < len(photo) - len(b"".join(PHOTO_SECRETS))


@pytest.mark.parametrize("path", [PATHS[0], PATHS[2]], ids=["ensemble-http", "stream-grpc"])
def test_alpha_is_flattened_on_white(triton, llm, path):
    ask(triton, path, transparent_png(), unique("What is on the left?"))
    seen = last_image(llm)
    assert (seen["width"], seen["height"]) == (VIEW_MAX_SIDE, 256)
    assert np.abs(np.array(seen["corner_rgb"]) - (255, 255, 255)).max() < 16


def test_two_photos_with_equal_labels_do_not_share_an_answer(triton, llm):
    """Equal labels and scores (the same pixels for the classifier), different photos
    for the LLM: the 224x224 centre crops match, the borders the LLM sees differ."""
    def photo(border):
        image = Image.new("RGB", (1200, 400), border)
        image.paste((120, 60, 30), (400, 0, 800, 400))
        out = io.BytesIO()
        image.save(out, "PNG")
        return out.getvalue()

    prompt = unique("Same labels?")
    first, first_text = infer(triton, "http", photo((255, 255, 255)), prompt)
    second, second_text = infer(triton, "http", photo((0, 0, 0)), prompt)
    again, again_text = infer(triton, "http", photo((255, 255, 255)), prompt)
    assert not second["cached"] and second_text != first_text
    assert again["cached"] and again_text == first_text
    hashes = [i[0]["sha256"] for i in llm.admin("stats")["images"][-2:]]
    assert hashes[0] != hashes[1]


def test_auto_falls_back_to_text_only_when_the_model_refuses_images(triton, llm):
    llm.admin("mode", {"mode": "no_vision"})
    parameters = {"model": "gpt-4o-mini-no-vision"}  # its own refusal memory
    usage, _ = infer(triton, "http", rotated_jpeg(), unique("refused"), parameters)
    assert usage["vision"] is False and usage["vision_skipped_reason"] == "refused_by_upstream"
    assert usage["attempts"] == 2 and usage["fallback_reason"] is None
    assert [len(i) for i in llm.admin("stats")["images"]] == [1, 0]
    usage, _ = infer(triton, "grpc", rotated_jpeg(), unique("remembered"), parameters)
    assert usage["attempts"] == 1 and usage["vision_skipped_reason"] == "refused_by_upstream"
    assert llm.admin("stats")["images"][-1] == []


def test_conversation_and_response_format_reach_the_upstream(triton, llm):
    conversation = [{"role": "system", "content": "Answer in one line."},
                    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    parameters = {"conversation": json.dumps(conversation), "response_format": json.dumps({"type": "json_object"})}
    usage, text = infer(triton, "grpc", rotated_jpeg(), unique("And now?"), parameters)
    body = llm.admin("stats")["bodies"][-1]
    assert [m["role"] for m in body["messages"]] == ["system", "system", "user", "assistant", "user"]
    assert body["messages"][1]["content"] == "Answer in one line."
    assert body["response_format"] == {"type": "json_object"} and json.loads(text)["description"]


@pytest.mark.parametrize("name, value", [("conversation", '[{"role": "tool", "content": "x"}]'),
                                         ("response_format", '{"type": "yaml"}')])
def test_bad_conversation_or_response_format_is_refused_by_field(triton, llm, name, value):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as error:
        infer(triton, "http", rotated_jpeg(), unique("bad"), {name: value})
    assert f"[code=invalid_parameter field={name}]" in str(error.value)
    assert llm.admin("stats")["requests"] == 0


def test_the_photo_never_reaches_the_log_or_the_metrics(triton, llm):
    # Noise, so that no stretch of its base64 (or its view's) is shared with another JPEG's.
    pixels = np.random.default_rng(7).integers(0, 256, size=(600, 800, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    photo = out.getvalue()
    infer(triton, "http", photo, unique("privacy"))
    # What travels towards the LLM is the view, a re-encoding of the photo: made here as preprocess
    # makes it, and checked to be that very JPEG by its sha256 at the fake upstream.
    _, view = inprocess.preprocessor(REPO / "model_repository").with_view(photo)
    assert hashlib.sha256(view).hexdigest() == last_image(llm)["sha256"]
    text = triton.log() + triton.metrics()
    assert "data:image" not in text and "/9j/4AAQSkZJRg" not in text  # no data URI, no JFIF start in base64
    # The pixels' part of each (past the headers' tables, which JPEGs share): every 64 characters of
    # the text against the base64 every 32, so any run of 96 or more is found.
    windows = {text[at:at + 64] for at in range(len(text) - 63)}
    for name, data in (("photo", photo), ("view", view)):
        encoded = base64.b64encode(data).decode()
        found = [at for at in range(1024, len(encoded) - 63, 32) if encoded[at:at + 64] in windows]
        assert found == [], f"{len(found)} stretches of the {name}'s base64 are in the log or metrics"


@STARTS_ITS_OWN_SERVER
def test_vision_off_sends_no_image_and_makes_no_view(fake_llm, tmp_path):
    fake_llm.admin("reset", {})
    with running_triton(tmp_path, fake_llm, {"LLM_VISION": "off"}) as server:
        usage, _ = infer(server, "http", rotated_jpeg(), unique("off"))
        assert usage["vision"] is False and usage["vision_skipped_reason"] == "off"
        stream_usage, _ = stream(server, "grpc", rotated_jpeg(), unique("off stream"))
        assert stream_usage["vision_skipped_reason"] == "off"
        client = httpclient.InferenceServerClient(server.http_url)
        image = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
        image.set_data_from_numpy(np.array([[rotated_jpeg()]], dtype=np.object_))
        view = client.infer("classify_with_view", [image]).as_numpy("VIEW")
        assert view.tolist() == [[b""]]  # preprocess made none
    assert fake_llm.admin("stats")["images"] == [[], []]
    fake_llm.admin("reset", {})
