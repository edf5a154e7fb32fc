"""The package behind one shared LLM gateway: a real LiteLLM proxy
(build/litellm-venv, `make litellm-gateway`) on the committed config
(deploy/llm-gateway/configmap.yaml), its provider pointed at the fake upstream,
and a server of this file's own whose LLM_BASE_URL is the proxy. Shown:
answers flow (ensemble -> LiteLLM -> upstream, whole and streamed through the
OpenAI front), with the provider key the gateway's alone; a refusal from the
gateway's own rate limit (rpm 1 on one model) becomes the flagged fallback,
or UNAVAILABLE where no prose fallback may be given, and is counted in the
describe metrics; neither the gateway's key nor the provider's shows in any
log, output, error or metric.

No Redis and no Postgres here: the proxy keeps its counts and cache in memory
(one proxy) and has no virtual keys, so the replica holds the master key where
a tenant's virtual key would be (docs/llm-gateway.md)."""

import base64
import json
import re
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from ..support.litellm_gateway import Gateway
from .conftest import REPO, running_triton

MASTER_KEY = "sk-gateway-master-DO-NOT-LEAK-" + uuid.uuid4().hex[:12]
PROVIDER_KEY = "sk-provider-DO-NOT-LEAK-" + uuid.uuid4().hex[:12]
MODEL = "gpt-4o-mini"                  # the shipped config's model (the replicas' LLM_MODEL)
LIMITED = "gpt-4o-mini-gateway-rpm1"   # the same, with rpm 1 at the gateway (allowed by gpt-4o-mini*)


@pytest.fixture(scope="module")
def gateway(fake_llm, tmp_path_factory):
    gateway = Gateway(tmp_path_factory.mktemp("litellm"), fake_llm.base_url, MASTER_KEY, PROVIDER_KEY, limited=LIMITED)
    try:
        yield gateway
    finally:
        gateway.stop()
        print(f"\nlitellm log: {gateway.log_path}")


@pytest.fixture(scope="module")
def server(fake_llm, gateway, tmp_path_factory):
    # The replica's key is the gateway's (here the master key; a tenant's virtual key in production).
    with running_triton(tmp_path_factory.mktemp("behind_gateway"), fake_llm,
                        extra_env={"LLM_BASE_URL": gateway.base_url, "LLM_API_KEY": MASTER_KEY,
                                   "LLM_MODEL": MODEL}) as s:
        yield s


@pytest.fixture(scope="module")
def seen():
    """Every output and error a client got, scanned for the keys at the end."""
    return []


def unique(text="What is it?"):
    return f"{text} ({uuid.uuid4().hex[:8]})"


def describe(server, seen, **parameters):
    """describe over HTTP: (DESCRIPTION, DESCRIPTION_SOURCE, USAGE), or the error."""
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        tensors = [httpclient.InferInput("LABELS", [1, 2], "BYTES"), httpclient.InferInput("SCORES", [1, 2], "FP32"),
                   httpclient.InferInput("PROMPT", [1, 1], "BYTES")]
        tensors[0].set_data_from_numpy(np.array([[b"espresso", b"cup"]], dtype=np.object_))
        tensors[1].set_data_from_numpy(np.array([[0.9, 0.05]], dtype=np.float32))
        tensors[2].set_data_from_numpy(np.array([[unique().encode()]], dtype=np.object_))
        try:
            result = client.infer("describe", tensors, parameters=parameters or None)
        except InferenceServerException as error:
            seen.append(str(error))
            return error
        text, source, usage = (result.as_numpy(n)[0][0].decode() for n in ("DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE"))
        seen.append(text + source + usage)
        return text, source, json.loads(usage)
    finally:
        client.close()


def metric_value(server, name, **labels):
    """Sum of `name`'s samples for model describe with these labels (the model
    writes its metrics every 0.25 s: wait for one write first)."""
    time.sleep(0.3)
    total = 0.0
    for line in server.metrics().splitlines():
        match = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if match and match.group(1) == name:
            sample = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            if sample.get("model") == "describe" and all(sample.get(k) == v for k, v in labels.items()):
                total += float(match.group(3))
    return total


def chat(server, seen, stream):
    body = {"model": "classify_and_describe", "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "text", "text": unique()},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
            (REPO / "docs/sample/coffee.png").read_bytes()).decode()}}]}]}
    request = urllib.request.Request(f"{server.openai_base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read().decode()
    seen.append(text)
    if not stream:
        return json.loads(text)["choices"][0]["message"]["content"]
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))


def test_answers_flow_through_the_gateway_with_the_provider_key_its_alone(server, gateway, llm, seen):
    text, source, usage = describe(server, seen)
    assert source == "llm" and text.startswith("Fake answer #"), (text, source)
    assert usage["attempts"] == 1 and usage["fallback_reason"] is None
    # The whole pipeline, whole and streamed, through the OpenAI front.
    assert "Fake answer #" in chat(server, seen, stream=False)
    assert "Fake answer #" in chat(server, seen, stream=True)
    calls = llm.admin("stats")["authorizations"]
    # At least the three calls (a slow attempt retried on a busy machine would add one).
    assert set(calls) == {f"Bearer {PROVIDER_KEY}"} and calls[f"Bearer {PROVIDER_KEY}"] >= 3, \
        "the upstream saw another key than the gateway's provider key"
    assert gateway.log().count("POST /v1/chat/completions HTTP/1.1\" 200") >= 3


def test_a_gateway_rate_limit_is_a_flagged_fallback_then_unavailable_and_counted(server, llm, seen):
    """rpm 1 at the gateway: one answer, then the gateway refuses (429, with a
    Retry-After of a minute). The describe step falls back, flagged with the
    reason; a request that asked for JSON (no prose fallback allowed: as with
    on_failure=error) is refused with UNAVAILABLE. A minute boundary between
    two requests renews the gateway's budget, hence "within a few"."""
    fallbacks_before = metric_value(server, "describe_requests_total", outcome="fallback")
    answers = [describe(server, seen, model=LIMITED) for _ in range(3)]
    sources = [a[1] for a in answers]
    assert sources[0] == "llm" and "fallback" in sources, sources
    refused = answers[sources.index("fallback")]
    assert refused[2]["fallback_reason"].startswith("rate_limited"), refused[2]
    assert refused[0].startswith("Most likely an espresso"), refused[0]  # composed from the labels
    assert llm.admin("stats")["authorizations"] == {f"Bearer {PROVIDER_KEY}": sources.count("llm")}, \
        "a refused request reached the provider"
    deadline = time.monotonic() + 10  # the model's metric writes are buffered (0.25 s)
    while metric_value(server, "describe_requests_total", outcome="fallback") < fallbacks_before + 1:
        assert time.monotonic() < deadline, "the gateway's refusal is not counted as a fallback"
    json_answers = [describe(server, seen, model=LIMITED, response_format=json.dumps({"type": "json_object"}))
                    for _ in range(2)]
    errors = [a for a in json_answers if isinstance(a, InferenceServerException)]
    assert errors, json_answers
    assert errors[0].status() == "503" and "upstream_unavailable" in str(errors[0]), str(errors[0])


def test_no_key_in_any_log_output_error_or_metric(server, gateway, seen):
    """Runs last in this file: after the outputs and errors above were collected."""
    assert len(seen) >= 6, "the answers above were not collected"
    scanned = {"server log": server.log(), "gateway log": gateway.log(), "outputs and errors": "\n".join(seen),
               "metrics": server.metrics()}
    for where, text in scanned.items():
        for name, key in (("gateway", MASTER_KEY), ("provider", PROVIDER_KEY)):
            assert key not in text, f"the {name} key is in the {where}"
