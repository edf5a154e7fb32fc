"""What the LLM is shown: the photo's view as an image part, the
labels as grounding, the client's conversation and response_format; vision
off/on/auto with the text-only retry of a model that refuses images; the
answer cache keyed on the photo; the view never in a log line or an error.
Over real HTTP against the fake upstream (tools/fake_openai)."""

import io
import json

import pytest
from classify_describe_server.describer import Job
from classify_describe_server.dialogue import read_conversation, read_response_format
from classify_describe_server.settings import InvalidOverride, Overrides, Settings, parse_settings
from PIL import Image
from test_describe_describer import run

from tools.fake_openai.server import IMAGE_TOKENS


def jpeg(color, size=(64, 48)):
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "JPEG", quality=90)
    return out.getvalue()


RED, BLUE = jpeg((220, 10, 10)), jpeg((10, 10, 220))


def job(image=RED, prompt="What breed is this cat?", model="gpt-4o-mini", **kw):
    return Job(("tabby, tabby cat", "tiger cat"), (0.7, 0.2), prompt, Overrides(model, 0.2, 64, 2.0),
               image=image, **kw)


def test_the_view_goes_as_an_image_part_with_the_labels_as_grounding():
    async def test(fake, d, obs, log):
        r = await d.describe(job())
        assert r.source == "llm" and r.usage.vision is True and r.usage.vision_skipped_reason is None
        [image] = fake.stats["images"][-1]
        assert (image["format"], image["width"], image["height"], image["detail"]) == ("JPEG", 64, 48, "low")
        assert image["mime"] == "image/jpeg" and image["bytes"] == len(RED)
        user = fake.stats["bodies"][-1]["messages"][-1]
        assert user["role"] == "user" and [p["type"] for p in user["content"]] == ["text", "image_url"]
        text = user["content"][0]["text"]
        assert "What breed is this cat?" in text and "ImageNet image classifier" in text and "tabby" in text
        # Image tokens are in the upstream's prompt_tokens, so in USAGE and the cost.
        assert r.usage.prompt_tokens > IMAGE_TOKENS["low"]
        assert r.usage.cost_usd == pytest.approx(r.usage.prompt_tokens * 0.15e-6 + r.usage.completion_tokens * 0.6e-6)
    run(test)


def test_detail_is_a_setting():
    async def test(fake, d, obs, log):
        await d.describe(job())
        assert fake.stats["images"][-1][0]["detail"] == "high"
    run(test, vision_detail="high")


def test_a_job_without_a_view_is_text_only_with_the_reason():
    async def test(fake, d, obs, log):
        r = await d.describe(job(image=None, vision_skipped="off"))
        assert fake.stats["images"][-1] == [] and isinstance(fake.stats["bodies"][-1]["messages"][-1]["content"], str)
        assert r.usage.vision is False and r.usage.vision_skipped_reason == "off"
    run(test)


def test_auto_retries_text_only_at_once_and_remembers_the_refusal():
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision")
        r = await d.describe(job(prompt="first"))
        assert r.source == "llm" and r.usage.vision is False and r.usage.vision_skipped_reason == "refused_by_upstream"
        assert r.usage.attempts == 2 and fake.stats["requests"] == 2
        assert [len(i) for i in fake.stats["images"]] == [1, 0]
        # Remembered: the next request goes text-only straight away.
        r = await d.describe(job(prompt="second"))
        assert r.usage.attempts == 1 and r.usage.vision_skipped_reason == "refused_by_upstream"
        assert fake.stats["requests"] == 3 and fake.stats["images"][-1] == []
        # Another model is not affected.
        fake.set_mode("ok")
        r = await d.describe(job(prompt="third", model="gpt-4o-mini-2"))
        assert r.usage.vision is True
        assert any("refused image input" in line for line in log.lines)
    run(test, vision="auto", allowed_models="gpt-4o-mini*")


# How real servers refuse list content or images, besides OpenAI's words.
WORDINGS = {
    "llama.cpp server": dict(refusal_status=500, refusal_message='can only concatenate str (not "list") to str',
                             refuse_lists=True),
    "unsupported part": dict(refusal_status=500, refusal_message='Unsupported content part type: "image_url"'),
    "groq": dict(refusal_status=400, refusal_message="'messages.1.content' : value must be a string", refuse_lists=True),
    "pydantic": dict(refusal_status=422, refusal_message="1 validation error: Input should be a valid string"),
}


