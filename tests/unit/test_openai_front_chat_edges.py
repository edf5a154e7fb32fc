"""openai_front/chat.py at its edges: each refusal's status, param, code and
words exactly as an OpenAI client reads them, each limit at and one past its
bound, and what is accepted (found by `make mutants`, docs/mutation.md)."""

import base64

import pytest

from openai_front import chat
from openai_front.errors import FrontError

URI = "data:image/png;base64," + base64.b64encode(b"img").decode()
IMAGE = {"type": "image_url", "image_url": {"url": URI}}


def body(*earlier, content=None, **fields):
    last = {"role": "user", "content": [IMAGE] if content is None else content}
    return {"model": "m", "messages": [*earlier, last], **fields}


def refusal(payload, max_bytes=100, allowlist=frozenset(), allow_private=False):
    with pytest.raises(FrontError) as info:
        chat.parse(payload, max_bytes, allowlist, allow_private)
    return info.value


NO_TOOLS = "this endpoint describes a photo and calls no tools"
CASES = [
    # (payload, status, param, code, message)
    ([], 400, None, None, "the request body must be a JSON object"),
    (body(model=""), 400, "model", None,
     "'model' is required: a string, e.g. 'classify_and_describe' (GET /v1/models lists them)"),
    (body(stream="yes"), 400, "stream", None, "'stream' must be true or false"),
    (body(stream_options={}), 400, "stream_options", None, "'stream_options' is only allowed when 'stream' is true"),
    (body(stream=True, stream_options="x"), 400, "stream_options", None, "'stream_options' must be an object"),
    (body(stream=True, stream_options={"zeta": 1, "alpha": 2}), 400, "stream_options.alpha", "unsupported_parameter",
     "'stream_options.alpha' is not supported: only include_usage"),
    (body(stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage", None,
     "'stream_options.include_usage' must be true or false"),
    (body(n=2), 400, "n", "unsupported_value", "only n=1 is supported: one image, one description"),
    (body(n=True), 400, "n", "unsupported_value", "only n=1 is supported: one image, one description"),
    (body(logprobs=0), 400, "logprobs", "unsupported_value",
     "only logprobs=false is supported: the pipeline returns no log probabilities"),
    (body(tools=[]), 400, "tools", "unsupported_parameter", f"'tools' is not supported: {NO_TOOLS}"),
    (body(seed=1), 400, "seed", "unsupported_parameter",
     "'seed' is not supported: the describe step passes only temperature and max_tokens to the LLM"),
    (body(**{"x" * 70: 1}), 400, "x" * 60, "unsupported_parameter",
     f"unknown field '{'x' * 60}': this endpoint refuses what it cannot honour (the README lists the fields it takes)"),
    (dict(body(), messages=[]), 400, "messages", None, "'messages' must be a non-empty array"),
    (dict(body(), messages={"role": "user"}), 400, "messages", None, "'messages' must be a non-empty array"),
    (dict(body(), messages=["hi"]), 400, "messages[0]", None, "messages[0] must be an object with a 'role'"),
    (body({"role": 1}), 400, "messages[0]", None, "messages[0] must be an object with a 'role'"),
    (body({"role": "tool", "content": "x"}), 400, "messages[0].role", "unsupported_parameter",
     f"messages[0] has role 'tool': {NO_TOOLS}"),
    (body({"role": "function", "content": "x"}), 400, "messages[0].role", "unsupported_parameter",
     f"messages[0] has role 'function': {NO_TOOLS}"),
    (body({"role": "robot" * 10}), 400, "messages[0].role", None,
     f"messages[0] has role {('robot' * 10)[:40]!r}: only system, developer, user and assistant"),
    (body({"role": "assistant", "content": "x", "tool_calls": [], "name": "n"}), 400, "messages[0].name",
     "unsupported_parameter", "'messages[0].name' is not supported: only 'role' and 'content' reach the LLM"),
    (body({"role": "assistant", "content": "x", "k" * 50: 1}), 400, "messages[0]." + "k" * 40,
     "unsupported_parameter", f"'messages[0].{'k' * 40}' is not supported: only 'role' and 'content' reach the LLM"),
    (body({"role": "assistant", "content": "x", "tool_calls": []}), 400, "messages[0].tool_calls",
     "unsupported_parameter", f"'messages[0].tool_calls' is not supported: {NO_TOOLS}"),
    (body({"role": "assistant", "content": "x", "function_call": {}}), 400, "messages[0].function_call",
     "unsupported_parameter", f"'messages[0].function_call' is not supported: {NO_TOOLS}"),
    (dict(body(), messages=[{"role": "system", "content": "x"}]), 400, "messages", None,
     "no message has role 'user': the last user message carries the image"),
    (dict(body(), messages=[body()["messages"][0], {"role": "assistant", "content": "x"}]), 400, "messages[1]", None,
     "messages[1] comes after the last user message, which carries the photo and must be the last message"),
    (body({"role": "system", "content": 3}), 400, "messages[0].content", None,
     "'content' must be a string or an array of text parts"),
    (body({"role": "system", "content": [{"type": "text", "text": "a"}, IMAGE]}), 400, "messages[0].content[1]",
     "unsupported_parameter", "only the last user message may carry an image (the photo); an earlier message cannot"),
    (body({"role": "system", "content": ["a"]}), 400, "messages[0].content[0]", None,
     "unsupported content part type None in an earlier message: only 'text'"),
    (body({"role": "system", "content": [{"type": "text"}]}), 400, "messages[0].content[0]", None,
     "a text part needs 'text', a string"),
    (body({"role": "system", "content": "\ud800"}), 400, "messages[0].content", None,
     "a text part is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)"),
    (body(content="a photo?"), 400, "messages[0].content", None,
     "the last user message has no image: send its content as an array with one "
     "{'type': 'image_url', 'image_url': {'url': 'data:image/jpeg;base64,...'}} part"),
    (body(content={"type": "text"}), 400, "messages[0].content", None,
     "'content' must be a string or an array of parts"),
    (body(content=[{"type": "image_url", "image_url": {"url": ""}}]), 400, "messages[0].content[0]", None,
     "an image_url part needs 'image_url': {'url': ...}"),
    (body(content=[IMAGE, {"type": "audio"}]), 400, "messages[0].content[1]", None,
     "unsupported content part type 'audio': only 'text' and 'image_url'"),
    (body(content=[{"type": "text", "text": "hi"}]), 400, "messages[0].content", None,
     "the last user message has no image_url part"),
    (body(content=[IMAGE, IMAGE, IMAGE]), 400, "messages[0].content", None,
     "the last user message has 3 images; send one per request"),
    (body(temperature=10**400), 400, "temperature", None, "'temperature' must be a number"),
    (body(max_tokens=2**31), 400, "max_tokens", None, "'max_tokens' must be a positive integer, at most 2147483647"),
    (body(max_completion_tokens=0), 400, "max_completion_tokens", None,
     "'max_completion_tokens' must be a positive integer, at most 2147483647"),
    (body(response_format="json"), 400, "response_format", None, "'response_format' must be an object with a 'type'"),
    (body(response_format={"type": "xml"}), 400, "response_format.type", None,
     "'response_format.type' must be 'text', 'json_object' or 'json_schema'"),
    (body(response_format={"type": "json_object", "json_schema": {}}), 400, "response_format.json_schema", None,
     "'response_format.json_schema' is not part of a json_object response_format"),
    (body(response_format={"type": "json_schema", "json_schema": []}), 400, "response_format.json_schema", None,
     "'response_format.json_schema' must be an object with a 'name' (and a 'schema')"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "a", "extra": 1}}), 400,
     "response_format.json_schema.extra", None, "'response_format.json_schema.extra' is not part of a json_schema"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "a", "k" * 50: 1}}), 400,
     "response_format.json_schema." + "k" * 40, None,
     f"'response_format.json_schema.{'k' * 40}' is not part of a json_schema"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "a" * 65}}), 400,
     "response_format.json_schema.name", None,
     "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "a", "strict": 1}}), 400,
     "response_format.json_schema.strict", None, "'response_format.json_schema.strict' must be true or false"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": []}}), 400,
     "response_format.json_schema.schema", None, "'response_format.json_schema.schema' must be an object"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "a", "description": 1}}), 400,
     "response_format.json_schema.description", None, "'response_format.json_schema.description' must be a string"),
    (body(response_format={"type": "json_schema", "json_schema": {"name": "a", "description": "\ud800"}}), 400,
     "response_format", None, "'response_format' is not valid Unicode: it holds a lone surrogate"),
]


