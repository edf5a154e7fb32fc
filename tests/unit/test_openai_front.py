"""openai_front's pure parts: request parsing and the URL policy, the OpenAI
objects it answers with, Triton errors -> HTTP statuses, settings, metrics.
The front against a real server: tests/integration/test_openai_front.py."""

import asyncio
import base64
import json
import socket
import threading

import aiohttp
import grpc
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from classify_describe_server import error_contract as contract
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import InferInput, service_pb2
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from openai_front import app as front_app
from openai_front import body as front_body
from openai_front import chat, responses, settings, triton
from openai_front import keys as front_keys
from openai_front.errors import FrontError
from openai_front.metrics import Metrics
from openai_front.triton import Answer, front_error

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 100


def body(url=None, text=None, **extra):
    parts = [{"type": "text", "text": text}] if text is not None else []
    parts.append({"type": "image_url", "image_url": {"url": url or "data:image/png;base64," + base64.b64encode(PNG).decode()}})
    return {"model": "classify_and_describe", "messages": [{"role": "user", "content": parts}], **extra}


def large_body(size=150_000):
    """A valid request of about `size` bytes of JSON, a photo's worth: its image padded (the
    question is bounded to 2,000 characters)."""
    padded = PNG + b"\0" * (size * 3 // 4)
    return body("data:image/png;base64," + base64.b64encode(padded).decode(), text="What is it?")


def refused(payload, max_bytes=10_000, allowlist=frozenset()):
    with pytest.raises(FrontError) as error:
        chat.parse(payload, max_bytes, allowlist)
    return error.value


def test_the_image_and_the_text_parts_of_the_last_user_message_become_image_and_prompt():
    request = chat.parse(body(text="What is it?"), 10_000)
    assert request.image == PNG and request.image_url is None
    assert request.prompt == "What is it?" and not request.stream and request.parameters == {}
    payload = body(text="  ")
    payload["messages"][0]["content"].append({"type": "text", "text": "second"})
    assert chat.parse(payload, 10_000).prompt == "second", "blank parts add nothing"
    assert chat.parse(body(), 10_000).prompt is None, "no text: the describe step's default question"


def test_the_legacy_string_form_of_image_url_is_read():
    payload = body()
    part = payload["messages"][0]["content"][0]
    part["image_url"] = part["image_url"]["url"]
    assert chat.parse(payload, 10_000).image == PNG


def test_stream_options_and_sampling_parameters():
    request = chat.parse(body(stream=True, stream_options={"include_usage": True}, temperature=0, max_tokens=7), 10_000)
    assert request.stream and request.include_usage
    assert request.parameters == {"temperature": 0.0, "max_tokens": 7}
    assert chat.parse(body(max_completion_tokens=5, max_tokens=9), 10_000).parameters == {"max_tokens": 5}
    assert not chat.parse(body(stream=None), 10_000).stream


@pytest.mark.parametrize("payload, words", [
    ([], "JSON object"),
    ({"messages": []}, "'model'"),
    (body(model=""), "'model'"),
    (body(messages="hi"), "'messages'"),
    (body(messages=[{"content": "x"}]), "role"),
    (body(messages=[{"role": "assistant", "content": "x"}]), "role 'user'"),
    (body(messages=[{"role": "user", "content": "describe"}]), "no image"),
    (body(messages=[{"role": "user", "content": {"a": 1}}]), "string or an array"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]), "'text'"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "image_url"),
    (body(messages=[{"role": "user", "content": ["x"]}]), "None"),
    (body(stream="true"), "'stream'"),
    (body(stream_options={"include_usage": True}), "only allowed"),
    (body(stream=True, stream_options=[]), "object"),
    (body(stream=True, stream_options={"include_usage": "yes"}), "include_usage"),
    (body(n=3), "n=1"),
    (body(temperature="hot"), "temperature"),
    (body(temperature=True), "temperature"),
    (body(temperature=float("nan")), "temperature"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens=2.5), "max_tokens"),
    (body(max_completion_tokens=True), "max_completion_tokens"),
])
def test_bad_requests_are_400_naming_what_is_wrong(payload, words):
    error = refused(payload)
    assert error.status == 400 and words in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_only_one_image_per_request():
    payload = body()
    payload["messages"][0]["content"] *= 2
    assert "one per request" in refused(payload).message


def test_only_the_last_user_message_counts():
    payload = body()
    payload["messages"].append({"role": "user", "content": "and now?"})
    error = refused(payload)
    assert error.param == "messages[0].content[0]" and "only the last user message" in error.message
    payload["messages"].pop(0)
    assert "no image" in refused(payload).message


@pytest.mark.parametrize("uri, status, words", [
    ("data:image/png;base64,", 400, "no data"),
    ("data:image/png;base64,!!!!", 400, "base64"),
    ("data:image/png;base64,QUJD\nREVG", 400, "base64"),
    ("data:image/png", 400, "','"),
    ("data:application/pdf;base64,QUJD", 400, "not an image"),
    ("data:;base64," + base64.b64encode(b"x" * 10_001).decode(), 413, "10001 bytes"),
    ("data:;base64," + "A" * 20_000, 413, "more than"),
    ("data:image/png," + "%00" * 10_001, 413, "10001 bytes"),
])
def test_data_uris(uri, status, words):
    error = refused(body(url=uri))
    assert error.status == status and words in error.message


def test_a_data_uri_at_the_limit_and_a_percent_encoded_one_are_read():
    assert chat.decode_data_uri("data:;base64," + base64.b64encode(b"x" * 10_000).decode(), 10_000) == b"x" * 10_000
    assert chat.decode_data_uri("data:image/png,%89PNG", 10_000) == b"\x89PNG"


