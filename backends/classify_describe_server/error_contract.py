"""The error contract between our backends and the OpenAI front.

Triton passes an error on as a message only (a decoupled model's errors reach
a gRPC stream without even a status code), so our backends begin the message
with a token that the front reads instead of matching the prose:

    [code=invalid_parameter field=max_tokens] max_tokens must be an integer in [1, 1024] ...

`code` says what happened, `field` names the input tensor or request
parameter at fault when there is one. This one module is the contract: every
backend and openai_front/ import it (docs/DESIGN.md#errors). Standard library only.
"""

import dataclasses
import re

# The request must change (the backend answers INVALID_ARG):
INVALID_INPUT = "invalid_input"            # an input tensor: IMAGE, PROMPT, LABELS, SCORES
INVALID_PARAMETER = "invalid_parameter"    # a request parameter: model, temperature, max_tokens, timeout_s
# Not the request's fault, worth a retry (UNAVAILABLE, CANCELLED):
UPSTREAM_UNAVAILABLE = "upstream_unavailable"  # on_failure=error and the LLM could not answer
MODEL_UNLOADING = "model_unloading"
OVERLOADED = "overloaded"                  # a streaming model has as many streams open as it takes
REQUEST_CANCELLED = "request_cancelled"
# The server's fault (INTERNAL):
INTERNAL = "internal"

CODES = frozenset({INVALID_INPUT, INVALID_PARAMETER, UPSTREAM_UNAVAILABLE, MODEL_UNLOADING, OVERLOADED,
                   REQUEST_CANCELLED, INTERNAL})
_TOKEN = re.compile(r"\[code=([a-z_]+)(?: field=([A-Za-z_]+))?\] ")


@dataclasses.dataclass(frozen=True)
class CodedError:
    code: str
    field: str  # None when no one input or parameter is at fault
    text: str   # the message for people, without the token


def tagged(code, text, field=None):
    """`text` with the token in front: what a backend puts in its TritonError."""
    if code not in CODES:
        raise ValueError(f"unknown error code {code!r}")
    if field is not None and not re.fullmatch(r"[A-Za-z_]+", field):
        raise ValueError(f"a field is a tensor or parameter name, got {field!r}")
    return f"[code={code}{f' field={field}' if field else ''}] {text}"


def read(message):
    """The CodedError a message starts with, or None (an error that is not ours: Triton's own)."""
    match = _TOKEN.match(message)
    if match is None or match.group(1) not in CODES:
        return None
    return CodedError(match.group(1), match.group(2), message[match.end():])
