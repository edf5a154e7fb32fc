"""settings.py at its edges: every limit at and past its boundary, the
spellings a value may take, and what each refusal names (found by
`make mutants`, docs/mutation.md)."""

import pytest
from classify_describe_server.settings import ConfigError, InvalidOverride, RequestModels, parse_settings

POSITIVE = ("timeout_s", "total_timeout_s", "circuit_cooldown_s", "cancel_poll_s")
NOT_NEGATIVE = ("backoff_base_s", "backoff_max_s", "max_retry_after_s", "cache_ttl_s",
                "price_input_per_million", "price_output_per_million")
AT_LEAST_ONE = ("max_attempts", "circuit_failure_threshold", "max_in_flight", "cache_max_entries",
                "max_prompt_chars", "max_labels", "max_label_chars", "max_open_streams", "max_photos_waiting",
                "max_answer_chars", "max_view_bytes", "max_conversation_messages", "max_conversation_chars")


def refusal(params, environ=None):
    with pytest.raises(ConfigError) as info:
        parse_settings(params, environ or {})
    return str(info.value)


@pytest.mark.parametrize("name", POSITIVE)
def test_durations_must_be_positive(name):
    assert f"{name} must be > 0" in refusal({name: "0"})
    small = {"timeout_s": "0.001", name: "0.001"}  # timeout_s may not exceed total_timeout_s
    assert getattr(parse_settings(small, {}), name) == 0.001


@pytest.mark.parametrize("name", NOT_NEGATIVE)
def test_delays_and_prices_may_be_zero_but_not_negative(name):
    assert f"{name} must be >= 0" in refusal({name: "-0.5"})
    assert getattr(parse_settings({name: "0"}, {}), name) == 0


@pytest.mark.parametrize("name", AT_LEAST_ONE)
def test_counts_must_be_at_least_one(name):
    assert f"{name} must be >= 1" in refusal({name: "0"})
    assert getattr(parse_settings({name: "1"}, {}), name) == 1


def test_max_tokens_and_temperature_accept_their_bounds_and_refuse_past_them():
    assert parse_settings({"max_tokens": "1"}, {}).max_tokens == 1
    assert parse_settings({"max_tokens": "512", "max_tokens_limit": "512"}, {}).max_tokens == 512
    assert "max_tokens must be in [1, max_tokens_limit]" in refusal({"max_tokens": "0"})
    assert "max_tokens must be in" in refusal({"max_tokens": "513", "max_tokens_limit": "512"})
    for bound in ("0.0", "1.0"):
        assert parse_settings({"temperature": bound}, {}).temperature == float(bound)
    assert "temperature must be in" in refusal({"temperature": "-0.1"})


def test_the_other_checks_name_what_is_wrong():
    assert parse_settings({"max_request_models": "0"}, {}).max_request_models == 0
    assert "max_request_models must be >= 0" in refusal({"max_request_models": "-1"})
    assert parse_settings({"vision_refusal_memory_s": "0"}, {}).vision_refusal_memory_s == 0
    assert "vision_refusal_memory_s must be >= 0" in refusal({"vision_refusal_memory_s": "-1"})
    assert "vision must be one of" in refusal({"vision": "maybe"})
    assert "vision_detail must be one of" in refusal({"vision_detail": "medium"})
    assert "model must not be empty" in refusal({"model": ""})
    assert "prompt_template is not a valid format string" in refusal({"prompt_template": "{prompt"})
    assert parse_settings({"base_url": "http://127.0.0.1:1/v1"}, {}).base_url == "http://127.0.0.1:1/v1"


def test_every_problem_is_reported_at_once():
    text = refusal({"model": "", "on_failure": "explode", "max_attempts": "0"})
    assert text.startswith("invalid describe settings: ")
    assert "model must not be empty; " in text and "max_attempts must be >= 1" in text
    assert "on_failure must be one of" in text


@pytest.mark.parametrize("text, value", [
    ("1", True), ("true", True), (" Yes ", True), ("ON", True),
    ("0", False), ("False", False), ("no", False), (" off", False),
])
def test_booleans_take_the_usual_spellings(text, value):
    assert parse_settings({"cache_enabled": text}, {}).cache_enabled is value


def test_a_boolean_that_is_neither_names_the_value():
    assert "expected true or false, got 'maybe'" in refusal({"cache_enabled": "maybe"})


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_floats_must_be_finite(text):
    assert refusal({"timeout_s": text}) == f"config parameter 'timeout_s'={text!r} is invalid: must be finite"


def test_choices_are_case_insensitive_and_lists_drop_blanks():
    s = parse_settings({"vision": " ON ", "vision_detail": "High", "on_failure": "Error",
                        "allowed_models": " a ,, b* ,"}, {})
    assert (s.vision, s.vision_detail, s.on_failure) == ("on", "high", "error")
    assert s.allowed_models == ("a", "b*")
    assert parse_settings({"model_prices": ""}, {}).model_prices == {}


@pytest.mark.parametrize("text", ['[1, 2]', '{"m": [1]}', '{"m": [1, 2, 3]}', '{"m": ["a", 1]}', '{"m": 1}', "{"])
def test_model_prices_must_be_pairs_of_numbers(text):
    assert "'model_prices'" in refusal({"model_prices": text})
    if text != "{":  # JSON that parses says what shape it must have
        assert refusal({"model_prices": text}).endswith(
            'is invalid: expected JSON like {"gpt-4o": [2.5, 10.0]} (USD per million tokens)')


def test_model_prices_accept_integers_as_floats():
    assert parse_settings({"model_prices": '{"m": [1, 2]}'}, {}).prices_for("m") == (1.0, 2.0)


