"""The Triton adapter's streaming path (a decoupled model of openai_describe)
with the fake triton_python_backend_utils and the fake upstream streaming SSE:
which outputs each response carries and with which flag, an error after the
labels as the stream's last response, cancellation, and the stream metrics."""

import json
import math
import time

import numpy as np
import pytest
from test_describe_model import KEY, load_model_module, metric, request

from tools.fake_openai import ThreadedFakeOpenAI


@pytest.fixture
def fake():
    with ThreadedFakeOpenAI() as fake:
        yield fake


def make_stream_model(monkeypatch, base_url, key=KEY, **params):
    monkeypatch.setenv("LLM_BASE_URL", base_url)
    if key:
        monkeypatch.setenv("LLM_API_KEY", key)
    else:
        monkeypatch.delenv("LLM_API_KEY", raising=False)
    config = {"name": "describe_stream", "max_batch_size": 1, "model_transaction_policy": {"decoupled": True},
              "parameters": {k: {"string_value": v} for k, v in {"cancel_poll_s": "0.05", **params}.items()}}
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
    observed = []
    for name in ("describe_stream_time_to_labels_seconds", "describe_stream_time_to_first_token_seconds",
                 "describe_stream_duration_seconds"):
        series = [m.observations for m in families[name].metrics if m.labels["model"] == "describe_stream"]
        assert [len(o) for o in series] == [1]
        observed.append(series[0][0])
    labels_s, first_token_s, duration_s = observed
    # In seconds and in order: the 12 chunks come 20 ms apart (0.22 s at least); 10 s leaves a loaded machine room.
    assert 0 <= labels_s <= first_token_s <= duration_s and 0.2 <= duration_s < 10, observed
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


