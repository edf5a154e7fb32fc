"""backends/image, steps classify (classifier), without a server, one suite for both runtimes (the `runtime`
parameter): its validation, load-time checks, batching and failures on each runtime, the
real model through preprocess on each, and the promises of the export on the graphs `make
build` writes (scripts/export_onnx.py): fp32 ONNX equals TorchScript on real photos, int8
agrees with fp32 on a fixed set of evaluation crops, and a phone-size JPEG decoded at reduced
scale classifies as the full decode does. TorchScript's generic checks run on a tiny
10-class model built per test.
"""

import json
import pathlib
import subprocess
import sys
from typing import Callable, NamedTuple

import numpy as np
import onnx
import pytest
import torch
from backend_model import load_model
from classify_describe_server import classifier_runtime
from classify_describe_server import error_contract as contract

from scripts import export_onnx

REPO = pathlib.Path(__file__).resolve().parents[2]
CLASSIFIER_DIR = REPO / "model_repository" / "classifier"
FP32, INT8 = "model.onnx", "model.int8.onnx"
RUNTIMES = ["onnxruntime", "torchscript"]
pb_utils = sys.modules["triton_python_backend_utils"]  # the fake, installed by conftest.py
# torch 2.13 marks torch.jit deprecated; TorchScript is still what the torchscript runtime serves.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")


classifier_model = load_model("image")
preprocess_model = load_model("image")


@pytest.fixture(scope="module", autouse=True)
def exported():
    for name in (f"1/{FP32}", f"1/{INT8}", "1/model.pt", "labels.txt"):
        if not (CLASSIFIER_DIR / name).is_file():
            pytest.fail(f"model_repository/classifier/{name} missing: run `make build`")


@pytest.fixture(autouse=True)
def keep_torch_threads():
    # The torchscript runtime calls torch.set_num_threads at load; leave the test process as it was.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def model_config(runtime, parameters=None, dtype="TYPE_UINT8", input_dims=(3, 224, 224), k=5):
    """A classifier config (backends/image, steps classify); runtime None leaves the parameter out."""
    parameters = {"steps": "classify", **({"runtime": runtime} if runtime else {}), **(parameters or {})}
    return {
        "name": "classifier",
        "max_batch_size": 8,
        "input": [{"name": "PIXELS", "data_type": dtype, "dims": list(input_dims)}],
        "output": [
            {"name": "LABELS", "data_type": "TYPE_STRING", "dims": [k]},
            {"name": "SCORES", "data_type": "TYPE_FP32", "dims": [k]},
        ],
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
    }


def onnx_config(parameters=None, **kwargs):
    return model_config("onnxruntime", parameters, **kwargs)


def tiny_config(parameters=None, dtype="TYPE_FP32", input_dims=(3, 8, 8), **kwargs):
    """The torchscript runtime on TinyClassifier's float 3x8x8 input."""
    return model_config("torchscript", parameters, dtype=dtype, input_dims=input_dims, **kwargs)


def make_model(config, model_dir=CLASSIFIER_DIR, kind="CPU"):
    model = classifier_model.TritonPythonModel()
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


@pytest.fixture(scope="module")
def fp32_model():
    return make_model(onnx_config({"model_file": FP32}))


@pytest.fixture(scope="module")
def photos():
    from skimage import data_dir

    return {name: (pathlib.Path(data_dir) / f"{name}.png").read_bytes() for name in ("chelsea", "coffee")}


def make_preprocess(output_type):
    from test_image_preprocess import model_config as preprocess_config

    model = preprocess_model.TritonPythonModel()
    config = preprocess_config()
    config["output"][0]["data_type"] = output_type
    model.initialize({"model_config": json.dumps(config), "model_name": "preprocess", "model_version": "1",
                      "model_repository": str(REPO / "model_repository" / "preprocess")})
    return model


@pytest.fixture(scope="module")
def preprocess():
    return make_preprocess("TYPE_UINT8")


def pixels_of(preprocess, data):
    response = preprocess.execute([pb_utils.InferenceRequest({"IMAGE": np.array([[data]], dtype=np.object_)})])[0]
    assert not response.has_error()
    return response.output("PIXELS")


# ---------------------------------------------------------------- the runtime parameter

