"""backends/image, steps decode,classify (classify_with_view), without a server: the CPU layout,
preprocess's decode and the classifier's forward pass in one stub. It must answer what the two models answer in
turn, fail a bad image alone, make VIEW only when asked, and be configured as they are."""

import io
import json
import os
import pathlib
import sys
import time

import numpy as np
import pytest
from backend_model import load_model
from PIL import Image

from tools.model_config import read as read_model_config

REPO = pathlib.Path(__file__).resolve().parents[2]
REPOSITORY = REPO / "model_repository"
pb_utils = sys.modules["triton_python_backend_utils"]  # the fake, installed by conftest.py


fused_module = load_model("image")
preprocess_module = load_model("image")
classifier_module = load_model("image")


def as_triton_json(path):
    """A committed config.pbtxt as the JSON Triton hands to initialize()."""
    from google.protobuf import json_format

    config = json_format.MessageToDict(read_model_config(path), preserving_proto_field_name=True)
    for output in config.get("output", []) + config.get("input", []):
        output["dims"] = [int(d) for d in output["dims"]]
    return config


def initialized(module, name, config):
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_name": name, "model_version": "1",
                      "model_repository": str(REPOSITORY / name), "model_instance_kind": "CPU",
                      "model_instance_device_id": "0"})
    return model


