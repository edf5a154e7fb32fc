"""The describe model on the real tritonserver (one per session, see
conftest.py), calling the fake OpenAI-compatible upstream over real HTTP.

Isolation inside the shared server: every test uses its own PROMPT (no
answers from the in-model cache of another test), tests that inject failures
use their own upstream model name (`gpt-4o-mini-it-*`, allowed by the
committed `allowed_models`), so each has its own circuit breaker, and an
autouse fixture puts the fake back to "ok" after each test.
"""

import asyncio
import json
import os
import pathlib
import re
import resource
import threading
import time
import uuid

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tools.local_stack import TritonServer

from .conftest import STARTS_ITS_OWN_SERVER

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = "describe"
LABELS = ("tabby, tabby cat", "tiger cat", "Egyptian cat")
SCORES = (0.62, 0.21, 0.09)


@pytest.fixture(autouse=True)
def restore_fake(fake_llm):
    yield
    deadline = time.monotonic() + 10  # a "refuse" test may leave the fake not listening for a moment
    while True:
        try:
            fake_llm.admin("mode", {"mode": "ok", "latency_ms": 0, "hold_for": 0})
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def client(triton):
    return httpclient.InferenceServerClient(triton.http_url, network_timeout=120, connection_timeout=120)


def unique(text="Describe"):
    return f"{text} [{uuid.uuid4().hex[:8]}]"


def inputs(prompt=None, module=httpclient):
    tensors = [module.InferInput("LABELS", [1, len(LABELS)], "BYTES"),
               module.InferInput("SCORES", [1, len(SCORES)], "FP32")]
    tensors[0].set_data_from_numpy(np.array([[x.encode() for x in LABELS]], dtype=np.object_))
    tensors[1].set_data_from_numpy(np.array([SCORES], dtype=np.float32))
    if prompt is not None:
        tensors.append(module.InferInput("PROMPT", [1, 1], "BYTES"))
        tensors[2].set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    return tensors


def describe(client, prompt=None, **parameters):
    result = client.infer(MODEL, inputs(prompt), parameters=parameters or None)
    text, source, usage = (result.as_numpy(n)[0][0].decode() for n in ("DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE"))
    return text, source, json.loads(usage)


