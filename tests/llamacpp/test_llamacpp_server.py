"""Every path of the product against llama-cpp-python's server, a text-only model that takes
no list content and sends no usage in its streams: keyless, the whole answer over HTTP and
gRPC, the photo stream over gRPC, the OpenAI front's stream, vision auto settling on
text-only without opening the circuit, a wrong key, and a server that goes away mid-stream."""

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

from .conftest import MODEL_NAME, LlamaServer

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
def test_a_whole_answer_comes_from_the_local_server_called_without_a_key(triton, protocol):
    port = triton.http_port if protocol == "http" else triton.grpc_port
    with Client(f"127.0.0.1:{port}", protocol=protocol, timeout_s=180) as client:
        result = client.infer(PHOTO, "What is on the table?")
    assert result.description_source == "llm" and result.description.strip(), result.usage
    assert result.labels and result.usage["model"] == MODEL_NAME
    # A text-only model: answered without the photo, and nobody priced it.
    assert result.usage["vision"] is False and result.usage["vision_skipped_reason"] == "refused_by_upstream"
    assert result.usage["total_tokens"] > 0 and result.usage["cost_usd"] is None


def test_vision_auto_settles_on_text_only_and_opens_no_circuit(triton):
    with Client(f"127.0.0.1:{triton.http_port}", timeout_s=180) as client:
        results = [client.infer(PHOTO, f"Photo {i}: what is it?") for i in range(3)]
    assert all(r.description_source == "llm" for r in results), [r.usage for r in results]
    assert results[-1].usage["attempts"] == 1  # remembered: asked text-only straight away
    assert metric(triton, "describe_circuit_state", upstream_model=MODEL_NAME) == 0
    refused = (metric(triton, "describe_upstream_latency_seconds_count", result="image_request_failed") or 0) + \
        (metric(triton, "describe_upstream_latency_seconds_count", result="image_refused_by_upstream") or 0)
    assert refused >= 1


def test_the_photo_stream_over_grpc_ends_with_usage_estimated(triton):
    with Client(f"127.0.0.1:{triton.grpc_port}", protocol="grpc", timeout_s=180) as client:
        events = list(client.stream(PHOTO, "Describe it in one sentence."))
    kinds = [event.kind for event in events]
    assert kinds[0] == "labels" and kinds[-1] == "done" and "text" in kinds
    result = events[-1].result
    assert result.description_source == "llm" and result.description == "".join(e.text for e in events if e.text)
    # The server's stream carries no usage chunk: billed from the text, and said so.
    assert result.usage["completion_tokens"] > 0 and result.usage.get("tokens_estimated") is True


def test_the_openai_fronts_stream_through_the_local_server(triton):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{triton.openai_port}/v1", api_key="unused", max_retries=0,
                           timeout=180)
    data_uri = "data:image/png;base64," + base64.b64encode(PHOTO).decode()
    chunks = list(client.chat.completions.create(
        model="classify_and_describe", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                               {"type": "image_url", "image_url": {"url": data_uri}}]}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def describer_against(base_url, key, **settings):
    settings = parse_settings({"base_url": base_url, "model": MODEL_NAME, "max_attempts": "1", "timeout_s": "60",
                               "total_timeout_s": "60", **settings}, {})
    return Describer(settings, make_client(settings, key), Scrubber(key))


def job(prompt="What is it?"):
    return Job(("espresso", "cup"), (0.6, 0.2), prompt, Overrides(MODEL_NAME, 0.2, 48, 60.0))


def test_a_wrong_key_is_a_flagged_fallback_and_never_shown(tmp_path):
    server = LlamaServer(tmp_path, api_key="sk-the-right-one")
    try:
        async def main():
            describer = describer_against(server.base_url, "sk-WRONG-do-not-show")
            try:
                return await describer.describe(job())
            finally:
                await describer.aclose()
        result = asyncio.run(main())
    finally:
        server.stop()
    assert result.source == "fallback" and result.usage.fallback_reason == "authentication_failed_http_401"
    assert "sk-WRONG" not in result.description and "sk-WRONG" not in result.usage.to_json()


def test_a_server_that_goes_away_mid_stream_ends_the_stream_as_partial(tmp_path):
    server = LlamaServer(tmp_path)
    chunks = []

    def emit(text):
        chunks.append(text)
        if len(chunks) == 2:
            server.process.kill()  # our own llama server, by its PID

    async def main():
        describer = describer_against(server.base_url, None, max_tokens="256", max_tokens_limit="1024")
        try:
            return await describer.describe(job("Write a long story about a cup of coffee."), emit=emit)
        finally:
            await describer.aclose()
    try:
        result = asyncio.run(main())
    finally:
        server.stop()
    assert len(chunks) >= 2 and result.source == "llm_partial", (result.source, result.usage.to_json())
    assert result.usage.fallback_reason in ("connection_error", "timeout") and result.usage.tokens_estimated is True
    assert json.loads(result.usage.to_json())["completion_tokens"] > 0
