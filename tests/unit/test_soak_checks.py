"""The verdict of `make soak` (tools/soak.py), without a server: each test
injects one failure into what a run observes (the metrics page at the end, the
fake upstream's record of Authorization headers, a valid request that gets no
valid answer, a secret in one client output among many) and checks that
`judge` reports exactly that problem, and nothing for a healthy run."""

import asyncio
import dataclasses
import json
import urllib.request

import pytest

from classify_describe import Result, TritonRequestError
from serving.procfs import http_json
from tools import soak
from tools.fake_openai.server import ThreadedFakeOpenAI

LLM_KEY = "sk-soak-" + "3f" * 12
ADMIN_KEY = "adm-soak-" + "9c" * 12

LABELS = 'model="describe",version="1"'
METRICS = "\n".join([
    "# TYPE nv_inference_request_success counter",
    'nv_inference_request_success{model="classify_and_describe",version="1"} 40',
    "# TYPE describe_requests_total counter",
    f'describe_requests_total{{{LABELS},outcome="ok"}} 37',
    f'describe_requests_total{{{LABELS},outcome="fallback"}} 3',
    f'describe_prompt_tokens_total{{{LABELS},upstream_model="gpt-4o-mini"}} 1480',
    f'describe_completion_tokens_total{{{LABELS},upstream_model="gpt-4o-mini"}} 444',
    f'describe_cost_usd_total{{{LABELS},upstream_model="gpt-4o-mini"}} 0.000488',
    f'describe_upstream_latency_seconds_count{{{LABELS},result="ok",upstream_model="gpt-4o-mini"}} 37',
    f'describe_upstream_latency_seconds_sum{{{LABELS},result="ok",upstream_model="gpt-4o-mini"}} 7.6',
    f'describe_upstream_latency_seconds_bucket{{{LABELS},result="ok",upstream_model="gpt-4o-mini",le="+Inf"}} 37',
    f'describe_circuit_state{{{LABELS},upstream_model="gpt-4o-mini"}} 0',
    f'describe_upstream_in_flight{{{LABELS}}} 0',
    f'describe_upstream_queued{{{LABELS}}} 0',
    f'describe_cache_lookups_total{{{LABELS},result="miss"}} 40',
    "",
])


def answer(number, source="llm", description=None):
    """What AsyncClient.infer returns for soak request `number`, as the fake upstream answers it."""
    if description is None:
        description = (f"Fake answer #{number + 1} from gpt-4o-mini: {soak.prompt_for(number)}" if source == "llm"
                       else "Most likely a tabby (62%); it could also be a tiger cat (21%).")
    return Result(labels=["tabby", "tiger cat", "Egyptian cat", "lynx", "tiger"],
                  scores=[0.62, 0.21, 0.09, 0.01, 0.005], description=description,
                  description_source=source, usage={"model": "gpt-4o-mini"}, latency_ms=512.0)


def observed(tally=None, metrics=METRICS, upstream=None, server_logs="I1201 server started\n"):
    """A healthy run's observations, with whatever the test replaces."""
    if tally is None:
        tally = soak.Tally(soak.SecretScan({"LLM key": LLM_KEY, "admin key": ADMIN_KEY}))
        for number in range(40):
            tally.answered(tally.sent(), number, answer(number, "llm" if number % 8 else "fallback"))
    if upstream is None:
        upstream = {"requests": 35, "authorizations": {f"Bearer {LLM_KEY}": 35}}
    return soak.Observed(
        llm_key=LLM_KEY, tally=tally, scan=tally.scan, hostile={"sent": 220, "clear": 220},
        faults=[{"fault": "llm_recovered", "circuit_closed_s": 5.3},
                {"fault": "preprocess_stub_sigkill", "serving_again_s": 2.5}],
        server_ready_at_end=True, metrics=metrics, upstream=upstream, server_logs=server_logs)


def new_tally():
    return soak.Tally(soak.SecretScan({"LLM key": LLM_KEY, "admin key": ADMIN_KEY}))


