"""backends/onnx_classifier without a server, on the graphs `make build` exports
(scripts/export_onnx.py): load-time checks, batching, and the promises of the export:
fp32 ONNX equals TorchScript on real photos, int8 agrees with fp32 on a fixed set of
evaluation crops, and a phone-size JPEG decoded at reduced scale classifies as the
full decode does.
"""

import importlib.util
import json
import pathlib
import sys

import numpy as np
import onnx
import pytest
import torch

from scripts import export_onnx

REPO = pathlib.Path(__file__).resolve().parents[2]
CLASSIFIER_DIR = REPO / "model_repository" / "classifier"
FP32, INT8 = "model.onnx", "model.int8.onnx"
pb_utils = sys.modules["triton_python_backend_utils"]  # the fake, installed by conftest.py
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


onnx_model = load_module("onnx_classifier_model", REPO / "backends/onnx_classifier/model.py")
torchscript_model = load_module("torchscript_classifier_model", REPO / "backends/torchscript_classifier/model.py")
preprocess_model = load_module("image_preprocess_model", REPO / "backends/image_preprocess/model.py")


@pytest.fixture(scope="module", autouse=True)
def exported():
    for name in (FP32, INT8, "model.pt"):
        if not (CLASSIFIER_DIR / "1" / name).is_file():
            pytest.fail(f"model_repository/classifier/1/{name} missing: run `make build`")


def model_config(parameters=None, dtype="TYPE_UINT8", input_dims=(3, 224, 224), k=5):
    return {
        "name": "classifier",
        "max_batch_size": 8,
        "input": [{"name": "PIXELS", "data_type": dtype, "dims": list(input_dims)}],
        "output": [
            {"name": "LABELS", "data_type": "TYPE_STRING", "dims": [k]},
            {"name": "SCORES", "data_type": "TYPE_FP32", "dims": [k]},
        ],
        "parameters": {key: {"string_value": value} for key, value in (parameters or {}).items()},
    }


def make_model(config, model_dir=CLASSIFIER_DIR, module=onnx_model, kind="CPU"):
    model = module.TritonPythonModel()
    model.initialize({
        "model_config": json.dumps(config), "model_name": config["name"], "model_version": "1",
        "model_repository": str(model_dir), "model_instance_kind": kind, "model_instance_device_id": "0",
    })
    return model


def request(pixels, dtype=np.uint8):
    return pb_utils.InferenceRequest({"PIXELS": np.ascontiguousarray(pixels, dtype=dtype)})


def top(response):
    assert not response.has_error(), response.error().message()
    return [label.decode() for label in response.output("LABELS")[0]], response.output("SCORES")[0]


@pytest.fixture(scope="module")
def fp32_model():
    return make_model(model_config({"model_file": FP32}))


@pytest.fixture(scope="module")
def photos():
    from skimage import data_dir

    return {name: (pathlib.Path(data_dir) / f"{name}.png").read_bytes() for name in ("chelsea", "coffee")}


@pytest.fixture(scope="module")
def preprocess():
    from test_image_preprocess import model_config as preprocess_config

    model = preprocess_model.TritonPythonModel()
    config = preprocess_config()
    config["output"][0]["data_type"] = "TYPE_UINT8"
    model.initialize({"model_config": json.dumps(config), "model_name": "preprocess", "model_version": "1",
                      "model_repository": str(REPO / "model_repository" / "preprocess")})
    return model


def pixels_of(preprocess, data):
    response = preprocess.execute([pb_utils.InferenceRequest({"IMAGE": np.array([[data]], dtype=np.object_)})])[0]
    assert not response.has_error()
    return response.output("PIXELS")


# ---------------------------------------------------------------- load-time checks

def test_committed_config_loads_and_serves_the_measured_default():
    from tools.model_config import read

    config = read(CLASSIFIER_DIR / "config.pbtxt")
    assert config.backend == "onnx_classifier"
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    model = make_model(model_config(parameters))
    assert model.classifier.top_k == 5 and model.classifier.intra_op_threads == 1
    assert model.classifier.session.get_session_options().intra_op_num_threads == 1


def test_a_config_without_model_file_serves_the_fp32_graph(fp32_model, fake_pb_utils_module):
    """The default is model.onnx (docs/classifier-runtime.md): the int8 file misses the
    agreement target, so a config that names no file (a trimmed or bring-your-own
    copy) must not silently get it."""
    assert onnx_model.parse_settings({}).model_file == FP32
    default = make_model(model_config())
    assert any(level == "info" and "ready: model.onnx," in message
               for level, message in fake_pb_utils_module.Logger.records)
    pixels = np.random.default_rng(7).integers(0, 256, (2, 3, 224, 224), dtype=np.uint8)
    int8 = make_model(model_config({"model_file": INT8}))
    (served,), (fp32,), (quantised,) = (m.execute([request(pixels)]) for m in (default, fp32_model, int8))
    np.testing.assert_array_equal(served.output("SCORES"), fp32.output("SCORES"))
    assert not np.array_equal(served.output("SCORES"), quantised.output("SCORES"))  # the check can tell them apart


