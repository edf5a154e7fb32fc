"""The product: one request to classify_and_describe over HTTP and gRPC, real
photos, the fake LLM upstream; every output of the public contract checked."""

import asyncio
import json
import subprocess
import sys
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from classify_describe import AsyncClient, Client, TritonRequestError

ENSEMBLE = "classify_and_describe"
CAT_CLASSES = {"Egyptian cat", "tabby", "tiger cat"}


def unique_prompt(text="What is it?"):
    # The describe step caches identical requests; a fresh prompt forces an upstream call.
    return f"{text} ({uuid.uuid4().hex[:8]})"


def assert_classification(result, top_classes):
    assert len(result.labels) == 5 and len(result.scores) == 5
    assert result.labels[0] in top_classes
    assert result.scores == sorted(result.scores, reverse=True)
    assert 0.0 < result.scores[-1] <= result.scores[0] <= 1.0
    assert sum(result.scores) <= 1.0 + 1e-5


def assert_llm_answer(result):
    assert result.description_source == "llm"
    assert result.description.startswith("Fake answer #")
    usage = result.usage
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["cost_usd"] > 0
    assert usage["attempts"] >= 1
    assert usage["model"]
    assert usage["fallback_reason"] is None


def upstream_bodies_containing(llm, text):
    return [body for body in llm.admin("stats")["bodies"] if text in json.dumps(body)]


def test_http_photo_and_question_in_one_request(triton, photos, llm):
    prompt = unique_prompt("What breed is this cat?")
    with Client(triton.http_url) as client:
        result = client.infer(photos["chelsea"], prompt=prompt)
    assert_classification(result, CAT_CLASSES)
    assert_llm_answer(result)

    body, = upstream_bodies_containing(llm, prompt)
    system, user = body["messages"][0], body["messages"][-1]
    assert system["role"] == "system" and prompt not in system["content"]
    text, image = user["content"]  # the question with the labels, and the photo (tests/integration/test_vision.py)
    assert user["role"] == "user" and prompt in text["text"] and image["type"] == "image_url"
    assert result.labels[0] in text["text"]  # the classification reached the LLM


def test_grpc_photo_and_question_in_one_request(triton, photos, llm):
    with Client(triton.grpc_url, protocol="grpc") as client:
        result = client.infer(photos["coffee"], prompt=unique_prompt())
    assert_classification(result, {"espresso"})
    assert_llm_answer(result)


def test_prompt_is_optional(triton, photos, llm):
    # The only request of the session without a PROMPT, so no cached answer hides the call.
    with Client(triton.http_url) as client:
        result = client.infer(photos["coffee"], prompt=None)
    assert_classification(result, {"espresso"})
    assert_llm_answer(result)
    assert upstream_bodies_containing(llm, "Describe this object in detail")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_raw_tritonclient_batch_of_two(triton, photos, llm, protocol):
    """The contract as tritonclient sees it: names, dtypes, shapes, batching."""
    module = httpclient if protocol == "http" else grpcclient
    url = triton.http_url if protocol == "http" else triton.grpc_url
    client = module.InferenceServerClient(url)
    image = module.InferInput("IMAGE", [2, 1], "BYTES")
    image.set_data_from_numpy(np.array([[photos["chelsea"]], [photos["coffee"]]], dtype=object))
    prompts = [unique_prompt("What cat is it?"), unique_prompt("What drink is it?")]
    prompt = module.InferInput("PROMPT", [2, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[p.encode()] for p in prompts], dtype=object))
    result = client.infer(ENSEMBLE, [image, prompt])

    labels, scores = result.as_numpy("LABELS"), result.as_numpy("SCORES")
    assert labels.shape == (2, 5) and scores.shape == (2, 5) and scores.dtype == np.float32
    assert labels[0, 0].decode() in CAT_CLASSES and labels[1, 0].decode() == "espresso"
    for name in ("DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE"):
        assert result.as_numpy(name).shape == (2, 1)
    assert [s.decode() for s in result.as_numpy("DESCRIPTION_SOURCE")[:, 0]] == ["llm", "llm"]
    for usage in result.as_numpy("USAGE")[:, 0]:
        assert json.loads(usage)["total_tokens"] > 0
    # Row by row: each description answers its own row's question, asked with its own photo's labels.
    for row, question in enumerate(prompts):
        assert question in result.as_numpy("DESCRIPTION")[row, 0].decode()
        body, = upstream_bodies_containing(llm, question)
        assert labels[row, 0].decode() in body["messages"][-1]["content"][0]["text"]


def test_failing_llm_keeps_the_classification(triton, photos, llm):
    llm.admin("mode", {"mode": "500"})
    with Client(triton.http_url) as client:
        result = client.infer(photos["chelsea"], prompt=unique_prompt())
    assert_classification(result, CAT_CLASSES)
    assert result.description_source == "fallback"
    assert result.labels[0] in result.description
    assert result.usage["fallback_reason"]
    assert result.usage["attempts"] > 1  # 5xx is retried before falling back


