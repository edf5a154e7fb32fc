"""The Triton adapter's streaming path (a decoupled model of openai_describe)
with the fake triton_python_backend_utils and the fake upstream streaming SSE:
which outputs each response carries and with which flag, an error after the
labels as the stream's last response, cancellation, and the stream metrics."""

import json
import time

import pytest
from test_describe_model import KEY, load_model_module, request

from tools.fake_openai import ThreadedFakeOpenAI


@pytest.fixture
def fake():
    with ThreadedFakeOpenAI() as fake:
        yield fake


def make_stream_model(monkeypatch, base_url, **params):
    monkeypatch.setenv("LLM_BASE_URL", base_url)
    monkeypatch.setenv("LLM_API_KEY", KEY)
    config = {"name": "describe_stream", "max_batch_size": 1, "model_transaction_policy": {"decoupled": True},
              "parameters": {k: {"string_value": v} for k, v in dict(cancel_poll_s="0.05", **params).items()}}
    model = load_model_module().TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_name": "describe_stream", "model_version": "1"})
    return model


def sent(req, pb_utils):
    """[(output names or the error, final?)] of what the model sent for `req`."""
    sender = req.get_response_sender()
    sender.wait(10)
    return [(r.error() if r.has_error() else sorted(t.name() for t in r.output_tensors()),
             bool(f & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)) for r, f in zip(sender.responses, sender.flags)]


def test_labels_then_chunks_then_source_and_usage_with_the_final_flag(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    fake.set_mode("ok", answer_words=12, chunk_ms=20)
    model = make_stream_model(monkeypatch, fake.base_url)
    try:
        req = request(pb_utils, prompt="What is it?")
        assert model.execute([req]) is None
        responses = sent(req, pb_utils)
    finally:
        model.finalize()
    assert responses == [(["LABELS", "SCORES"], False)] + [(["DESCRIPTION"], False)] * 12 + \
        [(["DESCRIPTION_SOURCE", "USAGE"], True)]
    texts = [r.output("DESCRIPTION")[0][0].decode() for r in req.get_response_sender().responses[1:-1]]
    last = req.get_response_sender().responses[-1]
    usage = json.loads(last.output("USAGE")[0][0])
    assert "".join(texts) == fake.stats()["streamed_answers"][-1]
    assert last.output("DESCRIPTION_SOURCE")[0][0] == b"llm" and usage["chunks"] == 12
    families = pb_utils.MetricFamily.families
    for name in ("describe_stream_time_to_labels_seconds", "describe_stream_time_to_first_token_seconds",
                 "describe_stream_duration_seconds"):
        assert [len(m.observations) for m in families[name].metrics if m.labels["model"] == "describe_stream"] == [1]
    assert sum(m.value() for m in families["describe_stream_chunks_total"].metrics
               if m.labels["model"] == "describe_stream") == 12


def test_on_failure_error_ends_the_stream_with_an_error_after_the_labels(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    fake.set_mode("500")
    model = make_stream_model(monkeypatch, fake.base_url, on_failure="error", max_attempts="1")
    try:
        req = request(pb_utils)
        model.execute([req])
        responses = sent(req, pb_utils)
    finally:
        model.finalize()
    assert responses[0] == (["LABELS", "SCORES"], False) and len(responses) == 2
    error, final = responses[1]
    assert final and error.code() == pb_utils.TritonError.UNAVAILABLE and "upstream_error_http_500" in error.message()


def test_a_cancelled_stream_ends_with_cancelled_and_closes_the_upstream(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    fake.set_mode("ok", answer_words=500, chunk_ms=20)
    model = make_stream_model(monkeypatch, fake.base_url)
    try:
        req = request(pb_utils, prompt="A long one")
        model.execute([req])
        deadline = time.monotonic() + 10
        while len(req.get_response_sender().responses) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        req.cancelled = True
        responses = sent(req, pb_utils)
        deadline = time.monotonic() + 5
        while not fake.stats()["disconnected"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        model.finalize()
    error, final = responses[-1]
    assert final and error.code() == pb_utils.TritonError.CANCELLED and len(responses) < 100
    assert fake.stats()["disconnected"] == 1 and fake.stats()["streams_completed"] == 0


def test_a_bad_request_gets_one_error_and_nothing_else(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_stream_model(monkeypatch, fake.base_url)
    try:
        req = request(pb_utils, prompt="x" * 5000)
        model.execute([req])
        responses = sent(req, pb_utils)
    finally:
        model.finalize()
    assert len(responses) == 1 and responses[0][1] and "PROMPT" in responses[0][0].message()
    assert fake.stats()["requests"] == 0