@pytest.mark.parametrize("parameters, words", [
    ({}, 'parameter runtime is missing: set it to "onnxruntime" or "torchscript" (parameters { key: "runtime"'),
    ({"runtime": "tensorrt"}, "parameter runtime is 'tensorrt': set it to \"onnxruntime\" or \"torchscript\""),
    ({"runtime": " "}, "parameter runtime is ' ': set it to"),
    ({"runtime": "onnxruntime", "torch_num_threads": "1"},
     "unknown parameter(s) ['torch_num_threads'] for runtime onnxruntime; "
     "known: ['idle_intra_op_threads', 'intra_op_threads', 'model_file', 'runtime']"),
    ({"runtime": "torchscript", "intra_op_threads": "1"},
     "unknown parameter(s) ['intra_op_threads'] for runtime torchscript; known: ['labels_file', 'mean', 'model_file', "
     "'runtime', 'std', 'top_k', 'torch_num_threads']"),
])
def test_the_runtime_parameter_is_checked_at_load_and_says_what_to_fix(parameters, words):
    with pytest.raises(pb_utils.TritonModelException) as caught:
        make_model(model_config(None, parameters))
    assert words in str(caught.value) and str(caught.value).startswith("classifier: ")


def test_each_runtime_has_its_own_defaults():
    assert classifier_runtime.parse_settings({"runtime": "onnxruntime"}) == classifier_runtime.OnnxRuntimeSettings(
        model_file=FP32, intra_op_threads=1, idle_intra_op_threads=1)
    assert classifier_runtime.parse_settings({"runtime": " torchscript "}) == classifier_runtime.TorchScriptSettings(
        model_file="model.pt", labels_file="labels.txt", torch_num_threads=1, top_k=5,
        mean=(127.0, 127.0, 127.0), std=(128.0, 128.0, 128.0))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_serves_the_shipped_weights_and_says_which(runtime, fake_pb_utils_module):
    model_file = {"onnxruntime": FP32, "torchscript": "model.pt"}[runtime]
    model = make_model(model_config(runtime))
    library = {"onnxruntime": "onnxruntime", "torchscript": "torch"}[runtime]
    assert f"{library} thread(s)" in model.classifier.details
    assert any(level == "info" and f"ready: {model_file}, runtime {runtime}, top 5," in message
               for level, message in fake_pb_utils_module.Logger.records)


