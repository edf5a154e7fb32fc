"""The OpenAI-compatible front (openai_front/) that the supervisor starts
beside the session's real tritonserver, driven by the openai SDK (sync, async,
streaming) and by curl: answers, usage, every error case, auth on and off,
the image-URL policy, metrics, and no key anywhere it should not be.

A second front process (`keyed_front`) runs against the same server with an
API key, a small image limit and an allowlisted host; a third points at a
port where nothing listens (Triton unavailable)."""

import asyncio
import base64
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from tools.local_stack import REPO, free_port, log_tail, stop_process

MODEL = "classify_and_describe"
STREAM_MODEL = "classify_and_describe_stream"
CAT_CLASSES = {"Egyptian cat", "tabby", "tiger cat"}
FRONT_KEY = "sk-front-DO-NOT-LEAK-4b1d8e"
SMALL_LIMIT = 1024 * 1024  # the keyed front's OPENAI_FRONT_MAX_IMAGE_BYTES


def data_uri(image, media_type="image/png"):
    return f"data:{media_type};base64,{base64.b64encode(image).decode()}"


def user_message(image_url, text=None):
    parts = [{"type": "text", "text": text}] if text is not None else []
    return [{"role": "user", "content": [*parts, {"type": "image_url", "image_url": {"url": image_url}}]}]


def unique_prompt(text="What is it?"):
    return f"{text} ({uuid.uuid4().hex[:8]})"


def post(base_url, body, key=None, raw=None, timeout=60):
    """(status, headers, decoded JSON or text) of one POST /chat/completions."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{base_url}/chat/completions", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, headers, text = response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        status, headers, text = error.code, error.headers, error.read().decode()
    try:
        return status, headers, json.loads(text)
    except ValueError:
        return status, headers, text


def assert_openai_error(status, body, expected_status, *words):
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    for word in words:
        assert word in body["error"]["message"], body


# -- the processes --------------------------------------------------------------

class Front:
    """python -m openai_front as its own process, stopped by its PID."""

    def __init__(self, log_path, grpc_url, env=None):
        self.port = free_port()
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "openai_front", "--host", "127.0.0.1", "--port", str(self.port),
                 "--triton-grpc-url", grpc_url],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env={**{k: v for k, v in os.environ.items() if not k.startswith("OPENAI_FRONT_")}, **(env or {})})
        wait_healthy(self.base_url, self.process, log_path)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self):
        return self.log_path.read_text(errors="replace")

    def stop(self):
        stop_process(self.process, grace_s=10)


def wait_healthy(base_url, process=None, log_path=None, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process is not None and process.poll() is not None:
            pytest.fail(f"openai_front exited with {process.returncode}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            pytest.fail(f"openai_front at {base_url} did not answer /health in {timeout_s}s")
        time.sleep(0.2)


class ImageHost:
    """A plain HTTP server on loopback: /<name>.png serves a photo, /big more
    than the keyed front's image limit, /redirect sends to 127.0.0.1 (not on
    the allowlist), anything else is 404."""

    def __init__(self, photos):
        port = free_port()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.strip("/").removesuffix(".png")
                if self.path == "/big":
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b"\0" * (SMALL_LIMIT + 1))
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.1:{port}/chelsea.png")
                    self.end_headers()
                elif name in photos:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    self.wfile.write(photos[name])
                else:
                    self.send_response(404)
                    self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def front(triton):
    """The open front that scripts/serve.sh's supervisor started with the server."""
    wait_healthy(triton.openai_base_url)
    return triton.openai_base_url


@pytest.fixture(scope="module")
def image_host(photos):
    host = ImageHost(photos)
    yield host
    host.stop()


@pytest.fixture(scope="module")
def keyed_front(triton, image_host, tmp_path_factory):
    """A front with a key (from a file), a 1 MiB image limit and the image host
    (localhost:<its port>) allowlisted. That host is on loopback, which the front
    refuses unless OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE=1 (for tests only; the
    next front shows the refusal)."""
    workdir = tmp_path_factory.mktemp("keyed_front")
    (workdir / "key").write_text(FRONT_KEY + "\n")
    front = Front(workdir / "front.log", triton.grpc_url,
                  {"OPENAI_FRONT_API_KEY_FILE": str(workdir / "key"), "OPENAI_FRONT_MAX_IMAGE_BYTES": str(SMALL_LIMIT),
                   "OPENAI_FRONT_IMAGE_URL_ALLOWLIST": f"localhost:{image_host.port}",
                   "OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE": "1"})
    yield front
    front.stop()