@pytest.mark.parametrize("payload, status, param, code, message", CASES)
def test_each_refusal_names_its_field_exactly(payload, status, param, code, message):
    error = refusal(payload)
    assert (error.status, error.param, error.code, error.message) == (status, param, code, message)


def test_fields_sent_as_null_or_ignored_change_nothing():
    plain = chat.parse(body(), 100)
    assert chat.parse(body(tools=None, stream=None, n=1, logprobs=False, modalities=["text"], store=False,
                           user="u", metadata={"a": "b"}, temperature=None, max_tokens=None), 100) == plain
    assert plain.stream is False and plain.include_usage is False and plain.parameters == {}
    streamed = chat.parse(body(stream=True, stream_options={"include_usage": None, "other": None}), 100)
    assert streamed.stream is True and streamed.include_usage is False
    assert chat.parse(body(stream=True, stream_options={"include_usage": True}), 100).include_usage is True
    assert chat.parse(body(stream=True, stream_options={}), 100).include_usage is False


def test_the_earlier_messages_become_the_conversation():
    parsed = chat.parse(body({"role": "developer", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": "ok", "name": None}), 100)
    assert parsed.conversation == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                                   {"role": "assistant", "content": "ok"})


def test_the_conversation_limits_are_inclusive():
    most = [{"role": "user", "content": "x"}] * chat.MAX_CONVERSATION_MESSAGES
    assert len(chat.parse(body(*most), 100).conversation) == chat.MAX_CONVERSATION_MESSAGES
    error = refusal(body(*most, {"role": "user", "content": "x"}))
    assert (error.param, error.message) == ("messages", "34 messages, more than the 33 allowed: at most 32 before "
                                                        "the last user message")
    longest = {"role": "user", "content": "x" * chat.MAX_CONVERSATION_CHARS}
    assert chat.parse(body(longest), 100).conversation[0]["content"] == longest["content"]
    error = refusal(body(longest, {"role": "user", "content": "y"}))
    assert (error.param, error.message) == ("messages", "the messages before the last user message hold 32001 "
                                                        "characters, more than the 32000 allowed")


def test_the_question_is_bounded_as_the_describe_step_bounds_it_counted_after_joining_its_parts():
    longest = "x" * chat.MAX_PROMPT_CHARS
    assert chat.parse(body(content=[{"type": "text", "text": f"  {longest} "}, IMAGE]), 100).prompt == longest
    half = "y" * (chat.MAX_PROMPT_CHARS // 2)
    error = refusal(body(content=[{"type": "text", "text": half}, IMAGE, {"type": "text", "text": half}]))
    assert (error.param, error.message) == ("messages[0].content", "the question (the text parts of the last user "
                                                                   "message) has 2001 characters, more than the "
                                                                   "2000 allowed")


def test_the_prompt_is_the_non_blank_text_parts_joined():
    text = [{"type": "text", "text": " "}, {"type": "text", "text": " a "}, IMAGE, {"type": "text", "text": "b"}]
    assert chat.parse(body(content=text), 100).prompt == "a \nb"
    assert chat.parse(body(content=[{"type": "text", "text": "  "}, IMAGE]), 100).prompt is None
    legacy = chat.parse(body(content=[{"type": "image_url", "image_url": URI}]), 100)
    assert legacy.image == b"img" and legacy.image_url is None


def test_sampling_values_pass_as_numbers_and_max_completion_tokens_wins():
    parsed = chat.parse(body(temperature=0, max_tokens=2**31 - 1, max_completion_tokens=1), 100)
    assert parsed.parameters == {"temperature": 0.0, "max_tokens": 1}
    assert isinstance(parsed.parameters["temperature"], float)
    assert chat.parse(body(max_tokens=7), 100).parameters == {"max_tokens": 7}


def test_response_formats_that_pass():
    schema = {"type": "json_schema", "json_schema": {"name": "A-b_9", "schema": {}, "strict": True, "description": "d"}}
    assert chat.parse(body(response_format=schema), 100).response_format == schema
    assert chat.parse(body(response_format={"type": "text"}), 100).response_format is None
    big = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"x": "y" * chat.MAX_CONVERSATION_CHARS}}}
    error = refusal(body(response_format=big))
    assert error.param == "response_format" and error.message.startswith("'response_format' is ")
    assert error.message.endswith(" characters of JSON, more than the 32000 allowed")


