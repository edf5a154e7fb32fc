"""The describe step under request parameters that a client calling Triton directly can send
(the OpenAI front checks its own, but Triton's HTTP and gRPC ports take any): each is refused
for that request alone with INVALID_ARG naming the parameter, before the upstream is called,
and none counts against the upstream's circuit breaker (found by an independent review,
2026-12-06: each case failed before its fix)."""

import json

import pytest
from test_describe_model import make_model, outputs, request
from test_describe_stream_model import make_stream_model, sent

from tools.fake_openai import ThreadedFakeOpenAI

FAST_RETRIES = {"backoff_base_s": "0.01", "backoff_max_s": "0.01"}
TOO_DEEP = "[" * 1000 + "]" * 1000
CASES = {
    # json.loads raised RecursionError, which escaped execute() and left the batch's others unanswered.
    "conversation nested 1,000 deep": ({"conversation": TOO_DEEP}, "conversation", "nested too deeply"),
    "response_format nested 1,000 deep": ({"response_format": '{"type":"text","x":' + TOO_DEEP + "}"},
                                          "response_format", "nested too deeply"),
    # Parsed, but the upstream body could not be encoded: blamed on the upstream, retried, and two
    # such requests opened the circuit for every client of the model.
    "an integer past 64 bits": ({"response_format": json.dumps({"type": "json_object", "x": 2 ** 64})},
                                "response_format", "cannot be sent on as JSON"),
    "nested past orjson's 254 levels": ({"response_format": '{"type":"json_object","x":' + "[" * 300 + "]" * 300
                                         + "}"}, "response_format", "cannot be sent on as JSON"),
    "a lone surrogate": ({"conversation": '[{"role":"user","content":"\\ud800"}]'}, "conversation",
                         "cannot be sent on as JSON"),
    "NaN": ({"response_format": '{"type":"text","x":NaN}'}, "response_format", "NaN is not JSON"),
    "-Infinity": ({"response_format": '{"type":"json_object","x":-Infinity}'}, "response_format",
                  "-Infinity is not JSON"),
    # Parsed whole before the message count refused it: 9 MB took 2.2 s and 192 MB.
    "a 9 MB conversation": ({"conversation": "[" + ",".join(["[]"] * 3_000_000) + "]"}, "conversation",
                            "characters of JSON, more than the"),
    # A glob's * admitted it; the name was kept (breaker, metric labels) and logged as a forged line.
    "a model name with a newline": ({"model": "gpt-4o-mini\n[describe] forged line"}, "model", "a model id"),
    "a model name of 5 MB": ({"model": "gpt-4o-mini" + "x" * 5_000_000}, "model", "a model id"),
}


@pytest.fixture
def fake():
    with ThreadedFakeOpenAI() as fake:
        yield fake


def refusal(pb_utils, req):
    response = req.get_response_sender().wait(20)
    assert response.has_error(), outputs(response)
    return response.error()


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_hostile_parameter_fails_its_request_alone_and_never_the_upstreams_circuit(
        fake_pb_utils_module, fake, monkeypatch, case):
    pb_utils = fake_pb_utils_module
    parameters, field, words = CASES[case]
    model = make_model(monkeypatch, fake.base_url, allowed_models="gpt-4o-mini*", circuit_failure_threshold="1",
                       **FAST_RETRIES)
    try:
        for turn in range(2):  # once would do; twice is what opened the circuit (threshold 5, 3 attempts)
            # a new question each turn: the answer cache would hide the second call
            bad, good = request(pb_utils, parameters=parameters), request(pb_utils, prompt=f"turn {turn}?")
            model.execute([good, bad])
            error = refusal(pb_utils, bad)
            assert error.code() == pb_utils.TritonError.INVALID_ARG
            assert error.message().startswith(f"[code=invalid_parameter field={field}] ") and words in error.message()
            assert len(error.message()) < 400  # never the value itself
            assert outputs(good.get_response_sender().wait(20))["DESCRIPTION_SOURCE"] == "llm"
        assert fake.stats()["requests"] == 2  # the good ones only
    finally:
        model.finalize()