@pytest.fixture(scope="module")
def sdk(front):
    with openai.OpenAI(base_url=front, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def stream_model(triton):
    """The decoupled streaming model that answers stream: true (docs/streaming.md)."""
    try:
        with urllib.request.urlopen(f"http://{triton.http_url}/v2/models/{STREAM_MODEL}/ready", timeout=5):
            return STREAM_MODEL
    except OSError as error:
        pytest.fail(f"{STREAM_MODEL} is not ready on the test server ({error}): stream: true cannot be answered")


# -- answers --------------------------------------------------------------------

def direct_grpc(triton, image, prompt):
    with grpcclient.InferenceServerClient(triton.grpc_url) as client:
        tensors = [grpcclient.InferInput("IMAGE", [1, 1], "BYTES"), grpcclient.InferInput("PROMPT", [1, 1], "BYTES")]
        tensors[0].set_data_from_numpy(np.array([[image]], dtype=object))
        tensors[1].set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
        return client.infer(MODEL, tensors)


def test_the_sdk_gets_the_description_usage_and_the_labels_of_the_same_request_sent_directly(sdk, triton, photos, llm):
    prompt = unique_prompt("What breed is this cat?")
    completion = sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["chelsea"]), prompt))
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.id.startswith("chatcmpl-")
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert choice.message.content.startswith("Fake answer #")
    seen = llm.admin("stats")
    assert prompt in seen["bodies"][-1]["messages"][-1]["content"][0]["text"], "the text part is the PROMPT"
    assert seen["images"][-1][0]["format"] == "JPEG" and seen["images"][-1][0]["width"] == 451  # the photo, as its view
    usage = completion.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = completion.classify_describe
    assert extra["description_source"] == "llm"
    assert extra["usage"]["prompt_tokens"] == usage.prompt_tokens and extra["usage"]["cost_usd"] > 0
    assert extra["labels"][0] in CAT_CLASSES and len(extra["labels"]) == len(extra["scores"]) == 5

    direct = direct_grpc(triton, photos["chelsea"], unique_prompt())
    assert extra["labels"] == [x.decode() for x in direct.as_numpy("LABELS")[0]]
    np.testing.assert_allclose(extra["scores"], direct.as_numpy("SCORES")[0], atol=1e-5)


def test_an_image_without_text_gets_the_default_question_and_every_image_format_the_pipeline_reads(sdk, photos):
    import io

    from PIL import Image  # a JPEG of the same photo: the media type in the URI is only a label

    buffer = io.BytesIO()
    Image.open(io.BytesIO(photos["coffee"])).convert("RGB").save(buffer, "JPEG", quality=90)
    for url in (data_uri(photos["coffee"]), data_uri(buffer.getvalue(), "image/jpeg"), data_uri(photos["coffee"], "")):
        completion = sdk.chat.completions.create(model=MODEL, messages=user_message(url))
        assert completion.classify_describe["labels"][0] == "espresso"
        assert completion.choices[0].message.content


def test_the_last_user_message_is_the_one_answered_and_the_only_one_with_a_photo(sdk, photos):
    """Its image is the photo; an image in an earlier turn is refused by name, never dropped.
    (That the earlier turns reach the LLM: test_openai_front_fields.py.)"""
    earlier = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "first"},
               {"role": "assistant", "content": "An espresso."}]
    last = user_message(data_uri(photos["chelsea"]), unique_prompt("And this one?"))
    completion = sdk.chat.completions.create(model=MODEL, messages=[*earlier, *last])
    assert completion.classify_describe["labels"][0] in CAT_CLASSES
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=[*user_message(data_uri(photos["coffee"]), "first"), *last])
    assert refused.value.param == "messages[0].content[1]"


def test_the_async_sdk_keeps_many_requests_in_flight(front, photos):
    async def main():
        async with openai.AsyncOpenAI(base_url=front, api_key="unused", max_retries=0) as client:
            names = ["chelsea", "coffee"] * 8
            return names, await asyncio.gather(*(
                client.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos[n]), unique_prompt()))
                for n in names))

    names, completions = asyncio.run(main())
    for name, completion in zip(names, completions):
        top = completion.classify_describe["labels"][0]
        assert top in CAT_CLASSES if name == "chelsea" else top == "espresso"
        assert completion.choices[0].message.content.startswith("Fake answer #")
    assert len({c.id for c in completions}) == len(completions)


