"""The Triton adapter (model.py) with the fake triton_python_backend_utils:
responses go out through the response sender, errors per request, metrics,
the no-key warning, and an orderly finalize."""

import json
import threading

import numpy as np
import pytest
from backend_model import load_model

from tools.fake_openai import ThreadedFakeOpenAI

KEY = "sk-adapter-DO-NOT-LEAK-0987654321"


def load_model_module():
    return load_model("openai_describe")


def make_model(monkeypatch, base_url, key=KEY, **params):
    monkeypatch.setenv("LLM_BASE_URL", base_url)
    if key:
        monkeypatch.setenv("LLM_API_KEY", key)
    else:
        monkeypatch.delenv("LLM_API_KEY", raising=False)
    config = {"name": "describe", "parameters": {k: {"string_value": v} for k, v in params.items()}}
    model = load_model_module().TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_name": "describe", "model_version": "1"})
    return model


def request(pb_utils, labels=("tabby, tabby cat", "tiger cat"), scores=(0.7, 0.2), prompt=None, parameters=None):
    inputs = {"LABELS": np.array([[label.encode() for label in labels]], dtype=np.object_),
              "SCORES": np.array([scores], dtype=np.float32)}
    if prompt is not None:
        inputs["PROMPT"] = np.array([[prompt.encode()]], dtype=np.object_)
    return pb_utils.InferenceRequest(inputs, parameters=parameters)


def outputs(response):
    return {name: response.output(name)[0][0].decode() for name in ("DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE")}


def metric(model, pb_utils, family, **labels):
    model.metrics.flush()  # updates are buffered between flushes
    for m in pb_utils.MetricFamily.families[family].metrics:
        if all(m.labels.get(k) == v for k, v in labels.items()):
            return m.value()
    return None


@pytest.fixture
def fake():
    with ThreadedFakeOpenAI() as fake:
        yield fake


