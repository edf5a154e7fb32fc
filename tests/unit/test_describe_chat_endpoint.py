"""chat_endpoint.ChatEndpoint: the whole answer over aiohttp directly must be
what the openai SDK's own post() gives, on every way the upstream answers:
the same parsed answer and usage, the same headers sent, and for every fault
the same exception type, message and Failure (reason, retryable, Retry-After)
from Describer.classify_failure. Each case runs both paths against the fake
upstream (tools/fake_openai) over real HTTP on 127.0.0.1."""

import asyncio

import openai
import pytest
from classify_describe_server.describer import Describer, make_client, response_bytes_limit
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import parse_settings
from openai.types.chat import ChatCompletion

from tools.fake_openai import FakeOpenAI

KEY = "sk-unit-DO-NOT-LEAK-chat-endpoint"
BODY = {"model": "gpt-4o-mini", "max_tokens": 64, "temperature": 0.2,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it? (tabby 0.7)"},
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ", "detail": "low"}}]}]}
OPTIONS = {"timeout": 1.0, "headers": {"X-Request-ID": "req-chat-endpoint-1"}}


def both_paths(mode, **mode_args):
    """[(path, the answer or the exception, the Failure or None, what the fake saw)] for the
    endpoint's own path and the SDK's post(), the fake in `mode` for each."""
    async def main():
        fake = FakeOpenAI(port=0)
        await fake.start()
        settings = parse_settings({"base_url": fake.base_url, "timeout_s": "1"}, {})
        endpoint = make_client(settings, KEY)
        describer = Describer(settings, endpoint, Scrubber(KEY))
        results = []
        try:
            for name, post in (("endpoint", endpoint.post), ("sdk", endpoint.sdk.post)):
                fake.set_mode(mode, **mode_args)
                try:
                    answer = await asyncio.wait_for(
                        post("/chat/completions", cast_to=ChatCompletion, options=OPTIONS, body=BODY), 5)
                    failure = None
                except Exception as error:  # noqa: BLE001 - what each path raises is the point
                    answer, failure = error, describer.classify_failure(error)
                await asyncio.sleep(0.05)  # the fake's own bookkeeping of a dropped call
                stats = fake.stats
                seen = {"authorization": stats["last_authorization"], "request_id": stats["request_ids"][-1]}
                results.append((name, answer, failure, seen))
                fake._reset()
        finally:
            await describer.aclose()
            await fake.stop()
        return results
    return asyncio.run(main())


def test_an_answer_reads_as_the_sdks_and_the_same_headers_are_sent():
    (_, ours, _, seen_ours), (_, sdks, _, seen_sdk) = both_paths("ok")
    assert ours.choices[0].message.content == sdks.choices[0].message.content
    assert ours.choices[0].message.content.startswith("Fake answer #1")
    assert ours.choices[0].finish_reason == sdks.choices[0].finish_reason == "stop"
    assert (ours.usage.prompt_tokens, ours.usage.completion_tokens) == (sdks.usage.prompt_tokens,
                                                                         sdks.usage.completion_tokens)
    assert seen_ours == seen_sdk == {"authorization": f"Bearer {KEY}", "request_id": "req-chat-endpoint-1"}


@pytest.mark.parametrize("mode, args, error_type, reason", [
    ("429", {"retry_after": 3}, openai.RateLimitError, "rate_limited_http_429"),
    ("500", {}, openai.InternalServerError, "upstream_error_http_500"),
    ("401", {}, openai.AuthenticationError, "authentication_failed_http_401"),
    ("no_vision", {}, openai.BadRequestError, "image_refused_by_upstream"),
    ("malformed", {}, None, "malformed_response"),
    # The SDK's aiohttp transport calls a dropped connection a timeout (APITimeoutError);
    # here it is an APIConnectionError: the Failure is the same.
    ("drop", {}, None, "connection_error"),
    ("hang", {}, openai.APITimeoutError, "timeout"),
    ("huge", {"huge_chars": 4 * response_bytes_limit(parse_settings({}, {}))}, None, "answer_too_long"),
])
def test_every_fault_fails_as_through_the_sdk(mode, args, error_type, reason):
    (_, ours, ours_failure, _), (_, sdks, sdk_failure, _) = both_paths(mode, **args)
    assert isinstance(ours, Exception) and isinstance(sdks, Exception), (ours, sdks)
    assert ours_failure == sdk_failure, (ours, sdks)
    if reason is not None:
        assert ours_failure.reason == reason
    if error_type is not None:
        assert type(ours) is type(sdks) is error_type
        assert str(ours) == str(sdks)
    if isinstance(ours, openai.APIStatusError):
        assert ours.status_code == sdks.status_code and ours.body == sdks.body
    if mode == "429":
        assert ours_failure.retry_after_s == 3
    if mode == "drop":
        assert type(ours) is openai.APIConnectionError


def test_a_refused_connection_fails_as_through_the_sdk():
    """Nothing listens: both paths raise APIConnectionError, classified connection_error."""
    async def main():
        settings = parse_settings({"base_url": "http://127.0.0.1:9/v1", "timeout_s": "1"}, {})
        endpoint = make_client(settings, KEY)
        describer = Describer(settings, endpoint, Scrubber(KEY))
        failures = []
        try:
            for post in (endpoint.post, endpoint.sdk.post):
                with pytest.raises(openai.APIConnectionError) as error:
                    await post("/chat/completions", cast_to=ChatCompletion, options=OPTIONS, body=BODY)
                failures.append(describer.classify_failure(error.value))
        finally:
            await describer.aclose()
        return failures
    ours, sdks = asyncio.run(main())
    assert ours == sdks and ours.reason == "connection_error"