@pytest.mark.parametrize("uri, image", [
    ("data:;BASE64," + base64.b64encode(b"abc").decode(), b"abc"),
    ("data:IMAGE/PNG; base64 ," + base64.b64encode(b"abc").decode(), b"abc"),
    ("data:image/png;charset=x,%41B", b"AB"),
    ("data:;base64," + base64.b64encode(b"z" * 100).decode(), b"z" * 100),
])
def test_data_uris_that_are_read(uri, image):
    assert chat.decode_data_uri(uri, 100) == image


def test_data_uri_refusals_name_their_param_and_sizes():
    error = refusal(body(content=[{"type": "image_url", "image_url": {"url": "data:;base64," + base64.b64encode(
        b"z" * 101).decode()}}]))
    assert (error.status, error.param, error.code, error.message) == (
        413, "messages[0].content", "image_too_large", "the image is 101 bytes, more than the 100 allowed")
    # the encoded text alone is past the limit: refused before decoding
    with pytest.raises(FrontError) as info:
        chat.decode_data_uri("data:;base64," + "A" * (4 * 34 + 5), 100, param="p")
    assert (info.value.status, info.value.param, info.value.message) == (
        413, "p", "the image is more than the 100 bytes allowed")
    for uri, message in (("data:image/png", "the image's data: URI has no ',' before its data"),
                         ("data:text/plain,x", "the data: URI's media type is 'text/plain', not an image"),
                         ("data:;base64,@@@@", "the image's data: URI is not valid base64"),
                         ("data:image/png,", "the image's data: URI holds no data")):
        with pytest.raises(FrontError) as info:
            chat.decode_data_uri(uri, 100, param="p")
        assert (info.value.status, info.value.param, info.value.message) == (400, "p", message)


