"""The front's field handling, driven by the real openai SDK against
the app, with a pool that records the Triton request each call would send:
every honoured field reaches the request parameters, every other field is
refused by name (400, `param` = the field) before any call, on both paths.
The describe step's side, against a real server: tests/integration/test_openai_front_fields.py."""

import asyncio
import base64
import inspect
import json

import openai
import pytest
from aiohttp.test_utils import TestServer
from classify_describe_server import error_contract as contract
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from openai_front import chat, triton
from openai_front.triton import Answer, front_error

from .test_openai_front import PNG, front_with

MODEL = "classify_and_describe"
PHOTO = "data:image/png;base64," + base64.b64encode(PNG).decode()


def last_user(text="What is it?"):
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": PHOTO}}]}


class RecordingPool:
    """Answers at once and records, per call, the parameters of the Triton
    request built by triton.build_request, read back from its bytes: those
    that go on the wire."""

    def __init__(self):
        self.calls = []

    def _record(self, kind, model, image, prompt, parameters, request_id, metadata):
        request = service_pb2.ModelInferRequest.FromString(
            triton.build_request(model, image, prompt, parameters, request_id))
        sent = {name: getattr(value, value.WhichOneof("parameter_choice")) for name, value in request.parameters.items()}
        self.calls.append({"kind": kind, "model": model, "prompt": prompt, "parameters": sent,
                           "request_id": request.id, "metadata": dict(metadata)})
        return Answer(labels=["espresso"], scores=[0.9], description="A coffee.", source="llm",
                      usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})

    async def infer(self, model, image, prompt=None, parameters=None, request_id="", metadata=()):
        return self._record("infer", model, image, prompt, parameters, request_id, metadata)

    async def stream(self, model, image, prompt=None, parameters=None, request_id="", metadata=()):
        yield self._record("stream", model, image, prompt, parameters, request_id, metadata), "A coffee."

    async def longest_queue_time_s(self, models):
        return 0.0  # no queue time limit: the front keeps its default

    async def close(self):
        pass


def ask(stream, **kwargs):
    """(the SDK's answer or the error it raised, the pool's calls)."""
    pool = RecordingPool()

    async def main():
        async with TestServer(front_with(pool), host="127.0.0.1") as server:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused",
                                          max_retries=0) as client:
                kwargs.setdefault("messages", [last_user()])
                try:
                    answer = await client.chat.completions.create(model=MODEL, stream=stream, **kwargs)
                    return [chunk async for chunk in answer] if stream else answer
                except openai.APIStatusError as error:
                    return error

    return asyncio.run(main()), pool.calls


def sent(stream, **kwargs):
    """The Triton request parameters of one answered request."""
    answer, calls = ask(stream, **kwargs)
    assert not isinstance(answer, Exception), answer
    assert len(calls) == 1 and calls[0]["kind"] == ("stream" if stream else "infer")
    return calls[0]["parameters"]


def refusal(stream, **kwargs):
    """The 400 of one refused request, which made no call."""
    answer, calls = ask(stream, **kwargs)
    assert isinstance(answer, openai.BadRequestError), answer
    assert calls == [], "refused before any call to Triton"
    return answer


# -- honoured -------------------------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_trace_context_goes_to_triton_as_grpc_metadata(stream):
    answer, calls = ask(stream, extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
    assert not isinstance(answer, Exception), answer
    assert calls[0]["metadata"] == {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    answer, calls = ask(stream)
    assert calls[0]["metadata"] == {}, "no trace context made up: Triton samples at its own rate"


@pytest.mark.parametrize("stream", [False, True])
def test_system_messages_and_earlier_turns_reach_the_describe_step_in_order(stream):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "I collect coffee cups."},
        {"role": "assistant", "content": [{"type": "text", "text": "Noted."}, {"type": "text", "text": "Send one."}],
         "refusal": None, "tool_calls": None},  # an SDK message echoed back: null fields count as absent
        {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]},
        last_user("And this one?"),
    ]
    parameters = sent(stream, messages=messages, temperature=0.5, max_tokens=50)
    assert json.loads(parameters.pop("conversation")) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "I collect coffee cups."},
        {"role": "assistant", "content": "Noted.\nSend one."},
        {"role": "system", "content": "Answer in French."},  # developer: OpenAI's newer name for system
    ]
    assert parameters == {"temperature": 0.5, "max_tokens": 50}