def test_execute_returns_none_and_answers_through_the_sender(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    try:
        reqs = [request(pb_utils, prompt="What is it?"), request(pb_utils)]
        assert model.execute(reqs) is None
        first, second = (outputs(r.get_response_sender().wait()) for r in reqs)
        assert first["DESCRIPTION_SOURCE"] == "llm" and "What is it?" in first["DESCRIPTION"]
        assert "Describe this object in detail" in second["DESCRIPTION"]  # the default prompt
        usage = json.loads(first["USAGE"])
        assert usage["model"] == "gpt-4o-mini" and usage["total_tokens"] > 0 and usage["cost_usd"] > 0
        assert all(r.get_response_sender().flags == [pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL] for r in reqs)
        assert fake.stats()["last_authorization"] == f"Bearer {KEY}"
        usages = [json.loads(outputs(r.get_response_sender().wait())["USAGE"]) for r in reqs]
        assert metric(model, pb_utils, "describe_requests_total", outcome="ok") == 2
        for family, field in (("describe_prompt_tokens_total", "prompt_tokens"),
                              ("describe_completion_tokens_total", "completion_tokens"),
                              ("describe_cost_usd_total", "cost_usd")):
            billed = sum(u[field] for u in usages)
            assert metric(model, pb_utils, family, upstream_model="gpt-4o-mini") == pytest.approx(billed, rel=1e-3)
        assert metric(model, pb_utils, "describe_fallbacks_total") is None, "a whole answer is no fallback"
    finally:
        model.finalize()
    assert not model.thread.is_alive()


def test_the_upstream_latency_histogram_holds_one_observation_per_attempt_in_seconds(fake_pb_utils_module,
                                                                                    monkeypatch):
    """The fake answers after 300 ms: each attempt is observed once, at 0.3 s or a
    little more (the upper bound is generous: a loaded machine), never 300 (ms)."""
    pb_utils = fake_pb_utils_module
    with ThreadedFakeOpenAI(latency_ms=300) as fake:
        model = make_model(monkeypatch, fake.base_url)
        try:
            reqs = [request(pb_utils, prompt=f"latency {i}") for i in range(3)]
            model.execute(reqs)
            assert [outputs(r.get_response_sender().wait())["DESCRIPTION_SOURCE"] for r in reqs] == ["llm"] * 3
            model.metrics.flush()
        finally:
            model.finalize()
    series = [m for m in pb_utils.MetricFamily.families["describe_upstream_latency_seconds"].metrics
              if m.labels.get("upstream_model") == "gpt-4o-mini" and m.labels.get("result") == "ok"]
    observed = [value for m in series for value in m.observations]
    assert len(observed) == 3 and all(0.29 <= value < 10 for value in observed), observed
    assert series[0].buckets[0] < 0.3 < series[0].buckets[-1] < 300, "buckets in seconds, around a 0.3 s call"


def test_bad_requests_get_their_own_error_and_do_not_fail_the_batch(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    try:
        good = request(pb_utils)
        mismatched = pb_utils.InferenceRequest({"LABELS": np.array([[b"a", b"b"]], dtype=np.object_),
                                                "SCORES": np.array([[0.5]], dtype=np.float32)})
        not_allowed = request(pb_utils, parameters={"model": "gpt-4o"})
        too_many_tokens = request(pb_utils, parameters={"max_tokens": 100000})
        model.execute([good, mismatched, not_allowed, too_many_tokens])
        assert outputs(good.get_response_sender().wait())["DESCRIPTION_SOURCE"] == "llm"
        for bad, text in ((mismatched, "same non-empty shape"), (not_allowed, "not allowed"),
                          (too_many_tokens, "max_tokens")):
            response = bad.get_response_sender().wait()
            assert response.has_error() and text in response.error().message()
            assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    finally:
        model.finalize()


def test_request_parameters_override_model_temperature_and_max_tokens(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, allowed_models="gpt-4o-mini*")
    try:
        req = request(pb_utils, parameters={"model": "gpt-4o-mini-2024-07-18", "temperature": 0.9,
                                            "max_tokens": 32})
        model.execute([req])
        assert json.loads(outputs(req.get_response_sender().wait())["USAGE"])["model"] == "gpt-4o-mini-2024-07-18"
        body = fake.stats()["bodies"][-1]
        assert (body["model"], body["temperature"], body["max_tokens"]) == ("gpt-4o-mini-2024-07-18", 0.9, 32)
    finally:
        model.finalize()


@pytest.mark.parametrize("base_url, required", [
    (None, "true"),                            # the operator says the endpoint needs a key
    ("https://api.openai.com/v1", "auto"),     # a hosted API that needs one (never called here)
    ("https://x.api.deepseek.com/v1", "auto"),  # and its subdomains
])
def test_without_a_key_an_endpoint_that_needs_one_serves_fallbacks_and_says_so_once(
        fake_pb_utils_module, fake, monkeypatch, base_url, required):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, base_url or fake.base_url, key=None, api_key_required=required)
    try:
        assert model.handler.describer._client is None  # no call can be made, to any host
        reqs = [request(pb_utils) for _ in range(3)]
        model.execute(reqs)
        for r in reqs:
            out = outputs(r.get_response_sender().wait())
            assert out["DESCRIPTION_SOURCE"] == "fallback" and out["DESCRIPTION"].startswith("Most likely a tabby")
            assert json.loads(out["USAGE"])["fallback_reason"] == "no_api_key"
        assert metric(model, pb_utils, "describe_fallbacks_total", outcome="fallback", reason="no_api_key") == 3
        hints = [m for _, m in pb_utils.Logger.records if "no API key found" in m]
        assert len(hints) == 1 and "set LLM_API_KEY" in hints[0] and (base_url or fake.base_url) in hints[0]
        assert fake.stats()["requests"] == 0
    finally:
        model.finalize()


@pytest.mark.parametrize("required", ["auto", "false", "0"])
def test_an_endpoint_that_takes_no_key_is_called_without_authorization(fake_pb_utils_module, fake, monkeypatch,
                                                                         required):
    """A local vLLM, Ollama or llama.cpp server given as a base URL alone: no Authorization header
    at all (not an empty or made-up bearer token), and the answer is the LLM's."""
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, key=None, api_key_required=required)
    try:
        req = request(pb_utils)
        model.execute([req])
        assert outputs(req.get_response_sender().wait())["DESCRIPTION_SOURCE"] == "llm"
        assert fake.stats()["authorizations"] == {"": 1}
        assert not [m for _, m in pb_utils.Logger.records if "no API key found" in m]
        assert any("key from environment variable LLM_API_KEY: none, called without one" in m
                   for _, m in pb_utils.Logger.records)
    finally:
        model.finalize()


