"""The describe step against an upstream that misbehaves in ways the fake
(tools/fake_openai) has no mode for: each answer scripted, headers and bytes,
by a plain aiohttp server on 127.0.0.1, read by the real Describer and openai
SDK. Whatever comes back, the request gets an answer or its fallback, and
nothing of the step (a slot, the circuit's probe, the bill, the log) is left
wrong for the requests after it."""

import asyncio
import gzip
import json
from types import SimpleNamespace

import pytest
from aiohttp import web
from classify_describe_server.accounting import tokens_from
from classify_describe_server.describer import SHOWN_ERROR_CHARS, Describer, make_client
from classify_describe_server.resilience import refuses_image
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import parse_settings, shown_url
from test_describe_describer import FAST, KEY, Log, Recorder, job

# Past every calendar: email.utils reads it, datetime cannot hold it (OverflowError).
NO_SUCH_DATE = "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"


def completion(text="A tabby cat.", usage=None):
    usage = usage or {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    return {"id": "c1", "object": "chat.completion", "created": 0, "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage}


def chunk(text=None, usage=None, finish_reason=None):
    choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}]
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "gpt-4o-mini",
            "choices": choices, "usage": usage}


def events(*chunks):
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def answer(status=200, body=b"", headers=None, gzipped=False, content_type="application/json"):
    """One scripted answer: its bytes as given, gzipped when asked (Content-Encoding said)."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    headers = dict(headers or {}, **{"Content-Type": content_type})
    if gzipped:
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    return lambda: web.Response(status=status, body=body, headers=headers)


def stream_answer(body, gzipped=False):
    return answer(body=body, gzipped=gzipped, content_type="text/event-stream")


class Upstream:
    """Answers requests with `script` in order, then with `then` (a good answer)."""

    def __init__(self, *script, then=None):
        self.script, self.then = list(script), then or answer(body=completion())
        self.request_headers = []

    async def handle(self, request):
        await request.read()
        self.request_headers.append(request.headers)
        return (self.script.pop(0) if self.script else self.then)()


def run(test, upstream, base_url=None, **params):
    """`test(describer, observer, log)` against `upstream` on one loop; `base_url(port)`:
    the describe step's, given the upstream's port (by default the upstream's own URL)."""
    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", upstream.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = base_url(port) if base_url else f"http://127.0.0.1:{port}/v1"
        settings = parse_settings(dict(FAST, base_url=url, **params), {})
        observer, log = Recorder(), Log()
        describer = Describer(settings, make_client(settings, KEY), Scrubber(KEY), observer, log)
        try:
            return await test(describer, observer, log)
        finally:
            await describer.aclose()
            await runner.cleanup()
    return asyncio.run(main())


async def streamed(describer, the_job=None):
    chunks = []
    result = await describer.describe(the_job or job(), lambda: False, chunks.append)
    return chunks, result


def test_a_retry_after_past_every_calendar_is_a_429_like_any_other():
    """parse_retry_after raised OverflowError for it, out of the describer with the
    request's slot still taken: with max_in_flight 1 every later request waited
    out its deadline for a slot."""
    upstream = Upstream(*[answer(429, {"error": {"message": "slow down"}}, {"Retry-After": NO_SUCH_DATE})] * 3)

    async def test(d, obs, log):
        first = await d.describe(job())
        second = await d.describe(job(prompt="again"))
        return first, second, d._in_flight
    first, second, in_flight = run(test, upstream, max_in_flight="1", max_attempts="3")
    assert (first.source, first.usage.fallback_reason) == ("fallback", "rate_limited_http_429")
    assert second.source == "llm" and in_flight == 0


def test_a_failure_that_cannot_be_read_keeps_neither_the_slot_nor_the_circuits_probe():
    """The guard around classify_failure: whatever it raises (a bug of ours, an
    exception nobody foresaw) fails that request alone."""
    upstream = Upstream(answer(500, {"error": {"message": "down"}}))

    async def test(d, obs, log):
        original, calls = d.classify_failure, []

        def broken(exc, request_id=None, image=False):
            calls.append(exc)
            raise RuntimeError("could not read the failure")
        d.classify_failure = broken
        try:
            await d.describe(job())
        except RuntimeError:
            pass
        d.classify_failure = original
        breaker = d._breaker("gpt-4o-mini")
        left = (d._in_flight, d._slots.locked(), breaker._probe_in_flight)
        return calls, left, await d.describe(job(prompt="next"))
    calls, left, after = run(test, upstream, max_in_flight="1")
    assert len(calls) == 1
    assert left == (0, False, False)
    assert after.source == "llm"


def test_a_gzipped_error_answer_is_read_as_its_status():
    """aiohttp inflates the body; handing its Content-Encoding on to the SDK's
    exception had httpx inflate it again: malformed_response, retried, the
    Retry-After lost, a 401 counted against the upstream's health."""
    rate_limited = answer(429, {"error": {"message": "slow down"}}, {"Retry-After": "0.01"}, gzipped=True)
    unauthorised = answer(401, {"error": {"message": "bad key", "code": "invalid_api_key"}}, gzipped=True)
    upstream = Upstream(rate_limited, unauthorised)

    async def test(d, obs, log):
        return await d.describe(job()), list(obs.attempts)
    result, attempts = run(test, upstream, max_attempts="3")
    assert attempts == ["rate_limited_http_429", "authentication_failed_http_401"]
    assert result.usage.fallback_reason == "authentication_failed_http_401"


def test_a_compressed_stream_is_refused_before_it_is_inflated():
    """The byte limit counts the stream's bytes as they come: 688 KB of gzip
    inflate to 670 MB. The step asks for identity and reads nothing else."""
    good = events(chunk("A tabby"), chunk(" cat.", finish_reason="stop"),
                  chunk(usage={"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}))
    upstream = Upstream(*[stream_answer(good, gzipped=True)] * 3)

    async def test(d, obs, log):
        return await streamed(d)
    chunks, result = run(test, upstream, max_attempts="3")
    assert chunks == [result.description] and result.source == "fallback"
    assert result.usage.fallback_reason == "malformed_response"
    assert {headers["Accept-Encoding"] for headers in upstream.request_headers} == {"identity"}


def test_an_empty_content_encoding_is_identity():
    """As httpx reads it: an empty header names no encoding (refused, every stream would fail)."""
    body = events(chunk("A tabby cat.", finish_reason="stop"))
    empty = lambda: web.Response(body=body, headers={"Content-Type": "text/event-stream",  # noqa: E731
                                                     "Content-Encoding": ""})

    async def test(d, obs, log):
        return await streamed(d)
    chunks, result = run(test, Upstream(then=empty))
    assert result.source == "llm" and "".join(chunks) == "A tabby cat."


def test_a_whole_answer_asks_for_identity_too():
    upstream = Upstream()
    run(lambda d, obs, log: d.describe(job()), upstream)
    assert upstream.request_headers[0]["Accept-Encoding"] == "identity"


def test_a_running_usage_total_on_every_chunk_is_billed_once():
    """vLLM's continuous_usage_stats repeats the total so far on every chunk: the last is the bill."""
    def running(n):
        return {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
    body = events(chunk("A", running(1)), chunk(" tabby", running(2)), chunk(" cat.", running(3), "stop"),
                  chunk(usage=running(3)))

    async def test(d, obs, log):
        return await streamed(d)
    chunks, result = run(test, Upstream(then=stream_answer(body)))
    assert "".join(chunks) == "A tabby cat." and result.source == "llm"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (10, 3)


def test_token_counts_that_are_not_counts_cost_nothing():
    for bad in (-1_000_000_000, 10**29, 1e29, "n/a", "-5", True, 3.5, float("nan"), [1], {"n": 1}):
        assert tokens_from(SimpleNamespace(prompt_tokens=bad, completion_tokens=bad)) == (0, 0), bad
    assert tokens_from(SimpleNamespace(prompt_tokens="12", completion_tokens=3.0)) == (12, 3)


def test_an_answer_with_unreadable_usage_is_kept_and_billed_as_estimated():
    """int("five") raised in the bill: a good answer thrown away, retried (each billed upstream).
    Counts that are not counts are no usage: estimated, as an answer without any, and said so."""
    whole = answer(body=completion(usage={"prompt_tokens": -1000000000, "completion_tokens": "five"}))
    stream = stream_answer(events(chunk("A tabby cat.", finish_reason="stop"),
                                  chunk(usage={"prompt_tokens": "n/a", "completion_tokens": 1e29})))

    async def test(d, obs, log):
        return await d.describe(job()), await streamed(d, job(prompt="streamed"))
    plain, (chunks, streamed_result) = run(test, Upstream(whole, stream))
    for result in (plain, streamed_result):
        assert result.source == "llm" and result.usage.attempts == 1 and result.usage.tokens_estimated is True
        assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens == 3  # "A tabby cat.", 4 a token
        assert result.usage.cost_usd > 0


def test_a_lone_surrogate_in_a_stream_is_a_replacement_character():
    """JSON lets "\\ud83d" through alone (an emoji's pair split across two chunks by a
    gateway): as it came, the chunk could not be encoded on its way out."""
    body = (b'data: {"id":"c1","object":"chat.completion.chunk","created":0,"model":"m","choices":'
            b'[{"index":0,"delta":{"content":"A cat \\ud83d"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')

    async def test(d, obs, log):
        return await streamed(d)
    chunks, result = run(test, Upstream(then=stream_answer(body)))
    assert result.source == "llm" and result.description == "A cat \ufffd"
    assert "".join(chunks).encode("utf-8") == "A cat \ufffd".encode()


def test_an_error_body_is_logged_short_and_scrubbed():
    """A 600 KB error body quoting the key: one line of at most SHOWN_ERROR_CHARS, the key masked."""
    body = {"error": {"message": f"Incorrect API key provided: {KEY}. " + "not base64, " * 50_000}}

    async def test(d, obs, log):
        await d.describe(job())
        return log.lines
    lines = run(test, Upstream(then=answer(500, body)), max_attempts="1")
    failed = [line for line in lines if "upstream attempt failed" in line]
    assert len(failed) == 1 and len(failed[0]) <= SHOWN_ERROR_CHARS + 200
    assert KEY not in failed[0] and "***" in failed[0]


def test_an_error_about_this_photo_is_not_a_model_that_takes_no_images():
    """Read as a refusal, one bad photo (or one a client made bad on purpose) would turn
    vision off for every request for vision_refusal_memory_s."""
    about_the_photo = [
        "You uploaded an unsupported image. Please make sure your image is below 20 MB in size and is of "
        "one the following formats: ['png', 'jpeg', 'gif', 'webp'].",
        "Invalid image.",
        "Image exceeds max size",
        "Your input image may contain content that is not allowed by our safety system.",
    ]
    for message in about_the_photo:
        assert not refuses_image(400, {"error": {"message": message}}, message), message
    no_images = [
        "The model `gpt-3.5-turbo` does not support image input.",
        "Invalid content type. image_url is only supported by certain models.",
        "meta-llama/Llama-3-8B is not a multimodal model",
        "At most 0 image(s) may be provided in one request.",
        "Failed to deserialize the JSON body into the target type: messages[0]: unknown variant `image_url`, "
        "expected `text`",
        "this model is missing data required for image input",  # Ollama, a model without a vision projector
        "The model doesn't support image input",
        "model is not multimodal",
        "Model llama3 is not a vision model",
        "Unsupported content type: image_url",
    ]
    for message in no_images:
        assert refuses_image(400, {"error": {"message": message}}, message), message


def test_an_upstream_url_is_logged_without_its_credentials():
    assert shown_url("https://user:tok3n@gw.example:8443/v1?key=abc&x=1") == "https://gw.example:8443/v1"
    assert shown_url("http://127.0.0.1:9000/v1") == "http://127.0.0.1:9000/v1"


def test_both_paths_reach_the_upstream_through_the_environments_proxy(monkeypatch):
    """The stream goes through the SDK, whose httpx honours HTTPS_PROXY/HTTP_PROXY and
    NO_PROXY; the whole answer's aiohttp session ignored them, so behind an egress proxy
    every whole answer failed (connection_error) while streams worked."""
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    whole = answer(body=completion("Through the proxy."))
    streamed_body = events(chunk("Streamed through", finish_reason="stop"))
    proxy = Upstream(whole, stream_answer(streamed_body))

    def through_the_proxy(port):
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        return "http://llm.invalid/v1"  # resolves nowhere: only the proxy can answer for it

    async def test(d, obs, log):
        return await d.describe(job()), await streamed(d, job(prompt="streamed"))
    plain, (chunks, stream_result) = run(test, proxy, base_url=through_the_proxy)
    assert (plain.source, plain.description) == ("llm", "Through the proxy.")
    assert (stream_result.source, "".join(chunks)) == ("llm", "Streamed through")
    assert [headers["Host"] for headers in proxy.request_headers] == ["llm.invalid", "llm.invalid"]


@pytest.mark.parametrize("streamed_path", [False, True], ids=["whole", "stream"])
def test_an_answer_that_is_not_utf8_is_billed_by_estimate_on_both_paths(streamed_path):
    """The upstream billed each attempt whose answer we could not read: both paths estimate
    its tokens by one rule, and what USAGE shows is what the metrics count."""
    bad = b'{"id": "c1", "choices": [{"message": {"content": "A cat \xff\xfe"}}]}'
    stream_bad = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"A cat \xff\xfe"}}]}\n\n'
    script = [stream_answer(stream_bad) if streamed_path else answer(body=bad)] * 3

    async def test(d, obs, log):
        if streamed_path:
            return (await streamed(d))[1], obs
        return await d.describe(job()), obs
    result, obs = run(test, Upstream(*script, then=script[0]), max_attempts="3")
    assert result.source == "fallback" and result.usage.attempts == 3
    assert result.usage.tokens_estimated is True and result.usage.prompt_tokens > 0
    assert obs.usages[-1] is result.usage  # the metrics count what USAGE says