@pytest.mark.parametrize("stream", [False, True])
def test_one_user_message_sends_what_it_sent_before(stream):
    answer, calls = ask(stream)
    assert calls[0]["parameters"] == {} and calls[0]["prompt"] == "What is it?"


JSON_SCHEMA = {"type": "json_schema", "json_schema": {
    "name": "cup", "description": "a cup", "strict": True,
    "schema": {"type": "object", "properties": {"full": {"type": "boolean"}}, "required": ["full"],
               "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("response_format", [{"type": "json_object"}, JSON_SCHEMA,
                                             {"type": "json_schema", "json_schema": {"name": "n-1_x"}}])
def test_response_format_reaches_the_describe_step_as_sent(stream, response_format):
    parameters = sent(stream, response_format=response_format)
    assert json.loads(parameters["response_format"]) == response_format and set(parameters) == {"response_format"}


@pytest.mark.parametrize("stream", [False, True])
def test_text_is_the_default_response_format_and_sends_nothing(stream):
    assert sent(stream, response_format={"type": "text"}) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_bookkeeping_fields_and_the_one_possible_value_of_others_are_accepted_and_change_nothing(stream):
    parameters = sent(stream, user="u-1", safety_identifier="s-1", prompt_cache_key="k", metadata={"team": "a"},
                      store=False, n=1, logprobs=False, modalities=["text"],
                      extra_body={"tools": None, "seed": None, "top_p": None})  # null: absent
    assert parameters == {}


def test_the_fields_at_the_limits_are_sent():
    turns = [{"role": "user" if i % 2 else "system", "content": "x" * 1000} for i in range(chat.MAX_CONVERSATION_MESSAGES)]
    turns[0]["content"] = "x" * (chat.MAX_CONVERSATION_CHARS - 1000 * (chat.MAX_CONVERSATION_MESSAGES - 1))
    parameters = sent(False, messages=[*turns, last_user()])
    assert len(json.loads(parameters["conversation"])) == chat.MAX_CONVERSATION_MESSAGES


def test_the_describe_steps_refusals_of_the_new_parameters_name_the_clients_field():
    for field, param in (("conversation", "messages"), ("response_format", "response_format")):
        error = front_error(InferenceServerException(
            "in ensemble 'classify_and_describe', "
            + contract.tagged(contract.INVALID_PARAMETER, f"{field} is too long", field)))
        assert (error.status, error.param) == (400, param)


# -- refused --------------------------------------------------------------------

SDK_FIELDS = set(inspect.signature(openai.resources.chat.completions.Completions.create).parameters) - {
    "self", "model", "messages", "extra_headers", "extra_query", "extra_body", "timeout"}
# What a client would send: a value the field can take (any value is refused), and
# for the fields accepted with one value only, another one.
VALUES = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto", "tool_choice": "auto",
    "parallel_tool_calls": False, "n": 2, "logprobs": True, "top_logprobs": 2, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "logit_bias": {"50256": -100},
    "seed": 7, "store": True, "top_p": 0.9, "stop": ["\n"], "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "service_tier": "auto",
}
REFUSED_FIELDS = sorted((SDK_FIELDS | set(chat.REFUSED) | set(chat.ONLY) | {"frobnicate", "max_token"})
                        - chat.HONOURED - chat.IGNORED)


def test_every_field_the_sdk_sends_is_honoured_ignored_or_refused_by_the_tests_below():
    assert chat.HONOURED - {"model", "messages"} <= SDK_FIELDS
    assert set(chat.REFUSED) | set(chat.ONLY) <= set(REFUSED_FIELDS)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", REFUSED_FIELDS)
def test_every_other_field_is_a_400_naming_it(stream, field):
    value = VALUES.get(field, "x")
    error = refusal(stream, **({field: value} if field in SDK_FIELDS else {"extra_body": {field: value}}))
    assert error.param == field and field in error.message, error.message
    assert error.code == ("unsupported_value" if field in chat.ONLY else "unsupported_parameter")


