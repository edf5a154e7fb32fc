"""accounting.py at its edges: upstreams that send partial usage, messages
with mixed content parts, and the USAGE output's exact form (found by
`make mutants`, docs/mutation.md)."""

import json
from types import SimpleNamespace

from classify_describe_server.accounting import Usage, finish_reason_of, message_chars, tokens_from


def test_usage_missing_or_partial_costs_nothing_for_what_is_missing():
    assert tokens_from(None) == (0, 0)
    assert tokens_from(SimpleNamespace()) == (0, 0)  # a local server's usage without the fields
    assert tokens_from(SimpleNamespace(prompt_tokens=None, completion_tokens=None)) == (0, 0)
    assert tokens_from(SimpleNamespace(prompt_tokens=7)) == (7, 0)
    assert tokens_from(SimpleNamespace(completion_tokens=9)) == (0, 9)
    assert tokens_from(SimpleNamespace(prompt_tokens="12", completion_tokens=3.0)) == (12, 3)


def test_message_chars_adds_every_message_and_every_text_part():
    messages = [
        {"role": "system", "content": "abc"},
        {"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "image_url", "image_url": {}},
                                     "not a part", {"type": "text", "text": None}, {"type": "text", "text": "fghi"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "j"}]},
    ]
    assert message_chars(messages) == 3 + 2 + 4 + 1
    assert message_chars([]) == 0


def test_finish_reason_is_only_ever_a_string():
    def response(reason):
        return SimpleNamespace(choices=[SimpleNamespace(finish_reason=reason)])

    assert finish_reason_of(response("length")) == "length"
    assert finish_reason_of(response(3)) is None
    assert finish_reason_of(response(None)) is None
    assert finish_reason_of(SimpleNamespace(choices=[])) is None
    assert finish_reason_of(object()) is None


def test_usage_json_is_compact_and_rounds_time_to_first_token():
    usage = Usage("m", time_to_first_token_ms=12.3456, chunks=4)
    text = usage.to_json()
    assert " " not in text  # one line, no padding: it travels in every response
    fields = json.loads(text)
    assert fields["time_to_first_token_ms"] == 12.3
    assert fields["chunks"] == 4
    assert "tokens_estimated" not in fields