@pytest.mark.parametrize("url, allowlist, allowed", [
    ("https://images.example.com/cat.jpg", {"images.example.com"}, True),
    ("http://IMAGES.example.com:80/cat.jpg", {"images.example.com"}, True),
    ("https://images.example.com:443/cat.jpg", {"images.example.com"}, True),
    ("http://images.example.com:8080/cat.jpg", {"images.example.com:8080"}, True),
    ("http://images.example.com:8080/cat.jpg", {"images.example.com"}, False),  # any port: 80 and 443 only
    ("http://images.example.com:2379/", {"images.example.com:8080"}, False),
    ("http://images.example.com/cat.jpg", {"images.example.com:8080"}, False),  # host:port names that port only
    ("http://127.0.0.1/x", {"127.0.0.1"}, False),  # an IP literal that is not public, even listed
    ("http://[::1]:8080/x", {"[::1]:8080"}, False),
    ("http://[::ffff:169.254.169.254]/x", {"::ffff:169.254.169.254"}, False),
    ("http://93.184.216.34/x", {"93.184.216.34"}, True),
    ("https://images.example.com/cat.jpg", set(), False),
    ("http://169.254.169.254/latest/meta-data/", {"images.example.com"}, False),
    ("http://images.example.com.evil.net/x", {"images.example.com"}, False),
    ("http://images.example.com@10.0.0.1/x", {"images.example.com"}, False),
    ("ftp://images.example.com/cat.jpg", {"images.example.com"}, False),
    ("file:///etc/passwd", {""}, False),
    ("http://images.example.com:99999/x", {"images.example.com"}, False),
    ("cat.jpg", {"images.example.com"}, False),
])
def test_remote_urls_only_for_allowlisted_hosts(url, allowlist, allowed):
    if allowed:
        request = chat.parse(body(url=url), 10_000, frozenset(allowlist))
        assert request.image is None and request.image_url == url
    else:
        assert refused(body(url=url), allowlist=frozenset(allowlist)).status == 400


