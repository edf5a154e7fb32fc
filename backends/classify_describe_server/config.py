"""A model config's `parameters` read into typed, frozen settings: the one ConfigError and the
one parser that every backend (and the front, for its environment) uses."""

import dataclasses
import math


class ConfigError(ValueError):
    """A config parameter, an environment variable or a model file is wrong; the message says how to fix it."""


def model_parameters(model_config):
    """config.pbtxt `parameters` (the JSON Triton hands a Python model) as {key: string value}."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def positive_int(name, raw):
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"parameter {name} must be a positive integer, got {raw!r}")
    return value


def boolean(name, raw):
    value = str(raw).strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"parameter {name} must be true or false, got {raw!r}")
    return value == "true"


def text(name, raw):
    if not str(raw).strip():
        raise ConfigError(f"parameter {name} must not be empty")
    return str(raw).strip()


def triple(name, raw):
    try:
        values = tuple(float(part) for part in str(raw).split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"parameter {name} must be three comma-separated numbers (R,G,B), got {raw!r}")
    return values


# By the type of a field's default: bool before int (a bool is an int).
PARSERS = {bool: boolean, int: positive_int, str: text, tuple: triple}


def parse(settings_class, parameters, context="", also_known=()):
    """settings_class (a dataclass) from {key: string value}: each value parsed by its default's
    type, the rest defaulted; a key neither a field nor in also_known fails, naming the known ones."""
    fields = {field.name: field for field in dataclasses.fields(settings_class) if field.init}
    unknown = sorted(set(parameters) - set(fields) - set(also_known))
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}{context}; known: {sorted([*fields, *also_known])}")
    return settings_class(**{name: PARSERS[type(fields[name].default)](name, raw)
                             for name, raw in parameters.items() if name in fields})