@pytest.mark.parametrize("config, words", [
    (model_config(dtype="TYPE_FP32"), "input PIXELS is tensor(uint8); the config declares float32"),
    (model_config(dtype="TYPE_INT16"), "input PIXELS must be TYPE_UINT8 or TYPE_FP32, the config declares int16"),
    (model_config(k=3), "returns (5,) scores and (5,) labels per image; the config's outputs ask for 3"),
    (model_config(input_dims=(3, 200, 200)), "has dims [3, 224, 224] after the batch; the config has [3, 200, 200]"),
    (model_config({"model_file": "other.onnx"}), "other.onnx not found (set parameter model_file, or run scripts/export_onnx.py)"),
    (model_config({"intra_op_threads": "0"}), "intra_op_threads must be a positive integer"),
    (model_config({"intra_op_threads": "one"}), "intra_op_threads must be a positive integer"),
    (model_config({"model_file": " "}), "model_file must not be empty"),
    (model_config({"threads": "1"}), "unknown parameter(s) ['threads']"),
])
def test_a_config_that_does_not_fit_the_graph_fails_the_load(config, words):
    with pytest.raises(pb_utils.TritonModelException) as caught:
        make_model(config)
    assert words in str(caught.value) and str(caught.value).startswith("classifier: ")


def test_a_gpu_instance_is_sent_to_the_onnxruntime_backend():
    with pytest.raises(pb_utils.TritonModelException, match="configs/gpu.pbtxt"):
        make_model(model_config(), kind="GPU")


def test_a_corrupt_file_fails_the_load(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.onnx").write_bytes(b"\x08\x07not a protobuf" * 10)
    with pytest.raises(pb_utils.TritonModelException, match="model.onnx cannot be loaded by onnxruntime"):
        make_model(model_config({"model_file": "model.onnx"}), model_dir=tmp_path)


def test_a_graph_without_the_labels_output_fails_the_load(tmp_path):
    graph = onnx.load(str(CLASSIFIER_DIR / "1" / FP32))
    graph.graph.output.remove(next(o for o in graph.graph.output if o.name == "LABELS"))
    (tmp_path / "1").mkdir()
    onnx.save(graph, str(tmp_path / "1" / "model.onnx"))
    with pytest.raises(pb_utils.TritonModelException, match="must have a tensor\\(string\\) output named LABELS"):
        make_model(model_config({"model_file": "model.onnx"}), model_dir=tmp_path)


# ---------------------------------------------------------------- execute

def test_batch_of_requests_is_split_back_in_order(fp32_model):
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 256, size=(n, 3, 224, 224)) for n in (1, 3, 2)]
    batched = fp32_model.execute([request(x) for x in inputs])
    assert len(batched) == 3
    for x, response in zip(inputs, batched):
        alone = fp32_model.execute([request(x)])[0]
        assert response.output("LABELS").shape == (len(x), 5) and response.output("SCORES").dtype == np.float32
        assert list(response.output("LABELS").ravel()) == list(alone.output("LABELS").ravel())
        assert isinstance(response.output("LABELS")[0, 0], bytes)
        np.testing.assert_allclose(response.output("SCORES"), alone.output("SCORES"), atol=1e-6)


def test_failure_answers_every_request_with_internal_and_logs_it(fp32_model, fake_pb_utils_module, monkeypatch):
    def broken(pixels):
        raise RuntimeError("onnxruntime: arena allocation failed")

    monkeypatch.setattr(fp32_model.classifier, "classify", broken)
    responses = fp32_model.execute([request(np.zeros((1, 3, 224, 224))) for _ in range(3)])
    assert len(responses) == 3
    for response in responses:
        assert response.error().code() == pb_utils.TritonError.INTERNAL
        assert "arena" not in response.error().message()
    assert any("arena allocation" in message for level, message in pb_utils.Logger.records if level == "error")


# ---------------------------------------------------------------- the exported graphs on real photos

