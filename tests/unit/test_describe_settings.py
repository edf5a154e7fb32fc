"""Settings parsing, per-request overrides and where the API key comes from."""


import pytest
from classify_describe_server.settings import ConfigError, InvalidOverride, Overrides, parse_settings


def test_defaults_point_at_openai():
    s = parse_settings({}, {})
    assert s.base_url == "https://api.openai.com/v1" and s.model == "gpt-4o-mini"
    assert s.cache_enabled and s.on_failure == "fallback" and s.max_in_flight >= 500


def test_config_values_are_typed():
    s = parse_settings({"max_tokens": "64", "temperature": "0.7", "api_key_required": "false",
                        "allowed_models": "gpt-4o*, claude-*", "model_prices": '{"gpt-4o": [2.5, 10]}'}, {})
    assert s.max_tokens == 64 and s.temperature == 0.7 and s.api_key_required == "false"
    assert s.allowed_models == ("gpt-4o*", "claude-*")
    assert s.prices_for("gpt-4o") == (2.5, 10.0) and s.prices_for("other") is None


def test_environment_overrides_config_with_the_prefix():
    env = {"LLM_BASE_URL": "http://127.0.0.1:1/v1", "LLM_MODEL": "m", "LLM_TIMEOUT_S": "2"}
    s = parse_settings({"base_url": "https://x/v1", "model": "gpt-4o-mini"}, env)
    assert (s.base_url, s.model, s.timeout_s) == ("http://127.0.0.1:1/v1", "m", 2.0)
    assert set(s.from_env) == {"base_url", "model", "timeout_s"}
    s = parse_settings({"env_prefix": "DESCRIBE_"}, dict(env, DESCRIBE_MODEL="x"))
    assert s.model == "x" and s.base_url == "https://api.openai.com/v1"


@pytest.mark.parametrize("params, fragment", [
    ({"api_key": "sk-123"}, "never put the key in config"),
    ({"bogus": "1"}, "unknown config parameter"),
    ({"max_tokens": "many"}, "'max_tokens'='many' is invalid"),
    ({"on_failure": "explode"}, "on_failure must be one of"),
    ({"prompt_template": "{prompt} {image}"}, "unknown placeholder(s) ['image']"),
    ({"base_url": "api.openai.com"}, "base_url must start with http"),
    ({"temperature": "3"}, "temperature must be in"),
])
def test_mistakes_fail_at_load_with_what_to_fix(params, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        parse_settings(params, {})
    assert fragment in str(info.value)


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="environment variable LLM_MAX_ATTEMPTS"):
        parse_settings({}, {"LLM_MAX_ATTEMPTS": "three"})


def test_request_overrides_stay_within_config_limits():
    s = parse_settings({"allowed_models": "gpt-4o-mini*", "max_tokens_limit": "512"}, {})
    assert s.resolve_overrides({}) == Overrides("gpt-4o-mini", 0.2, 256, 15.0)
    assert s.resolve_overrides({"model": "gpt-4o-mini-2024-07-18", "temperature": "0.5",
                                "max_tokens": 100, "timeout_s": 2, "other_step": "x"}) == \
        Overrides("gpt-4o-mini-2024-07-18", 0.5, 100, 2.0)
    for bad in ({"model": "gpt-4o"}, {"temperature": 1.5}, {"max_tokens": 513}, {"max_tokens": 2.5},
                {"timeout_s": 60}, {"temperature": "hot"}, {"max_tokens": True}):
        with pytest.raises(InvalidOverride) as refused:
            s.resolve_overrides(bad)
        assert refused.value.field == next(iter(bad))  # the parameter at fault, for the error contract


def test_api_key_from_env_var_or_file(tmp_path):
    s = parse_settings({}, {})
    assert s.load_api_key({"LLM_API_KEY": " sk-abc \n"}) == ("sk-abc", "environment variable LLM_API_KEY")
    assert s.load_api_key({})[0] is None
    custom = parse_settings({"api_key_env": "DEEPSEEK_API_KEY"}, {})
    assert custom.load_api_key({"DEEPSEEK_API_KEY": "k"})[0] == "k"
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    from_file = parse_settings({}, {"LLM_API_KEY_FILE": str(key_file)})
    assert from_file.load_api_key({"LLM_API_KEY": "ignored"}) == ("sk-from-file", f"file {key_file}")
    missing = parse_settings({"api_key_file": str(tmp_path / "absent")}, {})
    key, where = missing.load_api_key({})
    assert key is None and "absent" in where


def test_an_attempt_timeout_longer_than_the_request_is_refused_at_load():
    with pytest.raises(ConfigError, match="timeout_s must not exceed total_timeout_s"):
        parse_settings({"timeout_s": "40", "total_timeout_s": "30"}, environ={})
    assert parse_settings({"timeout_s": "30", "total_timeout_s": "30"}, environ={}).timeout_s == 30


@pytest.mark.parametrize("base_url, required, needs", [
    ("https://api.openai.com/v1", "auto", True),
    ("https://API.OpenAI.com/v1", "auto", True),
    ("https://myorg.openai.azure.com/openai", "auto", True),
    ("https://api.deepseek.com", "auto", True),
    ("https://api.holysheep.ai/v1", "auto", True),
    ("https://evilapi.openai.com/v1", "auto", False),      # not a subdomain of a hosted API
    ("https://api.openai.com.example.net/v1", "auto", False),
    ("http://127.0.0.1:11434/v1", "auto", False),          # Ollama
    ("http://vllm.llm.svc:8000/v1", "auto", False),        # a vLLM service in the cluster
    ("http://127.0.0.1:11434/v1", "true", True),
    ("https://api.openai.com/v1", "false", False),
    ("https://api.openai.com/v1", "yes", True),
])
def test_whether_the_endpoint_needs_a_key(base_url, required, needs):
    assert parse_settings({"base_url": base_url, "api_key_required": required}, {}).needs_key() is needs


def test_api_key_required_defaults_to_auto_and_refuses_other_words():
    assert parse_settings({}, {}).api_key_required == "auto"
    with pytest.raises(ConfigError, match="'api_key_required'='maybe' is invalid: expected auto, true or false"):
        parse_settings({"api_key_required": "maybe"}, {})


@pytest.mark.parametrize("model, prices", [
    ("gpt-4o-mini", (0.15, 0.60)),
    ("gpt-4o-mini-2024-07-18", (0.15, 0.60)),   # a dated snapshot: its model's price
    ("gpt-4o", (2.50, 10.00)),
    ("gpt-4.1", (2.00, 8.00)),
    ("gpt-4.1-mini-2025-04-14", (0.40, 1.60)),  # the longest name that fits
    ("claude-sonnet-4-5", (3.00, 15.00)),
    ("deepseek-chat", (0.28, 0.42)),
    ("llama3.1", None),                          # a local model nobody priced: unknown
    ("gpt-4o-minis", None),                      # not a snapshot of gpt-4o-mini
])
def test_each_model_named_in_the_docs_has_its_own_price_and_others_none(model, prices):
    assert parse_settings({}, {}).prices_for(model) == prices


def test_prices_set_for_the_endpoint_or_a_model_win_over_the_table():
    s = parse_settings({"model_prices": '{"gpt-4o": [1, 2]}'}, {"LLM_PRICE_INPUT_PER_MILLION": "0",
                                                                 "LLM_PRICE_OUTPUT_PER_MILLION": "0"})
    assert s.prices_for("gpt-4o") == (1.0, 2.0) and s.prices_for("llama3.1") == (0.0, 0.0)
    assert s.prices_for("claude-sonnet-4-5") == (0.0, 0.0)  # the endpoint's price is every model's
