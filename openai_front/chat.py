"""A chat-completions request body -> what the pipeline needs: the image
(bytes from a data: URI, or an allowlisted http(s) URL to fetch), the prompt
(the text parts of the last user message), the client's system messages and
earlier turns (text only), response_format and the sampling overrides the
describe step accepts; every other field is refused by name. Pure: no I/O,
no Triton."""

import binascii
import dataclasses
import ipaddress
import json
import math
import re
import urllib.parse

import pybase64
from classify_describe_server import dialogue
from classify_describe_server.settings import Settings as DescribeSettings

from .errors import FrontError, invalid, too_large

MAX_TOKENS_LIMIT = 2**31 - 1  # far above any model's output; the describe step then applies its own limit
DEFAULT_PORTS = (80, 443)     # the only ports of an allowlisted host, unless an entry says host:port
# The describe step's bounds on the client's earlier messages (its `conversation`
# parameter) and on the question (its `max_prompt_chars`, which the settings can
# change: OPENAI_FRONT_MAX_PROMPT_CHARS), its defaults read from its settings and
# checked here too, so a request is refused before it costs a classification.
MAX_CONVERSATION_MESSAGES = DescribeSettings.max_conversation_messages
MAX_CONTENT_PARTS = 64  # parts of one message's content; counted before any is read
MAX_CONVERSATION_CHARS = DescribeSettings.max_conversation_chars  # also the bound on response_format's JSON
MAX_PROMPT_CHARS = DescribeSettings.max_prompt_chars  # the question: the last user message's text parts, joined

# Every top-level field is honoured, accepted with the one value the pipeline
# gives anyway, accepted and ignored (OpenAI's own bookkeeping, which does not
# change the answer), or refused by name: nothing a client relies on is dropped
# in silence, and a field OpenAI adds later is refused until it is listed here.
# A field sent as null counts as absent (OpenAI's own reading of null).
HONOURED = frozenset({"model", "messages", "stream", "stream_options", "temperature", "max_tokens",
                      "max_completion_tokens", "response_format"})
ONLY = {"n": 1, "logprobs": False, "modalities": ["text"], "store": False}
IGNORED = frozenset({"user", "safety_identifier", "prompt_cache_key", "metadata"})
_NO_TOOLS = "this endpoint describes a photo and calls no tools"
_NOT_PASSED = "the describe step passes only temperature and max_tokens to the LLM"
REFUSED = {
    "tools": _NO_TOOLS, "tool_choice": _NO_TOOLS, "parallel_tool_calls": _NO_TOOLS,
    "functions": _NO_TOOLS, "function_call": _NO_TOOLS,
    "top_logprobs": "the pipeline returns no log probabilities",
    "audio": "the answer is text only", "prediction": "predicted outputs are not passed to the LLM",
    "web_search_options": "the LLM searches nothing",
    **{name: _NOT_PASSED for name in ("top_p", "stop", "seed", "frequency_penalty", "presence_penalty",
                                      "logit_bias", "reasoning_effort", "verbosity")},
}
WHY_ONLY = {"n": "one image, one description", "logprobs": "the pipeline returns no log probabilities",
            "modalities": "the answer is text only", "store": "this endpoint stores no completion"}
# Message roles: the describe step's, and developer (OpenAI's newer name for system) as system.
CONVERSATION_ROLES = {**{role: role for role in dialogue.ROLES}, "developer": "system"}
_JSON_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str
    image: bytes = None          # decoded from a data: URI
    image_url: str = None        # an allowlisted http(s) URL, fetched by the app
    prompt: str = None           # None: the describe step's default question
    stream: bool = False
    include_usage: bool = False
    parameters: dict = dataclasses.field(default_factory=dict)  # the sampling overrides, as Triton request parameters
    # The client's system messages and earlier turns, in order, text only:
    # ({"role": "system"|"user"|"assistant", "content": text}, ...).
    conversation: tuple = ()
    response_format: dict = None  # json_object or json_schema, as the client sent it; None: text