def test_an_onnxruntime_instance_never_imports_torch():
    """Half the stub's resident memory (docs/classifier-runtime.md): torch loads only for torchscript."""
    script = (
        "import sys, numpy as np, classify_describe_server.classifier_runtime as r\n"
        "tensors = r.Tensors('PIXELS', (3, 224, 224), np.dtype(np.uint8), 'SCORES', 'LABELS', 5)\n"
        f"classifier = r.load(r.parse_settings({{'runtime': 'onnxruntime'}}), {str(CLASSIFIER_DIR)!r}, 1, tensors)\n"
        "assert classifier.classify(np.zeros((1, 3, 224, 224), np.uint8))[0].shape == (1, 5)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------- load-time checks

def test_committed_config_loads_and_serves_the_measured_default():
    from tools.model_config import read

    config = read(CLASSIFIER_DIR / "config.pbtxt")
    assert config.backend == "image"
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["steps"] == "classify" and parameters["runtime"] == "onnxruntime"
    model = make_model(model_config(None, parameters))
    assert model.classifier.top_k == 5 and model.classifier.intra_op_threads == 1
    assert model.classifier.session.get_session_options().intra_op_num_threads == 1
    assert model.classifier.idle_session is model.classifier.session  # classify_with_view's setting, not this one's


def test_a_pass_takes_the_idle_threads_only_when_asked_and_answers_the_same(preprocess, photos):
    wide = make_model(onnx_config({"idle_intra_op_threads": "2"})).classifier
    assert wide.idle_threads == 2 and wide.idle_session is not wide.session
    assert wide.idle_session.get_session_options().intra_op_num_threads == 2
    assert "1 onnxruntime thread(s), 2 when the other instances are idle" in wide.details
    # The wide pass's workers spin between its ops and stop when it ends; the narrow ones never spin.
    wide_options, narrow_options = wide.idle_session.get_session_options(), wide.session.get_session_options()
    assert wide_options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert wide_options.get_session_config_entry("session.force_spinning_stop") == "1"
    assert narrow_options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    runs = []
    for session in (wide.session, wide.idle_session):  # which session each call ran on
        session.run = (lambda run, threads: lambda *a, **k: runs.append(threads) or run(*a, **k))(
            session.run, session.get_session_options().intra_op_num_threads)
    pixels = np.concatenate([pixels_of(preprocess, photo) for photo in photos.values()])
    (narrow_labels, narrow_scores), (wide_labels, wide_scores) = (classifier_runtime.classify_rows(wide, [pixels], idle=idle)[0]
                                                                  for idle in (False, True))
    assert runs == [1, 2]
    assert narrow_labels.tolist() == wide_labels.tolist()
    np.testing.assert_allclose(wide_scores, narrow_scores, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("idle", ["1", "3"])
def test_idle_threads_at_most_the_busy_ones_make_no_second_session(idle):
    classifier = make_model(onnx_config({"intra_op_threads": "3", "idle_intra_op_threads": idle})).classifier
    assert classifier.idle_threads is None and classifier.idle_session is classifier.session
    assert "when the other instances are idle" not in classifier.details


def test_a_config_without_model_file_serves_the_fp32_graph(fp32_model, fake_pb_utils_module):
    """The default is model.onnx (docs/classifier-runtime.md): the int8 file misses the
    agreement target, so a config that names no file (a trimmed or bring-your-own
    copy) must not silently get it."""
    assert classifier_runtime.parse_settings({"runtime": "onnxruntime"}).model_file == FP32
    default = make_model(onnx_config())
    assert any(level == "info" and "ready: model.onnx," in message
               for level, message in fake_pb_utils_module.Logger.records)
    pixels = np.random.default_rng(7).integers(0, 256, (2, 3, 224, 224), dtype=np.uint8)
    int8 = make_model(onnx_config({"model_file": INT8}))
    (served,), (fp32,), (quantised,) = (m.execute([request(pixels)]) for m in (default, fp32_model, int8))
    np.testing.assert_array_equal(served.output("SCORES"), fp32.output("SCORES"))
    assert not np.array_equal(served.output("SCORES"), quantised.output("SCORES"))  # the check can tell them apart


@pytest.mark.parametrize("runtime, parameters, words", [
    ("onnxruntime", {"intra_op_threads": "0"}, "intra_op_threads must be a positive integer"),
    ("onnxruntime", {"intra_op_threads": "one"}, "intra_op_threads must be a positive integer"),
    ("onnxruntime", {"model_file": " "}, "model_file must not be empty"),
    ("onnxruntime", {"threads": "1"}, "unknown parameter(s) ['threads']"),
    ("torchscript", {"torch_num_threads": "two"}, "torch_num_threads must be a positive integer"),
    ("torchscript", {"torch_num_threads": "0"}, "torch_num_threads must be a positive integer"),
    ("torchscript", {"model_file": " "}, "model_file must not be empty"),
    ("torchscript", {"mean": "1,2"}, "mean must be three comma-separated numbers"),
    ("torchscript", {"std": "128,0,128"}, "std values must be > 0"),
    ("torchscript", {"threads": "2"}, "unknown parameter(s) ['threads']"),
])
def test_bad_parameters_fail_the_load(runtime, parameters, words):
    with pytest.raises(pb_utils.TritonModelException) as caught:
        make_model(model_config(runtime, parameters))
    assert words in str(caught.value) and str(caught.value).startswith("classifier: ")


@pytest.mark.parametrize("runtime, parameters, words", [
    ("onnxruntime", {"model_file": "other.onnx"},
     r"other\.onnx not found \(set parameter model_file, or run scripts/export_onnx\.py\)"),
    ("torchscript", {"model_file": "other.pt"}, r"other\.pt not found .*export_classifier\.py"),
    ("torchscript", {"labels_file": "names.txt"}, r"labels file .*names\.txt not found"),
])
def test_a_missing_file_says_how_to_fix(runtime, parameters, words):
    with pytest.raises(pb_utils.TritonModelException, match=words):
        make_model(model_config(runtime, parameters))


@pytest.mark.parametrize("config, words", [
    (onnx_config(dtype="TYPE_FP32"), "input PIXELS is tensor(uint8); the config declares float32"),
    (onnx_config(dtype="TYPE_INT16"), "input PIXELS must be TYPE_UINT8 or TYPE_FP32, the config declares int16"),
    (onnx_config(k=3), "returns (5,) scores and (5,) labels per image; the config's outputs ask for 3"),
    (onnx_config(k=-1), "outputs LABELS and SCORES must both have dims [k], k > 0 (the graph's k)"),
    (onnx_config(input_dims=(3, 200, 200)), "has dims [3, 224, 224] after the batch; the config has [3, 200, 200]"),
])
def test_a_config_that_does_not_fit_the_graph_fails_the_load(config, words):
    with pytest.raises(pb_utils.TritonModelException) as caught:
        make_model(config)
    assert words in str(caught.value) and str(caught.value).startswith("classifier: ")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_outputs_of_different_k_fail_the_load(runtime):
    config = model_config(runtime)
    config["output"][1]["dims"] = [3]
    with pytest.raises(pb_utils.TritonModelException, match=r"outputs LABELS and SCORES must both have dims \[k\]"):
        make_model(config)


def test_a_gpu_instance_is_sent_to_the_onnxruntime_backend():
    with pytest.raises(pb_utils.TritonModelException, match="configs/gpu.pbtxt"):
        make_model(onnx_config(), kind="GPU")


def test_a_corrupt_file_fails_the_load(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.onnx").write_bytes(b"\x08\x07not a protobuf" * 10)
    with pytest.raises(pb_utils.TritonModelException, match="model.onnx cannot be loaded by onnxruntime"):
        make_model(onnx_config({"model_file": "model.onnx"}), model_dir=tmp_path)


def test_a_graph_without_the_labels_output_fails_the_load(tmp_path):
    graph = onnx.load(str(CLASSIFIER_DIR / "1" / FP32))
    graph.graph.output.remove(next(o for o in graph.graph.output if o.name == "LABELS"))
    (tmp_path / "1").mkdir()
    onnx.save(graph, str(tmp_path / "1" / "model.onnx"))
    with pytest.raises(pb_utils.TritonModelException, match="must have a tensor\\(string\\) output named LABELS"):
        make_model(onnx_config({"model_file": "model.onnx"}), model_dir=tmp_path)


def test_loads_a_generic_torchscript_model(tiny_model_dir):
    model = make_model(tiny_config({"torch_num_threads": "1"}), tiny_model_dir)
    assert model.classifier.top_k == 5 and len(model.classifier.labels) == 10
    assert torch.get_num_threads() == 1


def test_labels_count_must_match_model_outputs(tiny_model_dir):
    (tiny_model_dir / "labels.txt").write_text("only\nnine\nlabels\n" * 3)
    with pytest.raises(pb_utils.TritonModelException, match="has 10 outputs but the labels file has 9 lines"):
        make_model(tiny_config(), tiny_model_dir)


def test_mean_and_std_normalise_the_pixels(tiny_model_dir):
    # torchvision-style values: the forward pass sees (x - mean) / std per channel.
    model = make_model(tiny_config({"mean": "123.675,116.28,103.53", "std": "58.395,57.12,57.375"}), tiny_model_dir)
    seen = []
    forward = model.classifier.model
    model.classifier.model = lambda x: seen.append(x.clone()) or forward(x)
    model.execute([request(np.full((1, 3, 8, 8), 200.0), dtype=np.float32)])
    expected = (200.0 - np.array([123.675, 116.28, 103.53])) / np.array([58.395, 57.12, 57.375])
    np.testing.assert_allclose(seen[0][0, :, 0, 0].numpy(), expected, rtol=1e-6)


def test_top_k_larger_than_classes_fails(tiny_model_dir):
    with pytest.raises(pb_utils.TritonModelException, match="top_k 11 must be between 1 and the 10 classes"):
        make_model(tiny_config(k=11), tiny_model_dir)


def test_variable_k_comes_from_the_top_k_parameter(tiny_model_dir):
    model = make_model(tiny_config({"top_k": "3"}, k=-1), tiny_model_dir)
    response = model.execute([request(np.zeros((1, 3, 8, 8)), dtype=np.float32)])[0]
    assert response.output("LABELS").shape == (1, 3)


def test_model_with_wrong_output_shape_fails(tmp_path):
    (tmp_path / "1").mkdir()
    torch.jit.save(torch.jit.script(torch.nn.Identity()), str(tmp_path / "1" / "model.pt"))
    (tmp_path / "labels.txt").write_text("a\nb\n")
    with pytest.raises(pb_utils.TritonModelException, match=r"must return logits \[batch, classes\]"):
        make_model(tiny_config(), tmp_path)


# ---------------------------------------------------------------- execute, on each runtime

class Served(NamedTuple):
    model: object
    pixels: Callable  # (rng, n) -> n images the model takes
    label_prefix: bytes  # every class name starts with it


@pytest.fixture(params=RUNTIMES)
def served(request, tiny_model_dir):
    """onnxruntime: the exported fp32 graph; torchscript: the tiny 10-class model."""
    if request.param == "onnxruntime":
        return Served(request.getfixturevalue("fp32_model"),
                      lambda rng, n: rng.integers(0, 256, size=(n, 3, 224, 224)).astype(np.uint8), b"")
    return Served(make_model(tiny_config(), tiny_model_dir),
                  lambda rng, n: rng.normal(size=(n, 3, 8, 8)).astype(np.float32), b"class ")


def test_batch_of_requests_is_split_back_in_order(served):
    rng = np.random.default_rng(0)
    inputs = [served.pixels(rng, n) for n in (1, 3, 2)]
    batched = served.model.execute([request(x, dtype=x.dtype) for x in inputs])
    assert len(batched) == 3
    for x, response in zip(inputs, batched):
        alone = served.model.execute([request(x, dtype=x.dtype)])[0]
        assert response.output("LABELS").shape == (len(x), 5) and response.output("SCORES").dtype == np.float32
        assert list(response.output("LABELS").ravel()) == list(alone.output("LABELS").ravel())
        assert isinstance(response.output("LABELS")[0, 0], bytes)
        assert response.output("LABELS")[0, 0].startswith(served.label_prefix)
        np.testing.assert_allclose(response.output("SCORES"), alone.output("SCORES"), atol=1e-6)


def test_failure_answers_every_request_with_internal_and_logs_it(served, fake_pb_utils_module, monkeypatch):
    def broken(pixels):
        raise RuntimeError("arena allocation failed: out of memory in a kernel")

    monkeypatch.setattr(served.model.classifier, "classify", broken)
    pixels = served.pixels(np.random.default_rng(0), 1)
    responses = served.model.execute([request(pixels, dtype=pixels.dtype) for _ in range(3)])
    assert len(responses) == 3
    for response in responses:
        assert response.error().code() == pb_utils.TritonError.INTERNAL
        assert contract.read(response.error().message()) == contract.CodedError(
            contract.INTERNAL, None, "internal error in the classifier")  # nothing of the exception
    assert any("arena allocation" in message for level, message in pb_utils.Logger.records if level == "error")


def test_classify_rows_runs_once_and_gives_each_request_its_own_rows():
    """One forward pass over a dynamic batch, split back by each request's row count
    (the classifier's and classify_with_view's execute both rely on it)."""
    class Echo:  # labels and scores that tell which row of the batch they came from
        calls = 0

        def classify(self, pixels):
            self.calls += 1
            rows = pixels[:, 0, 0, 0].astype(np.float32)
            return np.array([[b"%d" % row] * 2 for row in rows], dtype=np.object_), np.stack([rows, rows], 1)

    echo = Echo()
    batches = [np.full((n, 3, 2, 2), first, np.uint8) + np.arange(n, dtype=np.uint8)[:, None, None, None]
               for n, first in ((2, 0), (1, 2), (3, 3))]
    results = classifier_runtime.classify_rows(echo, batches)
    assert echo.calls == 1 and len(results) == 3
    assert [labels[:, 0].tolist() for labels, _ in results] == [[b"0", b"1"], [b"2"], [b"3", b"4", b"5"]]
    assert [scores[:, 1].tolist() for _, scores in results] == [[0, 1], [2], [3, 4, 5]]
    assert [labels.shape for labels, _ in classifier_runtime.classify_rows(echo, batches[:1])] == [(2, 2)]


def test_scores_are_sorted_softmax_probabilities(tiny_model_dir):
    model = make_model(tiny_config(k=10), tiny_model_dir)
    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8))
    scores = model.execute([request(x, dtype=np.float32)])[0].output("SCORES")
    assert np.all(np.diff(scores, axis=1) <= 0)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)


