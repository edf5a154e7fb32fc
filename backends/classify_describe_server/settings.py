"""Typed settings for the describe step, parsed once at model load.

Sources, lowest to highest precedence: the defaults below, the model's
config.pbtxt `parameters`, then environment variables named
`<env_prefix><NAME>` (e.g. LLM_BASE_URL, LLM_MODEL, LLM_TIMEOUT_S), so one
committed model repository can point at any endpoint. The API key itself is
never a setting: it is read from the environment variable `api_key_env`
(default `<env_prefix>API_KEY`) or from the file `api_key_file`.

A problem in config or environment raises ConfigError, a request parameter
out of the configured limits InvalidOverride; both say what to fix.
"""

import dataclasses
import fnmatch
import json
import math
import os
import re
import string
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from .config import ConfigError

DEFAULT_SYSTEM_PROMPT = (
    "You describe a photo. You get the top labels of an ImageNet image classifier with their "
    "confidences, and the photo itself when it is attached. Look at the photo when you have it; "
    "use the labels as hints and say when the classifier is unsure. "
    "Answer in plain prose, at most a short paragraph."
)
DEFAULT_PROMPT_TEMPLATE = (
    "{prompt}\n\nAn ImageNet image classifier's top labels for this photo, with confidence:\n{labels}"
)
# The placeholders a prompt template may use (see prompting.py).
TEMPLATE_FIELDS = {"prompt", "labels", "top_label"}
ON_FAILURE = ("fallback", "error")
VISION = ("off", "on", "auto")
VISION_DETAIL = ("low", "high", "auto")
KEY_REQUIRED = ("auto", "true", "false")
# USD per million (input, output) tokens of the models the docs name, as their providers list
# them; model_prices or price_*_per_million override, and a model not here costs "unknown".
PRICES = {
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4o": (2.50, 10.00),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1-nano": (0.10, 0.40),
    "claude-sonnet-4-5": (3.00, 15.00),
    "claude-sonnet-4.5": (3.00, 15.00),
    "deepseek-chat": (0.28, 0.42),       # DeepSeek V3.2
    "deepseek-reasoner": (0.28, 0.42),
}
# Hosted OpenAI-compatible APIs that refuse every call without a key (and their subdomains).
KEYED_HOSTS = ("api.openai.com", "openai.azure.com", "api.deepseek.com", "api.holysheep.ai", "api.anthropic.com",
               "openrouter.ai", "api.groq.com", "api.together.xyz", "api.mistral.ai", "api.fireworks.ai",
               "generativelanguage.googleapis.com", "api.x.ai", "api.perplexity.ai")
MAX_MODEL_NAME = 256
# What a request's `model` may hold: the ids of OpenAI, DeepSeek, vLLM (Qwen/Qwen2-VL-7B-Instruct),
# Ollama (llava:13b) and dated snapshots, no whitespace or control characters.
REQUEST_MODEL_NAME = re.compile(rf"[A-Za-z0-9_.:/@+-]{{1,{MAX_MODEL_NAME}}}")


class InvalidOverride(ValueError):
    """A request parameter (model, temperature, ...) is outside what the config allows."""

    def __init__(self, message, field):
        super().__init__(message)
        self.field = field  # the request parameter at fault


@dataclass(frozen=True)
class Overrides:
    """What one request may choose within the config's limits (its Triton
    request parameters), checked by Settings.resolve_overrides."""

    model: str
    temperature: float
    max_tokens: int
    timeout_s: float


