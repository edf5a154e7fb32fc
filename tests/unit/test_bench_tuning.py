"""The bench's tuning sweep edits the committed classifier config through
Triton's own config schema (protobuf text format), so every variant still
parses, changes only what it names, and reads back as it should. Regex edits
broke silently when the config gained a multi-line instance_group and a queue
policy inside dynamic_batching."""

import pathlib

import pytest
from classify_describe_server import classifier_runtime, image_steps

from tools import model_config
from tools.bench import run

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "model_repository/classifier/config.pbtxt"


@pytest.fixture(scope="module")
def shipped():
    return model_config.read(CONFIG)


def test_the_shipped_config_reads_back(shipped):
    assert run.classifier_instances(shipped) == 2 and run.classifier_threads(shipped) == 1
    assert list(shipped.dynamic_batching.preferred_batch_size) == [2, 4]
    assert shipped.dynamic_batching.default_queue_policy.max_queue_size > 0


@pytest.mark.parametrize("name", sorted(run.TUNING_VARIANTS))
def test_every_variant_renders_a_config_that_parses(shipped, name):
    config = run.classifier_config(shipped, **run.TUNING_VARIANTS[name])
    assert model_config.parse(model_config.render(config)) == config
    variant = run.TUNING_VARIANTS[name]
    assert config.HasField("dynamic_batching") == variant.get("batching", True)
    if "threads" in variant:
        assert run.classifier_threads(config) == variant["threads"]
    if "preferred" in variant:
        assert list(config.dynamic_batching.preferred_batch_size) == variant["preferred"]
    # What a variant does not name stays as shipped.
    assert config.output == shipped.output and config.input == shipped.input
    assert [g.rate_limiter for g in config.instance_group] == [g.rate_limiter for g in shipped.instance_group]
    # The run labels a variant (reading its thread count) before rendering it: the backend must still
    # accept every parameter (reading a missing protobuf map key once added an unknown one).
    run.describe_classifier_config(config)
    parameters = {key: value.string_value for key, value in
                  model_config.parse(model_config.render(config)).parameters.items()}
    assert config.backend == "image"
    classifier_runtime.parse_settings(image_steps.split_parameters(parameters)[2])


def test_labels_name_the_policy(shipped):
    assert run.describe_classifier_config(shipped) == \
        "dynamic batching, preferred [2, 4], delay 0 ms, 2 instance(s) x 1 thread(s)"
    no_batching = run.classifier_config(shipped, batching=False)
    assert run.describe_classifier_config(no_batching).startswith("no dynamic batching")


def test_figure_2_keeps_its_burst_within_the_admission_queue():
    """perf_analyzer starts every request at once: a concurrency above a step's max_queue_size, or
    above what starts within its time limit, is refused by admission control, so figure 2 hides the
    longest LLM latency that fits instead."""
    from tools.bench.run import concurrency_to_cover, latency_to_cover, queue_limit

    assert latency_to_cover(60.0, 1000, 4, 128) == 1000  # 96 in flight cover 1 s
    latency = latency_to_cover(144.0, 1000, 4, 128)
    assert latency == 500 and concurrency_to_cover(144.0, latency, 4, 128) <= 128
    repository = pathlib.Path(__file__).resolve().parents[2] / "model_repository"
    assert queue_limit(repository) == 128
    assert queue_limit(repository, throughput=45.0) == 90  # what starts within the 2 s limit
    assert queue_limit(repository, throughput=500.0) == 128


def test_the_tuning_sweep_changes_the_model_that_runs_classifys_forward_pass(tmp_path):
    """The CPU layout's classify_with_view (one stub), or the classifier where classify chains two models."""
    import shutil

    from tools.bench.run import forward_model

    repository = pathlib.Path(__file__).resolve().parents[2] / "model_repository"
    assert forward_model(repository) == "classify_with_view"
    copy = tmp_path / "repository"
    for model in ("classify", "classify_with_view", "preprocess", "classifier"):
        shutil.copytree(repository / model, copy / model, ignore=shutil.ignore_patterns("*.onnx", "*.pt"))
    (copy / "classify_with_view/config.pbtxt").write_text((copy / "classify_with_view/configs/gpu.pbtxt").read_text())
    assert forward_model(copy) == "classifier"  # classify -> classify_with_view (ensemble) -> classifier