def test_the_supervisors_stopping_file_ends_open_streams_with_unavailable(fake_pb_utils_module, fake, monkeypatch,
                                                                          tmp_path):
    """serving/supervise_tritonserver.sh creates TRITON_STOPPING_FILE before TERM to
    tritonserver: an open stream then ends within cancel_poll_s with UNAVAILABLE
    (retry elsewhere), not CANCELLED, and its LLM call is closed; its client did not leave."""
    pb_utils = fake_pb_utils_module
    stopping = tmp_path / "triton-stopping"
    monkeypatch.setenv("TRITON_STOPPING_FILE", str(stopping))
    fake.set_mode("ok", answer_words=500, chunk_ms=20)
    model = make_stream_model(monkeypatch, fake.base_url)
    try:
        req = request(pb_utils, prompt="A long one")
        model.execute([req])
        deadline = time.monotonic() + 10
        while len(req.get_response_sender().responses) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # polls without the file go on streaming
        assert not req.get_response_sender().flags or not any(
            f & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL for f in req.get_response_sender().flags)
        stopping.touch()
        responses = sent(req, pb_utils)
        deadline = time.monotonic() + 5
        while not fake.stats()["disconnected"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        model.finalize()
    error, final = responses[-1]
    assert final and error.code() == pb_utils.TritonError.UNAVAILABLE and "shutting down" in error.message()
    assert len(responses) < 100 and fake.stats()["disconnected"] == 1 and fake.stats()["streams_completed"] == 0


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


def test_a_chunk_that_could_not_be_sent_ends_the_stream_with_an_error(fake_pb_utils_module, fake, monkeypatch):
    """A lost DESCRIPTION chunk must not pass for a whole description: no more text
    goes out after it, the upstream call stops, and the stream ends with an error
    instead of DESCRIPTION_SOURCE "llm"."""
    pb_utils = fake_pb_utils_module
    fake.set_mode("ok", answer_words=300, chunk_ms=20)
    model = make_stream_model(monkeypatch, fake.base_url)
    req = request(pb_utils, prompt="A long one")
    sender = req.get_response_sender()
    record, attempts = sender.send, []

    def send(response=None, flags=0):
        attempts.append(response)
        if len(attempts) == 3:  # the second DESCRIPTION chunk
            raise pb_utils.TritonModelException("the stub could not send this response")
        record(response, flags)

    sender.send = send
    try:
        model.execute([req])
        responses = sent(req, pb_utils)
        deadline = time.monotonic() + 5
        while not fake.stats()["disconnected"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        model.finalize()
    assert responses[:2] == [(["LABELS", "SCORES"], False), (["DESCRIPTION"], False)]
    assert len(responses) == 3, responses  # nothing after the lost chunk but the error
    error, final = responses[-1]
    assert final and error.code() == pb_utils.TritonError.INTERNAL
    assert "could not be sent" in error.message() and "incomplete" in error.message()
    assert fake.stats()["disconnected"] == 1 and fake.stats()["streams_completed"] == 0
    logged = [m for level, m in pb_utils.Logger.records if level == "error"]
    assert any("the stub could not send this response" in m for m in logged), logged


def photo_request(pb_utils):
    return pb_utils.InferenceRequest({"IMAGE": np.array([[b"\xff\xd8 a photo"]], dtype=np.object_)})


def stream_one_photo(model, pb_utils):
    """One photo request's stream on `model`, which is finalized after: (the request, what it sent)."""
    try:
        req = photo_request(pb_utils)
        model.execute([req])
        return req, sent(req, pb_utils)
    finally:
        model.finalize()


@pytest.mark.parametrize("labels, scores, problem", [
    ([b"x" * 300] + [b"cat"] * 4, [0.5] * 5, "LABELS[0] has 300 characters"),
    ([b"cat"] * 5, [math.nan] * 5, "SCORES must be finite"),
    ([b"\xff"] + [b"cat"] * 4, [0.5] * 5, "LABELS[0] is not valid UTF-8"),
])
def test_classifier_output_the_describe_step_cannot_use_is_a_clear_error(
        fake_pb_utils_module, fake, monkeypatch, labels, scores, problem):
    """classify_and_describe_stream: a (bring-your-own) classifier whose labels break
    the limits or whose scores are not finite gets an error naming the classifier
    and the problem, not "internal error" and a traceback; no LLM call."""
    pb_utils = fake_pb_utils_module

    def classifier(bls_request):
        assert bls_request.requested_output_names() == ["LABELS", "SCORES", "VIEW"]  # vision auto: the view too
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("LABELS", np.array([labels], dtype=np.object_)),
            pb_utils.Tensor("SCORES", np.array([scores], dtype=np.float32))])

    monkeypatch.setitem(pb_utils.InferenceRequest.models, "classify", classifier)
    model = make_stream_model(monkeypatch, fake.base_url, classify_model="classify")
    req, responses = stream_one_photo(model, pb_utils)
    assert len(responses) == 1, responses
    error, final = responses[0]
    assert final and isinstance(error, pb_utils.TritonError), responses
    assert error.code() == pb_utils.TritonError.INTERNAL
    assert "classifier 'classify'" in error.message() and problem in error.message(), error.message()
    assert "internal error in the describe step" not in error.message()
    assert not any("Traceback" in m for _, m in pb_utils.Logger.records)
    assert fake.stats()["requests"] == 0


def test_a_photo_stream_sends_the_classifiers_labels_first(fake_pb_utils_module, fake, monkeypatch):
    """The same path with a classifier that answers well: the checks above refuse bad output only."""
    pb_utils = fake_pb_utils_module
    fake.set_mode("ok", answer_words=3, chunk_ms=1)

    def classifier(bls_request):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("LABELS", np.array([[b"tabby, tabby cat", b"tiger cat"]], dtype=np.object_)),
            pb_utils.Tensor("SCORES", np.array([[0.7, 0.2]], dtype=np.float32))])

    monkeypatch.setitem(pb_utils.InferenceRequest.models, "classify", classifier)
    model = make_stream_model(monkeypatch, fake.base_url, classify_model="classify")
    req, responses = stream_one_photo(model, pb_utils)
    assert responses[0] == (["LABELS", "SCORES"], False) and responses[-1] == (["DESCRIPTION_SOURCE", "USAGE"], True)
    assert req.get_response_sender().responses[0].output("LABELS")[0][0] == b"tabby, tabby cat"


# -- admission and cancellation before the work ---------------------------------

def labelling_classifier(pb_utils, calls, before=None):
    """A classify model for BLS that counts its calls and runs `before(call number)` first."""
    def classifier(bls_request):
        calls.append(bls_request)
        if before is not None:
            before(len(calls))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("LABELS", np.array([[b"tabby, tabby cat", b"tiger cat"]], dtype=np.object_)),
            pb_utils.Tensor("SCORES", np.array([[0.7, 0.2]], dtype=np.float32))])
    return classifier