def test_sampling_parameters_reach_the_describe_step_and_its_limits_answer_400(sdk, photos, llm):
    sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["coffee"]), unique_prompt()),
                                temperature=0.5, max_tokens=50)
    sent = llm.admin("stats")["bodies"][-1]
    assert sent["temperature"] == 0.5 and sent.get("max_tokens", sent.get("max_completion_tokens")) == 50
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["coffee"]), unique_prompt()),
                                    temperature=1.9)
    assert "temperature" in refused.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_the_front_bounds_the_question_where_the_served_describe_step_does_before_any_classification(
        sdk, stream_model, photos, llm, stream):
    """The longest question the describe step takes gets its answer; one character more is the
    front's own 400, sent before Triton (and so the classifier) sees the request."""
    from openai_front import chat

    photo = data_uri(photos["coffee"])
    longest = unique_prompt("Describe it.").ljust(chat.MAX_PROMPT_CHARS, "x")
    answer = sdk.chat.completions.create(model=MODEL, stream=stream, messages=user_message(photo, longest))
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream else \
        answer.choices[0].message.content
    assert text.startswith("Fake answer #")
    assert longest in llm.admin("stats")["bodies"][-1]["messages"][-1]["content"][0]["text"]
    before = len(llm.admin("stats")["bodies"])
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, stream=stream, messages=user_message(photo, longest + "y"))
    assert refused.value.param == "messages[0].content"
    assert "the question (the text parts of the last user message) has 2001 characters" in refused.value.message
    assert len(llm.admin("stats")["bodies"]) == before


def test_models_lists_what_can_be_asked_for(sdk):
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4o")


# -- streaming ------------------------------------------------------------------

def test_streaming_sends_chunks_whose_text_is_the_non_streaming_answer(sdk, stream_model, photos, llm):
    # The upstream streams a word every 30 ms (the model sends text that arrives
    # while a send is on its way together with the next, so 0 ms would be one chunk).
    llm.admin("mode", {"mode": "ok", "chunk_ms": 30, "answer_words": 12})
    prompt = unique_prompt("Describe it")
    plain = sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["chelsea"]), prompt))
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["chelsea"]), prompt),
                                              stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].classify_describe["labels"] == plain.classify_describe["labels"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The fake upstream numbers its answers ("Fake answer #12"); the rest is the same text.
    assert re.sub(r"#\d+", "#", text) == re.sub(r"#\d+", "#", plain.choices[0].message.content)
    assert text == llm.admin("stats")["streamed_answers"][-1], "exactly the text the LLM streamed"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 3, "the text comes as it is written"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_include_usage_has_no_usage_chunk(sdk, stream_model, photos):
    chunks = list(sdk.chat.completions.create(model=MODEL, stream=True,
                                              messages=user_message(data_uri(photos["coffee"]), unique_prompt())))
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].classify_describe["description_source"] == "llm"


def test_the_async_sdk_streams(front, stream_model, photos):
    async def main():
        async with openai.AsyncOpenAI(base_url=front, api_key="unused", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model=MODEL, stream=True, messages=user_message(data_uri(photos["coffee"]), unique_prompt()))
            return [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    assert "".join(c.choices[0].delta.content or "" for c in chunks).startswith("Fake answer #")


def test_an_upstream_cut_short_still_ends_the_stream_properly(sdk, stream_model, photos, llm):
    llm.admin("mode", {"mode": "cut", "cut_after": 3, "count": 1})
    chunks = list(sdk.chat.completions.create(model=MODEL, stream=True,
                                              messages=user_message(data_uri(photos["coffee"]), unique_prompt())))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].classify_describe["description_source"]
    assert text.startswith("Fake answer #")


def test_a_client_that_leaves_mid_stream_stops_the_llm_call(front, stream_model, photos, llm):
    """Closing the HTTP stream cancels the gRPC stream, which the streaming
    model passes on to the upstream (its connection closes)."""
    llm.admin("mode", {"mode": "ok", "chunk_ms": 200, "answer_words": 100})
    before = llm.admin("stats")["disconnected"]
    with openai.OpenAI(base_url=front, api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(model=MODEL, stream=True,
                                                messages=user_message(data_uri(photos["coffee"]), unique_prompt()))
        for index, _ in enumerate(stream):
            if index == 3:
                break
        stream.close()
    deadline = time.monotonic() + 10
    while llm.admin("stats")["disconnected"] == before:
        assert time.monotonic() < deadline, "the upstream stream was still read 10 s after the client left"
        time.sleep(0.2)
    assert llm.admin("stats")["streams_completed"] == 0
    metrics = urllib.request.urlopen(front.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    assert metric(metrics, "openai_front_errors_total", code="client_closed_request") >= 1


def test_a_broken_image_while_streaming_is_a_400_before_any_chunk(front, stream_model):
    status, _, body = post(front, {"model": MODEL, "stream": True,
                                   "messages": user_message(data_uri(b"not an image at all"))})
    assert_openai_error(status, body, 400, "IMAGE")


# -- curl -----------------------------------------------------------------------

def curl(*args, data=None):
    run = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], input=data, capture_output=True, timeout=60)
    body, _, code = run.stdout.decode().rpartition("\n")
    return int(code), body


