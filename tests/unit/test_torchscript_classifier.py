"""backends/torchscript_classifier without a server: load-time checks, batching, top-k.

The end-to-end checks use the exported EfficientNet-Lite0 (`make build`) and compare the
preprocess + classifier adapters with the eager PyTorch reference in tools/reference.py.
"""

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
CLASSIFIER_DIR = REPO / "model_repository" / "classifier"
pb_utils = sys.modules["triton_python_backend_utils"]  # the fake, installed by conftest.py
# torch 2.13 marks torch.jit deprecated; TorchScript is still what this backend serves.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


classifier_model = load_module("torchscript_classifier_model", REPO / "backends/torchscript_classifier/model.py")
preprocess_model = load_module("image_preprocess_model", REPO / "backends/image_preprocess/model.py")


@pytest.fixture(autouse=True)
def keep_torch_threads():
    # initialize() calls torch.set_num_threads; leave the test process as it was.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def model_config(parameters=None, input_dims=(3, 224, 224), k=5):
    return {
        "name": "classifier",
        "max_batch_size": 8,
        "input": [{"name": "PIXELS", "data_type": "TYPE_FP32", "dims": list(input_dims)}],
        "output": [
            {"name": "LABELS", "data_type": "TYPE_STRING", "dims": [k]},
            {"name": "SCORES", "data_type": "TYPE_FP32", "dims": [k]},
        ],
        "parameters": {key: {"string_value": value} for key, value in (parameters or {}).items()},
    }


def make_model(model_dir, config, module=classifier_model):
    model = module.TritonPythonModel()
    model.initialize({
        "model_config": json.dumps(config), "model_name": config["name"], "model_version": "1",
        "model_repository": str(model_dir), "model_instance_kind": "CPU", "model_instance_device_id": "0",
    })
    return model