BAD_MESSAGES = {
    "tool result": ([{"role": "tool", "tool_call_id": "c1", "content": "42"}], "messages[0].role"),
    "function result": ([{"role": "function", "name": "f", "content": "42"}], "messages[0].role"),
    "assistant tool call": ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls"),
    "a participant name": ([{"role": "user", "name": "ann", "content": "hi"}], "messages[0].name"),
    "an image in an earlier turn": ([last_user("first")], "messages[0].content[1]"),
    "an audio part in an earlier turn": ([{"role": "user", "content": [{"type": "input_audio"}]}],
                                         "messages[0].content[0]"),
    "an earlier turn without content": ([{"role": "assistant", "content": None}], "messages[0].content"),
    "an unknown role": ([{"role": "critic", "content": "meh"}], "messages[0].role"),
    "too many earlier messages": ([{"role": "user", "content": "x"}] * (chat.MAX_CONVERSATION_MESSAGES + 1),
                                  "messages"),
    "too much earlier text": ([{"role": "system", "content": "x" * (chat.MAX_CONVERSATION_CHARS + 1)}], "messages"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", BAD_MESSAGES, ids=list(BAD_MESSAGES))
def test_messages_the_pipeline_cannot_honour_are_400_naming_the_part(stream, case):
    earlier, param = BAD_MESSAGES[case]
    assert refusal(stream, messages=[*earlier, last_user()]).param == param


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("after", [{"role": "assistant", "content": "It is"}, {"role": "system", "content": "Be brief."}])
def test_a_message_after_the_last_user_message_is_refused_not_dropped(stream, after):
    assert refusal(stream, messages=[last_user(), after]).param == "messages[1]"


@pytest.mark.parametrize("stream", [False, True])
def test_more_than_one_image_in_the_last_user_message_is_refused(stream):
    message = last_user()
    message["content"].append(message["content"][1])
    error = refusal(stream, messages=[message])
    assert error.param == "messages[0].content" and "2 images" in error.message


BAD_FORMATS = {
    "not an object": ("json", "response_format"),
    "no type": ({}, "response_format.type"),
    "an unknown type": ({"type": "xml"}, "response_format.type"),
    "json_object with a schema": ({"type": "json_object", "json_schema": {"name": "x"}}, "response_format.json_schema"),
    "json_schema without its object": ({"type": "json_schema"}, "response_format.json_schema"),
    "json_schema without a name": ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    "a name with a space": ({"type": "json_schema", "json_schema": {"name": "a b"}}, "response_format.json_schema.name"),
    "a schema that is no object": ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}},
                                   "response_format.json_schema.schema"),
    "strict not a bool": ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}},
                          "response_format.json_schema.strict"),
    "an unknown key": ({"type": "json_schema", "json_schema": {"name": "a", "schemas": {}}},
                       "response_format.json_schema.schemas"),
    "too large": ({"type": "json_schema", "json_schema": {"name": "a", "description": "x" * chat.MAX_CONVERSATION_CHARS}},
                  "response_format"),
    "a lone surrogate": ({"type": "json_schema", "json_schema": {"name": "a", "description": "\ud800"}},
                         "response_format"),
}


@pytest.mark.parametrize("case", BAD_FORMATS, ids=list(BAD_FORMATS))
def test_a_response_format_of_the_wrong_shape_is_400_naming_the_part(case):
    value, param = BAD_FORMATS[case]
    payload = {"model": MODEL, "messages": [last_user()], "response_format": value}
    with pytest.raises(chat.FrontError) as error:
        chat.parse(payload, 10_000)
    assert (error.value.status, error.value.param) == (400, param), error.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_response_format_is_refused_through_the_sdk_too(stream):
    assert refusal(stream, response_format={"type": "xml"}).param == "response_format.type"


def test_unknown_stream_options_are_refused_by_name():
    error = refusal(True, stream_options={"include_usage": True, "include_obfuscation": True})
    assert error.param == "stream_options.include_obfuscation"