def metric_value(triton, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`. The model
    writes its metrics every 0.25 s: wait for one write before reading."""
    time.sleep(0.3)
    total, found = 0.0, False
    for line in triton.metrics().splitlines():
        match = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        sample = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if sample.get("model") in (None, MODEL) and all(sample.get(k) == v for k, v in labels.items()):
            total, found = total + float(match.group(3)), True
    return total if found else None


def assert_metric_becomes(triton, name, expected, timeout_s=30, **labels):
    """The metric equals `expected` within `timeout_s`: a loaded machine can delay the
    model's write past the 0.3 s metric_value waits."""
    deadline = time.monotonic() + timeout_s
    value = metric_value(triton, name, **labels)
    while value != expected and time.monotonic() < deadline:
        value = metric_value(triton, name, **labels)
    assert value == expected, f"{name} {labels}: {value}, expected {expected}"


def wait_until_upstream_has(fake_llm, requests, timeout_s=60):
    """Until the fake upstream has received `requests` in all (generous: on a loaded
    machine classification and the model's queue take seconds)."""
    deadline = time.monotonic() + timeout_s
    while stats(fake_llm)["requests"] < requests:
        assert time.monotonic() < deadline, f"the upstream got {stats(fake_llm)['requests']} of {requests} requests"
        time.sleep(0.1)


def stats(fake_llm):
    return fake_llm.admin("stats")


def test_answer_from_the_llm_with_usage_and_cost(client, fake_llm):
    prompt = unique("What is this animal?")
    text, source, usage = describe(client, prompt)
    assert source == "llm" and text.startswith("Fake answer") and prompt in text
    assert usage["model"] == "gpt-4o-mini" and usage["attempts"] == 1 and usage["fallback_reason"] is None
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert usage["cost_usd"] == pytest.approx((usage["prompt_tokens"] * 0.15 + usage["completion_tokens"] * 0.60) / 1e6)
    seen = stats(fake_llm)
    assert seen["last_authorization"].startswith("Bearer sk-")
    body = seen["bodies"][-1]
    assert body["model"] == "gpt-4o-mini" and body["max_tokens"] == 256
    assert "tabby, tabby cat (62.0%)" in body["messages"][1]["content"]


def test_the_prompt_is_optional(client):
    text, source, _ = describe(client, prompt=None)
    assert source in ("llm",) and "Describe this object in detail" in text


def test_identical_requests_are_answered_by_the_in_model_cache(client, fake_llm, triton):
    prompt = unique("cache")
    hits_before = metric_value(triton, "describe_cache_lookups_total", result="hit") or 0
    first = describe(client, prompt)
    requests_after_first = stats(fake_llm)["requests"]
    second = describe(client, prompt)
    assert second[0] == first[0] and second[1] == "llm"
    assert second[2]["cached"] is True and second[2]["cost_usd"] == 0
    assert stats(fake_llm)["requests"] == requests_after_first  # no new upstream call
    assert_metric_becomes(triton, "describe_cache_lookups_total", hits_before + 1, result="hit")
    # Triton's response cache is deliberately off for this model (it would keep fallbacks).
    assert not metric_value(triton, "nv_cache_num_hits_per_model")


def test_a_fallback_is_not_cached(client, fake_llm):
    prompt = unique("outage")
    fake_llm.admin("mode", {"mode": "500"})
    assert describe(client, prompt, model="gpt-4o-mini-it-nocache")[1] == "fallback"
    fake_llm.admin("mode", {"mode": "ok"})
    assert describe(client, prompt, model="gpt-4o-mini-it-nocache")[1] == "llm"


def test_request_parameters_override_within_limits(client, fake_llm):
    _, source, usage = describe(client, unique(), model="gpt-4o-mini-2024-07-18", temperature=0.7, max_tokens=40)
    body = stats(fake_llm)["bodies"][-1]
    assert source == "llm" and usage["model"] == "gpt-4o-mini-2024-07-18"
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("gpt-4o-mini-2024-07-18", 0.7, 40)
    for bad in ({"model": "gpt-4o"}, {"max_tokens": 5000}, {"temperature": 1.5}):
        with pytest.raises(InferenceServerException, match="allowed|max_tokens|temperature"):
            describe(client, unique(), **bad)


def test_429_is_retried_after_retry_after(client, fake_llm, triton):
    retried_before = metric_value(triton, "describe_requests_total", outcome="retried")
    fake_llm.admin("mode", {"mode": "429", "retry_after": 1, "count": 1})
    _, source, usage = describe(client, unique(), model="gpt-4o-mini-it-429")
    assert source == "llm" and usage["attempts"] == 2
    first, second = stats(fake_llm)["arrivals"][-2:]
    assert second - first >= 1.0
    assert_metric_becomes(triton, "describe_requests_total", retried_before + 1, outcome="retried")


@pytest.mark.parametrize("mode, reason", [("500", "upstream_error_http_500"), ("malformed", "malformed_response"),
                                          ("drop", "connection_error")])
def test_upstream_failures_are_retried_then_fall_back(client, fake_llm, mode, reason):
    before = stats(fake_llm)["requests"]
    fake_llm.admin("mode", {"mode": mode})
    text, source, usage = describe(client, unique(), model=f"gpt-4o-mini-it-{mode}")
    assert source == "fallback" and usage["fallback_reason"] == reason and usage["attempts"] == 3
    assert text == "Most likely a tabby (62%); it could also be a tiger cat (21%) or an Egyptian cat (9%)."
    assert stats(fake_llm)["requests"] - before == 3


def test_401_is_not_retried_and_the_key_never_leaks(client, fake_llm, triton):
    key = stats(fake_llm)["last_authorization"].removeprefix("Bearer ")
    before = stats(fake_llm)["requests"]
    fake_llm.admin("mode", {"mode": "401"})  # the fake echoes the key back, as providers do
    text, source, usage = describe(client, unique(), model="gpt-4o-mini-it-401")
    assert source == "fallback" and usage["fallback_reason"] == "authentication_failed_http_401" and usage["attempts"] == 1
    assert stats(fake_llm)["requests"] - before == 1
    log = triton.log()
    assert "Incorrect API key provided" in log  # the failure was logged ...
    for place in (text, json.dumps(usage), log, triton.metrics()):
        assert key not in place  # ... without the key


def test_an_answer_past_max_tokens_is_cut_and_not_cached(client, fake_llm):
    """50,000 characters for max_tokens 64 end at 16 x 64 as
    llm_partial (answer_too_long), and the same request asks the upstream again;
    a body of 2,000,000 characters is not read at all (fallback, no retry)."""
    fake_llm.admin("mode", {"mode": "huge", "huge_chars": 50_000})
    prompt = unique("Huge")
    requests_before = stats(fake_llm)["requests"]
    for _ in range(2):
        text, source, usage = describe(client, prompt, max_tokens=64)
        assert source == "llm_partial" and len(text) == 16 * 64 and usage["fallback_reason"] == "answer_too_long"
        assert usage["finish_reason"] == "length" and usage["cost_usd"] > 0
    assert stats(fake_llm)["requests"] == requests_before + 2  # never cached
    fake_llm.admin("mode", {"mode": "huge", "huge_chars": 2_000_000})
    text, source, usage = describe(client, unique("Huger"), max_tokens=64)
    assert source == "fallback" and usage["fallback_reason"] == "answer_too_long" and usage["attempts"] == 1


def test_a_hanging_upstream_is_cut_by_the_timeout(client, fake_llm):
    fake_llm.admin("mode", {"mode": "hang"})
    started = time.monotonic()
    _, source, usage = describe(client, unique(), model="gpt-4o-mini-it-hang", timeout_s=0.5)
    assert source == "fallback" and usage["fallback_reason"] == "timeout" and usage["attempts"] == 3
    # Three 0.5 s attempts and their back-off, cut by the timeout: far below the hang (an
    # hour) and the client's 120 s, with room for a loaded machine.
    assert time.monotonic() - started < 60


def test_refused_connections_fall_back(client, fake_llm):
    describe(client, unique(), model="gpt-4o-mini-it-refuse")  # a pooled connection exists
    fake_llm.admin("mode", {"mode": "refuse", "duration_s": 2})
    _, source, usage = describe(client, unique(), model="gpt-4o-mini-it-refuse")
    assert source == "fallback" and usage["fallback_reason"] == "connection_error"
    time.sleep(2.2)


def test_circuit_opens_then_half_opens_and_closes(client, fake_llm, triton):
    model = "gpt-4o-mini-it-circuit"
    fake_llm.admin("mode", {"mode": "500"})
    describe(client, unique(), model=model)   # 3 failed attempts
    describe(client, unique(), model=model)   # 2 more: the threshold (5) opens the circuit
    assert_metric_becomes(triton, "describe_circuit_state", 2, upstream_model=model)
    before = stats(fake_llm)["requests"]
    _, source, usage = describe(client, unique(), model=model)
    assert source == "fallback" and usage["fallback_reason"] == "circuit_open" and usage["attempts"] == 0
    assert stats(fake_llm)["requests"] == before  # open: nothing went upstream
    # Other upstream models keep their own circuit.
    fake_llm.admin("mode", {"mode": "ok"})
    assert describe(client, unique(), model="gpt-4o-mini-it-other")[1] == "llm"
    deadline = time.monotonic() + 15  # circuit_cooldown_s is 10 in the committed config
    while describe(client, unique(), model=model)[1] != "llm":
        assert time.monotonic() < deadline, "the circuit never half-opened"
        time.sleep(0.5)
    assert_metric_becomes(triton, "describe_circuit_state", 0, upstream_model=model)


def test_a_cancelled_request_stops_its_upstream_call(triton, fake_llm):
    fake_llm.admin("mode", {"mode": "hang"})
    cancelled_before = metric_value(triton, "describe_requests_total", outcome="cancelled")
    disconnected_before, requests_before = stats(fake_llm)["disconnected"], stats(fake_llm)["requests"]
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    done = threading.Event()
    context = client.async_infer(MODEL, inputs(unique("cancel me"), grpcclient),
                                 callback=lambda result, error: done.set(),
                                 parameters={"model": "gpt-4o-mini-it-cancel"})
    wait_until_upstream_has(fake_llm, requests_before + 1)  # the call is open: now the cancellation
    context.cancel()
    # Below the 15 s attempt timeout, whose end would make the outcome a timeout instead.
    deadline = time.monotonic() + 12
    while metric_value(triton, "describe_requests_total", outcome="cancelled") == cancelled_before:
        assert time.monotonic() < deadline, "the model never noticed the cancellation"
        time.sleep(0.2)
    time.sleep(0.2)
    assert stats(fake_llm)["disconnected"] > disconnected_before
    client.close()


def test_one_instance_holds_500_calls_and_queues_beyond_the_cap(triton, fake_llm):
    """1,100 concurrent 1 s requests: at least 500 at once upstream, at most 1,024 (max_in_flight),
    the rest queued, none failed."""
    # Each request holds an open file here and in tritonserver, and up to 1,024 of them one
    # in the describe stub and in the fake upstream; all started under this process's limit
    # (tests/conftest.py raised it to the hard one). Each keeps some of its own (tritonserver
    # 73, counted idle); 300 leave room for them.
    requests = min(1100, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 300)
    assert requests > 500, f"the open-file limit leaves room for {requests} requests: raise it (ulimit -n)"
    # The upstream answers none until 500 are in flight at once: the event this test is
    # about, whatever the machine's speed; each then takes 1 s, so those past the cap queue.
    fake_llm.admin("mode", {"mode": "ok", "latency_ms": 1000, "hold_for": 500})
    before = stats(fake_llm)
    tag = uuid.uuid4().hex[:8]

    async def run():
        url = f"http://{triton.http_url}/v2/models/{MODEL}/infer"
        connector = aiohttp.TCPConnector(limit=0)
        # Generous: a loaded machine takes seconds to open them all, and the last wait for 1 s calls to end.
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one(i):
                payload = {"inputs": [
                    {"name": "LABELS", "shape": [1, 3], "datatype": "BYTES", "data": list(LABELS)},
                    {"name": "SCORES", "shape": [1, 3], "datatype": "FP32", "data": list(SCORES)},
                    {"name": "PROMPT", "shape": [1, 1], "datatype": "BYTES", "data": [f"load {tag} {i}"]}]}
                async with session.post(url, json=payload) as response:
                    body = await response.json()
                    return response.status, body
            return await asyncio.gather(*(one(i) for i in range(requests)))

    results = asyncio.run(run())
    sources = [next(o["data"][0] for o in body["outputs"] if o["name"] == "DESCRIPTION_SOURCE")
               for status, body in results if status == 200]
    assert len(sources) == requests and set(sources) == {"llm"}
    peak = stats(fake_llm)["max_in_flight"]
    assert 500 <= peak <= 1024, peak
    assert stats(fake_llm)["requests"] - before["requests"] == requests


def settled(triton, expected, deadline_s=30.0):
    """{(name, labels): value} read until every `expected` value is there: the model
    writes its metrics every 0.25 s, later on a loaded machine, hence the generous
    deadline. Returns the last reading, which the caller asserts on."""
    deadline = time.monotonic() + deadline_s
    while True:
        seen = {key: metric_value(triton, key[0], **dict(key[1])) for key in expected}
        if all(seen[key] == value for key, value in expected.items()) or time.monotonic() > deadline:
            return seen


def test_metrics_count_each_request_and_what_it_billed_and_time_it_in_seconds(triton, client, fake_llm):
    """Three requests to a 300 ms upstream, on an upstream model of their own (series
    no other test feeds): the counters move by exactly what was sent and billed,
    and the latency histogram holds three observations in seconds."""
    upstream = "gpt-4o-mini-it-metrics"
    ok = ("describe_requests_total", (("outcome", "ok"),))
    ok_before = metric_value(triton, "describe_requests_total", outcome="ok") or 0
    fake_llm.admin("mode", {"mode": "ok", "latency_ms": 300})
    usages = [describe(client, unique(), model=upstream)[2] for _ in range(3)]
    assert [u["model"] for u in usages] == [upstream] * 3 and all(u["attempts"] == 1 for u in usages)

    def series(name, **labels):
        return name, tuple(sorted(dict(labels, upstream_model=upstream).items()))

    latency = "describe_upstream_latency_seconds"
    expected = {
        ok: ok_before + 3,
        series("describe_prompt_tokens_total"): sum(u["prompt_tokens"] for u in usages),
        series("describe_completion_tokens_total"): sum(u["completion_tokens"] for u in usages),
        series(latency + "_count", result="ok"): 3,
        series(latency + "_bucket", result="ok", le="0.25"): 0,  # each call took 0.3 s at least
        series(latency + "_bucket", result="ok", le="10"): 3,  # and far less than 10 s
        series("describe_circuit_state"): 0,
    }
    seen = settled(triton, expected)
    assert seen == expected
    total_s = metric_value(triton, latency + "_sum", upstream_model=upstream, result="ok")
    assert 0.9 <= total_s < 30, f"three 0.3 s calls took {total_s} (seconds expected)"
    cost = metric_value(triton, "describe_cost_usd_total", upstream_model=upstream)
    assert cost == pytest.approx(sum(u["cost_usd"] for u in usages), rel=1e-3)
    assert metric_value(triton, "describe_upstream_in_flight") == 0


@STARTS_ITS_OWN_SERVER
def test_without_a_key_the_server_still_serves_and_says_so_once(tmp_path, fake_llm):
    """A second, small server (describe, and the classifier serve.sh insists on)
    started by the same scripts/serve.sh, without LLM_API_KEY, for an endpoint that needs
    one (LLM_API_KEY_REQUIRED=true, as the hosted APIs are): never called. A local one
    without a key is called without Authorization (tests/upstreams)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("describe", "classifier"):
        (repo / name).symlink_to(REPO / "model_repository" / name)
    # None removes a variable: no LLM_* setting of the caller's leaks in.
    env = {name: None for name in os.environ if name.startswith("LLM_")}
    env.update(LLM_API_KEY=None, LLM_BASE_URL=fake_llm.base_url, LLM_API_KEY_REQUIRED="true")
    server = TritonServer(tmp_path, env, repository=repo)
    client = None
    try:
        server.start(timeout_s=120)
        client = httpclient.InferenceServerClient(server.http_url)
        before = stats(fake_llm)["requests"]
        for _ in range(3):
            text, source, usage = describe(client, unique())
            assert source == "fallback" and usage["fallback_reason"] == "no_api_key"
            assert text.startswith("Most likely a tabby")
        assert stats(fake_llm)["requests"] == before
        log = server.log()
        assert log.count("no API key found") == 1 and "set LLM_API_KEY" in log and fake_llm.base_url in log
    finally:
        if client is not None:
            client.close()  # an open keep-alive connection would hold the shutdown for exit-timeout-secs
        server.stop()
