"""The describe step's side of request ids: Triton's request id (the
OpenAI front's X-Request-ID, or a tritonclient caller's request_id) goes to
the LLM upstream as X-Request-ID on every attempt, whole or streamed, and to
the classify model's BLS request, and the log lines about the request name
it; an id that is not valid is replaced. Against the real server:
tests/integration/test_request_ids.py."""

import re

import numpy as np
import pytest
from classify_describe_server.settings import parse_settings

from tools.fake_openai import ThreadedFakeOpenAI

from .test_describe_describer import job, run
from .test_describe_model import make_model, request
from .test_describe_stream_model import make_stream_model, sent

NEW_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def fake():
    with ThreadedFakeOpenAI() as fake:
        yield fake


def test_every_attempt_whole_or_streamed_carries_the_id_and_none_without_one():
    async def test(fake, d, obs, log):
        fake.set_mode("500", count=1)  # the first attempt fails, the retry answers
        assert (await d.describe(job("whole", request_id="rid-whole"))).source == "llm"
        chunks = []
        assert (await d.describe(job("streamed", request_id="rid-stream"), emit=chunks.append)).source == "llm"
        await d.describe(job("no id"))
        assert fake.stats["request_ids"] == ["rid-whole", "rid-whole", "rid-stream", None]
        # The failed attempt's warning names its request (model_log.Log writes "[request id: ...]").
        assert log.request_ids == ["rid-whole"] and "upstream attempt failed" in log.lines[0]
    run(test)


def test_the_id_is_no_part_of_the_cache_key():
    settings = parse_settings({"base_url": "http://127.0.0.1:1/v1"}, {})
    assert job("same", request_id="one").cache_key(settings) == job("same", request_id="other").cache_key(settings)


def test_the_adapter_takes_tritons_request_id_and_replaces_a_bad_one(fake_pb_utils_module, fake, monkeypatch):
    pb_utils = fake_pb_utils_module
    model = make_model(monkeypatch, fake.base_url)
    try:
        good, bad, none = (request(pb_utils, prompt=f"q{i}") for i in range(3))
        good._request_id, bad._request_id = "client-rid-1", "a b\n[request id: forged]"
        fake.set_mode("500", count=1)  # the first attempt of the first request fails (logged), its retry answers
        model.execute([good])
        good.get_response_sender().wait()
        model.execute([bad, none])
        for r in (bad, none):
            r.get_response_sender().wait()
        sent_ids = fake.stats()["request_ids"]
        assert sent_ids.count("client-rid-1") == 2, sent_ids
        others = [i for i in sent_ids if i != "client-rid-1"]
        assert len(others) == 2 and all(NEW_ID.fullmatch(i) for i in others) and others[0] != others[1], sent_ids
        warnings = [m for level, m in pb_utils.Logger.records if level == "warn"]
        assert any(m.startswith("[describe] [request id: client-rid-1] upstream attempt failed") for m in warnings), \
            warnings
        assert not any("forged" in m for _, m in pb_utils.Logger.records)
    finally:
        model.finalize()


def test_a_photo_stream_passes_the_id_to_the_classify_call_and_the_upstream(fake_pb_utils_module, fake,
                                                                            monkeypatch):
    pb_utils = fake_pb_utils_module
    classify_ids = []

    def classifier(bls_request):
        classify_ids.append(bls_request.request_id())
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("LABELS", np.array([[b"tabby, tabby cat", b"tiger cat"]], dtype=np.object_)),
            pb_utils.Tensor("SCORES", np.array([[0.7, 0.2]], dtype=np.float32))])

    monkeypatch.setitem(pb_utils.InferenceRequest.models, "classify", classifier)
    model = make_stream_model(monkeypatch, fake.base_url, classify_model="classify")
    try:
        req = pb_utils.InferenceRequest({"IMAGE": np.array([[b"\xff\xd8 a photo"]], dtype=np.object_)},
                                        request_id="photo-rid")
        model.execute([req])
        assert sent(req, pb_utils)[-1] == (["DESCRIPTION_SOURCE", "USAGE"], True)
    finally:
        model.finalize()
    assert classify_ids == ["photo-rid"] and fake.stats()["request_ids"] == ["photo-rid"]


def test_a_log_line_about_a_request_names_it_after_the_model(fake_pb_utils_module):
    from classify_describe_server.model_log import Log

    log = Log("describe", fake_pb_utils_module.Logger)
    log.error("it broke", "rid-9")
    log.info("loaded")
    assert fake_pb_utils_module.Logger.records[-2:] == [("error", "[describe] [request id: rid-9] it broke"),
                                                      ("info", "[describe] loaded")]