@dataclass(frozen=True)
class Settings:
    env_prefix: str = "LLM_"
    base_url: str = "https://api.openai.com/v1"
    model: str = "gpt-4o-mini"
    # Comma-separated glob patterns a request may pick with the `model`
    # parameter; the default model is always allowed.
    allowed_models: tuple = ()
    # How many distinct models requests may pick besides the default (see RequestModels).
    max_request_models: int = 32
    max_tokens: int = 256
    max_tokens_limit: int = 1024
    temperature: float = 0.2
    temperature_min: float = 0.0
    temperature_max: float = 1.0
    timeout_s: float = 15.0        # one upstream attempt
    total_timeout_s: float = 30.0  # all attempts and back-off of one request
    max_attempts: int = 3
    backoff_base_s: float = 0.25
    backoff_max_s: float = 4.0
    max_retry_after_s: float = 10.0  # a longer Retry-After means: fall back now
    circuit_failure_threshold: int = 5
    circuit_cooldown_s: float = 10.0
    max_in_flight: int = 1024
    # How often an in-flight request asks Triton whether the client cancelled it
    # (each ask is a round trip to the server process).
    cancel_poll_s: float = 1.0
    # Streaming models only: streams open at once on the instance, from the request
    # taken to its final response; one more is refused at once (UNAVAILABLE,
    # code=overloaded). 500 streams on one instance held on 2 cores (docs/streaming.md).
    max_open_streams: int = 512
    # classify_and_describe_stream only: photos taken but not yet classified, each
    # holding its IMAGE (up to 20 MiB); about 1 s of the classifier's work on 2 cores.
    max_photos_waiting: int = 64
    # The longest answer kept, whatever max_tokens allows (16 characters a token,
    # describer.CHARS_PER_TOKEN): past either, the text is cut and ends as llm_partial
    # (fallback_reason answer_too_long), never cached.
    max_answer_chars: int = 16384
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    default_prompt: str = "Describe this object in detail"
    max_prompt_chars: int = 2000  # a caller's PROMPT is input tokens we pay for
    # A caller may send its own LABELS to describe directly: they are paid input too.
    max_labels: int = 20
    max_label_chars: int = 200
    # USD per million tokens for every model (a local server: 0); None: each model's price from
    # model_prices, else from PRICES, else unknown (USAGE cost_usd null, no cost counted).
    price_input_per_million: float = None
    price_output_per_million: float = None
    # {"model": [input_price, output_price]}, over PRICES.
    model_prices: dict = field(default_factory=dict)
    api_key_env: str = ""  # empty: <env_prefix>API_KEY
    api_key_file: str = ""
    # auto: a key is needed only by the hosted APIs in KEYED_HOSTS; any other endpoint (a local
    # vLLM, Ollama, llama.cpp, LM Studio) without a key is called without Authorization.
    api_key_required: str = "auto"
    on_failure: str = "fallback"
    cache_enabled: bool = True
    cache_max_entries: int = 10000
    cache_ttl_s: float = 3600.0
    # Whether the LLM is shown the photo (VIEW, made by preprocess) as an image part of the user
    # message: "on" always, "auto" unless the model refused image input (then text-only for
    # vision_refusal_memory_s), "off" never (docs/llm-endpoints.md#vision).
    vision: str = "auto"
    vision_detail: str = "low"  # the image part's detail: "low" is OpenAI's 85-token tier
    vision_refusal_memory_s: float = 600.0
    # A VIEW over this is refused (preprocess makes at most its view_max_bytes): a client calling
    # describe directly must not push megabytes to the paid upstream.
    max_view_bytes: int = 1048576
    # The client's system messages and earlier turns (request parameter `conversation`).
    max_conversation_messages: int = 32
    max_conversation_chars: int = 32000
    # A streaming model that takes a photo (IMAGE) asks this model for LABELS and
    # SCORES first (BLS); empty: requests carry LABELS and SCORES themselves.
    classify_model: str = ""
    # Names of the settings that came from the environment (for the load log).
    from_env: tuple = ()

    # -- per-request overrides -------------------------------------------------

    def is_model_allowed(self, model):
        return model == self.model or any(fnmatch.fnmatchcase(model, p) for p in self.allowed_models)

    def prices_for(self, model):
        """(input, output) USD per million tokens of `model`, or None when nobody said: its
        model_prices entry, else price_*_per_million, else PRICES (a dated snapshot,
        gpt-4o-mini-2024-07-18 or claude-sonnet-4-5-20250929, priced as its model)."""
        if model in self.model_prices:
            return self.model_prices[model]
        if self.price_input_per_million is not None or self.price_output_per_million is not None:
            return self.price_input_per_million or 0.0, self.price_output_per_million or 0.0
        known = [name for name in PRICES if model == name or (model.startswith(name + "-")
                                                               and model[len(name) + 1:][:1].isdigit())]
        return PRICES[max(known, key=len)] if known else None

    def resolve_overrides(self, params):
        """The Overrides of one request.

        `params` are the Triton request parameters; unknown keys are ignored
        (an ensemble may carry parameters meant for other steps). Values out
        of the limits set in config raise InvalidOverride, never silently clamp.
        """
        model = params.get("model", self.model)
        if not isinstance(model, str) or not model:
            raise InvalidOverride("parameter 'model' must be a non-empty string", "model")
        # A glob's * matches anything, newlines and megabytes included, and an admitted name is kept
        # (breaker, metric labels, log lines): names are held to what model ids are made of.
        if "model" in params and not REQUEST_MODEL_NAME.fullmatch(model):
            raise InvalidOverride(f"parameter 'model' must be 1 to {MAX_MODEL_NAME} letters, digits or ._:/@+- "
                                  "(a model id)", "model")
        if not self.is_model_allowed(model):
            raise InvalidOverride(f"model '{model}' is not allowed here (allowed_models)", "model")
        temperature = _number(params, "temperature", self.temperature)
        if not self.temperature_min <= temperature <= self.temperature_max:
            raise InvalidOverride(
                f"temperature {temperature} is outside [{self.temperature_min}, {self.temperature_max}]", "temperature")
        max_tokens = _number(params, "max_tokens", self.max_tokens)
        if max_tokens != int(max_tokens) or not 1 <= max_tokens <= self.max_tokens_limit:
            raise InvalidOverride(f"max_tokens must be an integer in [1, {self.max_tokens_limit}] "
                                f"(max_tokens_limit in the model config), got {max_tokens:g}", "max_tokens")
        # A caller may only shorten the per-attempt timeout ("answer fast or fall back").
        timeout_s = _number(params, "timeout_s", self.timeout_s)
        if not 0 < timeout_s <= self.timeout_s:
            raise InvalidOverride(f"timeout_s must be in (0, {self.timeout_s}]", "timeout_s")
        return Overrides(model, float(temperature), int(max_tokens), float(timeout_s))

    # -- the API key -------------------------------------------------------------

    def needs_key(self):
        """Whether the endpoint cannot be called without a key: api_key_required true, or auto
        and base_url a hosted API (KEYED_HOSTS)."""
        if self.api_key_required != "auto":
            return self.api_key_required == "true"
        host = (urlsplit(self.base_url).hostname or "").lower()
        return any(host == known or host.endswith("." + known) for known in KEYED_HOSTS)

    def load_api_key(self, environ):
        """Return (key or None, where it was looked for). Never logs the key."""
        if self.api_key_file:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    key = f.read().strip()
            except OSError as exc:
                return None, f"file {self.api_key_file} ({exc.strerror})"
            return key or None, f"file {self.api_key_file}"
        env_name = self.api_key_env or self.env_prefix + "API_KEY"
        return environ.get(env_name, "").strip() or None, f"environment variable {env_name}"