@pytest.mark.parametrize("name", ["chelsea", "coffee"])
def test_onnx_fp32_equals_torchscript_and_the_eager_reference(fp32_model, preprocess, photos, name):
    from tools.reference import reference_top5

    pixels = pixels_of(preprocess, photos[name])
    assert pixels.dtype == np.uint8
    labels, scores = top(fp32_model.execute([request(pixels)])[0])
    torchscript = make_model(model_config(dtype="TYPE_UINT8"), module=torchscript_model)
    ts_labels, ts_scores = top(torchscript.execute([request(pixels)])[0])
    assert labels == ts_labels
    np.testing.assert_allclose(scores, ts_scores, atol=export_onnx.MAX_SCORE_DIFF)
    ref_labels, ref_scores = reference_top5(photos[name])
    assert labels == ref_labels
    np.testing.assert_allclose(scores, ref_scores, atol=export_onnx.MAX_SCORE_DIFF)


def test_int8_agrees_with_fp32_on_a_fixed_set_of_evaluation_crops():
    # 120 crops of the evaluation photos (never calibrated on). At least 97.5 % keep their
    # top-1 class: the level int8 measures at (97-98 % on 600 crops), short of the 99 %
    # target, which is why fp32 is the default (docs/classifier-runtime.md). The 600-crop
    # measurement: python -m tools.classifier_accuracy.
    pixels = export_onnx.evaluation_pixels(120)
    fp32_scores, fp32_labels = export_onnx.run(export_onnx.session(str(CLASSIFIER_DIR / "1" / FP32)), pixels)
    int8_scores, int8_labels = export_onnx.run(export_onnx.session(str(CLASSIFIER_DIR / "1" / INT8)), pixels)
    changed = int((fp32_labels[:, 0] != int8_labels[:, 0]).sum())
    assert changed <= 3, f"int8 changed the top-1 class of {changed} of 120 crops"
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(fp32_labels, int8_labels)])
    assert overlap >= 0.95
    # Quantised, not a copy of the fp32 graph: the scores move.
    assert np.abs(fp32_scores - int8_scores).max() > 1e-3


def test_calibration_and_evaluation_photos_are_apart():
    assert not set(export_onnx.CALIBRATION_PHOTOS) & set(export_onnx.EVALUATION_PHOTOS)
    for name in export_onnx.CALIBRATION_PHOTOS + export_onnx.EVALUATION_PHOTOS:
        assert export_onnx.photo_path(name).is_file(), name


def test_phone_size_jpeg_at_reduced_scale_classifies_as_the_full_decode(fp32_model, preprocess):
    from test_image_preprocess import phone_photo as make_phone_photo

    from tools.reference import reference_pixels

    data = make_phone_photo.__wrapped__()
    drafted = pixels_of(preprocess, data)
    labels, scores = top(fp32_model.execute([request(drafted)])[0])
    full_labels, full_scores = top(fp32_model.execute([request(reference_pixels(data)[None])])[0])
    assert labels[:3] == full_labels[:3] and labels[0] in {"Egyptian cat", "tabby", "tiger cat"}
    np.testing.assert_allclose(scores[0], full_scores[0], atol=0.05)


# ---------------------------------------------------------------- the uint8 path (both backends)

@pytest.mark.parametrize("name", ["chelsea", "coffee"])
def test_uint8_pixels_give_what_the_float_path_gave(preprocess, photos, name):
    """Before: preprocess sent (x - 127) / 128 as float32 and the TorchScript file ran on it.
    Now: uint8 goes over, and each classifier normalises. The network sees the same input
    bit for bit in TorchScript (the same float ops) and gives the same scores (up to the
    thread count's summation order); the ONNX graph's within MAX_SCORE_DIFF."""
    from tools.reference import normalise

    pixels = pixels_of(preprocess, photos[name])
    torchscript = make_model(model_config(dtype="TYPE_UINT8"), module=torchscript_model)
    seen = []
    forward = torchscript.classifier.model
    torchscript.classifier.model = lambda x: seen.append(x.clone()) or forward(x)
    labels, from_uint8 = top(torchscript.execute([request(pixels)])[0])
    _, from_float = top(torchscript.execute([request(pixels, dtype=np.float32)])[0])
    np.testing.assert_array_equal(seen[0].numpy(), normalise(pixels))
    np.testing.assert_array_equal(from_uint8, from_float)
    with torch.inference_mode():
        before = torch.softmax(forward(torch.from_numpy(normalise(pixels))), dim=1).topk(5, dim=1)
    assert labels == [torchscript.classifier.labels[i].decode() for i in before.indices[0]]
    np.testing.assert_allclose(from_uint8, before.values.numpy()[0], atol=1e-6)
    onnx_classifier = make_model(model_config({"model_file": FP32}))
    _, from_onnx = top(onnx_classifier.execute([request(pixels)])[0])
    np.testing.assert_allclose(from_onnx, before.values.numpy()[0], atol=export_onnx.MAX_SCORE_DIFF)