def parse(body, max_image_bytes, url_allowlist=frozenset(), allow_private_addresses=False,
          max_prompt_chars=MAX_PROMPT_CHARS):
    """Validate one decoded JSON body; raise FrontError (4xx) naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: a string, e.g. 'classify_and_describe' (GET /v1/models lists them)",
                      param="model")
    conversation, index = _conversation(body.get("messages"))
    prompt, image_url = _user_content(body["messages"][index].get("content"), f"messages[{index}].content",
                                      max_prompt_chars)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", param="stream_options")
        for key in sorted(options.keys() - {"include_usage"}):
            if options[key] is not None:
                raise unsupported(f"'stream_options.{key[:40]}' is not supported: only include_usage",
                                  f"stream_options.{key[:40]}")
        include_usage = options.get("include_usage", False)
        if include_usage is None:
            include_usage = False
        if not isinstance(include_usage, bool):
            raise invalid("'stream_options.include_usage' must be true or false", param="stream_options.include_usage")

    image = None
    if image_url[:5].lower() == "data:":  # a scheme is case-insensitive (RFC 3986)
        image = decode_data_uri(image_url, max_image_bytes, param=f"messages[{index}].content")
        image_url = None
    else:
        check_remote_url(image_url, url_allowlist, param=f"messages[{index}].content",
                         allow_private_addresses=allow_private_addresses)
    return ChatRequest(model=model, image=image, image_url=image_url, prompt=prompt, stream=stream,
                       include_usage=include_usage, parameters=_sampling(body), conversation=conversation,
                       response_format=_response_format(body.get("response_format")))


def unsupported(message, param, code="unsupported_parameter"):
    return invalid(message, param=param, code=code)


def check_fields(body):
    """Refuse, by name, every top-level field the pipeline cannot honour."""
    for name, value in body.items():
        if value is None or name in HONOURED or name in IGNORED:
            continue
        if name in ONLY:
            allowed = ONLY[name]
            if type(value) is not type(allowed) or value != allowed:
                raise unsupported(f"only {name}={json.dumps(allowed)} is supported: {WHY_ONLY[name]}", name,
                                  code="unsupported_value")
        elif name in REFUSED:
            raise unsupported(f"'{name}' is not supported: {REFUSED[name]}", name)
        else:
            raise unsupported(f"unknown field '{name[:60]}': this endpoint refuses what it cannot honour "
                              "(the README lists the fields it takes)", name[:60])


def _conversation(messages):
    """(the messages before the last user message as the describe step's
    conversation, the index of the last user message: the photo and question)."""
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", param="messages")
    # Counted before any message is checked or copied: 900,000 tiny messages in a 29 MB body
    # took 1.4 s of the front's CPU to refuse when the count came last.
    if len(messages) > MAX_CONVERSATION_MESSAGES + 1:
        raise invalid(f"{len(messages)} messages, more than the {MAX_CONVERSATION_MESSAGES + 1} allowed: at most "
                      f"{MAX_CONVERSATION_MESSAGES} before the last user message", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{index}] must be an object with a 'role'", param=f"messages[{index}]")
        role = message["role"]
        if role in ("tool", "function"):
            raise unsupported(f"messages[{index}] has role '{role}': {_NO_TOOLS}", f"messages[{index}].role")
        if role not in CONVERSATION_ROLES:
            raise invalid(f"messages[{index}] has role {role[:40]!r}: only system, developer, user and assistant",
                          param=f"messages[{index}].role")
        for key in sorted(message.keys() - {"role", "content"}):
            if message[key] is not None:
                why = _NO_TOOLS if key in ("tool_calls", "function_call") else "only 'role' and 'content' reach the LLM"
                raise unsupported(f"'messages[{index}].{key[:40]}' is not supported: {why}",
                                  f"messages[{index}].{key[:40]}")
    user = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not user:
        raise invalid("no message has role 'user': the last user message carries the image", param="messages")
    last = user[-1]
    if last != len(messages) - 1:
        raise invalid(f"messages[{last + 1}] comes after the last user message, which carries the photo and must "
                      "be the last message", param=f"messages[{last + 1}]")
    conversation = tuple({"role": CONVERSATION_ROLES[m["role"]], "content": _text_content(m.get("content"), i)}
                         for i, m in enumerate(messages[:last]))
    chars = sum(len(m["content"]) for m in conversation)
    if chars > MAX_CONVERSATION_CHARS:
        raise invalid(f"the messages before the last user message hold {chars} characters, more than the "
                      f"{MAX_CONVERSATION_CHARS} allowed", param="messages")
    return conversation, last


def _text_content(content, index):
    """The text of a message before the last user one: a string, or text parts
    (joined by newlines). Only the last user message may carry the photo."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return _valid_text(content, param)
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of text parts", param=param)
    _count_parts(content, param)
    texts = []
    for position, part in enumerate(content):
        where = f"{param}[{position}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            raise unsupported("only the last user message may carry an image (the photo); an earlier message "
                              "cannot", where)
        if kind != "text":
            raise invalid(f"unsupported content part type {_shown(kind)} in an earlier message: only 'text'",
                          param=where)
        texts.append(_text_part(part, where))
    return "\n".join(texts)