ANSWER = Answer(labels=["espresso", "cup"], scores=[0.9, 0.05], description="A coffee.", source="llm",
                usage={"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15, "cost_usd": 1e-6})


def test_a_completion_has_openais_shape_and_the_extra_field():
    completion = responses.completion("chatcmpl-1", "classify_and_describe", ANSWER, created=5)
    assert completion["object"] == "chat.completion" and completion["created"] == 5
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": "A coffee.", "refusal": None}
    assert completion["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    assert completion["classify_describe"]["labels"] == ["espresso", "cup"]
    assert completion["classify_describe"]["usage"]["cost_usd"] == 1e-6
    assert responses.openai_usage(None) == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def events(data):
    assert data.endswith(b"\n\n")
    return [line.removeprefix(b"data: ").decode() for line in data.split(b"\n\n") if line]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunks_first_text_last_usage_done(include_usage):
    writer = responses.ChunkWriter("chatcmpl-1", "m", include_usage, created=5)
    first = json.loads(events(writer.first(["a"], [0.5]))[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["classify_describe"] == {"labels": ["a"], "scores": [0.5]}
    text = json.loads(events(writer.text("Hel"))[0])
    assert text["choices"][0]["delta"] == {"content": "Hel"} and text["choices"][0]["finish_reason"] is None
    last = events(writer.last("llm", ANSWER.usage))
    assert last[-1] == "[DONE]"
    stop = json.loads(last[0])
    assert stop["choices"][0]["finish_reason"] == "stop" and stop["classify_describe"]["description_source"] == "llm"
    if include_usage:
        assert text["usage"] is None and stop["usage"] is None
        assert json.loads(last[1])["choices"] == [] and json.loads(last[1])["usage"]["total_tokens"] == 15
        assert len(last) == 3
    else:
        assert "usage" not in text and len(last) == 2


@pytest.mark.parametrize("error, status", [
    (InferenceServerException("IMAGE is not a recognised image file", status="StatusCode.INVALID_ARGUMENT"), 400),
    (InferenceServerException("Exceeds maximum queue size", status="StatusCode.UNAVAILABLE"), 503),
    (InferenceServerException("failed to connect to all addresses", status="StatusCode.UNAVAILABLE"), 503),
    (InferenceServerException("Request for unknown model", status="StatusCode.NOT_FOUND"), 503),
    (InferenceServerException("Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED"), 504),
    (InferenceServerException("boom", status="StatusCode.INTERNAL"), 500),
    (InferenceServerException("in ensemble 'x', " + contract.tagged(contract.INVALID_INPUT, "IMAGE PNG data is corrupt",
                                                                     "IMAGE")), 400),  # a stream error: text only
    (InferenceServerException("Exceeds maximum queue size"), 503),
    (InferenceServerException("something else broke"), 500),
])
def test_triton_errors_become_the_status_a_client_acts_on(error, status):
    mapped = front_error(error)
    assert mapped.status == status
    assert ("Retry-After" in mapped.headers()) == (status == 503)


def test_settings_from_the_environment(tmp_path):
    defaults = settings.from_environ({})
    assert (defaults.host, defaults.port, defaults.triton_grpc_url, defaults.api_key) == ("127.0.0.1", 8003, "127.0.0.1:8001", None)
    assert defaults.model("classify_and_describe").stream_model == "classify_and_describe_stream"
    assert defaults.model("gpt-4o") is None
    given = settings.from_environ({"LISTEN_ADDRESS": "0.0.0.0", "OPENAI_PORT": "9003", "OPENAI_FRONT_API_KEY": " k1 ",
                                   "OPENAI_FRONT_IMAGE_URL_ALLOWLIST": "A.example.com, b.example.com,"}, port=7003)
    assert (given.host, given.port, given.api_key) == ("0.0.0.0", 7003, "k1")
    assert given.image_url_allowlist == {"a.example.com", "b.example.com"}
    assert "k1" not in repr(given)
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    from_file = settings.from_environ({"OPENAI_FRONT_API_KEY_FILE": str(key_file), "OPENAI_FRONT_API_KEY": "env"})
    assert from_file.api_key == "from-file" and "OPENAI_FRONT_API_KEY_FILE" in from_file.api_key_source
    missing = settings.from_environ({"OPENAI_FRONT_API_KEY_FILE": str(tmp_path / "absent")})
    assert missing.api_key is None and "does not exist" in missing.api_key_source


def test_the_front_refuses_to_start_open_where_tritons_inference_has_a_key(tmp_path):
    """The inference key closes 8000/8001; an open front on 8003 would answer anyone with it."""
    with pytest.raises(settings.ConfigError, match="Set OPENAI_FRONT_API_KEY or OPENAI_FRONT_API_KEY_FILE, or "
                                                  "OPENAI_FRONT_OPEN=1"):
        settings.from_environ({"TRITON_INFERENCE_KEY": "inf-key"})
    absent = str(tmp_path / "absent")  # an optional Secret not created counts as no key
    with pytest.raises(settings.ConfigError):
        settings.from_environ({"TRITON_INFERENCE_KEY": "inf-key", "OPENAI_FRONT_API_KEY_FILE": absent})
    assert settings.from_environ({"TRITON_INFERENCE_KEY": "inf-key", "OPENAI_FRONT_API_KEY": "k"}).api_key == "k"
    opened = settings.from_environ({"TRITON_INFERENCE_KEY": "inf-key", "OPENAI_FRONT_OPEN": "1"})
    assert opened.api_key is None and opened.triton_inference_key == "inf-key"
    assert settings.from_environ({}).api_key is None  # no inference key: open, as before


def test_the_question_limit_follows_the_describe_steps_setting_unless_the_front_is_given_its_own():
    """The supervisor runs the front and Triton in one environment: the describe step's
    LLM_MAX_PROMPT_CHARS raised, the front must not refuse what that step would take."""
    assert settings.from_environ({}).max_prompt_chars == chat.MAX_PROMPT_CHARS == 2000
    assert settings.from_environ({"LLM_MAX_PROMPT_CHARS": "4000"}).max_prompt_chars == 4000
    assert settings.from_environ({"LLM_MAX_PROMPT_CHARS": "4000",
                                  "OPENAI_FRONT_MAX_PROMPT_CHARS": "3000"}).max_prompt_chars == 3000
    question = "x" * 3000
    assert chat.parse(body(text=question), 10_000, max_prompt_chars=3000).prompt == question
    assert refused(body(text=question + "y")).status == 400  # the default, 2000

    class Answering(StalledPool):
        async def infer(self, model, image, prompt=None, *args, **kwargs):
            self.prompt = prompt
            return Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}, description="A cup")

    pool = Answering()  # the app passes its setting on
    status, _, _ = asyncio.run(_post(front_with(pool, max_prompt_chars=3000), json.dumps(body(text=question))))
    assert status == 200 and pool.prompt == question


@pytest.mark.parametrize("environ, words", [
    ({"OPENAI_FRONT_MAX_PROMPT_CHARS": "0"}, "at least 1"),
    ({"OPENAI_PORT": "http"}, "OPENAI_PORT"),
    ({"OPENAI_FRONT_MAX_IMAGE_BYTES": "0"}, "at least 1"),
    ({"OPENAI_FRONT_GRPC_CHANNELS": "0"}, "at least 1"),
    ({"OPENAI_FRONT_TIMEOUT_S": "-1"}, "positive"),
    ({"OPENAI_FRONT_TIMEOUT_S": "inf"}, "positive"),
    ({"OPENAI_FRONT_API_KEY": "two words"}, "spaces"),
])
def test_settings_that_cannot_work_are_refused(environ, words):
    with pytest.raises(settings.ConfigError, match=words):
        settings.from_environ(environ)


def test_an_empty_key_file_is_an_error_not_an_open_front(tmp_path):
    (tmp_path / "key").write_text("\n")
    with pytest.raises(settings.ConfigError, match="empty"):
        settings.from_environ({"OPENAI_FRONT_API_KEY_FILE": str(tmp_path / "key")})


def samples(text):
    """{(sample name, sorted labels): value} of an exposition, as Prometheus's own client parses it."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text, name, **labels):
    return samples(text).get((name, tuple(sorted(labels.items()))))


def test_metrics_render_counters_and_a_cumulative_histogram():
    metrics = Metrics(["m"])
    metrics.observe("m", False, 200, 0.004, {"prompt_tokens": 3, "completion_tokens": 2})
    metrics.observe("m", False, 200, 0.3)
    metrics.observe("client-chosen", True, 404, 0.001)
    metrics.error(404, "model_not_found")
    metrics.in_flight = 3
    text = metrics.render()
    assert value(text, "openai_front_requests_total", model="m", stream="false", status="200") == 2
    assert value(text, "openai_front_requests_total", model="other", stream="true", status="404") == 1
    assert "client-chosen" not in text
    assert value(text, "openai_front_tokens_total", model="m", kind="prompt") == 3
    assert value(text, "openai_front_tokens_total", model="m", kind="completion") == 2
    bucket = "openai_front_request_duration_seconds_bucket"
    assert value(text, bucket, model="m", stream="false", le="0.005") == 1
    assert value(text, bucket, model="m", stream="false", le="0.25") == 1
    assert value(text, bucket, model="m", stream="false", le="0.5") == 2
    assert value(text, bucket, model="m", stream="false", le="+Inf") == 2
    assert value(text, "openai_front_request_duration_seconds_count", model="m", stream="false") == 2
    assert abs(value(text, "openai_front_request_duration_seconds_sum", model="m", stream="false") - 0.304) < 1e-9
    assert value(text, "openai_front_errors_total", status="404", code="model_not_found") == 1
    assert value(text, "openai_front_in_flight") == 3


def test_the_exposed_names_are_the_ones_dashboards_use_and_no_more_of_ours():
    """The series names are a contract (dashboards and alerts use them): a
    prometheus_client upgrade that renames one, or adds `_created` series, fails here."""
    metrics = Metrics(["m"])
    metrics.observe("m", True, 200, 0.1, {"prompt_tokens": 1, "completion_tokens": 1})
    metrics.error(503, "overloaded")
    ours = {name for name, _ in samples(metrics.render()) if name.startswith("openai_front_")}
    assert ours == {"openai_front_requests_total", "openai_front_errors_total", "openai_front_tokens_total",
                    "openai_front_in_flight", "openai_front_admission_limit",
                    "openai_front_request_duration_seconds_bucket",
                    "openai_front_request_duration_seconds_sum", "openai_front_request_duration_seconds_count"}
    families = {f.name: f.type for f in text_string_to_metric_families(metrics.render())}
    assert families["openai_front_requests"] == "counter" and families["openai_front_in_flight"] == "gauge"
    assert families["openai_front_request_duration_seconds"] == "histogram"
    assert "process_cpu_seconds_total" in {name for name, _ in samples(metrics.render())}, "process metrics"


def test_the_bench_section_renders_every_committed_front_run():
    """`make bench` renders the front's section from its results (tools/bench/sections.py);
    every committed standalone run has the figures that section and its targets read."""
    import pathlib

    from tools.bench import openai_front, sections

    assert "tools.bench.openai_front" in sections.SECTIONS
    paths = sorted((pathlib.Path(__file__).resolve().parents[2] / "docs/results").glob("openai-front-*.json"))
    assert paths
    for path in paths:
        run = json.loads(path.read_text())
        text = "\n".join(openai_front.render(run))
        assert text.startswith(openai_front.SECTION)
        assert f"{run['latency']['added_p50_ms']:+.2f} ms" in text
        added, ratio = openai_front.targets(run)
        assert added.measured == run["latency"]["added_p50_ms"] and ratio.measured == run["throughput_ratio"]


# -- review findings: requests that parse but cannot be sent, the URL policy after
# DNS, clients that leave, stream errors, large bodies, finish_reason ------------

def surrogate_body(**extra):
    return json.dumps(body(text="\ud800", **extra))  # json.dumps writes it as the escape "\\ud800"


@pytest.mark.parametrize("payload, param", [
    (body(text="\ud800"), "messages[0].content[0]"),
    (body(text="ok \udfff ok"), "messages[0].content[0]"),
    (body(max_tokens=2**63), "max_tokens"),
    (body(max_tokens=2**31), "max_tokens"),
    (body(max_tokens=-1), "max_tokens"),
    (body(max_tokens=False), "max_tokens"),
    (body(max_completion_tokens=10**30), "max_completion_tokens"),
    (body(temperature=10**400), "temperature"),  # too long for a float: OverflowError
])
def test_values_json_accepts_but_triton_cannot_take_are_400_naming_the_field(payload, param):
    error = refused(payload)
    assert error.status == 400 and error.param == param, error.message
    assert chat.parse(body(max_tokens=chat.MAX_TOKENS_LIMIT), 10_000).parameters == {"max_tokens": 2**31 - 1}


@pytest.mark.parametrize("prompt, parameters", [
    ("\ud800", None),
    ("ok", {"max_tokens": 2**63}),
    ("ok", {"max_tokens": [1]}),
    ("ok", {"sequence_id": 1}),  # a parameter Triton reserves
])
def test_a_request_that_cannot_be_built_is_a_400_before_any_call(prompt, parameters):
    with pytest.raises(FrontError) as error:
        triton.build_request("m", PNG, prompt, parameters)
    assert error.value.status == 400


def tritonclients_request(model, image, prompt, parameters, request_id):
    """The same request as tritonclient builds it with the tensors' data set."""
    tensors = []
    for name, content in (("IMAGE", image), ("PROMPT", None if prompt is None else prompt.encode())):
        if content is not None:
            tensors.append(InferInput(name, [1, 1], "BYTES"))
            tensors[-1].set_data_from_numpy(np.array([[content]], dtype=np.object_))
    return _get_inference_request(model_name=model, inputs=tensors, model_version="", request_id=request_id,
                                  outputs=None, sequence_id=0, sequence_start=False, sequence_end=False,
                                  priority=0, timeout=None, parameters=parameters or None)


@pytest.mark.parametrize("image_bytes", [1, 123, 124, 16_379, 16_380, 2_097_147, 2_097_148, 5_000_000])
@pytest.mark.parametrize("prompt, parameters, request_id", [
    (None, None, ""),
    ("What is it?", {"max_tokens": 64, "temperature": 0.5}, "req-1"),
    ("", {"conversation": '[{"role":"system","content":"Be brief."}]', "flag": True}, ""),
    ("Qu'est-ce que c'est ? \u732b \U0001f431", {"response_format": '{"type":"json_object"}'}, "x" * 200),
])
def test_the_request_sent_is_the_request_tritonclient_builds(image_bytes, prompt, parameters, request_id):
    """build_request writes the tensors' contents on the wire itself: Triton must read
    from its bytes the request tritonclient would have sent, field for field, whatever
    the lengths (varint lengths of 1 to 4 bytes at the sizes chosen: with its 4-byte
    length prefix, 124 bytes is the first content that takes two), the prompt and the
    parameters."""
    image = bytes(range(256)) * (image_bytes // 256) + bytes(image_bytes % 256)
    sent = triton.build_request("classify_and_describe", image, prompt, parameters, request_id)
    assert isinstance(sent, bytes)
    reference = tritonclients_request("classify_and_describe", image, prompt, parameters, request_id)
    assert service_pb2.ModelInferRequest.FromString(sent) == reference
    assert len(sent) == reference.ByteSize()


class FakeStub:
    """The gRPC stub's two calls, failing as told, recording whether they were made."""

    def __init__(self, fail=None, responses=()):
        self.fail, self.responses, self.calls = fail, list(responses), []

    async def ModelInfer(self, request, timeout=None, metadata=()):  # noqa: N802 - the stub's own name
        self.metadata = metadata
        self.calls.append(("infer", request))
        if self.fail is not None:
            raise self.fail
        await asyncio.sleep(3600)

    def ModelStreamInfer(self, requests, timeout=None, metadata=()):  # noqa: N802
        self.metadata = metadata
        stub = self

        class Call:
            cancelled = False

            def __aiter__(self):
                return self

            async def __anext__(self):
                stub.calls.append(("stream", [r async for r in requests] if not stub.calls else None))
                if stub.fail is not None:
                    raise stub.fail
                if stub.responses:
                    return stub.responses.pop(0)
                await asyncio.sleep(3600)

            def cancel(self):
                Call.cancelled = True

        self.call = Call()
        return self.call


def pool_with(stub, inference_key=None):
    """A real TritonPool whose channels are the fake stub."""
    pool = triton.TritonPool.__new__(triton.TritonPool)
    pool.timeout_s, pool._stub = 5.0, lambda: stub
    pool._metadata = triton.inference_metadata(inference_key)
    return pool


@pytest.mark.parametrize("stream", [False, True], ids=["infer", "stream"])
def test_the_inference_key_goes_with_every_call_under_tritons_grpc_header(stream):
    """Triton restricts inference with header inference-key (TRITON_INFERENCE_KEY);
    over gRPC it wants the prefixed name. No key: no header at all."""
    for key, expected in (("inf-0123456789abcdef", (("triton-grpc-protocol-inference-key", "inf-0123456789abcdef"),)),
                          (None, ())):
        stub = FakeStub(fail=asyncio.CancelledError())  # answered as a 503; the call was made
        pool = pool_with(stub, key)
        with pytest.raises(FrontError):
            asyncio.run(_drain(pool.stream("m", PNG, "ok")) if stream else pool.infer("m", PNG, "ok"))
        assert stub.metadata == expected


async def _drain(agen):
    return [item async for item in agen]


def test_an_unbuildable_stream_request_fails_in_the_handler_and_opens_no_call():
    stub = FakeStub()
    with pytest.raises(FrontError) as error:
        asyncio.run(_drain(pool_with(stub).stream("m", PNG, "\ud800")))
    assert error.value.status == 400 and stub.calls == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_grpc_call_cancelled_under_the_front_is_a_clean_503_not_a_dropped_connection(stream):
    stub = FakeStub(fail=asyncio.CancelledError())
    pool = pool_with(stub)

    async def main():
        if stream:
            return await _drain(pool.stream("m", PNG, "ok"))
        return await pool.infer("m", PNG, "ok")

    with pytest.raises(FrontError) as error:
        asyncio.run(main())
    assert error.value.status == 503 and "Retry-After" in error.value.headers() and stub.calls


def test_the_tasks_own_cancellation_still_cancels_the_call():
    stub = FakeStub()
    pool = pool_with(stub)

    async def main():
        task = asyncio.ensure_future(_drain(pool.stream("m", PNG, "ok")))
        for _ in range(500):
            if stub.calls or task.done():
                break
            await asyncio.sleep(0.01)
        assert stub.calls, "the call was made"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert stub.call.cancelled


@pytest.mark.parametrize("message, status, param", [
    # our backends (error_contract.py): on_failure=error, a stream's only text
    (contract.tagged(contract.UPSTREAM_UNAVAILABLE, "the LLM upstream could not answer (rate_limited_http_429)"), 503, None),
    ("in ensemble 'classify_and_describe', "
     + contract.tagged(contract.UPSTREAM_UNAVAILABLE, "the LLM upstream could not answer (timeout)"), 503, None),
    (contract.tagged(contract.MODEL_UNLOADING, "the model is unloading"), 503, None),
    (contract.tagged(contract.REQUEST_CANCELLED, "request cancelled"), 503, None),
    (contract.tagged(contract.INTERNAL, "internal error in the describe step"), 500, None),
    # Triton's own texts
    ("Request for unknown model: 'classify_and_describe_stream' is not found", 503, None),
    ("Request for unknown model: 'classify_and_describe_stream' has no available versions", 503, None),
    ("in ensemble 'classify_and_describe', [request id: 6192] Exceeds maximum queue size", 503, None),
    ("Server is stopping, scheduler for model has stopped accepting new inference requests", 503, None),
    ("in ensemble 'classify_and_describe', Request timeout expired", 503, None),
    # refusals (INVALID_ARG), each naming the field at fault
    ("in ensemble 'classify', " + contract.tagged(contract.INVALID_INPUT, "IMAGE PNG data is corrupt or truncated: x",
                                                  "IMAGE"), 400, "messages"),
    (contract.tagged(contract.INVALID_INPUT, "IMAGE format GIF is not supported (use one of JPEG, PNG)", "IMAGE"),
     400, "messages"),
    (contract.tagged(contract.INVALID_INPUT, "PROMPT has 9000 characters, more than the limit max_prompt_chars=4000 "
                                             "(model config)", "PROMPT"), 400, "messages"),
    (contract.tagged(contract.INVALID_PARAMETER, "temperature 1.9 is outside [0.0, 1.5]", "temperature"),
     400, "temperature"),
    (contract.tagged(contract.INVALID_PARAMETER, "max_tokens must be an integer in [1, 1024] (max_tokens_limit in the "
                                                 "model config), got 5000", "max_tokens"), 400, "max_tokens"),
    (contract.tagged(contract.INVALID_PARAMETER, "timeout_s must be in (0, 15.0]", "timeout_s"), 400, None),
    (contract.tagged(contract.INVALID_INPUT, "LABELS has 30 labels", "LABELS"), 400, None),
    # text without the token is no refusal, whatever it mentions; nor is a code the contract does not know
    ("the stub process crashed while reading IMAGE", 500, None),
    ("PROMPTLY failed", 500, None),
    ("IMAGE format GIF is not supported (use one of JPEG, PNG)", 500, None),
    ("[code=made_up field=IMAGE] IMAGE is odd", 500, None),
])
def test_stream_errors_map_on_the_error_contracts_code_and_field(message, status, param):
    mapped = front_error(InferenceServerException(message))  # a stream error: text only, no status
    assert (mapped.status, mapped.param) == (status, param), mapped.message
    assert ("Retry-After" in mapped.headers()) == (status == 503)
    assert "[code=" not in mapped.message or status == 500 and "made_up" in message, "the token is for machines"
    if "LLM upstream" in message:
        assert mapped.code == "upstream_unavailable" and message[message.index("("):] in mapped.message


@pytest.mark.parametrize("text", ["the model is unloading; retry later",
                                  "the server is shutting down: retry on another replica"])
def test_an_unloading_model_says_whether_the_server_is_shutting_down(text):
    # At a shutdown the client should go to another replica, not wait for this one.
    mapped = front_error(InferenceServerException(contract.tagged(contract.MODEL_UNLOADING, text)))
    assert (mapped.status, mapped.message) == (503, text)


def test_the_upstream_failure_of_the_plain_ensemble_says_so_too():
    error = InferenceServerException("in ensemble 'classify_and_describe', " + contract.tagged(
        contract.UPSTREAM_UNAVAILABLE, "the LLM upstream could not answer (timeout)"), status="StatusCode.UNAVAILABLE")
    mapped = front_error(error)
    assert mapped.status == 503 and "LLM upstream" in mapped.message and mapped.headers()["Retry-After"] == "1"


@pytest.mark.parametrize("address, allowed", [
    ("93.184.216.34", True), ("2606:4700::1", True),
    ("127.0.0.1", False), ("::1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("fe80::1%eth0", False), ("100.64.0.1", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("240.0.0.1", False), ("::ffff:127.0.0.1", False), ("fd00::1", False),
    ("not an address", False),
])
def test_only_public_unicast_addresses_are_fetched_from(address, allowed):
    assert chat.address_allowed(address) is allowed
    assert chat.address_allowed(address, allow_private=True)


class ListResolver:
    def __init__(self, *addresses):
        self.addresses = addresses

    async def resolve(self, host, port=0, family=0):
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET, "proto": 0, "flags": 0}
                for a in self.addresses]

    async def close(self):
        pass


def test_the_resolver_hands_aiohttp_only_the_public_addresses_it_checked():
    from openai_front import fetch

    mixed = fetch.PublicOnlyResolver(resolver=ListResolver("10.0.0.1", "93.184.216.34", "169.254.169.254"))
    assert [a["host"] for a in asyncio.run(mixed.resolve("images.example.com", 80))] == ["93.184.216.34"]
    with pytest.raises(fetch.NonPublicAddress):
        asyncio.run(fetch.PublicOnlyResolver(resolver=ListResolver("127.0.0.1")).resolve("rebound.example.com", 80))
    opened = fetch.PublicOnlyResolver(allow_private=True, resolver=ListResolver("127.0.0.1"))
    assert len(asyncio.run(opened.resolve("localhost", 80))) == 1


@pytest.mark.parametrize("allow_private", [False, True])
def test_an_allowlisted_name_that_resolves_to_loopback_is_refused_unless_the_test_setting_allows_it(allow_private):
    """A real fetch through the front's session from a server on 127.0.0.1, by the name localhost."""
    from openai_front import fetch

    async def main():
        image_host = web.Application()
        async def cat(request):
            return web.Response(body=PNG)

        image_host.router.add_get("/cat.png", cat)
        async with TestServer(image_host, host="127.0.0.1") as server:
            async with fetch.session(5.0, allow_private) as session:
                return await fetch.fetch_image(session, f"http://localhost:{server.port}/cat.png", 10_000)

    if allow_private:
        assert asyncio.run(main()) == PNG
    else:
        with pytest.raises(FrontError) as error:
            asyncio.run(main())
        assert error.value.status == 400 and error.value.code == "image_url_not_allowed"
        assert "non-public" in error.value.message


def test_allowlist_entries_with_ports_and_the_private_address_switch():
    given = settings.from_environ({"OPENAI_FRONT_IMAGE_URL_ALLOWLIST": "a.example.com, B.example.com:8080,[::1]:81"})
    assert given.image_url_allowlist == {"a.example.com", "b.example.com:8080", "[::1]:81"}
    assert not given.image_url_allow_private and given.max_bodies_in_flight == 16
    opened = settings.from_environ({"OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE": "1", "OPENAI_FRONT_MAX_BODIES_IN_FLIGHT": "3"})
    assert opened.image_url_allow_private and opened.max_bodies_in_flight == 3
    for environ in ({"OPENAI_FRONT_IMAGE_URL_ALLOWLIST": "a.example.com:http"},
                    {"OPENAI_FRONT_IMAGE_URL_ALLOWLIST": "a.example.com:0"},
                    {"OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE": "maybe"},
                    {"OPENAI_FRONT_MAX_BODIES_IN_FLIGHT": "0"}):
        with pytest.raises(settings.ConfigError):
            settings.from_environ(environ)


def test_the_front_runs_with_handler_cancellation(monkeypatch):
    from openai_front import __main__ as main_module

    seen = {}
    monkeypatch.setattr(main_module.web, "run_app", lambda app, **kwargs: seen.update(kwargs))
    assert main_module.main(["--port", "1"]) == 0
    assert seen["handler_cancellation"] is True


class StalledPool:
    """Answers nothing: every call waits until it is cancelled, which it records."""

    def __init__(self):
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()

    async def _wait(self):
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def infer(self, *args, **kwargs):
        await self._wait()

    async def stream(self, *args, **kwargs):
        await self._wait()
        yield None

    async def longest_queue_time_s(self, models):
        return 0.0  # no queue time limit: the front keeps its default

    async def close(self):
        pass


def front_with(pool=None, **changes):
    app = front_app.create_app(settings.Settings(**changes))

    async def swap_pool(app):
        if pool is not None:
            await app[front_keys.POOL].close()
            app[front_keys.POOL] = pool

    app.on_startup.append(swap_pool)
    return app


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_the_front_waits_cancels_the_call_and_is_counted(stream):
    pool = StalledPool()
    app = front_with(pool)

    async def main():
        async with TestServer(app, host="127.0.0.1", handler_cancellation=True) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            payload = json.dumps(body(stream=stream)).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            await writer.drain()
            await asyncio.wait_for(pool.started.wait(), 5)
            writer.close()
            await asyncio.wait_for(pool.cancelled.wait(), 5)
            for _ in range(100):  # the handler's own bookkeeping runs as the cancellation unwinds
                if app[front_keys.METRICS].in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            return app[front_keys.METRICS].render()

    text = asyncio.run(main())
    assert value(text, "openai_front_errors_total", status="499", code="client_closed_request") == 1
    assert value(text, "openai_front_requests_total", model="classify_and_describe", stream=str(stream).lower(),
                 status="499") == 1
    assert value(text, "openai_front_in_flight") == 0


async def _post(app, payload, **server_options):
    async with TestClient(TestServer(app, host="127.0.0.1", **server_options)) as client:
        response = await client.post("/v1/chat/completions", data=payload, timeout=aiohttp.ClientTimeout(total=20),
                                     headers={"Content-Type": "application/json"})
        return response.status, response.headers, await response.read()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("payload, param", [
    (lambda stream: surrogate_body(stream=stream), "messages[0].content[0]"),
    (lambda stream: json.dumps(body(stream=stream, max_tokens=2**63)), "max_tokens"),
    (lambda stream: json.dumps(body(stream=stream, max_tokens=True)), "max_tokens"),
    # orjson refuses these bodies; the stdlib's reading names the field as before
    (lambda stream: json.dumps(body(stream=stream, temperature=float("nan"))), "temperature"),
    (lambda stream: "\ufeff" + json.dumps(body(stream=stream, max_tokens=True)), "max_tokens"),
])
def test_through_the_front_they_are_a_400_in_openai_format_on_both_paths(stream, payload, param):
    """The real app and the real TritonPool: the request is refused before any
    call (nothing listens at its Triton address)."""
    app = front_with(triton_grpc_url=f"127.0.0.1:{_free_port()}")
    status, _, answer = asyncio.run(_post(app, payload(stream)))
    assert status == 400, answer
    assert json.loads(answer)["error"]["param"] == param


@pytest.mark.parametrize("raw", [
    json.dumps(body(text="What is it? \u00e9\u4e2d", temperature=0.5, max_tokens=2**63 - 1)).encode(),
    b'{"temperature": NaN, "a": Infinity, "b": -Infinity}',
    b'{"text": "\\ud800 alone", "pair": "\\ud83d\\ude00"}',
    b'\xef\xbb\xbf{"model": "m"}',
    b' [1, 2.5, -0, 1e-7, "x", null, true] ',
    b'{"a": 1, "a": 2}',
], ids=["a chat request", "NaN and Infinity", "a lone surrogate", "a byte order mark", "a list", "a repeated key"])
def test_a_body_is_read_as_the_standard_library_reads_it(raw):
    """orjson reads what it accepts alike, and what it refuses goes to the stdlib."""
    assert repr(front_body.load_json(raw)) == repr(json.loads(raw))


@pytest.mark.parametrize("raw", [b"{", b'{"a": 1} x', b'{"a": "\xff"}', b"[" * 5000 + b"]" * 5000, b""])
def test_a_body_neither_reads_is_a_400(raw):
    with pytest.raises(FrontError) as error:
        front_body.load_json(raw)
    assert error.value.status == 400 and "not valid JSON" in error.value.message


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(predicate, what, deadline_s=10.0):
    """Wait for `predicate()`, polled; the deadline is generous because a loaded
    machine may take long to accept and start reading a connection."""
    for _ in range(int(deadline_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {deadline_s:g} s: {what}")


def test_bodies_being_read_past_the_limit_are_503_with_retry_after_and_free_their_slots():
    """Two real bodies held half-sent take the two slots; a third chat request waits
    BODY_SLOT_WAIT_S for one and is refused, other routes are not; once both bodies arrive, both are read
    (their own answers) and the slots are free again."""
    # No pace: the held bodies must outlast the third request's wait for a slot.
    app = front_with(StalledPool(), max_bodies_in_flight=2, min_body_rate=0)
    payload = json.dumps(body(model="unknown")).encode()  # read and parsed, then 404: the pool is never called
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload))
    bodies = app[front_keys.BODIES]

    async def main():
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            held = []
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
                writer.write(head + payload[:10])
                await writer.drain()
                held.append((reader, writer))
            await until(lambda: bodies.now == 2, "two bodies being read hold two slots")
            refused = await client.post("/v1/chat/completions", data=payload)
            models = await client.get("/v1/models")  # only chat bodies count
            answers = []
            for reader, writer in held:
                writer.write(payload[10:])
                await writer.drain()
                answers.append(await asyncio.wait_for(reader.read(), 10))
                writer.close()
            await until(lambda: bodies.now == 0, "both slots freed")
            served = await client.post("/v1/chat/completions", data=payload)
            return (refused.status, refused.headers.get("Retry-After"), await refused.json(), models.status,
                    answers, served.status)

    status, retry_after, answer, models, answers, served = asyncio.run(main())
    assert status == 503 and int(retry_after) >= 1 and "OPENAI_FRONT_MAX_BODIES_IN_FLIGHT" in answer["error"]["message"]
    assert "reading 2 request bodies" in answer["error"]["message"]
    assert models == 200
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 404 Not Found"] * 2
    assert all(b"model_not_found" in a for a in answers)
    assert served == 404, "a freed slot reads the next body"


def test_a_body_that_waits_for_a_slot_gets_the_next_one_freed():
    """A burst is queued, not refused: with the one slot held by a half-sent body, the
    next request waits; when the held body arrives, the waiting one is read and
    answered (404: an unknown model), and the slot count returns to 0."""
    app = front_with(StalledPool(), max_bodies_in_flight=1)
    payload = json.dumps(body(model="unknown")).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload))
    bodies = app[front_keys.BODIES]

    async def main():
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
            writer.write(head + payload[:10])
            await writer.drain()
            await until(lambda: bodies.now == 1, "the half-sent body holds the slot")
            waiting = asyncio.ensure_future(client.post("/v1/chat/completions", data=payload))
            await until(lambda: len(bodies._waiting) == 1, "the next body waits for the slot")
            writer.write(payload[10:])
            await writer.drain()
            first = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            second = await asyncio.wait_for(waiting, 10)
            await until(lambda: bodies.now == 0, "the slot is free again")
            return first.split(b"\r\n", 1)[0], second.status, len(bodies._waiting)

    first, second, still_waiting = asyncio.run(main())
    assert first == b"HTTP/1.1 404 Not Found" and second == 404 and still_waiting == 0


@pytest.mark.parametrize("image_bytes, on_the_loop", [(0, True), (466_000, True), (front_body.OFFLOAD_BYTES, False)],
                         ids=["tiny", "coffee.png's size", "over the limit"])
def test_large_bodies_are_parsed_off_the_event_loop_and_small_ones_on_it(monkeypatch, image_bytes, on_the_loop):
    """A photo's body is parsed on the loop (the hop to a thread and back cost more
    than the parse); one that would stall the loop for milliseconds goes to a worker."""
    threads = []
    parse = front_body.parse_body

    def recording(raw, settings):
        threads.append(threading.current_thread() is threading.main_thread())
        return parse(raw, settings)

    monkeypatch.setattr(front_body, "parse_body", recording)
    payload = json.dumps(body(url="data:image/png;base64," + base64.b64encode(PNG + b"\0" * image_bytes).decode(),
                              model="x"))
    status, _, _ = asyncio.run(_post(front_with(StalledPool(), max_image_bytes=2 * front_body.OFFLOAD_BYTES), payload))
    assert status == 404  # parsed: the model id is unknown
    assert threads == [on_the_loop]
    assert (len(payload) > front_body.OFFLOAD_BYTES) != on_the_loop


def test_finish_reason_is_the_one_the_describe_step_passed_on_in_usage():
    """USAGE.finish_reason is the upstream's own (backends/openai_describe: accounting.Usage)."""
    cut = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "attempts": 1, "finish_reason": "length"}
    assert responses.finish_reason(cut) == "length"
    assert responses.finish_reason({**cut, "completion_tokens": 1, "attempts": 2, "cached": True}) == "length", \
        "a fact, not a guess from the token counts"
    assert responses.finish_reason({**cut, "finish_reason": "stop"}) == "stop"
    assert responses.finish_reason({**cut, "finish_reason": None}) == "stop", "a fallback or a stream cut short"
    assert responses.finish_reason({}) == responses.finish_reason(None) == "stop"
    answer = Answer(labels=["a"], scores=[0.5], description="a b c d e", source="llm", usage=cut)
    assert responses.completion("c", "m", answer)["choices"][0]["finish_reason"] == "length"
    last = events(responses.ChunkWriter("c", "m", False).last("llm", cut))
    assert json.loads(last[0])["choices"][0]["finish_reason"] == "length"