class TinyClassifier(torch.nn.Module):
    """Mean colour -> logits; small enough to build per test, real TorchScript all the same."""

    def __init__(self, classes):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, classes)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A model folder like model_repository/classifier, with a 10-class TorchScript model."""
    (tmp_path / "1").mkdir()
    torch.jit.save(torch.jit.script(TinyClassifier(10).eval()), str(tmp_path / "1" / "model.pt"))
    (tmp_path / "labels.txt").write_text("".join(f"class {i}\n" for i in range(10)))
    return tmp_path


def request(pixels):
    return pb_utils.InferenceRequest({"PIXELS": np.ascontiguousarray(pixels, dtype=np.float32)})


# ---------------------------------------------------------------- load-time checks

def test_loads_a_generic_torchscript_model(tiny_model_dir):
    model = make_model(tiny_model_dir, model_config({"torch_num_threads": "1"}, input_dims=(3, 8, 8)))
    assert model.classifier.top_k == 5 and len(model.classifier.labels) == 10
    assert torch.get_num_threads() == 1


def test_labels_count_must_match_model_outputs(tiny_model_dir):
    (tiny_model_dir / "labels.txt").write_text("only\nnine\nlabels\n" * 3)
    with pytest.raises(pb_utils.TritonModelException, match="has 10 outputs but the labels file has 9 lines"):
        make_model(tiny_model_dir, model_config(input_dims=(3, 8, 8)))


def test_missing_model_file_says_how_to_fix(tiny_model_dir):
    with pytest.raises(pb_utils.TritonModelException, match=r"other\.pt not found .*export_classifier\.py"):
        make_model(tiny_model_dir, model_config({"model_file": "other.pt"}, input_dims=(3, 8, 8)))


def test_missing_labels_file_says_how_to_fix(tiny_model_dir):
    with pytest.raises(pb_utils.TritonModelException, match=r"labels file .*names\.txt not found"):
        make_model(tiny_model_dir, model_config({"labels_file": "names.txt"}, input_dims=(3, 8, 8)))


@pytest.mark.parametrize("params, words", [
    ({"torch_num_threads": "two"}, "torch_num_threads must be a positive integer"),
    ({"torch_num_threads": "0"}, "torch_num_threads must be a positive integer"),
    ({"model_file": " "}, "model_file must not be empty"),
    ({"mean": "1,2"}, "mean must be three comma-separated numbers"),
    ({"std": "128,0,128"}, "std values must be > 0"),
    ({"threads": "2"}, "unknown parameter(s) ['threads']"),
])
def test_bad_parameters_fail_the_load(tiny_model_dir, params, words):
    with pytest.raises(pb_utils.TritonModelException) as caught:
        make_model(tiny_model_dir, model_config(params, input_dims=(3, 8, 8)))
    assert words in str(caught.value)


def test_mean_and_std_normalise_the_pixels(tiny_model_dir):
    # torchvision-style values: the forward pass sees (x - mean) / std per channel.
    model = make_model(tiny_model_dir, model_config(
        {"mean": "123.675,116.28,103.53", "std": "58.395,57.12,57.375"}, input_dims=(3, 8, 8)))
    seen = []
    forward = model.classifier.model
    model.classifier.model = lambda x: seen.append(x.clone()) or forward(x)
    model.execute([request(np.full((1, 3, 8, 8), 200.0))])
    expected = (200.0 - np.array([123.675, 116.28, 103.53])) / np.array([58.395, 57.12, 57.375])
    np.testing.assert_allclose(seen[0][0, :, 0, 0].numpy(), expected, rtol=1e-6)


def test_top_k_larger_than_classes_fails(tiny_model_dir):
    with pytest.raises(pb_utils.TritonModelException, match="top_k 11 must be between 1 and the 10 classes"):
        make_model(tiny_model_dir, model_config(input_dims=(3, 8, 8), k=11))


def test_variable_k_comes_from_the_top_k_parameter(tiny_model_dir):
    model = make_model(tiny_model_dir, model_config({"top_k": "3"}, input_dims=(3, 8, 8), k=-1))
    response = model.execute([request(np.zeros((1, 3, 8, 8)))])[0]
    assert response.output("LABELS").shape == (1, 3)


def test_model_with_wrong_output_shape_fails(tmp_path):
    (tmp_path / "1").mkdir()
    torch.jit.save(torch.jit.script(torch.nn.Identity()), str(tmp_path / "1" / "model.pt"))
    (tmp_path / "labels.txt").write_text("a\nb\n")
    with pytest.raises(pb_utils.TritonModelException, match=r"must return logits \[batch, classes\]"):
        make_model(tmp_path, model_config(input_dims=(3, 8, 8)))


# ---------------------------------------------------------------- execute

def test_batch_of_requests_is_split_back_in_order(tiny_model_dir):
    model = make_model(tiny_model_dir, model_config(input_dims=(3, 8, 8)))
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=(n, 3, 8, 8)) for n in (1, 3, 2)]
    batched = model.execute([request(x) for x in inputs])
    assert len(batched) == 3
    for x, response in zip(inputs, batched):
        alone = model.execute([request(x)])[0]
        assert response.output("LABELS").shape == (len(x), 5)
        assert list(response.output("LABELS").ravel()) == list(alone.output("LABELS").ravel())
        np.testing.assert_allclose(response.output("SCORES"), alone.output("SCORES"), atol=1e-6)
        assert response.output("SCORES").dtype == np.float32
        assert response.output("LABELS")[0, 0].startswith(b"class ")


def test_scores_are_sorted_softmax_probabilities(tiny_model_dir):
    model = make_model(tiny_model_dir, model_config(input_dims=(3, 8, 8), k=10))
    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8))
    scores = model.execute([request(x)])[0].output("SCORES")
    assert np.all(np.diff(scores, axis=1) <= 0)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)


def test_non_finite_pixels_fail_only_their_request(tiny_model_dir):
    model = make_model(tiny_model_dir, model_config(input_dims=(3, 8, 8)))
    bad = np.zeros((1, 3, 8, 8))
    bad[0, 1, 2, 3] = np.nan
    responses = model.execute([request(np.zeros((1, 3, 8, 8))), request(bad), request(np.ones((1, 3, 8, 8)))])
    assert len(responses) == 3
    assert not responses[0].has_error() and not responses[2].has_error()
    assert responses[1].error().code() == pb_utils.TritonError.INVALID_ARG
    assert "NaN" in responses[1].error().message()


def test_forward_failure_answers_every_request_with_internal(tiny_model_dir, fake_pb_utils_module):
    model = make_model(tiny_model_dir, model_config(input_dims=(3, 8, 8)))

    def broken(pixels):
        raise RuntimeError("out of memory in a kernel")

    model.classifier.classify = broken
    responses = model.execute([request(np.zeros((1, 3, 8, 8))) for _ in range(3)])
    assert len(responses) == 3
    for response in responses:
        assert response.error().code() == pb_utils.TritonError.INTERNAL
        assert "out of memory" not in response.error().message()
    assert any("out of memory" in message for level, message in pb_utils.Logger.records if level == "error")


# ---------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def real_pipeline():
    """The committed preprocess and classifier configs' adapters on the exported model."""
    if not (CLASSIFIER_DIR / "1" / "model.pt").is_file() or not (CLASSIFIER_DIR / "labels.txt").is_file():
        pytest.fail("model_repository/classifier/1/model.pt or labels.txt missing: run `make build`")
    threads = torch.get_num_threads()
    classifier = make_model(CLASSIFIER_DIR, model_config({"torch_num_threads": "2"}))
    preprocess = preprocess_model.TritonPythonModel()
    preprocess_dir = REPO / "model_repository" / "preprocess"
    from test_image_preprocess import model_config as preprocess_config

    preprocess.initialize({"model_config": json.dumps(preprocess_config()), "model_name": "preprocess",
                           "model_version": "1", "model_repository": str(preprocess_dir)})
    yield preprocess, classifier
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def photos():
    from skimage import data_dir

    return {name: (pathlib.Path(data_dir) / f"{name}.png").read_bytes() for name in ("chelsea", "coffee")}