@pytest.mark.parametrize("url, allowlist", [
    ("https://images.example.com:443/x", {"images.example.com"}),
    ("http://images.example.com/x", {"images.example.com"}),
    ("https://images.example.com/x", {"images.example.com:443"}),
    ("http://[2606:4700::1111]:8080/x", {"[2606:4700::1111]:8080"}),
])
def test_allowlisted_urls_that_pass(url, allowlist):
    assert chat.parse(body(content=[{"type": "image_url", "image_url": {"url": url}}]), 100,
                      frozenset(allowlist)).image_url == url


def test_url_refusals_say_why():
    def refused_url(url, allowlist=frozenset({"images.example.com"}), allow_private=False):
        return refusal(body(content=[{"type": "image_url", "image_url": {"url": url}}]), allowlist=allowlist,
                       allow_private=allow_private)

    error = refused_url("http://images.example.com:99999/x")
    assert (error.param, error.message) == ("messages[0].content", "the image URL is malformed")
    for url in ("ftp://images.example.com/x", "http:///x"):  # no scheme of ours, or no host
        error = refused_url(url, allowlist=frozenset({"images.example.com", ""}))
        assert (error.param, error.message) == (
            "messages[0].content", "the image must be a data: URI (data:image/jpeg;base64,...) or an http(s) URL")
    error = refused_url("http://other.example.com/x")
    assert (error.code, error.param) == ("image_url_not_allowed", "messages[0].content")
    assert error.message == ("remote image URLs are refused: send the image as a data: URI (the server's "
                             "OPENAI_FRONT_IMAGE_URL_ALLOWLIST does not list this host, or this port: only 80 and 443 "
                             "unless an entry says host:port)")
    error = refused_url("http://10.0.0.1/x", allowlist=frozenset({"10.0.0.1"}))
    assert (error.code, error.param, error.message) == (
        "image_url_not_allowed", "messages[0].content",
        "the image URL is refused: its host is a loopback, private or otherwise non-public address")
    allowed = chat.parse(body(content=[{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x"}}]), 100,
                         frozenset({"10.0.0.1"}), allow_private_addresses=True)
    assert allowed.image_url == "http://10.0.0.1/x"


def test_a_direct_check_refuses_private_addresses_unless_told_otherwise():
    with pytest.raises(FrontError):
        chat.check_remote_url("http://10.0.0.1/x", frozenset({"10.0.0.1"}))
    chat.check_remote_url("http://10.0.0.1/x", frozenset({"10.0.0.1"}), allow_private_addresses=True)


def test_a_plain_http_url_is_on_port_80():
    chat.check_remote_url("http://images.example.com/x", frozenset({"images.example.com:80"}))
    with pytest.raises(FrontError):
        chat.check_remote_url("https://images.example.com/x", frozenset({"images.example.com:80"}))


@pytest.mark.parametrize("address, allowed", [
    ("fe80::1%eth0", False), ("not-an-ip", False), ("::ffff:8.8.8.8", True), ("224.0.0.1", False),
    ("240.0.0.1", False), ("0.0.0.0", False), ("100.64.0.1", False), ("8.8.8.8", True),
    # a zone id is cut off, and the address judged alone
    ("8.8.8.8%eth0", True), ("8.8.8.8%a%b", True), ("10.0.0.1%eth0", False),
    ("4000::1", False),  # reserved IPv6 space, which Python counts as global
])
def test_addresses(address, allowed):
    assert chat.address_allowed(address) is allowed


def test_long_names_in_refusals_are_cut_at_40_characters():
    error = refusal(body(response_format={"type": "json_object", "k" * 50: 1}))
    assert (error.param, error.message) == ("response_format." + "k" * 40,
                                            f"'response_format.{'k' * 40}' is not part of a json_object response_format")
    with pytest.raises(FrontError) as info:
        chat.decode_data_uri("data:application/" + "x" * 50 + ",abc", 100)
    assert info.value.message == f"the data: URI's media type is {('application/' + 'x' * 50)[:40]!r}, not an image"


def test_a_response_format_of_exactly_the_limit_passes():
    value = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"x": "y" * (chat.MAX_CONVERSATION_CHARS - 74)}}}
    assert chat.parse(body(response_format=value), 100).response_format == value
    value["json_schema"]["schema"]["x"] += "y"
    assert refusal(body(response_format=value)).param == "response_format"