class RequestModels:
    """The models requests have picked with the `model` parameter, at most
    `max_request_models` besides the default one.

    Each upstream model gets its own circuit breaker and metric series, so the
    names a glob in allowed_models lets through (gpt-4o-mini-1, -2, ...) must
    not grow them without bound. A name beyond the cap is refused; names once
    admitted stay admitted, since their breaker and series live as long as the
    model. Used from the model thread only (execute).
    """

    def __init__(self, settings):
        self.settings = settings
        self._admitted = set()

    def admit(self, model):
        if model == self.settings.model or model in self._admitted:
            return
        limit = self.settings.max_request_models
        if len(self._admitted) >= limit:
            raise InvalidOverride(
                f"model '{model}' is refused: requests have already picked {limit} other models "
                f"(max_request_models={limit} in the model config); use one of those or the default "
                f"'{self.settings.model}'", "model")
        self._admitted.add(model)


def _number(params, name, default):
    value = params.get(name, default)
    if isinstance(value, bool):
        raise InvalidOverride(f"parameter '{name}' must be a number", name)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InvalidOverride(f"parameter '{name}' must be a number, got {value!r}", name) from None
    if not math.isfinite(value):
        raise InvalidOverride(f"parameter '{name}' must be finite", name)
    return value


def _parse_bool(text):
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _convert(name, kind, text):
    if kind is bool:
        return _parse_bool(text)
    if kind is int:
        return int(text)
    if kind is float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value
    if name == "api_key_required":
        if text.strip().lower() == "auto":
            return "auto"
        try:
            return "true" if _parse_bool(text) else "false"
        except ValueError:
            raise ValueError(f"expected auto, true or false, got {text!r}") from None
    if name in ("vision", "vision_detail", "on_failure"):
        return text.strip().lower()
    if name == "allowed_models":
        return tuple(p.strip() for p in text.split(",") if p.strip())
    if name == "model_prices":
        prices = json.loads(text or "{}")
        if not isinstance(prices, dict) or not all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)
                for v in prices.values()):
            raise ValueError('expected JSON like {"gpt-4o": [2.5, 10.0]} (USD per million tokens)')
        return {k: (float(v[0]), float(v[1])) for k, v in prices.items()}
    return text


_FIELDS = {f.name: f for f in dataclasses.fields(Settings) if f.name != "from_env"}
# A field's kind: its default's type, or its annotation where the default says none (None, a factory).
_KINDS = {name: f.type if f.default is None or f.default is dataclasses.MISSING else type(f.default)
          for name, f in _FIELDS.items()}