def test_llm_authentication_failure_is_explained_and_key_never_echoed(
        triton, photos, llm, test_api_key):
    llm.admin("mode", {"mode": "401"})
    with Client(triton.http_url) as client:
        result = client.infer(photos["chelsea"], prompt=unique_prompt())
    assert_classification(result, CAT_CLASSES)
    assert result.description_source == "fallback"
    assert "auth" in result.usage["fallback_reason"].lower()
    assert result.usage["attempts"] == 1  # 401 is not retried
    # The key did reach the upstream, and nowhere else.
    assert llm.admin("stats")["last_authorization"] == f"Bearer {test_api_key}"
    assert test_api_key not in json.dumps(result.as_dict())
    assert test_api_key not in triton.log()
    assert test_api_key not in triton.metrics()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_wrong_dtype_or_shape_names_what_was_expected(triton, protocol):
    module = httpclient if protocol == "http" else grpcclient
    url = triton.http_url if protocol == "http" else triton.grpc_url
    client = module.InferenceServerClient(url)

    wrong_dtype = module.InferInput("IMAGE", [1, 1], "FP32")
    wrong_dtype.set_data_from_numpy(np.zeros((1, 1), dtype=np.float32))
    with pytest.raises(module.InferenceServerException) as error:
        client.infer(ENSEMBLE, [wrong_dtype])
    assert "BYTES" in error.value.message() and "FP32" in error.value.message()

    wrong_shape = module.InferInput("IMAGE", [1, 2], "BYTES")
    wrong_shape.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=object))
    with pytest.raises(module.InferenceServerException) as error:
        client.infer(ENSEMBLE, [wrong_shape])
    assert "[-1,1]" in error.value.message() and "[1,2]" in error.value.message()
    assert triton.is_ready()


def test_bad_image_is_an_error_for_that_request_only(triton, photos, llm):
    with Client(triton.http_url) as client:
        with pytest.raises(TritonRequestError) as error:
            client.infer(b"\x00not an image at all", prompt="?")
        assert "image" in str(error.value).lower()
        assert_classification(client.infer(photos["chelsea"], prompt=unique_prompt()), CAT_CLASSES)


def test_client_deadline_shorter_than_the_llm(triton, photos, llm):
    """A client timeout ends that call with DEADLINE_EXCEEDED; the server is unharmed."""
    llm.admin("mode", {"mode": "ok", "latency_ms": 3000})
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    image = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[photos["chelsea"]]], dtype=object))
    prompt = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[unique_prompt().encode()]], dtype=object))
    with pytest.raises(grpcclient.InferenceServerException) as error:
        client.infer(ENSEMBLE, [image, prompt], client_timeout=0.5)
    assert "Deadline" in str(error.value)
    assert triton.is_ready()


def test_async_client_keeps_n_requests_in_flight(triton, photos, llm):
    """With 8 in flight the upstream sees them overlap, not one after another."""
    llm.admin("mode", {"mode": "ok", "latency_ms": 700})
    images = [photos["chelsea"]] * 8

    async def run():
        results = []
        async with AsyncClient(triton.http_url, concurrency=8) as client:
            # distinct prompts so that no answer comes from the cache
            for image in images:
                results.append(client.infer(image, prompt=unique_prompt()))
            return await asyncio.gather(*results)

    results = asyncio.run(run())
    assert all(r.description_source == "llm" for r in results)
    assert llm.admin("stats")["max_in_flight"] >= 6


def test_async_client_infer_many_sliding_window(triton, photos, llm):
    async def run():
        answered = {}
        async with AsyncClient(triton.http_url, concurrency=3) as client:
            images = [photos["chelsea"], b"broken", photos["coffee"], photos["chelsea"]]
            async for index, outcome in client.infer_many(images, prompt=unique_prompt()):
                answered[index] = outcome
        return answered

    answered = asyncio.run(run())
    assert sorted(answered) == [0, 1, 2, 3]
    assert isinstance(answered[1], TritonRequestError)
    assert answered[2].labels[0] == "espresso"
    assert answered[0].labels[0] in CAT_CLASSES


def test_command_line(triton, photos, llm, tmp_path):
    cat, broken = tmp_path / "chelsea.png", tmp_path / "broken.jpg"
    cat.write_bytes(photos["chelsea"])
    broken.write_bytes(photos["coffee"][:200])  # truncated
    command = [sys.executable, "-m", "classify_describe", "--url", triton.http_url, "--json",
               "--prompt", unique_prompt()]

    ok = subprocess.run(command + [str(cat)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    line, = ok.stdout.splitlines()
    answer = json.loads(line)
    assert answer["labels"][0] in CAT_CLASSES and answer["description_source"] == "llm"

    mixed = subprocess.run(command + [str(cat), str(broken)], capture_output=True, text=True,
                           timeout=120)
    assert mixed.returncode == 1
    answers = {json.loads(line)["image"]: json.loads(line) for line in mixed.stdout.splitlines()}
    assert "error" in answers[str(broken)] and "labels" in answers[str(cat)]

    text = subprocess.run([sys.executable, "-m", "classify_describe", "--url", triton.http_url,
                           str(cat)], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "description (" in text.stdout and "cost $" in text.stdout


def test_request_parameters_reach_the_llm_step_through_the_ensemble(triton, photos, llm):
    """Per-request overrides (model, temperature, max_tokens) pass through the ensemble."""
    with Client(triton.http_url) as client:
        result = client.infer(photos["coffee"], prompt=unique_prompt(),
                              parameters={"model": "gpt-4o-mini-override", "temperature": 0.7,
                                          "max_tokens": 64})
    assert result.description_source == "llm" and result.usage["model"] == "gpt-4o-mini-override"
    body = llm.admin("stats")["bodies"][-1]
    assert body["model"] == "gpt-4o-mini-override"
    assert body["temperature"] == 0.7 and body["max_tokens"] == 64

    with Client(triton.http_url) as client, pytest.raises(TritonRequestError) as error:
        client.infer(photos["coffee"], prompt=unique_prompt(), parameters={"temperature": 5.0})
    assert "temperature" in str(error.value)
