"""openai_front's pure parts: request parsing and the URL policy, the OpenAI
objects it answers with, Triton errors -> HTTP statuses, settings, metrics.
The front against a real server: tests/integration/test_openai_front.py."""

import base64
import json

import pytest
from tritonclient.utils import InferenceServerException

from openai_front import chat, responses, settings
from openai_front.errors import FrontError
from openai_front.metrics import Metrics
from openai_front.triton import Answer, front_error

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 100


def body(url=None, text=None, **extra):
    parts = [{"type": "text", "text": text}] if text is not None else []
    parts.append({"type": "image_url", "image_url": {"url": url or "data:image/png;base64," + base64.b64encode(PNG).decode()}})
    return {"model": "classify_and_describe", "messages": [{"role": "user", "content": parts}], **extra}


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
    ("http://IMAGES.example.com:8080/cat.jpg", {"images.example.com"}, True),
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
    (InferenceServerException("in ensemble 'x', IMAGE PNG data is corrupt"), 400),  # a stream error: text only
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


@pytest.mark.parametrize("environ, words", [
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


def test_metrics_render_counters_and_a_cumulative_histogram():
    metrics = Metrics(["m"])
    metrics.observe("m", False, 200, 0.004, {"prompt_tokens": 3, "completion_tokens": 2})
    metrics.observe("m", False, 200, 0.3)
    metrics.observe("client-chosen", True, 404, 0.001)
    metrics.error(404, "model_not_found")
    text = metrics.render()
    assert 'openai_front_requests_total{model="m",stream="false",status="200"} 2' in text
    assert 'openai_front_requests_total{model="other",stream="true",status="404"} 1' in text
    assert "client-chosen" not in text
    assert 'openai_front_tokens_total{model="m",kind="prompt"} 3' in text
    assert 'openai_front_request_duration_seconds_bucket{model="m",stream="false",le="0.005"} 1' in text
    assert 'openai_front_request_duration_seconds_bucket{model="m",stream="false",le="0.25"} 1' in text
    assert 'openai_front_request_duration_seconds_bucket{model="m",stream="false",le="0.5"} 2' in text
    assert 'openai_front_request_duration_seconds_bucket{model="m",stream="false",le="+Inf"} 2' in text
    assert 'openai_front_errors_total{status="404",code="model_not_found"} 1' in text


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
