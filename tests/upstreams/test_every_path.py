"""Every path of the product against each upstream (conftest.py): keyless, the whole answer
over HTTP and gRPC, the photo stream over gRPC, the OpenAI front's stream, vision auto (on
llama-cpp-python's server, a text-only model that takes no list content, settling on
text-only without opening the circuit), a wrong key, and a server that goes away mid-stream."""

import asyncio
import base64
import json
import pathlib
import urllib.request

import openai
import pytest
from classify_describe_server.describer import Describer, Job, make_client
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import Overrides, parse_settings

from classify_describe import Client

from .conftest import MODEL_NAME

REPO = pathlib.Path(__file__).resolve().parents[2]
PHOTO = (REPO / "docs/sample/coffee.png").read_bytes()


def metric(triton, name, **labels):
    with urllib.request.urlopen(f"http://127.0.0.1:{triton.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total = (total or 0) + float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_whole_answer_comes_from_the_upstream(triton, upstream, protocol):
    port = triton.http_port if protocol == "http" else triton.grpc_port
    with Client(f"127.0.0.1:{port}", protocol=protocol, timeout_s=180) as client:
        result = client.infer(PHOTO, f"What is on the table ({protocol})?")  # not the answer cached for the other
    assert result.description_source == "llm" and result.description.strip(), result.usage
    assert result.labels and result.usage["model"] == upstream.model
    # Shown the photo where the model takes it, else answered without it; nobody priced the model.
    assert result.usage["vision"] is upstream.expected["vision"]
    assert result.usage["vision_skipped_reason"] == (None if upstream.expected["vision"] else "refused_by_upstream")
    assert result.usage["total_tokens"] > 0
    assert (result.usage["cost_usd"] is None) is (upstream.model == MODEL_NAME)  # priced in the shipped table or not


def test_vision_auto_settles_on_what_the_model_takes_and_opens_no_circuit(triton, upstream):
    with Client(f"127.0.0.1:{triton.http_port}", timeout_s=180) as client:
        results = [client.infer(PHOTO, f"Photo {i}: what is it?") for i in range(3)]
    assert all(r.description_source == "llm" for r in results), [r.usage for r in results]
    assert all(r.usage["vision"] is upstream.expected["vision"] for r in results)
    assert results[-1].usage["attempts"] == 1  # a text-only model remembered: asked text-only straight away
    assert metric(triton, "describe_circuit_state", upstream_model=upstream.model) == 0
    refused = (metric(triton, "describe_upstream_latency_seconds_count", result="image_request_failed") or 0) + \
        (metric(triton, "describe_upstream_latency_seconds_count", result="image_refused_by_upstream") or 0)
    assert (refused >= 1) is not upstream.expected["vision"]  # each text-only recovery counted


def test_the_photo_stream_over_grpc_is_billed(triton, upstream):
    with Client(f"127.0.0.1:{triton.grpc_port}", protocol="grpc", timeout_s=180) as client:
        events = list(client.stream(PHOTO, "Describe it in one sentence."))
    kinds = [event.kind for event in events]
    assert kinds[0] == "labels" and kinds[-1] == "done" and "text" in kinds
    result = events[-1].result
    assert result.description_source == "llm" and result.description == "".join(e.text for e in events if e.text)
    # A stream without a usage chunk (llama-cpp-python's) is billed from the text, and says so.
    assert result.usage["completion_tokens"] > 0
    assert result.usage.get("tokens_estimated", False) is upstream.expected["stream_usage_estimated"]


def test_the_openai_fronts_stream_through_the_upstream(triton):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{triton.openai_port}/v1", api_key="unused", max_retries=0,
                           timeout=180)
    data_uri = "data:image/png;base64," + base64.b64encode(PHOTO).decode()
    chunks = list(client.chat.completions.create(
        model="classify_and_describe", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                               {"type": "image_url", "image_url": {"url": data_uri}}]}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def describer_against(base_url, key, model, **settings):
    settings = parse_settings({"base_url": base_url, "model": model, "max_attempts": "1", "timeout_s": "60",
                               "total_timeout_s": "60", **settings}, {})
    return Describer(settings, make_client(settings, key), Scrubber(key))


def job(model, prompt="What is it?"):
    return Job(("espresso", "cup"), (0.6, 0.2), prompt, Overrides(model, 0.2, 48, 60.0))


async def close_own(close):
    if asyncio.iscoroutinefunction(close):
        await close()
    else:
        await asyncio.to_thread(close)


def test_a_wrong_key_is_a_flagged_fallback_and_never_shown(upstream):
    async def main():
        base_url, _, close = await upstream.start_own(api_key="sk-the-right-one")
        describer = describer_against(base_url, "sk-WRONG-do-not-show", upstream.model)
        try:
            return await describer.describe(job(upstream.model))
        finally:
            await describer.aclose()
            await close_own(close)
    result = asyncio.run(main())
    assert result.source == "fallback" and result.usage.fallback_reason == upstream.expected["wrong_key"]
    assert "sk-WRONG" not in result.description and "sk-WRONG" not in result.usage.to_json()


def test_a_server_that_goes_away_mid_stream_ends_the_stream_as_partial(upstream):
    chunks = []

    async def main():
        base_url, cut, close = await upstream.start_own(goes_away=True)

        def emit(text):
            chunks.append(text)
            if len(chunks) == 2:
                cut()
        describer = describer_against(base_url, upstream.key, upstream.model, max_tokens="256", max_tokens_limit="1024")
        try:
            return await describer.describe(job(upstream.model, "Write a long story about a cup of coffee."), emit=emit)
        finally:
            await describer.aclose()
            await close_own(close)
    result = asyncio.run(main())
    assert len(chunks) >= 2 and result.source == "llm_partial", (result.source, result.usage.to_json())
    assert result.usage.fallback_reason in upstream.expected["cut"] and result.usage.tokens_estimated is True
    assert json.loads(result.usage.to_json())["completion_tokens"] > 0