def _count_parts(content, param):
    if len(content) > MAX_CONTENT_PARTS:
        raise invalid(f"'content' has {len(content)} parts, more than the {MAX_CONTENT_PARTS} allowed", param=param)


def _shown(value):
    """A client's value for an error message: a short string as it came, anything else by its JSON
    type only (the repr of a deeply nested list runs out of stack; a long one would be echoed whole)."""
    if isinstance(value, str):
        return repr(value[:40])
    return "None" if value is None else f"of JSON type {_JSON_TYPES.get(type(value), type(value).__name__)}"


_JSON_TYPES = {dict: "object", list: "array", bool: "boolean", int: "number", float: "number"}


def _text_part(part, where):
    if not isinstance(part.get("text"), str):
        raise invalid("a text part needs 'text', a string", param=where)
    return _valid_text(part["text"], where)


def _valid_text(text, where):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON's \ud800 escapes decode to lone surrogates
        raise invalid("a text part is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)",
                      param=where) from None
    return text


def _response_format(value):
    """None for text (the describe step's default), else the object to pass
    on: {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'response_format' must be an object with a 'type'", param="response_format")
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(
        kind if isinstance(kind, str) else None)
    if allowed is None:
        raise invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                      param="response_format.type")
    for key in sorted(value.keys() - allowed):
        raise invalid(f"'response_format.{key[:40]}' is not part of a {kind} response_format",
                      param=f"response_format.{key[:40]}")
    if kind == "text":
        return None
    if kind == "json_schema":
        _json_schema(value.get("json_schema"))
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except RecursionError:  # orjson parses 1,024 levels; json.dumps runs out of stack before that
        raise invalid("'response_format' is nested too deeply", param="response_format") from None
    except ValueError:  # the stdlib's reading of the body lets NaN and Infinity through; JSON has neither
        raise invalid("'response_format' holds NaN or Infinity, which JSON does not have",
                      param="response_format") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("'response_format' is not valid Unicode: it holds a lone surrogate",
                      param="response_format") from None
    if len(text) > MAX_CONVERSATION_CHARS:
        raise invalid(f"'response_format' is {len(text)} characters of JSON, more than the {MAX_CONVERSATION_CHARS} "
                      "allowed", param="response_format")
    return value


def _json_schema(spec):
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise invalid(f"'{param}' must be an object with a 'name' (and a 'schema')", param=param)
    for key in sorted(spec.keys() - {"name", "description", "schema", "strict"}):
        raise invalid(f"'{param}.{key[:40]}' is not part of a json_schema", param=f"{param}.{key[:40]}")
    name = spec.get("name")
    if not isinstance(name, str) or not _JSON_SCHEMA_NAME.fullmatch(name):
        raise invalid(f"'{param}.name' must be 1 to 64 letters, digits, '_' or '-'", param=f"{param}.name")
    for key, kind, what in (("description", str, "a string"), ("schema", dict, "an object"),
                            ("strict", bool, "true or false")):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise invalid(f"'{param}.{key}' must be {what}", param=f"{param}.{key}")


def _user_content(content, param, max_prompt_chars):
    """(prompt or None, the image part's url) from a user message's content."""
    if isinstance(content, str) or content is None:
        raise invalid("the last user message has no image: send its content as an array with one "
                      "{'type': 'image_url', 'image_url': {'url': 'data:image/jpeg;base64,...'}} part", param=param)
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of parts", param=param)
    _count_parts(content, param)
    texts, urls = [], []
    for position, part in enumerate(content):
        where = f"{param}[{position}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(_text_part(part, where))
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url  # the old form: a bare string
            if not isinstance(url, str) or not url:
                raise invalid("an image_url part needs 'image_url': {'url': ...}", param=where)
            urls.append(url)
        else:
            raise invalid(f"unsupported content part type {_shown(kind)}: only 'text' and 'image_url'", param=where)
    if not urls:
        raise invalid("the last user message has no image_url part", param=param)
    if len(urls) > 1:
        raise invalid(f"the last user message has {len(urls)} images; send one per request", param=param)
    prompt = "\n".join(t for t in texts if t.strip()).strip()
    if len(prompt) > max_prompt_chars:
        raise invalid(f"the question (the text parts of the last user message) has {len(prompt)} characters, "
                      f"more than the {max_prompt_chars} allowed", param=param)
    return prompt or None, urls[0]


def decode_data_uri(uri, max_bytes, param=None):
    """The bytes of `data:[<media type>][;base64],<data>`. The size is checked
    on the encoded text first, so a huge URI is refused before it is decoded."""
    comma = uri.find(",", 5)
    if comma < 0:
        raise invalid("the image's data: URI has no ',' before its data", param=param)
    # One copy of the data (uri[5:].partition(",") made two of a photo's 622 KB).
    header, data = uri[5:comma], uri[comma + 1:]
    fields = header.split(";")
    media_type = fields[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise invalid(f"the data: URI's media type is {media_type[:40]!r}, not an image", param=param)
    is_base64 = "base64" in (f.strip().lower() for f in fields[1:])
    if is_base64 and len(data) > 4 * math.ceil(max_bytes / 3) + 4:  # + a little padding and whitespace slack
        raise too_large(f"the image is more than the {max_bytes} bytes allowed", param=param)
    try:
        # pybase64: the same result and errors as base64.b64decode, with SIMD; the stdlib's
        # took 18 % of the front's CPU (0.86 ms for a 466 KB photo, docs/benchmarks-method.md).
        image = pybase64.b64decode(data, validate=True) if is_base64 else urllib.parse.unquote_to_bytes(data)
    except (binascii.Error, ValueError):
        raise invalid("the image's data: URI is not valid base64", param=param) from None
    if not image:
        raise invalid("the image's data: URI holds no data", param=param)
    if len(image) > max_bytes:
        raise too_large(f"the image is {len(image)} bytes, more than the {max_bytes} allowed", param=param)
    return image


def check_remote_url(url, allowlist, param=None, allow_private_addresses=False):
    """Only http(s) URLs whose host is on the allowlist, on port 80 or 443 unless
    an entry names `host:port`, and never an IP literal that is not public: the
    front must not be a way to reach hosts its clients cannot (cloud metadata,
    internal services). Names are checked again after DNS (fetch.py)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        port = parts.port  # raises ValueError on a malformed port
    except ValueError:
        raise invalid("the image URL is malformed", param=param) from None
    if parts.scheme not in ("http", "https") or not host:
        raise invalid("the image must be a data: URI (data:image/jpeg;base64,...) or an http(s) URL", param=param)
    port = port if port is not None else (443 if parts.scheme == "https" else 80)
    host_port = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not (host_port in allowlist or (host in allowlist and port in DEFAULT_PORTS)):
        raise FrontError(400, "remote image URLs are refused: send the image as a data: URI "
                              "(the server's OPENAI_FRONT_IMAGE_URL_ALLOWLIST does not list this host, "
                              "or this port: only 80 and 443 unless an entry says host:port)",
                         param=param, code="image_url_not_allowed")
    if _is_ip_literal(host) and not address_allowed(host, allow_private_addresses):
        raise FrontError(400, "the image URL is refused: its host is a loopback, private or otherwise "
                              "non-public address", param=param, code="image_url_not_allowed")


def _is_ip_literal(host):
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def address_allowed(address, allow_private=False):
    """Whether the front may connect to this IP address: public unicast only
    (no loopback, private, link-local, shared, multicast, reserved or
    unspecified address; an IPv4-mapped IPv6 address counts as its IPv4 one).
    allow_private (OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE, for tests) lifts that."""
    if allow_private:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id ("fe80::1%eth0")
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local
                                 or ip.is_private or ip.is_unspecified)


def _sampling(body):
    """temperature and max_tokens go to the describe step as Triton request
    parameters; it refuses values outside its configured limits (400)."""
    parameters = {}
    temperature = body.get("temperature")
    if temperature is not None:
        try:  # an integer too long for a float (10**400) is no number either
            valid = not isinstance(temperature, bool) and isinstance(temperature, (int, float)) and math.isfinite(temperature)
        except OverflowError:
            valid = False
        if not valid:
            raise invalid("'temperature' must be a number", param="temperature")
        parameters["temperature"] = float(temperature)
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
            raise invalid(f"'{name}' must be a positive integer, at most {MAX_TOKENS_LIMIT}", param=name)
        parameters.setdefault("max_tokens", value)
    return parameters
