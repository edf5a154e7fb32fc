"""Every classifier runtime the repository ships serves through the real server:
the committed `classifier` (ONNX fp32), the same config switched to the int8 file,
and switched to the TorchScript backend (the bring-your-own path the README
describes). Each variant is loaded beside the committed models on the session's
copy of the repository, fed the uint8 pixels of the server's own preprocess over
HTTP and gRPC, and must answer as the in-process eager reference does."""

import os
import shutil
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tools import model_config
from tools.reference import reference_top5

from .raw_infer import bytes_tensor, http_infer

# name -> (backend, parameters, file in the version folder): the README's switch.
VARIANTS = {
    "classifier_int8": ("onnx_classifier", {"model_file": "model.int8.onnx", "intra_op_threads": "1"},
                        "model.int8.onnx"),
    "classifier_torchscript": ("torchscript_classifier", {"model_file": "model.pt", "labels_file": "labels.txt",
                                                          "torch_num_threads": "1"}, "model.pt"),
}
PROTOCOLS = {"http": httpclient, "grpc": grpcclient}


def variant_config(name, backend, parameters):
    """The committed classifier config with another name, backend and parameters, one instance."""
    config = model_config.read(model_config_path())
    config.name, config.backend = name, backend
    config.parameters.clear()
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    config.instance_group[0].count = 1
    return model_config.render(config)


def model_config_path():
    from .public_models import REPO

    return REPO / "model_repository" / "classifier" / "config.pbtxt"


@pytest.fixture(scope="module")
def variants(triton):
    admin = httpclient.InferenceServerClient(triton.http_url)
    source = triton.repository / "classifier"
    try:
        for name, (backend, parameters, file_name) in VARIANTS.items():
            folder = triton.repository / name
            (folder / "1").mkdir(parents=True)
            os.symlink(source / "1" / file_name, folder / "1" / file_name)
            os.symlink(source / "labels.txt", folder / "labels.txt")
            (folder / "config.pbtxt").write_text(variant_config(name, backend, parameters))
            admin.load_model(name, headers=triton.admin_headers)
            assert admin.is_model_ready(name), name
        yield list(VARIANTS)
    finally:
        for name in VARIANTS:
            if admin.is_model_ready(name):
                admin.unload_model(name, headers=triton.admin_headers)
        deadline = time.monotonic() + 60
        while any(admin.is_model_ready(name) for name in VARIANTS) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in VARIANTS:
            shutil.rmtree(triton.repository / name, ignore_errors=True)
        admin.close()


@pytest.fixture(scope="module")
def pixels(triton, photos):
    """{photo: uint8 [1,3,224,224]} from the server's own preprocess."""
    out = {}
    for name, data in photos.items():
        answer = http_infer(triton.http_url, "preprocess", [bytes_tensor("IMAGE", [[data]])])
        assert answer.ok, answer.message
        assert answer.outputs["PIXELS"].dtype == np.uint8
        out[name] = answer.outputs["PIXELS"]
    return out


def classify(triton, protocol, model, pixels):
    module = PROTOCOLS[protocol]
    client = module.InferenceServerClient(triton.http_url if protocol == "http" else triton.grpc_url)
    try:
        tensor = module.InferInput("PIXELS", list(pixels.shape), "UINT8")
        tensor.set_data_from_numpy(pixels)
        result = client.infer(model, [tensor])
        return [label.decode() for label in result.as_numpy("LABELS")[0]], result.as_numpy("SCORES")[0]
    finally:
        client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", ["classifier", *VARIANTS])
def test_every_runtime_answers_like_the_eager_reference(triton, variants, pixels, photos, protocol, model):
    for name in ("chelsea", "coffee"):
        labels, scores = classify(triton, protocol, model, pixels[name])
        ref_labels, ref_scores = reference_top5(photos[name])
        if model == "classifier_int8":  # quantised: the same answer, not the same digits
            assert labels[0] == ref_labels[0] and len(set(labels) & set(ref_labels)) >= 4, (name, labels)
            np.testing.assert_allclose(scores[0], ref_scores[0], atol=0.05)
        else:
            assert labels == ref_labels, (name, labels)
            np.testing.assert_allclose(scores, ref_scores, atol=1e-4)


def test_the_committed_classifier_serves_onnx_fp32(triton):
    config = httpclient.InferenceServerClient(triton.http_url).get_model_config("classifier")
    assert config["backend"] == "onnx_classifier"
    assert config["parameters"]["model_file"]["string_value"] == "model.onnx"
    assert config["input"][0]["data_type"] == "TYPE_UINT8"