def test_an_empty_environment_variable_leaves_the_config_value_and_the_prefix_is_not_read_from_it():
    s = parse_settings({"model": "from-config"}, {"LLM_MODEL": "", "LLM_ENV_PREFIX": "OTHER_", "OTHER_MODEL": "x"})
    assert s.model == "from-config" and s.env_prefix == "LLM_" and s.from_env == ()


def test_a_bad_config_value_names_the_config_parameter():
    assert refusal({"max_attempts": "three"}).startswith("config parameter 'max_attempts'='three' is invalid")


def test_allowed_models_match_case_sensitively():
    s = parse_settings({"allowed_models": "gpt-4o-mini*"}, {})
    assert s.is_model_allowed("gpt-4o-mini") and s.is_model_allowed("gpt-4o-mini-2")
    assert not s.is_model_allowed("GPT-4o-mini-2") and not s.is_model_allowed("gpt-4o")


def test_overrides_accept_their_bounds_and_refuse_past_them():
    s = parse_settings({"max_tokens": "50", "max_tokens_limit": "100", "temperature_max": "1.5", "timeout_s": "5"}, {})
    edge = s.resolve_overrides({"max_tokens": 100, "temperature": 1.5, "timeout_s": 5})
    assert (edge.max_tokens, edge.temperature, edge.timeout_s) == (100, 1.5, 5.0)
    assert s.resolve_overrides({"max_tokens": "1", "temperature": 0}).max_tokens == 1
    refused = {
        "max_tokens": [0, 101, "nan"],
        "temperature": [-0.01, 1.51, float("inf")],
        "timeout_s": [0, -1, 5.01],
        "model": ["", 3, None],
    }
    for name, values in refused.items():
        for value in values:
            with pytest.raises(InvalidOverride) as info:
                s.resolve_overrides({name: value})
            assert info.value.field == name and name in str(info.value), (name, value)


def test_override_messages_say_the_limit():
    s = parse_settings({"max_tokens": "50", "max_tokens_limit": "100"}, {})
    with pytest.raises(InvalidOverride, match=r"max_tokens must be an integer in \[1, 100\] .*got 101"):
        s.resolve_overrides({"max_tokens": 101})
    with pytest.raises(InvalidOverride, match=r"temperature 2.0 is outside \[0.0, 1.0\]"):
        s.resolve_overrides({"temperature": 2})
    with pytest.raises(InvalidOverride, match=r"parameter 'temperature' must be a number, got 'hot'"):
        s.resolve_overrides({"temperature": "hot"})
    with pytest.raises(InvalidOverride, match="model 'x' is not allowed here"):
        s.resolve_overrides({"model": "x"})


def test_request_models_cap_the_names_besides_the_default():
    models = RequestModels(parse_settings({"max_request_models": "2"}, {}))
    for name in ("gpt-4o-mini", "a", "b", "a", "gpt-4o-mini"):
        models.admit(name)  # the default and names once admitted never count again
    with pytest.raises(InvalidOverride) as info:
        models.admit("c")
    assert info.value.field == "model" and "max_request_models=2" in str(info.value)
    none = RequestModels(parse_settings({"max_request_models": "0"}, {}))
    none.admit("gpt-4o-mini")
    with pytest.raises(InvalidOverride):
        none.admit("a")


def test_an_empty_key_file_or_blank_variable_is_no_key(tmp_path):
    empty = tmp_path / "key"
    empty.write_text("\n")
    assert parse_settings({"api_key_file": str(empty)}, {}).load_api_key({}) == (None, f"file {empty}")
    s = parse_settings({"env_prefix": "X_"}, {})
    assert s.load_api_key({"X_API_KEY": "  "}) == (None, "environment variable X_API_KEY")
    assert s.load_api_key({"X_API_KEY": "k", "LLM_API_KEY": "other"})[0] == "k"


def test_override_refusals_say_what_the_value_must_be():
    s = parse_settings({}, {})
    for params, message in (({"model": ""}, "parameter 'model' must be a non-empty string"),
                            ({"model": 3}, "parameter 'model' must be a non-empty string"),
                            ({"max_tokens": True}, "parameter 'max_tokens' must be a number"),
                            ({"temperature": float("nan")}, "parameter 'temperature' must be finite")):
        with pytest.raises(InvalidOverride) as info:
            s.resolve_overrides(params)
        assert str(info.value) == message


def test_a_timeout_under_a_second_may_be_asked_for():
    assert parse_settings({}, {}).resolve_overrides({"timeout_s": 0.25}).timeout_s == 0.25


def test_the_range_refusals_word_for_word():
    assert refusal({"max_tokens": "0"}) == "invalid describe settings: max_tokens must be in [1, max_tokens_limit]"
    assert refusal({"temperature": "2"}) == \
        "invalid describe settings: temperature must be in [temperature_min, temperature_max]"


def test_more_refusals_word_for_word():
    assert refusal({"max_request_models": "-1"}) == "invalid describe settings: max_request_models must be >= 0"
    assert refusal({"vision_refusal_memory_s": "-1"}) == \
        "invalid describe settings: vision_refusal_memory_s must be >= 0"
    assert refusal({"timeout_s": "31"}) == "invalid describe settings: timeout_s must not exceed total_timeout_s"
    assert refusal({"api_key": "sk-1"}) == (
        "config parameter 'api_key' is refused: never put the key in config; "
        "set api_key_env (an environment variable name) or api_key_file (a path)")


def test_the_process_environment_is_read_when_none_is_given(monkeypatch):
    monkeypatch.setenv("LLM_MODEL", "from-the-environment")
    assert parse_settings({}).model == "from-the-environment"