@pytest.mark.parametrize("wording", WORDINGS, ids=list(WORDINGS))
def test_auto_recovers_from_an_upstream_that_cannot_take_the_photo_however_it_says_so(wording):
    """Each image request is answered text-only at once; the model is asked text-only from the
    second such answer on (at once where it said so in words we know), every attempt is counted,
    and no circuit opens: text-only traffic goes on."""
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision", **WORDINGS[wording])
        first = [await d.describe(job(prompt=f"photo {i}")) for i in range(2)]
        for r in first:
            assert r.source == "llm" and r.usage.vision is False and r.usage.vision_skipped_reason == "refused_by_upstream"
        assert [r.usage.attempts for r in first][0] == 2
        r = await d.describe(job(prompt="remembered"))
        assert r.source == "llm" and r.usage.attempts == 1 and fake.stats["images"][-1] == []
        assert any(reason in ("image_refused_by_upstream", "image_request_failed") for reason in obs.attempts)
        assert d._breaker("gpt-4o-mini").state == "closed"
        text = await d.describe(job(image=None, prompt="text only", vision_skipped="off"))
        assert text.source == "llm", (text.usage.fallback_reason, obs.attempts)
    run(test, vision="auto", circuit_failure_threshold="1")


def test_auto_recovers_from_a_stream_with_no_text_to_the_photo():
    """llama-cpp-python's server streams a 200 and then nothing when its template fails on the
    image part: answered text-only at once, not retried with the photo."""
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision", refusal_status=200, refuse_lists=True)
        chunks = []
        r = await d.describe(job(), emit=chunks.append)
        assert r.source == "llm" and r.usage.attempts == 2 and r.usage.vision_skipped_reason == "refused_by_upstream"
        assert [len(i) for i in fake.stats["images"]] == [1, 0] and obs.attempts[0] == "image_request_failed"
        assert "".join(chunks) == r.description
    run(test, vision="auto")


@pytest.mark.parametrize("mode", [{"mode": "500", "count": 1}, {"mode": "malformed", "count": 1}], ids=["500", "malformed"])
def test_an_upstream_glitch_on_an_image_request_is_retried_with_the_photo_and_never_turns_vision_off(mode):
    """A 500 that says nothing of the content, or an answer that is not one, is the upstream's
    own trouble: retried as such, with the photo, and no number of them remembers text-only."""
    async def test(fake, d, obs, log):
        for i in range(3):
            fake.set_mode(**mode)
            r = await d.describe(job(prompt=f"glitch {i}"))
            assert r.source == "llm" and r.usage.vision is True and r.usage.attempts == 2, r.usage
        assert "image_request_failed" not in obs.attempts and all(len(i) == 1 for i in fake.stats["images"])
    run(test, vision="auto", backoff_base_s="0.01")


def test_one_photo_the_upstream_cannot_use_does_not_turn_vision_off():
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision", count=1, refusal_status=400, refusal_message="Invalid image: exceeds max size")
        r = await d.describe(job(prompt="a"))
        assert r.source == "llm" and r.usage.vision is False and r.usage.attempts == 2
        assert (await d.describe(job(prompt="b"))).usage.vision is True
    run(test, vision="auto")


@pytest.mark.parametrize("status", [401, 403, 404, 429, 502, 503, 504])
def test_a_failure_that_is_not_the_photos_is_not_retried_text_only(status):
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision", refusal_status=status, refusal_message="nope")
        r = await d.describe(job())
        assert r.source == "fallback" and fake.stats["images"][-1] != [] and all(fake.stats["images"])
    run(test, vision="auto", max_attempts="1")


def test_the_refusal_is_forgotten_after_the_memory():
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision", count=1)
        assert (await d.describe(job(prompt="a"))).usage.vision is False
        assert (await d.describe(job(prompt="b"))).usage.vision is True
    run(test, vision_refusal_memory_s="0")


def test_on_does_not_retry_text_only():
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision")
        r = await d.describe(job())
        assert r.source == "fallback" and r.usage.fallback_reason == "image_refused_by_upstream"
        assert r.usage.vision is False and fake.stats["requests"] == 1
    run(test, vision="on")


def test_two_photos_with_equal_labels_never_share_an_answer():
    async def test(fake, d, obs, log):
        red = await d.describe(job(RED))
        blue = await d.describe(job(BLUE))
        again = await d.describe(job(RED))
        assert not blue.usage.cached and blue.description != red.description
        assert again.usage.cached and again.description == red.description
        assert again.usage.vision is True
        assert fake.stats["requests"] == 2
    run(test)