def test_a_key_given_is_sent_to_any_endpoint(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, api_key_required="false")
    try:
        req = request(pb_utils)
        model.execute([req])
        assert outputs(req.get_response_sender().wait())["DESCRIPTION_SOURCE"] == "llm"
        assert fake.stats()["authorizations"] == {f"Bearer {KEY}": 1}
    finally:
        model.finalize()


def test_on_failure_error_sends_unavailable(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, on_failure="error", backoff_base_s="0.01")
    try:
        fake.set_mode("500")
        req = request(pb_utils)
        model.execute([req])
        response = req.get_response_sender().wait()
        assert response.error().code() == pb_utils.TritonError.UNAVAILABLE
        assert "http_500" in response.error().message()
        assert metric(model, pb_utils, "describe_fallbacks_total", upstream_model="gpt-4o-mini",
                      outcome="error", reason="upstream_error_http_500") == 1
    finally:
        fake.set_mode("ok")
        model.finalize()


def test_cancelled_requests_get_a_cancelled_error(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, cancel_poll_s="0.05")
    try:
        fake.set_mode("hang")
        req = request(pb_utils)
        model.execute([req])
        threading.Timer(0.2, lambda: setattr(req, "cancelled", True)).start()
        response = req.get_response_sender().wait(timeout=3)
        assert response.error().code() == pb_utils.TritonError.CANCELLED
        assert metric(model, pb_utils, "describe_requests_total", outcome="cancelled") >= 1
    finally:
        fake.set_mode("ok")
        model.finalize()


def test_the_key_never_reaches_logs_or_outputs(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    try:
        fake.set_mode("401")  # the fake echoes the key it was given, as real providers do
        req = request(pb_utils)
        model.execute([req])
        out = outputs(req.get_response_sender().wait())
        assert json.loads(out["USAGE"])["fallback_reason"] == "authentication_failed_http_401"
        assert any("Incorrect API key" in m for _, m in pb_utils.Logger.records)
        everything = json.dumps(out) + json.dumps(pb_utils.Logger.records)
        assert "0987654321" not in everything
    finally:
        fake.set_mode("ok")
        model.finalize()


def test_finalize_drains_in_flight_requests(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    fake.set_mode("ok", latency_ms=300)
    try:
        reqs = [request(pb_utils, prompt=f"drain {i}") for i in range(5)]
        model.execute(reqs)
    finally:
        model.finalize()
        fake.set_mode("ok", latency_ms=0)
    # Every request was answered before finalize returned, and the loop thread is gone.
    assert all(outputs(r.get_response_sender().wait(0))["DESCRIPTION_SOURCE"] == "llm" for r in reqs)
    assert not model.thread.is_alive()
    late = request(pb_utils)
    model.closing = True
    model.execute([late])
    assert late.get_response_sender().wait(0).error().code() == pb_utils.TritonError.UNAVAILABLE


def test_a_decoupled_config_with_batches_is_refused_at_load(fake_pb_utils_module, monkeypatch):
    """A stream carries one description: a decoupled model must take one row per request."""
    pb_utils = fake_pb_utils_module
    config = {"name": "describe_stream", "max_batch_size": 8, "model_transaction_policy": {"decoupled": True}}
    with pytest.raises(pb_utils.TritonModelException, match="max_batch_size: 1"):
        load_model_module().TritonPythonModel().initialize(
            {"model_config": json.dumps(config), "model_name": "describe", "model_version": "1"})


def test_request_chosen_models_are_capped(fake_pb_utils_module, fake, monkeypatch):
    """Each upstream model has its own circuit breaker and metric series: a client
    cycling through names that match allowed_models (gpt-4o-mini-1, -2, ...) must
    not grow them without bound. Beyond the cap a new name is refused for that
    request alone; names already tracked and the default model keep working."""
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, allowed_models="gpt-4o-mini*", cache_enabled="false")
    try:
        hostile = [request(pb_utils, parameters={"model": f"gpt-4o-mini-{i}"}) for i in range(100)]
        model.execute(hostile)
        refused = [r for r in hostile if r.get_response_sender().wait().has_error()]
        assert refused, "every distinct model name was tracked"
        for r in refused:
            error = r.get_response_sender().wait().error()
            assert error.code() == pb_utils.TritonError.INVALID_ARG
            assert "max_request_models" in error.message()
        served = len(hostile) - len(refused)
        assert served == model.settings.max_request_models

        again, default = request(pb_utils, parameters={"model": "gpt-4o-mini-0"}), request(pb_utils)
        model.execute([again, default])
        for r in (again, default):
            assert outputs(r.get_response_sender().wait())["DESCRIPTION_SOURCE"] == "llm"
        model.metrics.flush()
        circuits = pb_utils.MetricFamily.families["describe_circuit_state"].metrics
        assert len({m.labels["upstream_model"] for m in circuits}) <= served + 1
    finally:
        model.finalize()


def view_request(pb_utils, view, parameters=None):
    req = request(pb_utils, prompt="What breed?", parameters=parameters)
    req._inputs["VIEW"] = pb_utils.Tensor("VIEW", np.array([[view]], dtype=np.object_))
    return req


@pytest.mark.parametrize("view, parameters, code, field, words", [
    (b"GIF89a not a jpeg", None, "invalid_input", "VIEW", "VIEW must be a JPEG"),
    (b"\xff\xd8\xff" + b"x" * 5000, None, "invalid_input", "VIEW", "max_view_bytes=4096"),
    (b"", {"conversation": '[{"role": "tool", "content": "x"}]'}, "invalid_parameter", "conversation", "role"),
    (b"", {"response_format": '{"type": "yaml"}'}, "invalid_parameter", "response_format", "type is one of"),
])
def test_a_bad_view_conversation_or_response_format_is_refused_naming_it(fake_pb_utils_module, fake, monkeypatch,
                                                                         view, parameters, code, field, words):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, max_view_bytes="4096")
    try:
        req = view_request(pb_utils, view, parameters)
        model.execute([req])
        error = req.get_response_sender().wait().error()
        assert error.code() == pb_utils.TritonError.INVALID_ARG
        assert error.message().startswith(f"[code={code} field={field}] ") and words in error.message()
        assert "x" * 100 not in error.message()  # never quotes the view
        assert fake.stats()["requests"] == 0
    finally:
        model.finalize()


