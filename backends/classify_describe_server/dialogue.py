"""What a chat client adds to the question (the OpenAI front passes them as request
parameters): its own system messages and earlier turns (`conversation`) and the
answer's format (`response_format`), read from JSON and bounded; a refusal names
the parameter (InvalidOverride: the error contract's invalid_parameter)."""

import json

import orjson

from .settings import InvalidOverride

ROLES = ("system", "user", "assistant")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def read_conversation(params, settings):
    """The request parameter `conversation` (a JSON string: the client's system
    messages and earlier turns, oldest first, text only) as ((role, content), ...);
    () when absent. Bounded: they are input tokens we pay for."""
    raw = params.get("conversation")
    if raw is None or raw == "":
        return ()
    field = "conversation"
    # Bounded before it is parsed: 9 MB of empty lists took 2.2 s and 192 MB to parse before the
    # message count refused them. Each character of content is at most 12 of JSON (an escaped
    # surrogate pair), each message's keys and quotes under 64.
    longest = 12 * settings.max_conversation_chars + 64 * settings.max_conversation_messages + 2
    if isinstance(raw, str) and len(raw) > longest:
        raise InvalidOverride(f"conversation has {len(raw)} characters of JSON, more than the {longest} that "
                              "max_conversation_chars and max_conversation_messages allow", field)
    messages = _json_param(raw, field)
    if not isinstance(messages, list):
        raise InvalidOverride("conversation must be a JSON list of {role, content} messages", field)
    if len(messages) > settings.max_conversation_messages:
        raise InvalidOverride(f"conversation has {len(messages)} messages, more than the limit "
                              f"max_conversation_messages={settings.max_conversation_messages}", field)
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidOverride(f"conversation[{i}] must be an object whose role is one of {', '.join(ROLES)}",
                                  field)
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidOverride(f"conversation[{i}].content must be text", field)
        turns.append((message["role"], content))
    total = sum(len(content) for _, content in turns)
    if total > settings.max_conversation_chars:
        raise InvalidOverride(f"conversation has {total} characters, more than the limit "
                              f"max_conversation_chars={settings.max_conversation_chars}", field)
    return tuple(turns)


def read_response_format(params, settings):
    """The request parameter `response_format` (a JSON string of OpenAI's object),
    checked and passed upstream as it came; None when absent."""
    raw = params.get("response_format")
    if raw is None or raw == "":
        return None
    field = "response_format"
    if isinstance(raw, str) and len(raw) > settings.max_conversation_chars:
        raise InvalidOverride(f"response_format has {len(raw)} characters, more than the limit "
                              f"max_conversation_chars={settings.max_conversation_chars}", field)
    value = _json_param(raw, field)
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise InvalidOverride(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}",
                              field)
    if value["type"] == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise InvalidOverride("response_format of type json_schema needs json_schema: {name, schema, ...}", field)
    return value


def _json_param(raw, field):
    """The parameter's JSON value, refused unless it can be sent on as JSON as it is: the upstream
    request is encoded after the request was admitted, and a value that fails there (NaN, an integer
    past 64 bits, a lone surrogate, nesting past orjson's 254 levels) was blamed on the upstream:
    retried, and counted by its circuit breaker against every client of the model."""
    if not isinstance(raw, str):
        raise InvalidOverride(f"parameter '{field}' must be a JSON string", field)
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidOverride(f"parameter '{field}' is nested too deeply", field) from None
    except ValueError as exc:
        raise InvalidOverride(f"parameter '{field}' is not valid JSON: {exc}", field) from None
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise InvalidOverride(f"parameter '{field}' cannot be sent on as JSON: {exc}", field) from None
    return value


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")