def test_conversation_and_response_format_reach_the_upstream_and_the_cache_key():
    conversation = (("system", "Answer in French."), ("user", "Hello"), ("assistant", "Bonjour"))
    response_format = {"type": "json_object"}

    async def test(fake, d, obs, log):
        r = await d.describe(job(conversation=conversation, response_format=response_format))
        body = fake.stats["bodies"][-1]
        assert [m["role"] for m in body["messages"]] == ["system", "system", "user", "assistant", "user"]
        assert body["messages"][0]["content"] == Settings().system_prompt  # the project's own first
        assert [m["content"] for m in body["messages"][1:4]] == ["Answer in French.", "Hello", "Bonjour"]
        assert body["response_format"] == response_format and json.loads(r.description)["description"]
        # Each changes the key: no answer made for another conversation or format is reused.
        plain = await d.describe(job())
        other = await d.describe(job(conversation=conversation))
        assert not plain.usage.cached and not other.usage.cached and fake.stats["requests"] == 3
        assert "response_format" not in fake.stats["bodies"][-1]
    run(test)


def test_the_view_never_reaches_the_log_or_usage():
    async def test(fake, d, obs, log):
        fake.set_mode("no_vision")
        r = await d.describe(job())
        fake.set_mode("500")
        await d.describe(job(prompt="x", model="gpt-4o-mini-3"))
        text = "\n".join(log.lines) + r.usage.to_json() + repr(job())
        assert "base64" not in text and "data:image" not in text
        assert str(RED[:8]) not in text
    run(test, allowed_models="gpt-4o-mini*")


def params(**values):
    return {k: json.dumps(v) if not isinstance(v, str) else v for k, v in values.items()}


@pytest.mark.parametrize("value, words", [
    ("not json", "not valid JSON"),
    ({"role": "user"}, "JSON list"),
    ([{"role": "tool", "content": "x"}], "role is one of"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "must be text"),
    ([{"role": "user", "content": "x"}] * 33, "max_conversation_messages=32"),
    ([{"role": "user", "content": "x" * 16001}] * 2, "max_conversation_chars=32000"),
])
def test_a_conversation_out_of_bounds_is_refused_naming_the_field(value, words):
    with pytest.raises(InvalidOverride) as error:
        read_conversation(params(conversation=value), Settings())
    assert error.value.field == "conversation" and words in str(error.value)


@pytest.mark.parametrize("value, words", [
    ("{", "not valid JSON"),
    ({"type": "xml"}, "type is one of"),
    ({"type": "json_schema"}, "json_schema: {name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"d": "x" * 32001}}}, "max_conversation_chars"),
])
def test_a_bad_response_format_is_refused_naming_the_field(value, words):
    with pytest.raises(InvalidOverride) as error:
        read_response_format(params(response_format=value), Settings())
    assert error.value.field == "response_format" and words in str(error.value)


def test_valid_conversation_and_response_format_are_read():
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    schema = {"type": "json_schema", "json_schema": {"name": "d", "schema": {"type": "object"}}}
    read = params(conversation=conversation, response_format=schema)
    assert read_conversation(read, Settings()) == (("system", "Be brief."), ("user", "Hi"))
    assert read_response_format(read, Settings()) == schema
    assert read_conversation({}, Settings()) == () and read_response_format({}, Settings()) is None


@pytest.mark.parametrize("name, value", [("vision", "sometimes"), ("vision_detail", "medium")])
def test_vision_settings_are_checked_at_load(name, value):
    with pytest.raises(ValueError, match=name):
        parse_settings({name: value}, {})


def test_vision_is_auto_by_default_and_llm_vision_sets_it():
    assert (Settings().vision, Settings().vision_detail) == ("auto", "low")
    assert parse_settings({}, {"LLM_VISION": "OFF"}).vision == "off"




def test_the_scrubber_masks_data_uris_and_long_base64():
    import base64

    from classify_describe_server.scrubbing import Scrubber

    encoded = base64.b64encode(RED).decode()
    scrub = Scrubber()
    text = scrub(f'400: invalid content {{"url": "data:image/jpeg;base64,{encoded}"}} and {encoded}')
    assert encoded not in text and encoded[:40] not in text and "data:image/jpeg;base64,***" in text
    assert scrub("a short token YWJj stays") == "a short token YWJj stays"
