"""Admission control is the queue policies of the models where a request waits
for a core (docs/reliability.md#overload): every one the package ships, in the
CPU layout and in the GPU one, refuses past a count and past a time, so an
admitted request's wait is bounded in seconds on any CPU, not only in
requests (128 waiting are about 2.8 s of work on the 2-core machine of
docs/reliability.md, more on a slower one)."""

import pathlib

import pytest
from tritonclient.grpc import model_config_pb2

from scripts import make_gpu_config
from tools import model_config

REPOSITORY = pathlib.Path(__file__).resolve().parents[2] / "model_repository"
MAX_WAIT_US = 2_000_000


def holds_a_core(config):
    return any(resource.name == "cpu" for group in config.instance_group
               for resource in group.rate_limiter.resources)


def admission_configs():
    """{name: ModelConfig} of every model holding a "cpu" slot of the rate limiter, and of the
    classifier's GPU config (generated from its CPU config by the build, as the image does)."""
    configs = {path.parent.name: model_config.read(path) for path in REPOSITORY.glob("*/config.pbtxt")}
    found = {name: config for name, config in configs.items() if holds_a_core(config)}
    found["classifier (GPU)"] = make_gpu_config.gpu_config((REPOSITORY / "classifier/config.pbtxt").read_text())
    return found


ADMISSION = admission_configs()


def test_the_models_that_wait_for_a_core_are_all_found():
    assert set(ADMISSION) == {"classify_with_view", "preprocess", "classifier", "classifier (GPU)"}


@pytest.mark.parametrize("name", sorted(ADMISSION))
def test_every_admission_queue_refuses_past_a_count_and_a_time(name):
    policy = ADMISSION[name].dynamic_batching.default_queue_policy
    assert 0 < policy.max_queue_size <= 128
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT
    assert 0 < policy.default_timeout_microseconds <= MAX_WAIT_US
    # A client may not ask for a longer wait than the server's (Triton takes only a shorter one anyway).
    assert not policy.allow_timeout_override


def test_the_fronts_admission_limit_waits_out_the_longest_queue_after_a_cut():
    """The front takes a refusal for news only once every request passed on before its
    last cut has left Triton's queue (openai_front/shedding.py, AdaptiveLimit)."""
    from openai_front.shedding import AdaptiveLimit
    longest_us = max(config.dynamic_batching.default_queue_policy.default_timeout_microseconds
                     for config in ADMISSION.values())
    assert AdaptiveLimit.TRITON_QUEUE_LIMIT_S == longest_us / 1e6
