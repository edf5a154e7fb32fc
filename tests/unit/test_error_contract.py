"""The error contract (classify_describe_server.error_contract) from both
sides: what the backends answer to bad requests, unavailable upstreams and
unloading, read by the front (openai_front/triton.py) into the HTTP status
and the request field a client fixes."""

import pathlib

import numpy as np
import pytest
from classify_describe_server import error_contract as contract
from test_describe_model import fake, make_model, request  # noqa: F401  (fake is a fixture)
from test_image_preprocess import make_model as make_preprocess
from tritonclient.utils import InferenceServerException

from openai_front import triton as front_triton
from openai_front.triton import front_error

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_both_sides_read_the_one_module():
    assert front_triton.contract is contract
    image_backend = (REPO / "backends/image/model.py").read_text()
    assert "from classify_describe_server import error_contract as contract" in image_backend


def test_the_token_round_trips_and_only_known_codes_are_written_or_read():
    message = contract.tagged(contract.INVALID_PARAMETER, "max_tokens must be ... [1, 1024]", "max_tokens")
    assert message == "[code=invalid_parameter field=max_tokens] max_tokens must be ... [1, 1024]"
    assert contract.read(message) == contract.CodedError("invalid_parameter", "max_tokens",
                                                         "max_tokens must be ... [1, 1024]")
    assert contract.read(contract.tagged(contract.MODEL_UNLOADING, "bye")) == contract.CodedError(
        "model_unloading", None, "bye")
    assert contract.read("[code=made_up] x") is None and contract.read("IMAGE is empty") is None
    assert contract.read("in ensemble 'x', " + message) is None, "the front strips Triton's prefixes first"
    with pytest.raises(ValueError):
        contract.tagged("made_up", "x")
    with pytest.raises(ValueError):
        contract.tagged(contract.INVALID_INPUT, "x", "IMAGE] [code=internal")


@pytest.mark.parametrize("make_request, field, param", [
    (lambda pb: request(pb, parameters={"max_tokens": 100000}), "max_tokens", "max_tokens"),
    (lambda pb: request(pb, parameters={"temperature": 9}), "temperature", "temperature"),
    (lambda pb: request(pb, parameters={"temperature": "hot"}), "temperature", "temperature"),
    (lambda pb: request(pb, parameters={"model": "gpt-4o"}), "model", None),
    (lambda pb: request(pb, parameters={"timeout_s": 999}), "timeout_s", None),
    (lambda pb: request(pb, prompt="x" * 5000), "PROMPT", "messages"),
    (lambda pb: request(pb, labels=("a",) * 50, scores=(0.01,) * 50), "LABELS", None),
    (lambda pb: request(pb, scores=(float("nan"), 0.2)), "SCORES", None),
    (lambda pb: pb.InferenceRequest({"LABELS": np.array([[b"a", b"b"]], dtype=np.object_),
                                     "SCORES": np.array([[0.5]], dtype=np.float32)}), "LABELS", None),
])
def test_every_describe_refusal_names_its_field_and_the_front_answers_400(
        fake_pb_utils_module, fake, monkeypatch, make_request, field, param):  # noqa: F811
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    try:
        bad = make_request(pb_utils)
        model.execute([bad])
        error = bad.get_response_sender().wait().error()
    finally:
        model.finalize()
    assert error.code() == pb_utils.TritonError.INVALID_ARG
    coded = contract.read(error.message())
    assert coded is not None and coded.field == field, error.message()
    kind = contract.INVALID_PARAMETER if field[0].islower() else contract.INVALID_INPUT
    assert coded.code == kind
    mapped = front_error(InferenceServerException(error.message()))  # as a stream error: text only
    assert (mapped.status, mapped.param) == (400, param) and mapped.message == coded.text


def test_the_upstream_failure_reaches_the_front_as_a_503_to_retry(fake_pb_utils_module, fake, monkeypatch):  # noqa: F811
    pb_utils = fake_pb_utils_module
    fake.set_mode("500")
    model = make_model(monkeypatch, fake.base_url, on_failure="error", max_attempts="1")
    try:
        sent = request(pb_utils)
        model.execute([sent])
        error = sent.get_response_sender().wait().error()
    finally:
        model.finalize()
    assert error.code() == pb_utils.TritonError.UNAVAILABLE
    assert contract.read(error.message()).code == contract.UPSTREAM_UNAVAILABLE
    mapped = front_error(InferenceServerException("in ensemble 'classify_and_describe', " + error.message()))
    assert (mapped.status, mapped.code, mapped.headers()) == (503, "upstream_unavailable", {"Retry-After": "1"})


def test_an_unloading_model_refuses_with_its_code(fake_pb_utils_module, fake, monkeypatch):  # noqa: F811
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    model.finalize()
    late = request(pb_utils)
    model.execute([late])
    error = late.get_response_sender().wait().error()
    assert error.code() == pb_utils.TritonError.UNAVAILABLE
    assert contract.read(error.message()).code == contract.MODEL_UNLOADING
    assert front_error(InferenceServerException(error.message())).status == 503


def test_a_refused_image_names_image_and_the_front_points_at_the_message(fake_pb_utils_module):
    pb_utils = fake_pb_utils_module
    model = make_preprocess()
    bad = pb_utils.InferenceRequest({"IMAGE": np.array([[b"not an image"]], dtype=np.object_)})
    error = model.execute([bad])[0].error()
    assert error.code() == pb_utils.TritonError.INVALID_ARG
    assert contract.read(error.message()) == contract.CodedError(contract.INVALID_INPUT, "IMAGE",
                                                                 contract.read(error.message()).text)
    mapped = front_error(InferenceServerException("in ensemble 'classify', " + error.message()))
    assert (mapped.status, mapped.param) == (400, "messages") and mapped.message.startswith("IMAGE ")