def test_a_healthy_run_passes_every_check():
    findings = soak.judge(observed())
    assert findings["problems"] == []
    assert findings["metrics_tail_ok"] and findings["upstream_saw_key"]
    assert findings["valid"] == {"sent": 40, "llm": 35, "fallback": 5, "failed": 0, "answered": 40, "lost": 0}
    assert findings["upstream_key"] == {"requests": 35, "with_key": 35}
    assert findings["secret_leaks"] == []
    assert findings["secrets_scanned"] == {"client_outputs": 40, "metrics": 1, "server_logs": 1}


# -- the metrics page at the end --------------------------------------------------------

def test_metrics_without_the_describe_families():
    triton_only = "\n".join(line for line in METRICS.splitlines() if "describe_" not in line)
    findings = soak.judge(observed(metrics=triton_only))
    assert findings["problems"] == ["metrics at the end lack " + ", ".join(soak.DESCRIBE_FAMILIES)]
    assert not findings["metrics_tail_ok"]


def test_metrics_missing_one_family():
    page = "\n".join(line for line in METRICS.splitlines() if not line.startswith("describe_circuit_state"))
    assert soak.judge(observed(metrics=page))["problems"] == ["metrics at the end lack describe_circuit_state"]


def test_metrics_that_count_no_llm_answer():
    page = METRICS.replace('outcome="ok"} 37', 'outcome="ok"} 0')
    assert soak.judge(observed(metrics=page))["problems"] == [
        'metrics at the end count no describe_requests_total{outcome="ok"}']


def test_metrics_endpoint_that_did_not_answer():
    findings = soak.judge(observed(metrics=None))
    assert findings["problems"] == ["the metrics endpoint did not answer at the end"]
    assert not findings["metrics_tail_ok"]


def test_metrics_with_the_key():
    page = METRICS + f'describe_upstream_errors_total{{{LABELS},message="Incorrect API key provided: {LLM_KEY}"}} 1\n'
    findings = soak.judge(observed(metrics=page))
    assert findings["problems"] == ["secret found in metrics: LLM key"]
    assert not findings["metrics_tail_ok"]


# -- the Authorization header the fake upstream received --------------------------------

def upstream_stats(keys):
    """The real fake upstream's /_admin/stats after one chat request per key (None: no header)."""
    with ThreadedFakeOpenAI() as fake:
        for key in keys:
            headers = {"Content-Type": "application/json"}
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).encode()
            request = urllib.request.Request(f"{fake.base_url}/chat/completions", data=body, headers=headers)
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200
        return http_json(f"http://127.0.0.1:{fake.fake.port}/_admin/stats")


def test_upstream_that_saw_the_key_on_every_request():
    findings = soak.judge(observed(upstream=upstream_stats([LLM_KEY, LLM_KEY])))
    assert findings["problems"] == [] and findings["upstream_key"] == {"requests": 2, "with_key": 2}


def test_upstream_that_never_saw_the_key():
    findings = soak.judge(observed(upstream=upstream_stats(["sk-some-other-key", None])))
    assert findings["problems"] == ["2 of 2 upstream request(s) without 'Authorization: Bearer <LLM key>'"]
    assert not findings["upstream_saw_key"]
    assert LLM_KEY not in json.dumps(findings) and "sk-some-other-key" not in json.dumps(findings)


def test_upstream_that_saw_the_key_on_some_requests_only():
    findings = soak.judge(observed(upstream=upstream_stats([LLM_KEY, "sk-some-other-key", LLM_KEY])))
    assert findings["problems"] == ["1 of 3 upstream request(s) without 'Authorization: Bearer <LLM key>'"]


def test_upstream_that_received_nothing():
    findings = soak.judge(observed(upstream={"requests": 0, "authorizations": {}}))
    assert findings["problems"] == ["the fake upstream received no request"]


# -- valid requests without a valid answer ------------------------------------------------