@pytest.fixture(autouse=True)
def restore_pillow_guard(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


@pytest.fixture(scope="module")
def fused():
    return initialized(fused_module, "classify_with_view", as_triton_json(REPOSITORY / "classify_with_view/config.pbtxt"))


@pytest.fixture(scope="module")
def two_models():
    return (initialized(preprocess_module, "preprocess", as_triton_json(REPOSITORY / "preprocess/config.pbtxt")),
            initialized(classifier_module, "classifier", as_triton_json(REPOSITORY / "classifier/config.pbtxt")))


@pytest.fixture(scope="module")
def photos():
    from skimage import data

    photos = {}
    for name in ("chelsea", "coffee", "astronaut", "rocket"):
        buffer = io.BytesIO()
        Image.fromarray(getattr(data, name)()).convert("RGB").save(buffer, "JPEG", quality=85)
        photos[name] = buffer.getvalue()
    return photos


def image_request(*images, outputs=None):
    return pb_utils.InferenceRequest({"IMAGE": np.array([[image] for image in images], dtype=np.object_)},
                                     requested_outputs=outputs)


def answer(response):
    assert not response.has_error(), response.error().message()
    return response.output("LABELS"), response.output("SCORES")


def test_it_answers_what_preprocess_then_the_classifier_answer(fused, two_models, photos):
    preprocess, classifier = two_models
    for name, photo in photos.items():
        pixels = preprocess.execute([image_request(photo, outputs=["PIXELS"])])[0].output("PIXELS")
        labels, scores = answer(classifier.execute([pb_utils.InferenceRequest({"PIXELS": pixels})])[0])
        fused_labels, fused_scores = answer(fused.execute([image_request(photo, outputs=["LABELS", "SCORES"])])[0])
        assert fused_labels.tolist() == labels.tolist(), name
        np.testing.assert_allclose(fused_scores, scores, rtol=1e-5, atol=1e-6, err_msg=name)


def test_requests_of_one_execution_get_their_own_answers_in_order(fused, photos):
    names = list(photos)
    responses = fused.execute([image_request(photos[name], outputs=["LABELS", "SCORES"]) for name in names])
    alone = [answer(fused.execute([image_request(photos[name], outputs=["LABELS", "SCORES"])])[0])[0] for name in names]
    assert [answer(response)[0].tolist() for response in responses] == [labels.tolist() for labels in alone]
    assert len({labels[0][0] for labels in alone}) == len(names)  # distinct photos: a swap would show


def test_a_request_with_several_rows_gets_one_answer_row_per_image(fused, photos):
    labels, scores = answer(fused.execute([image_request(photos["coffee"], photos["chelsea"])])[0])
    assert labels.shape == scores.shape == (2, 5)
    assert labels[0][0] != labels[1][0]


def test_a_bad_image_fails_alone(fused, photos):
    responses = fused.execute([image_request(photos["coffee"]), image_request(b"not an image at all"),
                               image_request(photos["chelsea"])])
    assert not responses[0].has_error() and not responses[2].has_error()
    assert responses[1].has_error()
    assert responses[1].error().code() == pb_utils.TritonError.INVALID_ARG
    assert "IMAGE" in responses[1].error().message()


def test_a_classifier_failure_fails_the_decoded_requests_as_internal_without_details(fused, photos, monkeypatch):
    def broken(pixels, idle=False):
        raise RuntimeError("secret detail of the runtime")

    monkeypatch.setattr(fused.classifier, "classify", broken)
    responses = fused.execute([image_request(photos["coffee"]), image_request(b"junk")])
    assert responses[0].error().code() == pb_utils.TritonError.INTERNAL
    assert "secret detail" not in responses[0].error().message()
    assert responses[1].error().code() == pb_utils.TritonError.INVALID_ARG  # still its own answer


def test_the_view_is_made_only_when_asked_for(fused, photos):
    without = fused.execute([image_request(photos["coffee"], outputs=["LABELS", "SCORES"])])[0]
    assert "VIEW" not in {tensor.name() for tensor in without.output_tensors()}
    for asked in (["LABELS", "SCORES", "VIEW"], None):  # None: a client that named no output gets all
        view = fused.execute([image_request(photos["coffee"], outputs=asked)])[0].output("VIEW")
        assert view.shape == (1, 1) and view[0][0].startswith(b"\xff\xd8\xff")


def test_vision_off_answers_an_empty_view(photos, monkeypatch):
    monkeypatch.setenv("LLM_VISION", "off")
    model = initialized(fused_module, "classify_with_view", as_triton_json(REPOSITORY / "classify_with_view/config.pbtxt"))
    response = model.execute([image_request(photos["coffee"], outputs=["VIEW", "LABELS"])])[0]
    assert response.output("VIEW")[0][0] == b""
    assert not response.has_error()


def test_parameters_are_split_between_the_decode_and_the_classifier():
    steps, decode, classifier, folder = fused_module.split_parameters(
        {"steps": "decode, classify", "crop_size": "224", "jpeg_draft": "false", "runtime": "onnxruntime",
         "model_file": "m.onnx", "classifier_model": "my_classifier"})
    assert steps == "decode,classify"
    assert decode == {"crop_size": "224", "jpeg_draft": "false"}
    assert classifier == {"runtime": "onnxruntime", "model_file": "m.onnx"}
    assert folder == "my_classifier"
    assert fused_module.split_parameters({"steps": "decode,classify", "runtime": "onnxruntime"})[3] == "classifier"


def test_a_single_step_gets_every_parameter_and_no_classifier_folder():
    params = {"crop_size": "224", "runtime": "onnxruntime"}
    assert fused_module.split_parameters({"steps": "decode", **params}) == ("decode", params, {}, None)
    assert fused_module.split_parameters({"steps": "classify", **params}) == ("classify", {}, params, None)


@pytest.mark.parametrize("steps", [None, "", "classify,decode", "decode+classify", "view"])
def test_steps_must_name_what_the_backend_does(steps):
    parameters = {"runtime": "onnxruntime"} if steps is None else {"steps": steps}
    found = "is missing" if steps is None else f"is {steps!r}"
    with pytest.raises(fused_module.ConfigError) as refused:
        fused_module.split_parameters(parameters)
    assert str(refused.value) == f"parameter steps {found}: it must be one of 'decode', 'classify', 'decode,classify'"


@pytest.mark.parametrize("folder", ["", "..", ".", "../classifier", "a/b"])
def test_a_classifier_folder_outside_the_repository_is_refused(folder):
    with pytest.raises(fused_module.ConfigError, match="classifier_model"):
        fused_module.split_parameters({"steps": "decode,classify", "classifier_model": folder})


def test_a_bad_parameter_fails_the_load_with_its_name(monkeypatch):
    config = as_triton_json(REPOSITORY / "classify_with_view/config.pbtxt")
    config["parameters"]["crop_size"] = {"string_value": "0"}
    with pytest.raises(pb_utils.TritonModelException, match="crop_size"):
        initialized(fused_module, "classify_with_view", config)
    config = as_triton_json(REPOSITORY / "classify_with_view/config.pbtxt")
    config["parameters"]["runtime"] = {"string_value": "tensorflow"}
    with pytest.raises(pb_utils.TritonModelException, match="runtime"):
        initialized(fused_module, "classify_with_view", config)


def test_the_config_keeps_preprocess_and_classifier_settings():
    """classify_with_view repeats preprocess's and the classifier's parameters (a model brought to
    classifier/ is served by both layouts): they must not drift apart."""
    def parameters(model):
        return {key: value.string_value
                for key, value in read_model_config(REPOSITORY / model / "config.pbtxt").parameters.items()}

    fused, preprocess, classifier = parameters("classify_with_view"), parameters("preprocess"), parameters("classifier")
    assert (fused.pop("steps"), preprocess.pop("steps"), classifier.pop("steps")) == ("decode,classify", "decode", "classify")
    assert fused.pop("classifier_model") == "classifier"
    # Only classify_with_view, the CPU layout, holds a second session for lone requests (its memory).
    assert fused.pop("idle_intra_op_threads") == "2" and "idle_intra_op_threads" not in classifier
    assert fused == {**preprocess, **classifier}


def test_the_gpu_config_chains_preprocess_and_the_gpu_classifier():
    gpu = read_model_config(REPOSITORY / "classify_with_view/configs/gpu.pbtxt")
    assert gpu.name == "classify_with_view" and gpu.platform == "ensemble"
    assert [step.model_name for step in gpu.ensemble_scheduling.step] == ["preprocess", "classifier"]
    cpu = read_model_config(REPOSITORY / "classify_with_view/config.pbtxt")
    assert [(o.name, o.data_type, list(o.dims)) for o in gpu.output] == [(o.name, o.data_type, list(o.dims)) for o in cpu.output]
    assert [(i.name, i.data_type, list(i.dims)) for i in gpu.input] == [(i.name, i.data_type, list(i.dims)) for i in cpu.input]


def test_a_config_without_view_never_makes_one(photos):
    config = as_triton_json(REPOSITORY / "classify_with_view/config.pbtxt")
    config["output"] = [output for output in config["output"] if output["name"] != "VIEW"]
    model = initialized(fused_module, "classify_with_view", config)
    response = model.execute([image_request(photos["coffee"])])[0]  # no outputs named: all the config has
    assert {tensor.name() for tensor in response.output_tensors()} == {"LABELS", "SCORES"}


def test_a_pass_takes_the_idle_core_only_while_every_neighbour_is_idle(fused, photos, monkeypatch):
    """busy_board.py across stubs: the committed config runs a lone request's forward pass on two
    threads, and one beside a neighbour that holds a "cpu" slot on one."""
    from classify_describe_server import busy_board

    assert fused.classifier.idle_threads == 2
    asked = []
    classify = fused.classifier.classify
    monkeypatch.setattr(fused.classifier, "classify", lambda pixels, idle=False: asked.append(idle) or classify(pixels, idle))
    neighbour = busy_board.BusyBoard(busy_board.CPU_BOARD, pid=os.getppid())  # another stub of this "server"
    try:
        answers = [answer(fused.execute([image_request(photos["coffee"])])[0])]
        with neighbour.executing():
            answers.append(answer(fused.execute([image_request(photos["coffee"])])[0]))
    finally:
        neighbour.close()
    assert asked == [True, False]
    assert answers[0][0].tolist() == answers[1][0].tolist()


def test_the_two_model_layout_takes_the_idle_core_the_same_way(two_models, photos, monkeypatch):
    from classify_describe_server import busy_board

    preprocess, _ = two_models
    config = as_triton_json(REPOSITORY / "classifier/config.pbtxt")
    config["parameters"]["idle_intra_op_threads"] = {"string_value": "2"}
    classifier = initialized(classifier_module, "classifier", config)
    assert classifier.classifier.idle_threads == 2
    asked = []
    classify = classifier.classifier.classify
    monkeypatch.setattr(classifier.classifier, "classify", lambda pixels, idle=False: asked.append(idle) or classify(pixels, idle))
    pixels = preprocess.execute([image_request(photos["coffee"], outputs=["PIXELS"])])[0].output("PIXELS")
    neighbour = busy_board.BusyBoard(busy_board.CPU_BOARD, pid=os.getppid())
    try:
        answer(classifier.execute([pb_utils.InferenceRequest({"PIXELS": pixels})])[0])
        with neighbour.executing():
            answer(classifier.execute([pb_utils.InferenceRequest({"PIXELS": pixels})])[0])
    finally:
        neighbour.close()
    assert asked == [True, False]


@pytest.mark.parametrize("layout", ["fused", "preprocess", "classifier"])
def test_every_model_holding_a_cpu_slot_is_busy_on_the_board_while_it_executes(layout, fused, two_models, photos,
                                                                                 monkeypatch):
    """A decode in preprocess keeps a core as busy as a forward pass: a neighbour's pass must not
    count it idle. Seen from a neighbour stub while each model's execute runs."""
    from classify_describe_server import busy_board

    model = {"fused": fused, "preprocess": two_models[0], "classifier": two_models[1]}[layout]
    if layout == "classifier":
        pixels = two_models[0].execute([image_request(photos["coffee"], outputs=["PIXELS"])])[0].output("PIXELS")
        request = pb_utils.InferenceRequest({"PIXELS": pixels})
    else:
        request = image_request(photos["coffee"])
    # Its clock a second ahead: only an execution in progress counts, not one that just ended.
    neighbour = busy_board.BusyBoard(busy_board.CPU_BOARD, pid=os.getppid(), clock=lambda: time.monotonic_ns() + 10**9)
    seen = []
    work = model._execute
    monkeypatch.setattr(model, "_execute", lambda *args: seen.append(neighbour.others_busy()) or work(*args))
    try:
        response = model.execute([request])
        response = response[0] if isinstance(response, list) else response
        assert not response.has_error()
    finally:
        neighbour.close()
    assert seen == [1]


def test_whether_the_others_are_idle_is_asked_after_the_decode(fused, photos, monkeypatch):
    """A neighbour that starts while this instance decodes takes its core: the pass runs narrow."""
    from classify_describe_server import busy_board

    asked = []
    classify = fused.classifier.classify
    monkeypatch.setattr(fused.classifier, "classify", lambda pixels, idle=False: asked.append(idle) or classify(pixels, idle))
    neighbour = busy_board.BusyBoard(busy_board.CPU_BOARD, pid=os.getppid())
    starts = neighbour.executing()
    decode = fused._read
    monkeypatch.setattr(fused, "_read", lambda request: (decode(request), starts.__enter__())[0])
    try:
        answer(fused.execute([image_request(photos["coffee"])])[0])
    finally:
        starts.__exit__(None, None, None)
        neighbour.close()
    assert asked == [False]


@pytest.mark.parametrize("name", ["classify_with_view", "preprocess", "classifier"])
def test_unloading_an_instance_gives_its_place_on_the_board_back(name, tmp_path, monkeypatch):
    from classify_describe_server import busy_board

    monkeypatch.setattr(busy_board, "default_directory", lambda: str(tmp_path))  # apart from the module's models
    module = {"classify_with_view": fused_module, "preprocess": preprocess_module, "classifier": classifier_module}[name]
    model = initialized(module, name, as_triton_json(REPOSITORY / name / "config.pbtxt"))
    assert model.board.slot == 0 and model.board.error is None
    model.finalize()
    assert model.board.slot is None
    after = busy_board.BusyBoard(busy_board.CPU_BOARD, pid=os.getppid())  # another live stub joining
    assert after.slot == 0  # 1 if the unloaded instance still held its place
    after.close()


def test_the_newest_classifier_version_holding_the_model_file_is_served(tmp_path):
    """Triton serves the classifier's newest version (latest: 1); this model must read the same
    weights, not those of its own version number (classify_with_view has only 1/)."""
    for version, has_file in (("1", True), ("2", True), ("10", True), ("11", False), ("draft", True)):
        (tmp_path / version).mkdir()
        if has_file:
            (tmp_path / version / "model.onnx").write_bytes(b"")
    (tmp_path / "12").write_bytes(b"")  # a file, not a version folder
    assert fused_module.newest_version(tmp_path, "model.onnx") == 10
    with pytest.raises(fused_module.ConfigError, match="model.pt"):
        fused_module.newest_version(tmp_path, "model.pt")


def test_a_new_classifier_version_is_loaded_and_named_in_the_log(tmp_path, monkeypatch):
    repository = tmp_path / "model_repository"
    (repository / "classify_with_view" / "1").mkdir(parents=True)
    (repository / "classifier" / "1").mkdir(parents=True)
    (repository / "classifier" / "2").mkdir()
    for version in ("1", "2"):
        (repository / "classifier" / version / "model.onnx").symlink_to(REPOSITORY / "classifier/1/model.onnx")
    loaded, logged = [], []
    real_load = fused_module.load
    monkeypatch.setattr(fused_module, "load", lambda settings, model_dir, version, tensors, device: (
        loaded.append(version), real_load(settings, model_dir, version, tensors, device))[1])
    monkeypatch.setattr(fused_module.Log, "info", lambda self, message: logged.append(message))
    model = fused_module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(as_triton_json(REPOSITORY / "classify_with_view/config.pbtxt")),
                      "model_name": "classify_with_view", "model_version": "1",
                      "model_repository": str(repository / "classify_with_view"), "model_instance_kind": "CPU",
                      "model_instance_device_id": "0"})
    assert loaded == [2]
    assert any("classifier/2/model.onnx" in message for message in logged)
    model.finalize()