def triton_response(**outputs):
    """A ModelInferResponse carrying `outputs` (name -> (datatype, array)) as Triton sends them."""
    response = service_pb2.ModelInferResponse(model_name="m")
    for name, (datatype, array) in outputs.items():
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(serialize_byte_tensor(array).item() if datatype == "BYTES"
                                            else array.tobytes())
    return response


def test_the_pools_calls_send_triton_the_request_with_its_metadata_and_deadline():
    """TritonPool's two calls (InferenceCalls: the request already serialized) against a
    gRPC server speaking Triton's service: the server reads the request tritonclient
    would have sent, with the inference key, the client's trace context and the deadline,
    and its outputs come back as the Answer."""
    seen = []
    answer_outputs = {"LABELS": ("BYTES", np.array([[b"espresso"]], dtype=np.object_)),
                      "SCORES": ("FP32", np.array([[0.75]], dtype=np.float32)),
                      "DESCRIPTION": ("BYTES", np.array([[b"A cup."]], dtype=np.object_)),
                      "DESCRIPTION_SOURCE": ("BYTES", np.array([[b"llm"]], dtype=np.object_))}

    async def infer(request, context):
        seen.append((request, dict(context.invocation_metadata()), context.time_remaining()))
        return triton_response(**answer_outputs)

    async def stream(requests, context):
        async for request in requests:
            seen.append((request, dict(context.invocation_metadata()), context.time_remaining()))
            yield service_pb2.ModelStreamInferResponse(infer_response=triton_response(**answer_outputs))

    handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(
            infer, request_deserializer=service_pb2.ModelInferRequest.FromString,
            response_serializer=service_pb2.ModelInferResponse.SerializeToString),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=service_pb2.ModelInferRequest.FromString,
            response_serializer=service_pb2.ModelStreamInferResponse.SerializeToString)})

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = triton.TritonPool(f"127.0.0.1:{port}", channels=2, timeout_s=30, inference_key="inf-key")
        try:
            answer = await pool.infer("m", PNG, "What is it?", {"max_tokens": 5}, request_id="r1",
                                      metadata=(("traceparent", TRACEPARENT),))
            streamed = [text async for _, text in pool.stream("m", PNG, None, None, request_id="r2")]
        finally:
            await pool.close()
            await server.stop(0)
        return answer, streamed

    answer, streamed = asyncio.run(main())
    assert (answer.labels, answer.scores, answer.description, answer.source) == (["espresso"], [0.75], "A cup.", "llm")
    assert streamed == ["A cup."]
    (infer_request, infer_metadata, infer_deadline), (stream_request, stream_metadata, stream_deadline) = seen
    assert infer_request == tritonclients_request("m", PNG, "What is it?", {"max_tokens": 5}, "r1")
    assert stream_request == tritonclients_request("m", PNG, None, None, "r2")
    for metadata in (infer_metadata, stream_metadata):
        assert metadata["triton-grpc-protocol-inference-key"] == "inf-key"
    assert infer_metadata["traceparent"] == TRACEPARENT
    assert 0 < infer_deadline <= 31 and 0 < stream_deadline <= 31  # 30 s, as its header rounds it up