def test_non_finite_pixels_fail_only_their_request(tiny_model_dir):
    model = make_model(tiny_config(), tiny_model_dir)
    bad = np.zeros((1, 3, 8, 8))
    bad[0, 1, 2, 3] = np.nan
    responses = model.execute([request(x, dtype=np.float32) for x in (np.zeros((1, 3, 8, 8)), bad, np.ones((1, 3, 8, 8)))])
    assert len(responses) == 3
    assert not responses[0].has_error() and not responses[2].has_error()
    assert responses[1].error().code() == pb_utils.TritonError.INVALID_ARG
    # In the error contract, naming the tensor, as every other refusal of the image steps.
    assert contract.read(responses[1].error().message()) == contract.CodedError(
        contract.INVALID_INPUT, "PIXELS", "PIXELS holds NaN or infinite values")


# ---------------------------------------------------------------- the real model through preprocess, on each runtime

# runtime -> (the PIXELS type preprocess sends and the classifier declares, parameters)
REAL_MODEL = {"onnxruntime": ("TYPE_UINT8", {"model_file": FP32}), "torchscript": ("TYPE_FP32", {"torch_num_threads": "2"})}


@pytest.fixture(scope="module", params=RUNTIMES)
def real_pipeline(request):
    """preprocess (the committed parameters) and the classifier on the exported model, in one runtime."""
    pixels_type, parameters = REAL_MODEL[request.param]
    threads = torch.get_num_threads()
    classifier = make_model(model_config(request.param, parameters, dtype=pixels_type))
    yield make_preprocess(pixels_type), classifier
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name, expected_top", [
    ("chelsea", {"Egyptian cat", "tabby", "tiger cat"}),
    ("coffee", {"espresso"}),
])
def test_top5_matches_the_eager_reference(real_pipeline, photos, name, expected_top):
    from tools.reference import reference_top5

    preprocess, classifier = real_pipeline
    pixels = pixels_of(preprocess, photos[name])
    labels, scores = top(classifier.execute([request(pixels, dtype=pixels.dtype)])[0])

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
    together = classifier.execute([request(pixels[:1], dtype=pixels.dtype), request(pixels[1:], dtype=pixels.dtype)])
    batch = classifier.execute([request(pixels, dtype=pixels.dtype)])[0]
    np.testing.assert_allclose(
        np.concatenate([r.output("SCORES") for r in together]), batch.output("SCORES"), atol=1e-5)