@pytest.mark.parametrize("name, expected_top", [
    ("chelsea", {"Egyptian cat", "tabby", "tiger cat"}),
    ("coffee", {"espresso"}),
])
def test_top5_matches_the_eager_reference(real_pipeline, photos, name, expected_top):
    from tools.reference import reference_top5

    preprocess, classifier = real_pipeline
    pixels = preprocess.execute([pb_utils.InferenceRequest({"IMAGE": np.array([[photos[name]]], dtype=np.object_)})])[0]
    assert not pixels.has_error()
    response = classifier.execute([request(pixels.output("PIXELS"))])[0]
    labels = [label.decode() for label in response.output("LABELS")[0]]
    scores = response.output("SCORES")[0]

    ref_labels, ref_scores = reference_top5(photos[name])
    assert labels == ref_labels
    np.testing.assert_allclose(scores, ref_scores, atol=1e-4)
    assert set(labels[:len(expected_top)]) == expected_top
    if name == "coffee":
        assert scores[0] > 0.8


def test_real_model_batches_like_single_requests(real_pipeline, photos):
    preprocess, classifier = real_pipeline
    images = np.array([[photos["chelsea"]], [photos["coffee"]]], dtype=np.object_)
    pixels = preprocess.execute([pb_utils.InferenceRequest({"IMAGE": images})])[0].output("PIXELS")
    together = classifier.execute([request(pixels[:1]), request(pixels[1:])])
    batch = classifier.execute([request(pixels)])[0]
    np.testing.assert_allclose(
        np.concatenate([r.output("SCORES") for r in together]), batch.output("SCORES"), atol=1e-5)