def test_curl_gets_an_answer_and_an_openai_error(front, photos, tmp_path):
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": MODEL, "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}))
    code, text = curl(f"{front}/chat/completions", "-H", "Content-Type: application/json", "-d", f"@{body}")
    assert code == 200
    assert json.loads(text)["classify_describe"]["labels"][0] == "espresso"
    code, text = curl(f"{front}/chat/completions", "-H", "Content-Type: application/json", "-d", '{"model": "gpt-4o"}')
    assert code == 400 and json.loads(text)["error"]["param"] == "messages"


def test_curl_streams_server_sent_events_ending_in_done(front, stream_model, photos, tmp_path):
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                                "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}))
    code, text = curl("-N", f"{front}/chat/completions", "-H", "Content-Type: application/json", "-d", f"@{body}")
    assert code == 200
    events = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert all(line.startswith("data: ") for line in text.splitlines() if line)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["total_tokens"] > 0


# -- errors: each request refused alone, in OpenAI's format ----------------------

BAD_REQUESTS = {
    "broken image": ({"messages": user_message(data_uri(b"GIF89a but not really"))}, 400, "IMAGE"),
    "no image": ({"messages": [{"role": "user", "content": "Describe the photo"}]}, 400, "no image"),
    "text parts only": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, 400, "no image_url"),
    "empty data URI": ({"messages": user_message("data:image/png;base64,")}, 400, "no data"),
    "not base64": ({"messages": user_message("data:image/png;base64,@@@@")}, 400, "base64"),
    "no comma": ({"messages": user_message("data:image/png;base64")}, 400, "','"),
    "not an image type": ({"messages": user_message("data:text/html;base64,PGI+")}, 400, "not an image"),
    "two images": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 2}]}, 400, "one per request"),
    "unknown part": ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400, "input_audio"),
    "no user message": ({"messages": [{"role": "system", "content": "hi"}]}, 400, "user"),
    "empty messages": ({"messages": []}, 400, "messages"),
    "messages not objects": ({"messages": ["hi"]}, 400, "messages[0]"),
    "n=2": ({"n": 2}, 400, "n=1"),
    "stream not a bool": ({"stream": "yes"}, 400, "stream"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    "max_tokens not a number": ({"max_tokens": "lots"}, 400, "max_tokens"),
    "remote URL": ({"messages": user_message("http://169.254.169.254/latest/meta-data/")}, 400, "refused"),
    "file URL": ({"messages": user_message("file:///etc/passwd")}, 400, "data: URI"),
    "prompt too long": ({"messages": user_message("PHOTO", "why? " * 20_000)}, 400, "the question"),
    "temperature out of range": ({"temperature": -1}, 400, "temperature"),
    "unknown model": ({"model": "gpt-4o"}, 404, "gpt-4o"),
    "no model": ({"model": None}, 400, "model"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_are_refused_alone_with_a_clear_openai_error(front, photos, case):
    changes, expected_status, words = BAD_REQUESTS[case]
    body = {"model": MODEL, "messages": user_message(data_uri(photos["coffee"])), **changes}
    body = json.loads(json.dumps(body).replace('"PHOTO"', json.dumps(data_uri(photos["coffee"]))))
    status, _, answer = post(front, body)
    assert_openai_error(status, answer, expected_status, words)
    if case == "unknown model":
        assert answer["error"]["code"] == "model_not_found"
    if case == "remote URL":
        assert answer["error"]["code"] == "image_url_not_allowed"
    status, _, answer = post(front, {"model": MODEL, "messages": user_message(data_uri(photos["coffee"]))})
    assert status == 200, "the next valid request is answered"


def test_the_sdk_raises_the_matching_exceptions(sdk, photos):
    with pytest.raises(openai.BadRequestError) as broken:
        sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(b"\x89PNG\r\n\x1a\n broken")))
    assert "IMAGE" in broken.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.chat.completions.create(model="gpt-4o", messages=user_message(data_uri(photos["coffee"])))
    assert unknown.value.code == "model_not_found"


