"""describer.py's pure parts at their edges: what the answer cache keys on,
what counts as an answer, the search for a cause in a chain of exceptions,
and warnings at most once per reason per interval (found by `make mutants`,
docs/mutation.md)."""

import asyncio
from types import SimpleNamespace

import pytest
from classify_describe_server.describer import Describer, Job, WholeAnswer, _answer_text, _caused_by
from classify_describe_server.resilience import MalformedResponse
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import Overrides, parse_settings

SETTINGS = parse_settings({}, {})


def job(temperature=0.2, max_tokens=256, image=None, model="gpt-4o-mini"):
    return Job(("tabby",), (0.9,), "q", Overrides(model, temperature, max_tokens, 15.0), image=image)


def test_the_cache_keys_on_everything_that_changes_the_answer():
    key = job().cache_key(SETTINGS)
    assert job().cache_key(SETTINGS) == key
    for other in (job(temperature=0.7), job(max_tokens=64), job(model="gpt-4o"), job(image=b"photo")):
        assert other.cache_key(SETTINGS) != key
    assert job(image=b"photo").cache_key(SETTINGS) != job(image=b"other photo").cache_key(SETTINGS)


def response(content):
    return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=content))])


def test_an_answer_is_non_blank_text_stripped():
    assert _answer_text(response("  A cat.\n")) == "A cat."
    for content, message in ((None, "empty answer"), ("  \n", "empty answer"), (3, "empty answer")):
        with pytest.raises(MalformedResponse) as info:
            _answer_text(response(content))
        assert str(info.value) == message
    for odd in (SimpleNamespace(choices=[]), SimpleNamespace(), SimpleNamespace(choices=None)):
        with pytest.raises(MalformedResponse) as info:
            _answer_text(odd)
        assert str(info.value) == "no choices[0].message.content in the response"


def test_a_cause_is_found_through_cause_and_context_and_a_loop_ends():
    def chain():
        try:
            try:
                raise TimeoutError("deep")
            except TimeoutError as inner:
                raise ValueError("middle") from inner
        except ValueError:
            raise RuntimeError("top")  # noqa: B904 - the context, not the cause, on purpose

    with pytest.raises(RuntimeError) as info:
        chain()
    assert _caused_by(info.value, TimeoutError) and not _caused_by(info.value, KeyError)
    looped = ValueError("a")
    looped.__context__ = KeyError("b")
    looped.__context__.__context__ = looped
    assert not _caused_by(looped, TimeoutError)
    assert _caused_by(looped, KeyError)


class Log:
    def __init__(self):
        self.lines = []

    def warn(self, message, request_id=None):
        self.lines.append(message)


class Clock:
    def __init__(self):
        self.now = 5.0  # a monotonic clock may be small (a machine just booted)

    def __call__(self):
        return self.now


def test_a_warning_goes_out_at_most_once_per_reason_every_ten_seconds():
    log, clock = Log(), Clock()
    describer = Describer(SETTINGS, None, Scrubber([]), log=log, clock=clock)
    describer._warn_rate_limited("a", "a1")
    describer._warn_rate_limited("a", "a2")
    describer._warn_rate_limited("b", "b1")  # another reason has its own interval
    clock.now = 14.5
    describer._warn_rate_limited("a", "a3")
    clock.now = 15.0  # ten seconds after a1
    describer._warn_rate_limited("a", "a4")
    assert log.lines == ["a1", "b1", "a4"]
    quiet = Describer(SETTINGS, None, Scrubber([]), log=None, clock=clock)
    quiet._warn_rate_limited("a", "nobody listens")  # no log: nothing to do, nothing raised


def status_error(status, message, body):
    import httpx2
    import openai

    request = httpx2.Request("POST", "https://llm.example/v1/chat/completions")
    return openai.APIStatusError(message, response=httpx2.Response(status, request=request), body=body)


def test_an_image_refusal_is_not_retried_and_says_nothing_about_the_upstreams_health():
    describer = Describer(SETTINGS, None, Scrubber([]), log=Log())
    # the words are in the body only, or in the message only: either is read
    for message, body in (("Error code: 400", {"error": {"message": "image_url is only supported by certain models"}}),
                          ("this model is not a multimodal model", None)):
        failure = describer.classify_failure(status_error(400, message, body))
        assert (failure.reason, failure.retryable, failure.upstream_fault) == ("image_refused_by_upstream", False, False)
    assert describer.classify_failure(status_error(400, "Error code: 400", {"error": "max_tokens"})).reason == \
        "bad_request_http_400"


def test_every_failure_kind_is_warned_about_with_the_exceptions_type():
    log = Log()
    describer = Describer(SETTINGS, None, Scrubber([]), log=log, clock=Clock())
    describer.classify_failure(ValueError("not a completion"))
    describer.classify_failure(TimeoutError())
    assert log.lines == ["upstream attempt failed (malformed_response): ValueError: not a completion",
                         "upstream attempt failed (timeout): TimeoutError: "]


def test_an_answer_of_exactly_the_longest_kept_is_whole():
    reader = WholeAnswer(SimpleNamespace(max_chars=5))
    assert asyncio.run(reader.read(SimpleNamespace(value=("abcde", "stop")))) == ("abcde", "stop", None)
    text, reason, failure = asyncio.run(reader.read(SimpleNamespace(value=("abcdef", "stop"))))
    assert (text, reason, failure.reason) == ("abcde", "length", "answer_too_long")