def stream_model_and_request(pb_utils, monkeypatch, base_url, model_kind, classifier=None, **params):
    """(the model, a function making one valid request) for either streaming model."""
    if model_kind == "classify_and_describe_stream":
        monkeypatch.setitem(pb_utils.InferenceRequest.models, "classify",
                            classifier or labelling_classifier(pb_utils, []))
        return (make_stream_model(monkeypatch, base_url, classify_model="classify", **params),
                lambda: photo_request(pb_utils))
    return make_stream_model(monkeypatch, base_url, **params), lambda: request(pb_utils, prompt="Hi")


STREAM_KINDS = ("describe_stream", "classify_and_describe_stream")


@pytest.mark.parametrize("model_kind", STREAM_KINDS)
def test_a_stream_beyond_max_open_streams_is_refused_at_once(fake_pb_utils_module, fake, monkeypatch, model_kind):
    """Two streams open (the upstream slow): a third is refused in execute() with
    UNAVAILABLE and code=overloaded, which the front answers 503 with Retry-After;
    once the two end, a new one is taken again."""
    from classify_describe_server import error_contract as contract
    from tritonclient.utils import InferenceServerException

    from openai_front.triton import front_error

    pb_utils = fake_pb_utils_module
    fake.set_mode("ok", latency_ms=1500, answer_words=3)
    model, make_request = stream_model_and_request(pb_utils, monkeypatch, fake.base_url, model_kind,
                                                   max_open_streams="2", cache_enabled="false")
    try:
        first, second, third = make_request(), make_request(), make_request()
        model.execute([first, second])
        model.execute([third])
        refused = sent(third, pb_utils)
        # At once: refused while both open streams still wait on their 1.5 s upstream, not after a slot freed.
        open_at_refusal = [not any(f & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL for f in r.get_response_sender().flags)
                           for r in (first, second)]
        done = [sent(first, pb_utils), sent(second, pb_utils)]
        fourth = make_request()
        model.execute([fourth])
        after = sent(fourth, pb_utils)
    finally:
        model.finalize()
    assert len(refused) == 1 and open_at_refusal == [True, True], (refused, open_at_refusal)
    error, final = refused[0]
    assert final and error.code() == pb_utils.TritonError.UNAVAILABLE, refused
    assert contract.read(error.message()).code == contract.OVERLOADED and "max_open_streams=2" in error.message()
    mapped = front_error(InferenceServerException(error.message()))
    assert mapped.status == 503 and mapped.headers() == {"Retry-After": "1"}
    assert all(responses[-1] == (["DESCRIPTION_SOURCE", "USAGE"], True) for responses in done + [after])
    assert fake.stats()["requests"] == 3
    assert metric(model, pb_utils, "describe_requests_total", outcome="overloaded") == 1


def test_photos_beyond_max_photos_waiting_are_refused_before_they_queue(fake_pb_utils_module, fake, monkeypatch):
    """classify_and_describe_stream: while the classifier is busy, photos beyond
    max_photos_waiting are refused at once instead of queueing with their IMAGE."""
    import threading

    pb_utils = fake_pb_utils_module
    fake.set_mode("ok", answer_words=3)
    calls, release = [], threading.Event()
    classifier = labelling_classifier(pb_utils, calls, before=lambda n: release.wait(10))
    model, make_request = stream_model_and_request(pb_utils, monkeypatch, fake.base_url, "classify_and_describe_stream",
                                                   classifier, max_photos_waiting="2")
    try:
        waiting = [make_request(), make_request()]
        model.execute(waiting)
        extra = make_request()
        model.execute([extra])
        refused = sent(extra, pb_utils)
        release.set()
        done = [sent(r, pb_utils) for r in waiting]
        again = make_request()
        model.execute([again])
        after = sent(again, pb_utils)
    finally:
        release.set()
        model.finalize()
    error, final = refused[0]
    assert len(refused) == 1 and final and error.code() == pb_utils.TritonError.UNAVAILABLE
    assert "max_photos_waiting=2" in error.message()
    assert all(responses[-1] == (["DESCRIPTION_SOURCE", "USAGE"], True) for responses in done + [after])
    assert len(calls) == 3


