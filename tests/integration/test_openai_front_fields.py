"""The front's honoured fields reach the LLM: the client's system
messages and earlier turns, after the project's own system prompt, and its
response_format, on both paths, seen in the bodies the fake upstream
recorded. These need the describe step's side of the contract (the request
parameters `conversation` and `response_format`); the front's own side and
its refusals: tests/unit/test_openai_front_fields.py and test_openai_front.py."""

import json
import uuid

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from openai_front.triton import front_error

from .test_openai_front import MODEL, data_uri, user_message, wait_healthy

EARLIER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "I collect coffee cups."},
    {"role": "assistant", "content": [{"type": "text", "text": "Noted."}]},
    {"role": "developer", "content": "Answer in French."},
]
SENT_EARLIER = [  # as the LLM gets them: text, developer as system
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "I collect coffee cups."},
    {"role": "assistant", "content": "Noted."},
    {"role": "system", "content": "Answer in French."},
]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {
    "name": "cup", "strict": True,
    "schema": {"type": "object", "properties": {"full": {"type": "boolean"}}, "required": ["full"],
               "additionalProperties": False}}}


@pytest.fixture(scope="module")
def sdk(triton):
    wait_healthy(triton.openai_base_url)
    with openai.OpenAI(base_url=triton.openai_base_url, api_key="unused", max_retries=0) as client:
        yield client


def unique(text):
    return f"{text} ({uuid.uuid4().hex[:8]})"  # no cached answer


def text_of(content):
    """A message's text, whether the describe step sent a string or parts (the photo beside it)."""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content if part.get("type") == "text")


def ask(sdk, photos, stream, messages_before=(), **fields):
    """The upstream body of one answered request."""
    prompt = unique("Is it full?")
    messages = [*messages_before, *user_message(data_uri(photos["coffee"]), prompt)]
    answer = sdk.chat.completions.create(model=MODEL, messages=messages, stream=stream, **fields)
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream \
        else answer.choices[0].message.content
    assert text
    return prompt


def last_body(llm, prompt):
    bodies = [b for b in llm.admin("stats")["bodies"] if prompt in text_of(b["messages"][-1]["content"])]
    assert bodies, f"no upstream request carried {prompt!r}"
    return bodies[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_system_messages_and_earlier_turns_reach_the_llm_after_the_projects_own_system_prompt(
        sdk, photos, llm, stream):
    prompt = ask(sdk, photos, stream, EARLIER)
    messages = last_body(llm, prompt)["messages"]
    assert messages[0]["role"] == "system" and messages[0]["content"] != "You are terse.", "the project's own first"
    assert [{"role": m["role"], "content": text_of(m["content"])} for m in messages[1:-1]] == SENT_EARLIER
    assert messages[-1]["role"] == "user" and prompt in text_of(messages[-1]["content"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("response_format", [{"type": "json_object"}, JSON_SCHEMA], ids=["json_object", "json_schema"])
def test_response_format_reaches_the_llm_as_sent(sdk, photos, llm, stream, response_format):
    prompt = ask(sdk, photos, stream, response_format=response_format)
    assert last_body(llm, prompt)["response_format"] == response_format


@pytest.mark.parametrize("stream", [False, True])
def test_without_them_the_llm_gets_no_response_format_and_only_the_project_system_prompt(sdk, photos, llm, stream):
    body = last_body(llm, ask(sdk, photos, stream, response_format={"type": "text"}))
    assert "response_format" not in body and [m["role"] for m in body["messages"]] == ["system", "user"]


def test_the_answer_cache_tells_apart_requests_that_differ_only_in_these_fields(sdk, photos, llm):
    """Same photo, same question: a different conversation or response_format is a new LLM call."""
    prompt = unique("Is it full?")
    messages = user_message(data_uri(photos["coffee"]), prompt)
    variants = [{}, {"response_format": {"type": "json_object"}}, {"response_format": JSON_SCHEMA},
                {"messages_before": EARLIER[:1]}, {"messages_before": EARLIER}]
    for variant in variants:
        before = variant.pop("messages_before", [])
        sdk.chat.completions.create(model=MODEL, messages=[*before, *messages], **variant)
    calls = [b for b in llm.admin("stats")["bodies"] if prompt in text_of(b["messages"][-1]["content"])]
    assert len(calls) == len(variants), "an answer for other fields was served from the cache"


@pytest.mark.parametrize("parameter, value, param", [
    ("conversation", [{"role": "user", "content": "x"}] * 33, "messages"),
    ("conversation", [{"role": "system", "content": "x" * 32_001}], "messages"),
    ("conversation", [{"role": "tool", "content": "x"}], "messages"),
    ("response_format", {"type": "xml"}, "response_format"),
], ids=["33 messages", "32001 characters", "a tool role", "an unknown type"])
def test_the_describe_step_bounds_them_itself_and_the_front_names_the_clients_field(
        triton, photos, parameter, value, param):
    """Sent straight to the ensemble over gRPC (the front would refuse them first):
    the backend's refusal carries the contract's field, which the front maps."""
    tensor = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[photos["coffee"]]], dtype=object))
    with grpcclient.InferenceServerClient(triton.grpc_url) as client:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(MODEL, [tensor], parameters={parameter: json.dumps(value)})
    assert "INVALID_ARGUMENT" in str(refused.value.status())
    mapped = front_error(refused.value)
    assert (mapped.status, mapped.param) == (400, param), mapped.message