@pytest.mark.parametrize("case", ["NaN", "a lone surrogate", "an integer past 64 bits"])
def test_the_streaming_model_refuses_them_too(fake_pb_utils_module, fake, monkeypatch, case):
    pb_utils = fake_pb_utils_module
    parameters, field, _ = CASES[case]
    model = make_stream_model(monkeypatch, fake.base_url, **FAST_RETRIES)
    try:
        req = request(pb_utils, parameters=parameters)
        model.execute([req])
        (error, final), = sent(req, pb_utils)
        assert final and error.code() == pb_utils.TritonError.INVALID_ARG
        assert error.message().startswith(f"[code=invalid_parameter field={field}] ")
        assert fake.stats()["requests"] == 0
    finally:
        model.finalize()


def test_a_clients_own_short_timeout_is_not_the_upstreams_fault(fake_pb_utils_module, monkeypatch):
    """timeout_s may only shorten the model's own; an attempt cut short by it had no fair chance.
    Counted, two requests asking 1 ms opened the circuit: the next client got the fallback."""
    pb_utils = fake_pb_utils_module
    with ThreadedFakeOpenAI(latency_ms=200) as fake:
        model = make_model(monkeypatch, fake.base_url, circuit_failure_threshold="1", **FAST_RETRIES)
        try:
            for _ in range(2):
                hurried = request(pb_utils, parameters={"timeout_s": 0.001})
                model.execute([hurried])
                usage = json.loads(outputs(hurried.get_response_sender().wait(20))["USAGE"])
                assert usage["fallback_reason"] == "timeout"
            patient = request(pb_utils)
            model.execute([patient])
            assert outputs(patient.get_response_sender().wait(20))["DESCRIPTION_SOURCE"] == "llm"
        finally:
            model.finalize()


@pytest.mark.parametrize("name", ["gpt-4o-mini-2024-07-18", "Qwen/Qwen2-VL-7B-Instruct", "llava:13b",
                                  "meta-llama/Llama-3.2-11B-Vision-Instruct", "x" * 256])
def test_model_ids_as_providers_write_them_pass_the_name_rule(fake_pb_utils_module, fake, monkeypatch, name):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, allowed_models="*")
    try:
        req = request(pb_utils, parameters={"model": name})
        model.execute([req])
        assert json.loads(outputs(req.get_response_sender().wait(20))["USAGE"])["model"] == name
    finally:
        model.finalize()


def not_utf8(*args):
    """What the real stub raises where Triton passed a client's bytes on as they came."""
    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


@pytest.mark.parametrize("where", ["parameters", "request_id", "trace"])
def test_bytes_that_are_not_utf8_fail_alone_or_are_replaced(fake_pb_utils_module, fake, monkeypatch, where):
    """Over HTTP a parameter, an id or a traceparent may hold any bytes; reading one raised
    UnicodeDecodeError out of execute() (a 500 with our traceback). A parameter is refused
    naming it; an id is replaced by a new one and a trace context dropped, the request served."""
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    try:
        req = request(pb_utils)
        if where == "trace":
            monkeypatch.setattr(req._trace, "get_context", not_utf8)
        else:
            monkeypatch.setattr(req, where, not_utf8)
        model.execute([req])
        response = req.get_response_sender().wait(20)
        if where == "parameters":
            assert response.error().code() == pb_utils.TritonError.INVALID_ARG
            assert response.error().message() == ("[code=invalid_parameter field=parameters] "
                                                  "a request parameter is not valid UTF-8")
            assert fake.stats()["requests"] == 0
        else:
            assert outputs(response)["DESCRIPTION_SOURCE"] == "llm"
            assert fake.stats()["traceparents"] == [None]
    finally:
        model.finalize()