def test_a_body_that_is_not_json_and_unknown_routes_answer_in_openai_format(front):
    status, _, body = post(front, None, raw=b"{not json")
    assert_openai_error(status, body, 400, "JSON")
    status, _, body = post(front, None, raw=b"[1, 2]")
    assert_openai_error(status, body, 400, "object")
    status, _, body = post(front, None, raw=b"[" * 100_000 + b"]" * 100_000)  # nesting past Python's recursion limit
    assert_openai_error(status, body, 400, "JSON")
    status, _, body = post(front, None, raw=b'{"model": "\xff\xfe"}')  # not UTF-8
    assert_openai_error(status, body, 400, "JSON")
    for path, expected in (("/v1/completions", 404), ("/v1/embeddings", 404)):
        request = urllib.request.Request(front.removesuffix("/v1") + path, data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert_openai_error(refused.value.code, json.loads(refused.value.read()), expected)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{front}/chat/completions", timeout=10)  # GET
    assert_openai_error(refused.value.code, json.loads(refused.value.read()), 405)


def test_oversized_images_are_413_whether_the_uri_or_the_body_is_too_big(keyed_front, photos):
    for size in (SMALL_LIMIT + 1000, 3 * SMALL_LIMIT):  # past the image limit; past the body limit as well
        body = {"model": MODEL, "messages": user_message(data_uri(os.urandom(size)))}
        status, _, answer = post(keyed_front.base_url, body, key=FRONT_KEY)
        assert_openai_error(status, answer, 413, "bytes" if size < 2 * SMALL_LIMIT else "larger")
    status, _, _ = post(keyed_front.base_url, {"model": MODEL, "messages": user_message(data_uri(photos["coffee"]))},
                        key=FRONT_KEY)
    assert status == 200


def test_the_front_learns_tritons_queue_time_limit_from_the_served_models(keyed_front):
    """The admission limit's recovery after a cut (openai_front/shedding.py) waits out the queue
    time limit of the models behind the front: read from the real server's model configs, the
    ensembles' steps included (the shipped 2 s)."""
    deadline = time.monotonic() + 10
    while "Triton queues a request of ours at most 2 s (the served models' queue policies" not in keyed_front.log():
        assert time.monotonic() < deadline, log_tail(keyed_front.log_path)
        time.sleep(0.1)


def test_triton_unavailable_is_503_with_retry_after(tmp_path, photos):
    dead = Front(tmp_path / "front.log", f"127.0.0.1:{free_port()}")
    try:
        body = {"model": MODEL, "messages": user_message(data_uri(photos["coffee"]))}
        for stream in (False, True):
            status, headers, answer = post(dead.base_url, {**body, "stream": stream})
            assert_openai_error(status, answer, 503, "unavailable")
            assert int(headers["Retry-After"]) >= 1
        with openai.OpenAI(base_url=dead.base_url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError) as refused:
                client.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["coffee"])))
        assert refused.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(dead.base_url.removesuffix("/v1") + "/health/ready", timeout=10)
        assert not_ready.value.code == 503
    finally:
        dead.stop()


