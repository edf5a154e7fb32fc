"""Admission control is the queue policies of the models a request waits for
a core in (docs/reliability.md#overload): every one the package ships, in the
CPU layout and the GPU one, refuses past a count and past a time, so an
admitted request's wait is bounded in seconds on any CPU, not only in
requests (128 waiting are 2 s of work on one 2-core machine, 4 s on a slower
one)."""

import pathlib

import pytest
from tritonclient.grpc import model_config_pb2

from tools import model_config

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.relative_to(REPO / "model_repository")
                 for p in (REPO / "model_repository").glob("*/**/*.pbtxt"))
QUEUED = [p for p in CONFIGS if model_config.read(REPO / "model_repository" / p).HasField("dynamic_batching")
          and "describe" not in str(p)]  # describe waits on its own event loop, bounded by max_in_flight
MAX_WAIT_US = 2_000_000


def test_the_models_that_queue_for_a_core_are_all_found():
    assert {str(p) for p in QUEUED} >= {"classify_with_view/config.pbtxt", "preprocess/config.pbtxt",
                                       "classifier/config.pbtxt", "classifier/configs/gpu.pbtxt"}


@pytest.mark.parametrize("path", QUEUED, ids=str)
def test_every_admission_queue_refuses_past_a_count_and_a_time(path):
    policy = model_config.read(REPO / "model_repository" / path).dynamic_batching.default_queue_policy
    assert 0 < policy.max_queue_size <= 128
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT
    assert 0 < policy.default_timeout_microseconds <= MAX_WAIT_US
    # A client may not ask for a longer wait than the server's (Triton takes only a shorter one anyway).
    assert not policy.allow_timeout_override