class StandIn:
    """AsyncClient.infer for soak.valid_load: answers every request like the fake
    upstream would, except request `odd`, which gets `fault` instead."""

    def __init__(self, odd, fault):
        self.odd, self.fault = odd, fault

    async def infer(self, image, prompt=None):
        number = int(prompt.split()[2].rstrip(":"))
        await asyncio.sleep(0.001)
        if number != self.odd:
            return answer(number)
        if self.fault == "never answers":
            await asyncio.sleep(3600)
        if self.fault == "outputs missing":  # what _parse raises when as_numpy("LABELS") is None
            raise TypeError("'NoneType' object is not subscriptable")
        if self.fault == "connection refused after the retries":
            raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 8000)")
        if self.fault == "another request's description":
            return answer(number, description=f"Fake answer #1 from gpt-4o-mini: {soak.prompt_for(number + 1)}")
        if self.fault == "no description source":
            return answer(number, source="")
        if self.fault == "stub down":
            raise TritonRequestError("Stub process 'preprocess_0_0' is not healthy.")
        raise AssertionError(self.fault)


def run_load(client, requests=60, concurrency=4, images=(b"photo",), mix=("infer",)):
    """soak.valid_load until `requests` were sent, with a short drain."""
    tally = new_tally()

    async def main():
        stop = asyncio.Event()
        load = asyncio.ensure_future(soak.valid_load(client, list(images), concurrency, tally, stop, drain_s=0.3,
                                                     mix=mix))
        while tally.row()["sent"] < requests:
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(load, 10)

    asyncio.run(main())
    return tally


@pytest.mark.parametrize("fault, kind", [
    ("never answers", "no answer when the load stopped"),
    ("outputs missing", "no answer (TypeError)"),
    ("connection refused after the retries", "no answer (ConnectionRefusedError)"),
    ("another request's description", "invalid answer"),
    ("no description source", "invalid answer"),
])
def test_a_request_without_a_valid_answer_is_lost(fault, kind):
    tally = run_load(StandIn(odd=7, fault=fault))
    findings = soak.judge(observed(tally=tally))
    assert findings["problems"] == [f"1 valid request(s) lost (no valid answer): {{'{kind}': 1}}"]
    assert findings["valid"]["lost"] == 1
    assert findings["valid"]["sent"] == findings["valid"]["answered"] + findings["valid"]["failed"] + 1


def test_an_error_answer_on_the_killed_stub_is_failed_not_lost():
    findings = soak.judge(observed(tally=run_load(StandIn(odd=7, fault="stub down"))))
    assert findings["problems"] == []
    assert findings["valid"]["failed"] == 1 and findings["valid"]["lost"] == 0
    assert findings["valid_failed_stub_down"] == 1


def test_a_request_that_was_sent_and_never_recorded_is_lost():
    tally = new_tally()
    tally.answered(tally.sent(), 0, answer(0))
    tally.sent()  # no answer, no error, nothing recorded
    assert soak.judge(observed(tally=tally))["problems"] == [
        "1 valid request(s) lost (no valid answer): {'sent, then nothing recorded': 1}"]


# -- the secret scan ------------------------------------------------------------------------

def test_a_secret_in_one_output_among_many():
    tally = new_tally()
    for number in range(12000):
        result = answer(number)
        if number == 9876:  # past any sample the old scan kept (the first 5,000, then 1%)
            result.usage["echo"] = f"Incorrect API key provided: {LLM_KEY}."
        tally.answered(tally.sent(), number, result)
    findings = soak.judge(observed(tally=tally))
    assert findings["problems"] == ["secret found in client_outputs: LLM key"]
    assert findings["secrets_scanned"]["client_outputs"] == 12000


def test_a_secret_in_an_error_message():
    tally = new_tally()
    tally.answered(tally.sent(), 0, answer(0))
    tally.failed(tally.sent(), TritonRequestError(f"Stub process 'preprocess_0_0' is not healthy. {ADMIN_KEY}"))
    assert soak.judge(observed(tally=tally))["problems"] == ["secret found in client_errors: admin key"]


def test_a_secret_in_the_server_log():
    findings = soak.judge(observed(server_logs=f"E1201 describe: calling with key {LLM_KEY}\n"))
    assert findings["problems"] == ["secret found in server_logs: LLM key"]


# -- the valid mix: every path, the photo's own labels, the front's restart ---------------