def test_a_view_reaches_the_llm_and_an_empty_one_is_text_only(fake_pb_utils_module, fake, monkeypatch):
    import io

    from PIL import Image

    pb_utils = fake_pb_utils_module
    buffer = io.BytesIO()
    Image.new("RGB", (30, 20), "white").save(buffer, "JPEG")
    model = make_model(monkeypatch, fake.base_url)
    try:
        seen, empty = view_request(pb_utils, buffer.getvalue()), view_request(pb_utils, b"")
        model.execute([seen])
        usage = json.loads(outputs(seen.get_response_sender().wait())["USAGE"])
        assert usage["vision"] is True and fake.stats()["images"][-1][0]["width"] == 30
        model.execute([empty])
        usage = json.loads(outputs(empty.get_response_sender().wait())["USAGE"])
        assert usage["vision"] is False and usage["vision_skipped_reason"] == "no_view"
        assert fake.stats()["images"][-1] == []
    finally:
        model.finalize()


def test_a_model_nobody_priced_reports_its_cost_as_unknown_and_counts_none(fake_pb_utils_module, fake, monkeypatch):
    """A local model: its tokens are counted, its cost is null in USAGE and absent from the cost
    counter, never another model's price."""
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url, model="llama3.1")
    try:
        req = request(pb_utils)
        model.execute([req])
        usage = json.loads(outputs(req.get_response_sender().wait())["USAGE"])
        assert usage["model"] == "llama3.1" and usage["total_tokens"] > 0 and usage["cost_usd"] is None
        assert metric(model, pb_utils, "describe_prompt_tokens_total", upstream_model="llama3.1") == usage["prompt_tokens"]
        assert metric(model, pb_utils, "describe_cost_usd_total", upstream_model="llama3.1") is None
    finally:
        model.finalize()