def parse_settings(parameters: dict[str, str], environ=None) -> Settings:
    """Build Settings from config.pbtxt parameters ({key: str}) and the environment."""
    environ = os.environ if environ is None else environ
    if "api_key" in parameters:
        raise ConfigError(
            "config parameter 'api_key' is refused: never put the key in config; "
            "set api_key_env (an environment variable name) or api_key_file (a path)")
    unknown = sorted(set(parameters) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown config parameter(s) {unknown}; known: {sorted(_FIELDS)}")

    raw = dict(parameters)
    prefix = raw.get("env_prefix", Settings.env_prefix)
    from_env = []
    for name in _FIELDS:
        if name == "env_prefix":
            continue
        env_value = environ.get(prefix + name.upper())
        if env_value is not None and env_value != "":
            raw[name] = env_value
            from_env.append(name)

    values = {}
    for name, text in raw.items():
        try:
            values[name] = _convert(name, _KINDS[name], text)
        except (ValueError, json.JSONDecodeError) as exc:
            source = f"environment variable {prefix}{name.upper()}" if name in from_env else "config parameter"
            raise ConfigError(f"{source} '{name}'={text!r} is invalid: {exc}") from None
    settings = Settings(**values, from_env=tuple(from_env))
    _validate(settings)
    return settings


def _validate(s):
    problems = []
    if not s.base_url.startswith(("http://", "https://")):
        problems.append(f"base_url must start with http:// or https://, got {shown_url(s.base_url)!r}")
    if not s.model:
        problems.append("model must not be empty")
    if not 1 <= s.max_tokens <= s.max_tokens_limit:
        problems.append("max_tokens must be in [1, max_tokens_limit]")
    if not s.temperature_min <= s.temperature <= s.temperature_max:
        problems.append("temperature must be in [temperature_min, temperature_max]")
    for name in ("timeout_s", "total_timeout_s", "circuit_cooldown_s", "cancel_poll_s"):
        if getattr(s, name) <= 0:
            problems.append(f"{name} must be > 0")
    for name in ("backoff_base_s", "backoff_max_s", "max_retry_after_s", "cache_ttl_s",
                 "price_input_per_million", "price_output_per_million"):
        if getattr(s, name) is not None and getattr(s, name) < 0:
            problems.append(f"{name} must be >= 0")
    for name in ("max_attempts", "circuit_failure_threshold", "max_in_flight", "cache_max_entries",
                 "max_prompt_chars", "max_labels", "max_label_chars", "max_open_streams", "max_photos_waiting",
                 "max_answer_chars", "max_view_bytes", "max_conversation_messages", "max_conversation_chars"):
        if getattr(s, name) < 1:
            problems.append(f"{name} must be >= 1")
    if s.timeout_s > s.total_timeout_s:
        # Otherwise no attempt could ever time out on its own: the request's
        # total deadline would always end it first, and the circuit would never
        # hear of a slow upstream.
        problems.append("timeout_s must not exceed total_timeout_s")
    if s.max_request_models < 0:
        problems.append("max_request_models must be >= 0")
    if s.on_failure not in ON_FAILURE:
        problems.append(f"on_failure must be one of {ON_FAILURE}")
    if s.vision not in VISION:
        problems.append(f"vision must be one of {VISION}")
    if s.api_key_required not in KEY_REQUIRED:
        problems.append(f"api_key_required must be one of {KEY_REQUIRED}")
    if s.vision_detail not in VISION_DETAIL:
        problems.append(f"vision_detail must be one of {VISION_DETAIL}")
    if s.vision_refusal_memory_s < 0:
        problems.append("vision_refusal_memory_s must be >= 0")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(s.prompt_template) if f is not None}
    except ValueError as exc:
        fields = set()
        problems.append(f"prompt_template is not a valid format string: {exc}")
    if fields - TEMPLATE_FIELDS:
        problems.append(f"prompt_template uses unknown placeholder(s) {sorted(fields - TEMPLATE_FIELDS)}; "
                        f"available: {sorted(TEMPLATE_FIELDS)}")
    if problems:
        raise ConfigError("invalid describe settings: " + "; ".join(problems))


def vision_off(environ):
    """Whether the environment switches the LLM's sight off (`<env_prefix>VISION=off`, the default
    prefix): the image steps then never encode a VIEW. A describe model with its own env_prefix
    reads its own vision setting; the image steps, which serve every describe model, read this one."""
    return environ.get(f"{Settings.env_prefix}VISION", "").strip().lower() == "off"


def shown_url(url):
    """`url` as a log or an error may show it: no user:password@ and no query (a
    gateway's ?key= or ?token=), which the scrubber's patterns would not all catch."""
    parts = urlsplit(str(url))
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