def test_term_lets_requests_in_flight_finish(triton, llm, photos, tmp_path):
    """The supervisor sends TERM to the front and the server together at
    shutdown; Triton drains what it was sent, and the front must answer those
    requests before it exits, not cut them."""
    import concurrent.futures
    import signal

    front = Front(tmp_path / "front.log", triton.grpc_url)
    try:
        llm.admin("mode", {"mode": "ok", "latency_ms": 3000})
        requests_before = llm.admin("stats")["requests"]
        body = {"model": MODEL, "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, front.base_url, body)
            # TERM once the request is in flight: at the LLM, which answers 3 s later
            # (generous: a loaded machine is slow to get it there).
            deadline = time.monotonic() + 60
            while llm.admin("stats")["requests"] == requests_before:
                assert time.monotonic() < deadline and not answer.done(), "the request never reached the LLM"
                time.sleep(0.05)
            front.process.send_signal(signal.SIGTERM)
            status, _, result = answer.result(timeout=30)
        assert status == 200 and result["choices"][0]["message"]["content"].startswith("Fake answer #")
        assert front.process.wait(timeout=30) == 0
    finally:
        front.stop()


# -- auth -----------------------------------------------------------------------

def test_without_a_key_the_front_is_open_and_says_so(front, triton):
    with urllib.request.urlopen(f"{front}/models", timeout=10) as response:
        assert response.status == 200
    assert "OPEN: no API key" in triton.log()


def test_with_a_key_every_v1_request_needs_it(keyed_front, photos):
    body = {"model": MODEL, "messages": user_message(data_uri(photos["coffee"]))}
    for key in (None, "wrong-key", FRONT_KEY + "x", FRONT_KEY[:-1]):
        status, _, answer = post(keyed_front.base_url, body, key=key)
        assert_openai_error(status, answer, 401, "API key")
        assert answer["error"]["type"] == "authentication_error"
    status, _, answer = post(keyed_front.base_url, body, key=FRONT_KEY)
    assert status == 200 and answer["classify_describe"]["labels"][0] == "espresso"
    with openai.OpenAI(base_url=keyed_front.base_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=keyed_front.base_url, api_key=FRONT_KEY, max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
    base = keyed_front.base_url.removesuffix("/v1")
    for path in ("//v1/models", "/v1/./models", "/v1/models/", "/V1/models", "/v1/unknown"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + path, timeout=10)
        assert refused.value.code == 401, path
    for path in ("/health", "/metrics"):  # probes and Prometheus need no key
        with urllib.request.urlopen(base + path, timeout=10) as response:
            assert response.status == 200
    log = keyed_front.log()
    assert "the key from OPENAI_FRONT_API_KEY_FILE" in log and "OPEN:" not in log


def test_no_key_appears_in_logs_answers_or_metrics(keyed_front, front, triton, test_api_key, photos):
    status, _, answer = post(keyed_front.base_url, {"model": MODEL, "messages": user_message("not a url")},
                             key=FRONT_KEY + "-wrong")
    metrics = "".join(urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
                      for base in (keyed_front.base_url, front))
    seen = json.dumps(answer) + metrics + keyed_front.log() + triton.log()
    for secret in (FRONT_KEY, test_api_key):
        assert secret not in seen


# -- the image-URL policy --------------------------------------------------------

def test_an_allowlisted_host_is_fetched_and_nothing_else(keyed_front, image_host):
    def ask(url):
        return post(keyed_front.base_url, {"model": MODEL, "messages": user_message(url)}, key=FRONT_KEY)

    status, _, answer = ask(f"http://localhost:{image_host.port}/chelsea.png")
    assert status == 200, answer
    assert answer["classify_describe"]["labels"][0] in CAT_CLASSES
    status, _, answer = ask(f"http://127.0.0.1:{image_host.port}/chelsea.png")  # the same server, not listed
    assert_openai_error(status, answer, 400, "refused")
    status, _, answer = ask(f"http://localhost:{image_host.port}/redirect")  # would leave the allowlist
    assert_openai_error(status, answer, 400, "302")
    status, _, answer = ask(f"http://localhost:{image_host.port}/big")
    assert_openai_error(status, answer, 413, "more than")
    status, _, answer = ask(f"http://localhost:{image_host.port}/missing.png")
    assert_openai_error(status, answer, 400, "404")
    status, _, answer = ask(f"http://localhost:{free_port()}/chelsea.png")  # a port the allowlist does not name
    assert_openai_error(status, answer, 400, "refused")
    status, _, answer = ask("http://localhost/chelsea.png")  # port 80 needs an entry without a port
    assert_openai_error(status, answer, 400, "refused")
    status, _, answer = ask(f"ftp://localhost:{image_host.port}/chelsea.png")
    assert_openai_error(status, answer, 400, "data: URI")


def test_without_the_test_setting_a_loopback_image_host_is_refused_by_name_and_by_address(triton, image_host, tmp_path):
    """The same allowlisted name and port, without OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE:
    localhost resolves to 127.0.0.1, which the front will not connect to."""
    front = Front(tmp_path / "front.log", triton.grpc_url,
                  {"OPENAI_FRONT_IMAGE_URL_ALLOWLIST": f"localhost:{image_host.port},127.0.0.1:{image_host.port}"})
    try:
        for host in ("localhost", "127.0.0.1"):
            status, _, answer = post(front.base_url, {"model": MODEL, "messages": user_message(
                f"http://{host}:{image_host.port}/chelsea.png")})
            assert_openai_error(status, answer, 400, "non-public address")
            assert answer["error"]["code"] == "image_url_not_allowed"
    finally:
        front.stop()


# -- fields the pipeline cannot honour --------------------------------

# Every field the front refuses, with a value a client would send (any value of
# these is refused; n, logprobs, modalities and store are taken with one value only).
REFUSED_FIELDS = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto", "parallel_tool_calls": False, "functions": [{"name": "f"}], "function_call": "auto",
    "n": 2, "logprobs": True, "top_logprobs": 2, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "logit_bias": {"50256": -100},
    "seed": 7, "store": True, "top_p": 0.9, "stop": ["\n"], "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "service_tier": "auto",
    "frobnicate": 1,  # and any field nobody has listed
}


def test_the_refused_fields_here_are_every_one_the_front_refuses():
    from openai_front import chat

    assert set(chat.REFUSED) | set(chat.ONLY) <= set(REFUSED_FIELDS)
    assert not set(REFUSED_FIELDS) & (chat.HONOURED | chat.IGNORED)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", REFUSED_FIELDS)
def test_a_field_the_pipeline_cannot_honour_is_a_400_naming_it_on_both_paths(sdk, photos, llm, stream, field):
    before = len(llm.admin("stats")["bodies"])
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, stream=stream, messages=user_message(data_uri(photos["coffee"])),
                                    extra_body={field: REFUSED_FIELDS[field]})
    assert refused.value.param == field and field in refused.value.message
    assert len(llm.admin("stats")["bodies"]) == before, "nothing reached the LLM"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("earlier, param", [
    ([{"role": "tool", "tool_call_id": "c1", "content": "42"}], "messages[0].role"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "x"}] * 33, "messages"),
    ([{"role": "system", "content": "x" * 32_001}], "messages"),
], ids=["tool role", "tool calls", "33 earlier messages", "32001 characters"])
def test_messages_the_pipeline_cannot_honour_are_a_400_naming_them_on_both_paths(sdk, photos, stream, earlier, param):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, stream=stream,
                                    messages=[*earlier, *user_message(data_uri(photos["coffee"]))])
    assert refused.value.param == param