def test_a_percent_encoded_image_may_hold_commas():
    assert chat.decode_data_uri("data:image/png,a,b", 100) == b"a,b"


def test_base64_just_within_the_early_bound_is_decoded_and_then_measured():
    # max_bytes 3 allows 4 * ceil(3 / 3) + 4 = 8 characters before decoding
    with pytest.raises(FrontError) as info:
        chat.decode_data_uri("data:;base64,QUJDRA==", 3)
    assert (info.value.status, info.value.message) == (413, "the image is 4 bytes, more than the 3 allowed")


def nested(depth):
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


# What a hostile client sends to make the front answer 500 or burn its CPU (an independent
# review, 2026-12-06): each is a 400 naming its field, echoing at most 40 characters of it.
HOSTILE = {
    "a part's type nested 1,000 deep, earlier message": (
        body({"role": "system", "content": [{"type": nested(1000)}]}), "messages[0].content[0]",
        "unsupported content part type of JSON type array in an earlier message: only 'text'"),
    "a part's type nested 1,000 deep, last message": (
        body(content=[IMAGE, {"type": nested(1000)}]), "messages[0].content[1]",
        "unsupported content part type of JSON type array: only 'text' and 'image_url'"),
    "a part's type a megabyte long": (
        body(content=[IMAGE, {"type": "t" * 2**20}]), "messages[0].content[1]",
        f"unsupported content part type {'t' * 40!r}: only 'text' and 'image_url'"),
    "response_format.type an array": (
        body(response_format={"type": []}), "response_format.type",
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'"),
    "response_format.type an object": (
        body(response_format={"type": {"a": 1}}), "response_format.type",
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'"),
    "a schema nested 1,000 deep": (
        body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"a": nested(1000)}}}),
        "response_format", "'response_format' is nested too deeply"),
    "NaN in a schema (the stdlib's reading of the body lets it through)": (
        body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"max": float("nan")}}}),
        "response_format", "'response_format' holds NaN or Infinity, which JSON does not have"),
    "Infinity in a schema": (
        body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"max": float("inf")}}}),
        "response_format", "'response_format' holds NaN or Infinity, which JSON does not have"),
    "a stream_options key a megabyte long": (
        body(stream=True, stream_options={"k" * 2**20: 1}), "stream_options." + "k" * 40,
        f"'stream_options.{'k' * 40}' is not supported: only include_usage"),
    "100,000 earlier messages": (
        body(*[{"role": "system", "content": "a"}] * 100_000), "messages",
        "100001 messages, more than the 33 allowed: at most 32 before the last user message"),
    "100,000 text parts in an earlier message": (
        body({"role": "system", "content": [{"type": "text", "text": ""}] * 100_000}), "messages[0].content",
        "'content' has 100000 parts, more than the 64 allowed"),
    "100,000 text parts beside the photo": (
        body(content=[IMAGE, *[{"type": "text", "text": ""}] * 99_999]), "messages[0].content",
        "'content' has 100000 parts, more than the 64 allowed"),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_hostile_fields_are_a_400_naming_the_field_not_a_500(case):
    payload, param, message = HOSTILE[case]
    error = refusal(payload)
    assert (error.status, error.param, error.message) == (400, param, message)


def test_the_message_and_part_counts_are_inclusive():
    most = [{"role": "system", "content": "x"}] * chat.MAX_CONVERSATION_MESSAGES
    assert len(chat.parse(body(*most), 100).conversation) == chat.MAX_CONVERSATION_MESSAGES
    parts = [{"type": "text", "text": "a"}] * chat.MAX_CONTENT_PARTS
    assert chat.parse(body({"role": "system", "content": parts}), 100).conversation[0]["content"] == \
        "\n".join(["a"] * chat.MAX_CONTENT_PARTS)
    assert chat.parse(body(content=[IMAGE, *parts[1:]]), 100).prompt == "\n".join(["a"] * (chat.MAX_CONTENT_PARTS - 1))
    assert refusal(body(content=[IMAGE, *parts])).param == "messages[0].content"


@pytest.mark.parametrize("scheme", ["data:", "DATA:", "Data:"])
def test_a_data_uri_is_read_whatever_the_case_of_its_scheme(scheme):
    assert chat.parse(body(content=[{"type": "image_url", "image_url": {"url": scheme + URI[5:]}}]), 100).image == b"img"