def test_a_photo_cancelled_before_its_classification_is_not_classified(fake_pb_utils_module, fake, monkeypatch):
    """The client left while its request waited: no BLS call, no LLM call, CANCELLED.
    cancel_poll_s is long here, so only the check before the BLS call can see it."""
    pb_utils = fake_pb_utils_module
    calls = []
    model, make_request = stream_model_and_request(pb_utils, monkeypatch, fake.base_url, "classify_and_describe_stream",
                                                   labelling_classifier(pb_utils, calls), cancel_poll_s="30")
    try:
        req = make_request()
        req.cancelled = True
        model.execute([req])
        responses = sent(req, pb_utils)
    finally:
        model.finalize()
    assert len(responses) == 1 and responses[0][0].code() == pb_utils.TritonError.CANCELLED, responses
    assert calls == [] and fake.stats()["requests"] == 0
    assert metric(model, pb_utils, "describe_requests_total", outcome="cancelled") == 1


@pytest.mark.parametrize("model_kind", STREAM_KINDS)
def test_a_stream_cancelled_before_its_llm_call_makes_none(fake_pb_utils_module, fake, monkeypatch, model_kind):
    """The client leaves while its photo is classified (or, for describe_stream,
    before the step got to it): the labels go out, then CANCELLED, and no LLM call."""
    pb_utils = fake_pb_utils_module
    holder = {}

    def leave(_):
        holder["request"].cancelled = True

    model, make_request = stream_model_and_request(
        pb_utils, monkeypatch, fake.base_url, model_kind, labelling_classifier(pb_utils, [], before=leave),
        cancel_poll_s="30")
    try:
        req = holder["request"] = make_request()
        if model_kind == "describe_stream":
            req.cancelled = True
        model.execute([req])
        responses = sent(req, pb_utils)
    finally:
        model.finalize()
    assert responses[0] == (["LABELS", "SCORES"], False) and len(responses) == 2, responses
    assert responses[1][0].code() == pb_utils.TritonError.CANCELLED
    assert fake.stats()["requests"] == 0


@pytest.mark.parametrize("vision", ["auto", "off"])
def test_a_photo_stream_shows_the_llm_the_classify_models_view(fake_pb_utils_module, fake, monkeypatch, vision):
    """classify_with_view's VIEW goes to the LLM as the image part; with vision off it is not even asked for."""
    import io

    from PIL import Image

    pb_utils = fake_pb_utils_module
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (9, 200, 9)).save(buffer, "JPEG")
    asked = []

    def classifier(bls_request):
        asked.append(bls_request.requested_output_names())
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("LABELS", np.array([[b"tabby, tabby cat", b"tiger cat"]], dtype=np.object_)),
            pb_utils.Tensor("SCORES", np.array([[0.7, 0.2]], dtype=np.float32)),
            pb_utils.Tensor("VIEW", np.array([[buffer.getvalue()]], dtype=np.object_))])

    monkeypatch.setitem(pb_utils.InferenceRequest.models, "classify_with_view", classifier)
    monkeypatch.setenv("LLM_VISION", vision)
    model = make_stream_model(monkeypatch, fake.base_url, classify_model="classify_with_view")
    req, responses = stream_one_photo(model, pb_utils)
    usage = json.loads(req.get_response_sender().responses[-1].output("USAGE")[0][0])
    images = fake.stats()["images"][-1]
    if vision == "off":
        assert asked == [["LABELS", "SCORES"]] and images == [] and usage["vision_skipped_reason"] == "off"
    else:
        assert [(i["format"], i["width"], i["height"]) for i in images] == [("JPEG", 40, 30)]
        assert usage["vision"] is True
    assert responses[-1] == (["DESCRIPTION_SOURCE", "USAGE"], True)


def test_a_stream_from_an_endpoint_that_takes_no_key_goes_without_authorization(fake_pb_utils_module, fake,
                                                                                monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_stream_model(monkeypatch, fake.base_url, key=None)
    try:
        req = request(pb_utils, prompt="What is it?")
        model.execute([req])
        assert sent(req, pb_utils)[-1] == (["DESCRIPTION_SOURCE", "USAGE"], True)
        assert req.get_response_sender().responses[-1].output("DESCRIPTION_SOURCE")[0][0] == b"llm"
        assert fake.stats()["authorizations"] == {"": 1}
    finally:
        model.finalize()
