"""Output selection (the `outputs` list of a KServe v2 request): every non-empty
subset of every public model's outputs answers with exactly those outputs and
the same values as the full answer, over HTTP and gRPC.

Triton 2.51 prunes ensemble steps whose outputs nobody asked for, and gets it
wrong when a tensor is both an ensemble output and another step's input: it
answered "unexpected deadlock" for 10 of the 31 subsets of classify_and_describe
until the describe step passed LABELS and SCORES through
(docs/troubleshooting.md#asking-for-some-of-the-outputs)."""

import itertools
import json

import pytest

from serving.procfs import http_json

from .public_models import MODELS, STREAM_MODELS, repository_models
from .raw_infer import GrpcInfer, http_infer


def test_every_model_of_the_repository_is_listed():
    assert sorted(MODELS + STREAM_MODELS) == repository_models()


def output_names(server, model):
    return [o["name"] for o in http_json(f"http://{server.http_url}/v2/models/{model}/config", timeout=30)["output"]]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", MODELS)
def test_every_subset_of_outputs(triton, valid_requests, model, protocol):
    grpc = GrpcInfer(triton.grpc_url)
    def infer(outputs):
        return (http_infer(triton.http_url, model, valid_requests.inputs(model), outputs)
                 if protocol == "http" else grpc(model, valid_requests.inputs(model), outputs))
    try:
        names = output_names(triton, model)
        full = infer(None)
        assert full.ok, full.message
        assert sorted(full.outputs) == sorted(names)
        assert valid_requests.check(full.outputs) == []
        wrong = {}
        subsets = [s for n in range(1, len(names) + 1) for s in itertools.combinations(names, n)]
        for subset in subsets:
            answer = infer(list(subset))
            if not answer.ok:
                wrong[subset] = f"{answer.code}: {answer.message[:120]}"
            elif sorted(answer.outputs) != sorted(subset):
                wrong[subset] = f"answered {sorted(answer.outputs)}"
            else:
                for name in subset:
                    if name == "USAGE":  # latency and the cached flag differ between calls
                        usage = json.loads(answer.outputs[name].reshape(-1)[0])
                        if usage.get("prompt_tokens") is None:
                            wrong[subset] = f"USAGE {usage}"
                    elif answer.outputs[name].tolist() != full.outputs[name].tolist():
                        wrong[subset] = f"{name} differs from the full answer"
        assert wrong == {}, f"{len(wrong)} of {len(subsets)} subsets wrong: {wrong}"
    finally:
        grpc.close()
