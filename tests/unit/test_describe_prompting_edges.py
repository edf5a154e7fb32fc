"""prompting.py at its edges: LABELS exactly at their limits, and which input
a refusal blames (found by `make mutants`, docs/mutation.md)."""

import pytest
from classify_describe_server.prompting import PromptError, build_messages, fallback_description, read_labels, read_prompt
from classify_describe_server.settings import parse_settings


def test_labels_exactly_at_each_limit_pass_and_one_more_is_refused():
    settings = parse_settings({"max_labels": "3", "max_label_chars": "4", "max_prompt_chars": "12"}, {})
    assert read_labels([b"abcd", b"efgh", "ijkl"], settings) == ("abcd", "efgh", "ijkl")
    for labels, limit in (([b"a"] * 4, "max_labels=3"), ([b"abcde"], "max_label_chars=4")):
        with pytest.raises(PromptError, match=limit) as info:
            read_labels(labels, settings)
        assert info.value.field == "LABELS"
    tighter = parse_settings({"max_labels": "3", "max_label_chars": "4", "max_prompt_chars": "11"}, {})
    with pytest.raises(PromptError, match="12 characters together") as info:
        read_labels([b"abcd", b"efgh", b"ijkl"], tighter)
    assert info.value.field == "LABELS"


def test_a_label_that_is_not_utf8_blames_labels_and_says_which():
    with pytest.raises(PromptError, match=r"LABELS\[1\] is not valid UTF-8 \(byte 0xff at offset 1\)") as info:
        read_labels([b"ok", b"a\xffb"], parse_settings({}, {}))
    assert info.value.field == "LABELS"


def test_a_prompt_that_is_not_utf8_blames_prompt():
    with pytest.raises(PromptError, match=r"^PROMPT is not valid UTF-8 \(byte 0xc3 at offset 2\)") as info:
        read_prompt(b"ab\xc3(", 100)
    assert info.value.field == "PROMPT"
    assert read_prompt(bytearray(" caf\xc3\xa9 ".encode("latin-1")), 4) == "café"


def test_the_fallback_says_an_only_before_a_vowel():
    assert fallback_description(["xylophone", "oboe"], [0.6, 0.3]) == \
        "Most likely a xylophone (60%); it could also be an oboe (30%)."


def test_the_question_lists_the_labels_by_score_whatever_order_they_came_in():
    settings = parse_settings({"prompt_template": "{top_label}|{labels}"}, {})
    [_, user] = build_messages(settings, ["apple", "zebra"], [0.1, 0.9], "q")
    assert user["content"] == "zebra|- zebra (90.0%)\n- apple (10.0%)"