def test_an_answer_with_another_photos_top_label_is_lost():
    tally = new_tally()
    tally.answered(tally.sent(), 0, answer(0), top_labels=soak.TOP_LABELS["chelsea"])
    tally.answered(tally.sent("front"), 1, answer(1), top_labels=soak.TOP_LABELS["coffee"], path="front")
    findings = soak.judge(observed(tally=tally))
    assert findings["problems"] == ["1 valid request(s) lost (no valid answer): {'invalid answer': 1}"]
    assert findings["valid_lost_sample"][0]["detail"] == "top label 'tabby', not this photo's"
    assert findings["valid_by_path"] == {"infer": {"sent": 1, "answered": 1, "failed": 0, "lost": 0},
                                         "front": {"sent": 1, "answered": 0, "failed": 0, "lost": 1}}


class EveryPath(StandIn):
    """StandIn on every path of the soak's mix; `silent` paths never answer validly."""

    def __init__(self, silent=()):
        super().__init__(odd=None, fault=None)
        self.silent = silent

    def __getattr__(self, path):
        async def send(image, prompt=None):
            if path in self.silent:
                raise ConnectionRefusedError(111, "Connect call failed")
            return await self.infer(image, prompt)
        return send


def run_mix(client, requests=80):
    return run_load(client, requests, images=(b"cat", b"cup"), mix=soak.soak_paths.MIX)


def test_every_path_of_the_mix_answers():
    tally = run_mix(EveryPath())
    findings = soak.judge(dataclasses.replace(observed(tally=tally), mix=soak.soak_paths.MIX))
    assert findings["problems"] == []
    assert set(findings["valid_by_path"]) == {"infer", "grpc_stream", "front", "front_stream"}
    assert all(row["answered"] > 0 for row in findings["valid_by_path"].values())


def test_a_path_of_the_mix_that_never_answers():
    tally = run_mix(EveryPath(silent={"front_stream"}))
    findings = soak.judge(dataclasses.replace(observed(tally=tally), mix=soak.soak_paths.MIX))
    lost = findings["valid_by_path"]["front_stream"]["lost"]
    assert findings["problems"] == [
        f"{lost} valid request(s) lost (no valid answer): {{'no answer (ConnectionRefusedError)': {lost}}}",
        "no valid answer by the front_stream path"]


@pytest.mark.parametrize("phase, error, problems", [
    ("restart", "error event: the OpenAI front is shutting down", []),
    ("stub_kill", "error event: the OpenAI front is shutting down", []),  # sent before, still open at the restart
    ("restart", "[code=model_unloading] the server is shutting down: retry on another replica", []),  # on Triton's gRPC
    ("restart", "error event: the server is shutting down: retry on another replica", []),  # through the front
    ("restart", "HTTP 503: the model is unloading; retry later", []),  # sent as describe began to unload
    ("restart", "HTTP 503: the inference server is unavailable; retry later",
     ["1 valid request(s) failed other than on the killed stub or a stream the restart's shutdown ended: "
      "['restart/front_stream: TritonRequestError: HTTP 503: the inference server is unavailable; retry later']"]),
])
def test_a_stream_the_front_ended_at_its_shutdown(phase, error, problems):
    tally = new_tally()
    tally.phase = phase
    tally.answered(tally.sent(), 0, answer(0))
    tally.failed(tally.sent("front_stream"), TritonRequestError(error, answered=True), "front_stream")
    findings = soak.judge(observed(tally=tally))
    assert findings["problems"] == problems
    assert findings["valid_failed_front_shutdown"] == (not problems)


def test_an_unexpected_error_is_named_in_the_verdict_with_its_secrets_redacted():
    tally = new_tally()
    tally.phase = "steady"
    tally.answered(tally.sent(), 0, answer(0))
    tally.failed(tally.sent(), TritonRequestError(f"HTTP 500: upstream said key {LLM_KEY} is wrong", answered=True))
    [problem] = soak.judge(observed(tally=tally))["problems"][:1]
    assert problem.startswith("1 valid request(s) failed other than") and "key <LLM key> is wrong" in problem
    assert LLM_KEY not in problem