# -- review findings: what parses but cannot be sent, clients that leave, stream errors

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("change, param", [
    ({"messages": user_message("PHOTO", "\ud800")}, "messages[0].content[0]"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": 10**400}, "temperature"),
], ids=["lone surrogate", "max_tokens 2**63", "max_tokens -1", "max_tokens true", "temperature 10**400"])
def test_values_json_accepts_but_triton_cannot_take_are_400_on_both_paths(front, photos, stream, change, param):
    body = json.dumps({"model": MODEL, "stream": stream, "messages": user_message("PHOTO"), **change})
    body = body.replace('"PHOTO"', json.dumps(data_uri(photos["coffee"])))
    status, _, answer = post(front, None, raw=body.encode())
    assert_openai_error(status, answer, 400)
    assert answer["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_answer_cancels_its_grpc_call(front, stream_model, photos, llm, stream):
    """aiohttp cancels the handler when the client leaves (handler_cancellation),
    which cancels the gRPC call at once (counted as 499 long before the LLM's
    15 s answer; without it the front would wait and count a 200). The streaming
    model then closes its LLM call. The plain ensemble cannot: Triton 2.51
    cancels an ensemble's steps not yet scheduled, never the running describe
    step (docs/streaming.md), so that LLM call runs to its end."""
    import socket

    llm.admin("mode", {"mode": "ok", "latency_ms": 15000})
    before, requests_before = (llm.admin("stats")[key] for key in ("disconnected", "requests"))
    scrape = lambda: urllib.request.urlopen(front.removesuffix("/v1") + "/metrics", timeout=10).read().decode()  # noqa: E731
    left_before = metric(scrape(), "openai_front_errors_total", code="client_closed_request")
    payload = json.dumps({"model": MODEL, "stream": stream,
                          "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}).encode()
    host, port = front.removeprefix("http://").removesuffix("/v1").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            # The photo classified and its LLM call open (generous: a loaded machine is slow to get there).
            deadline = time.monotonic() + 60
            while llm.admin("stats")["requests"] == requests_before:
                assert time.monotonic() < deadline, "the request never reached the LLM"
                time.sleep(0.1)
        left = time.monotonic()
        # Well inside the LLM's 15 s answer, with room for a loaded machine.
        while metric(scrape(), "openai_front_errors_total", code="client_closed_request") == left_before:
            assert time.monotonic() - left < 10, "the front did not notice the client leave"
            time.sleep(0.1)
        deadline = left + 12
        while stream and llm.admin("stats")["disconnected"] == before:
            assert time.monotonic() < deadline, "the LLM call was still open 12 s after the client left"
            time.sleep(0.2)
    finally:
        llm.admin("mode", {"mode": "ok", "latency_ms": 0})
    assert metric(scrape(), "openai_front_errors_total", code="client_closed_request") == left_before + 1


def test_an_unknown_model_is_503_on_both_paths_with_tritons_own_text(triton):
    """Triton's "Request for unknown model" reaches a stream as text only."""
    from openai_front.triton import TritonPool

    async def main():
        pool = TritonPool(triton.grpc_url, channels=1, timeout_s=10)
        errors = []
        try:
            for call in (pool.infer("no_such_model", b"x"), _first(pool.stream("no_such_model", b"x"))):
                try:
                    await call
                except Exception as error:  # noqa: BLE001 - the FrontError is what is checked
                    errors.append(error)
        finally:
            await pool.close()
        return errors

    errors = asyncio.run(main())
    assert [(e.status, "Retry-After" in e.headers()) for e in errors] == [(503, True), (503, True)], errors


async def _first(agen):
    async for item in agen:
        return item


def test_finish_reason_is_length_when_the_llm_used_the_clients_max_tokens(sdk, photos, llm):
    """The fake upstream reports one completion token per word of its answer (more than 3)."""
    llm.admin("mode", {"mode": "ok", "answer_words": 12})
    messages = user_message(data_uri(photos["coffee"]), unique_prompt())
    plain = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert plain.usage.completion_tokens >= 3 and plain.choices[0].finish_reason == "length"
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["coffee"]),
                                                                                  unique_prompt()),
                                              max_tokens=3, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    roomy = sdk.chat.completions.create(model=MODEL, messages=user_message(data_uri(photos["coffee"]),
                                                                            unique_prompt()), max_tokens=500)
    assert roomy.choices[0].finish_reason == "stop"


# -- metrics --------------------------------------------------------------------

def metric(text, name, **labels):
    """The sum of the series of name whose labels include these."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_metrics_count_answers_errors_tokens_and_latency(front, photos):
    def scrape():
        return urllib.request.urlopen(front.removesuffix("/v1") + "/metrics", timeout=10).read().decode()

    before = scrape()
    status, _, answer = post(front, {"model": MODEL, "messages": user_message(data_uri(photos["coffee"]), unique_prompt())})
    assert status == 200, answer
    post(front, {"model": "no-such-model", "messages": user_message(data_uri(photos["coffee"]))})
    after = scrape()
    ok = dict(model=MODEL, stream="false", status="200")
    assert metric(after, "openai_front_requests_total", **ok) == metric(before, "openai_front_requests_total", **ok) + 1
    assert (metric(after, "openai_front_requests_total", model="other", status="404")
            == metric(before, "openai_front_requests_total", model="other", status="404") + 1), "client ids never become labels"
    assert (metric(after, "openai_front_errors_total", code="model_not_found")
            == metric(before, "openai_front_errors_total", code="model_not_found") + 1)
    for kind in ("prompt", "completion"):  # exactly what this answer billed
        assert (metric(after, "openai_front_tokens_total", model=MODEL, kind=kind)
                == metric(before, "openai_front_tokens_total", model=MODEL, kind=kind) + answer["usage"][f"{kind}_tokens"])
    durations = dict(model=MODEL, stream="false")
    for series, labels in (("_count", durations), ("_bucket", dict(durations, le="+Inf"))):
        name = "openai_front_request_duration_seconds" + series
        assert metric(after, name, **labels) == metric(before, name, **labels) + 1
    assert "no-such-model" not in after


# -- the README's examples run as written ---------------------------------------

README = (REPO / "README.md").read_text()
README_PYTHON = [b for b in re.findall(r"```python\n(.*?)```", README, flags=re.S) if "127.0.0.1:8003" in b]
README_CURL = [b for b in re.findall(r"```bash\n(.*?)```", README, flags=re.S) if "127.0.0.1:8003/v1/chat" in b]


def test_the_readme_python_example_runs(front, photos, tmp_path):
    (example,) = README_PYTHON
    assert len(example.strip().splitlines()) <= 6, "the README promises a short example"
    (tmp_path / "photo.jpg").write_bytes(photos["chelsea"])
    run = subprocess.run([sys.executable, "-c", example.replace("http://127.0.0.1:8003/v1", front)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Fake answer #" in run.stdout and "total_tokens=" in run.stdout
    assert any(label in run.stdout for label in CAT_CLASSES)


def test_the_readme_curl_example_runs(front):
    (example,) = README_CURL
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", example.replace("127.0.0.1:8003", front.removeprefix("http://").removesuffix("/v1"))],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["classify_describe"]["labels"][0] == "espresso"


def test_the_front_logged_no_unexpected_error(front, triton):
    """Runs after the hostile cases above: none of them reached the catch-all."""
    assert "openai_front: unexpected" not in triton.log()
