"""The describe models' configs: each default is written once, in the
backend's settings (settings.Settings), and a config.pbtxt sets only what its
model does differently; the streaming models then have the same LLM settings
as `describe` (endpoint, limits, retries, circuit breaker, prices, cache), so
a change to describe's config.pbtxt that is not made to theirs fails here."""

import dataclasses
import pathlib

import pytest
from classify_describe_server.settings import Settings, parse_settings

from tools import model_config

REPO = pathlib.Path(__file__).resolve().parents[2]
STREAM_ONLY = {  # parameters the streaming models may set differently, and why
    "cancel_poll_s",   # a stream asks more often whether its client left
    "classify_model",  # classify_and_describe_stream gets LABELS, SCORES and VIEW from classify_with_view
}


def parameters(model):
    config = model_config.read(REPO / "model_repository" / model / "config.pbtxt")
    return {key: value.string_value for key, value in config.parameters.items()}


@pytest.mark.parametrize("model", ["describe_stream", "classify_and_describe_stream"])
def test_stream_models_share_describes_parameters(model):
    describe, stream = parameters("describe"), parameters(model)
    assert {k: v for k, v in stream.items() if k not in STREAM_ONLY} == describe


@pytest.mark.parametrize("model", ["describe", "describe_stream", "classify_and_describe_stream"])
def test_a_config_sets_only_what_differs_from_the_backends_defaults(model):
    for key, text in parameters(model).items():
        assert getattr(parse_settings({key: text}, {}), key) != getattr(Settings(), key), \
            f"{model}: parameter {key}={text!r} is the backend's default: written twice"


@pytest.mark.parametrize("model", ["describe_stream", "classify_and_describe_stream"])
def test_stream_models_have_describes_settings(model):
    describe, stream = parse_settings(parameters("describe"), {}), parse_settings(parameters(model), {})
    differ = {f.name for f in dataclasses.fields(Settings) if getattr(describe, f.name) != getattr(stream, f.name)}
    assert differ <= STREAM_ONLY


@pytest.mark.parametrize("model", ["describe_stream", "classify_and_describe_stream"])
def test_stream_models_are_decoupled_and_take_one_row(model):
    config = model_config.read(REPO / "model_repository" / model / "config.pbtxt")
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 1
    assert config.backend == "openai_describe"


def test_the_photo_stream_model_has_the_public_contract():
    config = model_config.read(REPO / "model_repository/classify_and_describe_stream/config.pbtxt")
    ensemble = model_config.read(REPO / "model_repository/classify_and_describe/config.pbtxt")
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == \
        [(i.name, i.data_type, list(i.dims), i.optional) for i in ensemble.input]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == \
        [(o.name, o.data_type, list(o.dims)) for o in ensemble.output]
    assert parameters("classify_and_describe_stream")["classify_model"] == "classify_with_view"