# ---------------------------------------------------------------- the exported graphs on real photos

@pytest.mark.parametrize("name", ["chelsea", "coffee"])
def test_onnx_fp32_equals_torchscript_and_the_eager_reference(fp32_model, preprocess, photos, name):
    from tools.reference import reference_top5

    pixels = pixels_of(preprocess, photos[name])
    assert pixels.dtype == np.uint8
    labels, scores = top(fp32_model.execute([request(pixels)])[0])
    torchscript = make_model(model_config("torchscript"))
    ts_labels, ts_scores = top(torchscript.execute([request(pixels)])[0])
    assert labels == ts_labels
    np.testing.assert_allclose(scores, ts_scores, atol=export_onnx.MAX_SCORE_DIFF)
    ref_labels, ref_scores = reference_top5(photos[name])
    assert labels == ref_labels
    np.testing.assert_allclose(scores, ref_scores, atol=export_onnx.MAX_SCORE_DIFF)


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


# ---------------------------------------------------------------- the uint8 path (both runtimes)

@pytest.mark.parametrize("name", ["chelsea", "coffee"])
def test_uint8_pixels_give_what_the_float_path_gave(preprocess, photos, name):
    """Before: preprocess sent (x - 127) / 128 as float32 and the TorchScript file ran on it.
    Now: uint8 goes over, and each classifier normalises. The network sees the same input
    bit for bit in TorchScript (the same float ops) and gives the same scores (up to the
    thread count's summation order); the ONNX graph's within MAX_SCORE_DIFF."""
    from tools.reference import normalise

    pixels = pixels_of(preprocess, photos[name])
    torchscript = make_model(model_config("torchscript"))
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
    onnx = make_model(onnx_config({"model_file": FP32}))
    _, from_onnx = top(onnx.execute([request(pixels)])[0])
    np.testing.assert_allclose(from_onnx, before.values.numpy()[0], atol=export_onnx.MAX_SCORE_DIFF)