async def _send_head(port, length, first_bytes=b""):
    """A chat request whose headers (and perhaps the start of its body) are sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % length + first_bytes)
    await writer.drain()
    return reader, writer


def test_requests_past_the_limit_in_flight_are_refused_from_their_headers_before_the_body():
    pool = StalledPool()
    app = front_with(pool, max_requests_in_flight=1)
    payload = json.dumps(body()).encode()

    async def main():
        async with TestServer(app, host="127.0.0.1", handler_cancellation=True) as server:
            _, holder = await _send_head(server.port, len(payload), payload)
            await asyncio.wait_for(pool.started.wait(), 5)  # the one slot is taken
            # Only the headers: an answer now was decided before the body was read.
            reader, refused = await _send_head(server.port, len(payload))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                         .split(b":")[1])
            answer = json.loads(await asyncio.wait_for(reader.readexactly(length), 5))
            refused.close()
            async with aiohttp.ClientSession() as session:  # the rest of the API is not shed
                async with session.get(f"http://127.0.0.1:{server.port}/v1/models") as models:
                    models_status = models.status
            holder.close()  # the held request ends (cancelled): its slot is free again
            for _ in range(500):
                if app[front_keys.ADMISSION].now == 0:
                    break
                await asyncio.sleep(0.01)
            pool.started.clear()
            _, again = await _send_head(server.port, len(payload), payload)
            await asyncio.wait_for(pool.started.wait(), 5)  # admitted: it reached Triton's pool
            again.close()
            return head, answer, models_status

    head, answer, models_status = asyncio.run(main())
    assert head.startswith(b"HTTP/1.1 503") and b"\r\nRetry-After: 1\r\n" in head
    assert answer["error"]["code"] == "service_unavailable"
    assert "OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT" in answer["error"]["message"]
    assert models_status == 200


def test_the_requests_in_flight_setting():
    assert settings.from_environ({}).max_requests_in_flight == 1024
    assert settings.from_environ({"OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT": "7"}).max_requests_in_flight == 7
    with pytest.raises(settings.ConfigError):
        settings.from_environ({"OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT": "0"})
