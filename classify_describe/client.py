"""Sync (HTTP or gRPC) and asyncio clients for the classify_and_describe ensemble.

Both speak the ensemble's public contract (IMAGE, optional PROMPT in; LABELS,
SCORES, DESCRIPTION, DESCRIPTION_SOURCE, USAGE out) and return `Result`.
"""

import asyncio
import base64
import email.utils
import http.client
import itertools
import json
import math
import os
import pathlib
import random
import time
import zlib
from dataclasses import dataclass, field
from urllib.parse import quote

import numpy as np

from classify_describe import http_transport
from classify_describe.throttle import AdaptiveThrottle

MODEL_NAME = "classify_and_describe"
STREAM_MODEL_NAME = "classify_and_describe_stream"
OUTPUT_NAMES = ("LABELS", "SCORES", "DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE")
# The most bytes of an HTTP answer read, once inflated. An answer holds 5 labels and scores, a
# description of at most the describe model's max_answer_chars (16384 characters, 6 bytes each
# even as JSON escapes) and a USAGE of a few hundred bytes: under 128 KiB. 16 MiB is over a hundred
# times that, and still bounds what a broken server or proxy makes the client hold.
MAX_ANSWER_BYTES = 16 * 2**20
# The longest line of a generate_stream (one event), for both clients: aiohttp's readline limit,
# twice the session's read_bufsize, set to aiohttp 3.14's default (256 KiB). An event carries a
# chunk of the description; even the whole description would fit in one.
MAX_EVENT_LINE_BYTES = 2 * 2**18


class TritonRequestError(RuntimeError):
    """One request failed; the other requests are unaffected.

    `infer` raises it when the server answered with an error (a bad image, a
    limit, an unknown model, UNAVAILABLE), or with an answer that is not the
    ensemble's outputs (one missing, of another shape or type, USAGE not a JSON
    object, larger than max_answer_bytes: a proxy or a misconfigured server;
    `stream` the same for a malformed event). `infer_many` reports every failure of
    one image with it: also no answer (connection refused or closed, timed out)
    and a file that cannot be read, with the original error as `__cause__`.

    `retryable`: sending the same image again may succeed (no answer came, or
    the server was unavailable); False when the server refused the request
    itself (INVALID_ARG / 400) or the file cannot be read.
    `answered`: the server itself answered with this error (a 503 under
    overload included), as opposed to no answer at all.
    """

    def __init__(self, message, retryable=False, answered=False):
        super().__init__(message)
        self.retryable = retryable
        self.answered = answered


class Throttled(TritonRequestError):
    """Refused by this client, unsent: the server refused most of what it was
    sent lately (the client's adaptive throttle, classify_describe/throttle.py)."""

    def __init__(self):
        super().__init__("refused by this client unsent: the server refused most recent requests "
                         "(overloaded); retry later", retryable=True)


# Retryable: the request got no answer because the connection failed (refused
# while the server restarts, reset, closed, an answer cut short) or it timed
# out, or the server said UNAVAILABLE (gRPC status, HTTP 503: stopping, model
# not ready). Never an answer that says the request itself is wrong.
_UNAVAILABLE_STATUSES = {"StatusCode.UNAVAILABLE", "503"}
# Triton's queue policy refuses with these (full; waited past its timeout).
QUEUE_REFUSALS = ("Exceeds maximum queue size", "Request timeout expired")
_TIMEOUT_STATUSES = {"StatusCode.DEADLINE_EXCEEDED"}  # gRPC's client_timeout


def queue_refused(message):
    """Whether an UNAVAILABLE's message is Triton's queue policy refusing (the server answered)."""
    return any(text in (message or "") for text in QUEUE_REFUSALS)


def _no_answer_errors():
    # The sync client's transport (http.client) raises plain socket errors
    # (ConnectionRefusedError, reset, TimeoutError) and an http.client.HTTPException
    # for a connection closed before the whole answer; aiohttp its ClientConnectionError family,
    # ClientPayloadError for an answer cut short, and TimeoutError.
    errors = [ConnectionError, TimeoutError, asyncio.TimeoutError, http.client.HTTPException]
    try:
        import aiohttp
        errors += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    return tuple(errors)


def _timed_out(error, module):
    if isinstance(error, module.InferenceServerException):
        return str(error.status()) in _TIMEOUT_STATUSES
    return isinstance(error, (TimeoutError, asyncio.TimeoutError))


def retryable_status(status):
    """Whether a request the server answered with `status` (HTTP or gRPC) may succeed when sent
    again: the server was unavailable or the call timed out; every other status is the answer.
    The one rule for infer (a tritonclient error) and stream (the HTTP status)."""
    return str(status) in _UNAVAILABLE_STATUSES | _TIMEOUT_STATUSES


def _retryable(error, module):
    if isinstance(error, module.InferenceServerException):
        return retryable_status(error.status())
    return isinstance(error, _no_answer_errors())


def _server_answered(error, module):
    # gRPC reports a connection it could not make as UNAVAILABLE too; the
    # server's own UNAVAILABLE (a queue policy's refusal: full, or waited too long) says why.
    if not isinstance(error, module.InferenceServerException) or _timed_out(error, module):
        return False
    return str(error.status()) != "StatusCode.UNAVAILABLE" or queue_refused(error.message())


def _resend(error, module):
    # What `retries=N` resends: the retryable errors but a timeout, which the
    # server may still be working on; resending it would pile more work on a
    # server that is already slow.
    return _retryable(error, module) and not _timed_out(error, module)


def _server_took(error, module):
    # For the throttle: the server answered and did not refuse for overload (a
    # 400 about the image was accepted work). No answer and UNAVAILABLE were not.
    return isinstance(error, module.InferenceServerException) and not _retryable(error, module)


def _request_error(error, module, timeout_s):
    """The TritonRequestError that reports `error`, the last attempt's failure."""
    if isinstance(error, module.InferenceServerException) and str(error.status()).startswith("3"):
        message = f"HTTP {error.status()}, a redirect, not followed (it would send the photo and the inference key on)"
    elif isinstance(error, module.InferenceServerException):
        message = error.message()
    elif _timed_out(error, module):
        message = f"no answer within {timeout_s:g} s (timed out)"
    elif _retryable(error, module):
        message = f"no answer: {str(error) or type(error).__name__}"
    else:
        message = f"{type(error).__name__}: {error}"
    request_error = TritonRequestError(message, retryable=_retryable(error, module),
                                       answered=_server_answered(error, module))
    request_error.__cause__ = error
    return request_error


BACKOFF_CAP_S = 5.0
# A server's Retry-After is honoured up to this: above the OpenAI front's longest (59 s), whose
# spread a lower cap would undo (every wait past it cut to the same value brings the clients
# refused in one burst back in one burst, as measured at 30 s: docs/reliability.md#overload).
RETRY_AFTER_CAP_S = 60.0


def backoff_s(base_s, attempt, retry_after_s=None):
    """Seconds to wait before resending after failed attempt number `attempt`
    (0 for the first): uniform in [0, min(BACKOFF_CAP_S, base_s * 2**attempt)]
    (exponential with full jitter, so clients refused or cut off together do
    not all come back in the same instant), and never less than the server's
    `Retry-After` when it sent one (itself capped at RETRY_AFTER_CAP_S)."""
    ceiling = min(BACKOFF_CAP_S, base_s * 2.0 ** min(attempt, 32))  # 2**32: far past the cap, never overflows
    wait = random.uniform(0, ceiling)
    if retry_after_s is not None:
        wait = max(wait, min(float(retry_after_s), RETRY_AFTER_CAP_S))
    return wait


def _check_retries(retries, retry_backoff_s):
    if retries < 0 or retry_backoff_s < 0:
        raise ValueError("retries and retry_backoff_s must be >= 0")


# Attempts the throttle holds back that one resend covers. At 20x overload it
# held back 11 to 14 attempts per one it sent (make overload), on average: runs
# of held-back attempts are geometric, so the bound sits well past the mean and
# a request is seldom given up for attempts the server never saw. It also
# bounds a call: at most retries x (1 + HELD_BACK_PER_RESEND) back-offs of at
# most BACKOFF_CAP_S each.
HELD_BACK_PER_RESEND = 30


class _Attempts:
    """One call's attempts under the retry policy that Client and AsyncClient
    share (their loops only send and wait):

    - up to `retries` resends of attempts the server saw and refused as
      UNAVAILABLE or did not answer (never a timeout, nor an answer about the
      request itself), each after `backoff_s`;
    - an attempt the throttle held back (Throttled) is tried again after its
      back-off without using a resend, up to HELD_BACK_PER_RESEND x `retries`
      of them: the throttle exists to spare the server, not to give up sooner.
    """

    def __init__(self, client):
        self._client = client
        self._attempt = 0  # every attempt, sent or held back: the back-off grows with each
        self._resends_left = client._retries
        self._held_back_left = client._retries * HELD_BACK_PER_RESEND

    def begin(self):
        """Before sending: raises Throttled when the throttle holds this attempt back."""
        self._client._allow()

    def answered(self):
        self._client._count_accepted(None)

    def after_failure(self, error):
        """After a failed attempt: the seconds to wait before the next one, or
        raises what the caller gets."""
        client = self._client
        client._count_accepted(error)
        retry_after_s = getattr(error, "retry_after_s", None)  # an HTTP answer's Retry-After (_http_error)
        if isinstance(error, Throttled):
            resend = self._held_back_left > 0
            self._held_back_left -= 1
        else:
            # A server that asks for a longer wait than the caller gives an attempt (timeout_s):
            # its error now, rather than the caller's time slept away before it.
            waits_too_long = (retry_after_s is not None and client._timeout_s is not None
                              and min(retry_after_s, RETRY_AFTER_CAP_S) > client._timeout_s)
            resend = self._resends_left > 0 and _resend(error, client._module) and not waits_too_long
            self._resends_left -= 1
            client.retried += resend
        if not resend:
            if isinstance(error, client._module.InferenceServerException):
                raise _request_error(error, client._module, client._timeout_s) from None
            raise error
        self._attempt += 1
        return backoff_s(client._retry_backoff_s, self._attempt - 1, retry_after_s)


@dataclass
class Result:
    labels: list
    scores: list
    description: str
    description_source: str  # "llm", or "fallback" when no LLM answer was used
    usage: dict = field(default_factory=dict)  # tokens, cost_usd, model, latency, attempts
    latency_ms: float = 0.0  # client-side, request sent to answer received

    def as_dict(self):
        return {
            "labels": self.labels, "scores": self.scores, "description": self.description,
            "description_source": self.description_source, "usage": self.usage,
            "latency_ms": round(self.latency_ms, 2),
        }


@dataclass
class StreamEvent:
    """One response of classify_and_describe_stream, in the order they come:
    kind "labels" (labels, scores), then "text" (text: the next chunk of the
    description), then "done" (result: the whole Result, its description the
    chunks joined)."""

    kind: str
    labels: list = None
    scores: list = None
    text: str = None
    result: Result = None


class _StreamState:
    """Turns the stream's responses (dicts of output name -> value) into StreamEvents."""

    def __init__(self):
        self.started = time.perf_counter()
        self.labels, self.scores, self.parts = [], [], []
        self.done = False

    def events(self, outputs):
        try:
            yield from self._events(outputs)
        except (TypeError, ValueError, IndexError, KeyError) as error:
            raise _bad_answer(error) from error

    def _events(self, outputs):
        if "LABELS" in outputs:
            self.labels = [_text(v, "LABELS") for v in outputs["LABELS"]]
            self.scores = [_score(v) for v in outputs["SCORES"]]
            yield StreamEvent("labels", labels=self.labels, scores=self.scores)
        if outputs.get("DESCRIPTION"):
            text = _text(outputs["DESCRIPTION"], "DESCRIPTION")
            self.parts.append(text)
            yield StreamEvent("text", text=text)
        if "DESCRIPTION_SOURCE" in outputs:
            usage = _usage(_text(outputs.get("USAGE", "{}"), "USAGE"))
            self.done = True
            yield StreamEvent("done", result=Result(
                labels=self.labels, scores=self.scores, description="".join(self.parts),
                description_source=_text(outputs["DESCRIPTION_SOURCE"], "DESCRIPTION_SOURCE"), usage=usage,
                latency_ms=(time.perf_counter() - self.started) * 1e3))


def _stream_response(result):
    """(its outputs or None, whether it is the last) of one response of a gRPC stream."""
    response = result.get_response()
    return (_grpc_outputs(result) if response.outputs else None), response.parameters["triton_final_response"].bool_param


def _grpc_outputs(result):
    """{name: the first row's value(s)} of one gRPC stream response."""
    outputs = {}
    try:
        for output in result.get_response().outputs:
            value = result.as_numpy(output.name)[0]
            outputs[output.name] = value if output.name in ("LABELS", "SCORES") else value[0]
    except (TypeError, ValueError, IndexError) as error:
        raise _bad_answer(error) from error
    return outputs


def _sse_outputs(line):
    """{name: value} of one generate_stream event (`data: {...}`), or None for other lines;
    raises TritonRequestError for an error event."""
    if not line.startswith("data:"):
        return None
    try:
        event = json.loads(line[5:])
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep to read
        raise _bad_answer(error) from error
    if not isinstance(event, dict):
        raise _bad_answer(ValueError(f"an event is a JSON {type(event).__name__}, not an object"))
    if "error" in event:
        raise TritonRequestError(event["error"], answered=True)
    outputs = {}
    for name in OUTPUT_NAMES:
        if name in event:
            value = event[name]
            outputs[name] = value if name in ("LABELS", "SCORES") or not isinstance(value, list) else value[0]
    return outputs


ERROR_BODY_BYTES = http_transport.ERROR_BODY_BYTES  # of a failed request's body, for its message


def _http_refusal(status, body):
    """TritonRequestError for a generate_stream request answered `status`, with Triton's message."""
    message = _error_message(body)
    return TritonRequestError(f"HTTP {status}" + (f": {message}" if message else ""),
                              retryable=retryable_status(status), answered=True)


async def _body_start(response, limit):
    """Up to `limit` bytes of an aiohttp response's body (a single read returns what has arrived,
    which may be less)."""
    body = bytearray()
    while len(body) < limit:
        chunk = await response.content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def _error_message(body):
    """Triton's {"error": ...} message in a failed request's body: as JSON, or as a stream's first
    event (how Triton answers a generate_stream request it refuses, 400 for a bad image)."""
    text = body.decode("utf-8", "replace").strip()
    if text.startswith("data:"):
        text = text[5:].split("\n", 1)[0]
    try:
        return str(json.loads(text)["error"])[:500]
    except (ValueError, KeyError, TypeError, RecursionError):
        return ""


def _http_error(status, headers, body, module):
    """The InferenceServerException tritonclient raises for an infer answered `status` (the retry
    policy reads its status), with Triton's message and the wait its Retry-After asks for
    (`retry_after_s`, None without one)."""
    error = module.InferenceServerException(msg=_error_message(body) or f"HTTP {status}", status=str(status))
    error.retry_after_s = _retry_after_s(headers.get("Retry-After"))
    return error


def _retry_after_s(value):
    """The seconds a Retry-After header asks to wait (a number of seconds or an HTTP date), None for
    none or one that cannot be read."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:  # a year past datetime's (9999) is an OverflowError
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _http_request_body(inputs, outputs, parameters, key_headers):
    """(body, headers) of an infer request as tritonclient's HTTP clients make it (binary tensors)."""
    import tritonclient.http

    body, json_size = tritonclient.http.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, parameters=parameters)
    # Identity: nothing to inflate, so an answer's size on the wire is the size it has in memory.
    headers = {"Accept-Encoding": "identity", **(key_headers or {})}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


def _http_result(body, headers, max_bytes):
    """The InferResult of a 200's body; TritonRequestError when it is not an inference answer, or
    past `max_bytes` once inflated."""
    import tritonclient.http

    body = _inflated(body, headers.get("Content-Encoding"), max_bytes)
    try:
        return tritonclient.http.InferenceServerClient.parse_response_body(
            body, header_length=headers.get("Inference-Header-Content-Length"))
    except Exception as error:  # noqa: BLE001 - whatever a 200 that is no inference answer raises in the parser
        raise _bad_answer(error) from error


def _inflated(body, encoding, max_bytes):
    """`body` decoded as its Content-Encoding says, never past `max_bytes`. The clients ask for
    identity, yet a proxy may compress anyway; tritonclient would inflate it whole, and 255 KB of
    gzip inflate to 256 MB."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)  # as tritonclient reads them
    if wbits is None:
        raise _bad_answer(ValueError(f"Content-Encoding {encoding[:40]!r}, not gzip or deflate"))
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, max_bytes + 1)  # its buffer grows as it inflates
    except zlib.error as error:
        raise _bad_answer(error) from error
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    if not inflater.eof:
        raise _bad_answer(ValueError("the compressed answer is cut short"))
    return data


def _too_large(max_bytes):
    return TritonRequestError(f"the server's answer is larger than max_answer_bytes ({max_bytes} bytes); "
                              "not read further", answered=True)


def _generate_body(image, prompt, parameters):
    if not isinstance(image, (bytes, bytearray)):
        raise TypeError("image must be the encoded bytes of a photo (JPEG, PNG, ...)")
    # generate_stream takes JSON only: the photo travels as base64, which the stream model decodes.
    body = {"IMAGE": base64.b64encode(bytes(image)).decode("ascii")}
    if prompt is not None:
        body["PROMPT"] = prompt
    body.update(parameters or {})
    return json.dumps(body).encode()


def _protocol_module(protocol, asynchronous):
    if protocol == "http":
        if asynchronous:
            import tritonclient.http.aio as module
        else:
            import tritonclient.http as module
    elif protocol == "grpc":
        if asynchronous:
            import tritonclient.grpc.aio as module
        else:
            import tritonclient.grpc as module
    else:
        raise ValueError(f"protocol must be 'http' or 'grpc', not {protocol!r}")
    return module


def _build_inputs(module, image, prompt):
    if not isinstance(image, (bytes, bytearray)):
        raise TypeError("image must be the encoded bytes of a photo (JPEG, PNG, ...)")
    tensors = [("IMAGE", bytes(image))]
    if prompt is not None:
        tensors.append(("PROMPT", prompt.encode("utf-8")))
    inputs = []
    for name, value in tensors:
        tensor = module.InferInput(name, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.object_))
        inputs.append(tensor)
    outputs = [module.InferRequestedOutput(name) for name in OUTPUT_NAMES]
    return inputs, outputs


def _text(value, name):
    """One value of the BYTES output `name` as text; ValueError for a value of another type (a
    number: the output is not BYTES)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):  # BYTES in an answer's JSON form, and in a stream's events
        return value
    raise ValueError(f"output {name} holds a {type(value).__name__}, not text")


def _score(value):
    # Not float(value): it reads the text "0.5" and a bool as scores, from an output that is not FP32.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating)):
        raise ValueError(f"output SCORES holds a {type(value).__name__}, not a number")
    return float(value)


def _usage(text):
    """USAGE's JSON object; {"raw": text} for text that is not JSON (or nested too deep to read);
    ValueError for JSON of another kind (null, a list, a number)."""
    try:
        usage = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return {"raw": text}
    if not isinstance(usage, dict):
        raise ValueError(f"output USAGE is a JSON {type(usage).__name__}, not an object")
    return usage


def _parse(result, latency_ms):
    """The Result of an answer; TritonRequestError when the answer is not the ensemble's outputs
    (one is missing, of another shape or type): never a Result made of the wrong values."""
    try:
        labels = [_text(v, "LABELS") for v in _row(result, "LABELS")]
        scores = [_score(v) for v in _row(result, "SCORES")]
        if len(labels) != len(scores):
            raise ValueError(f"{len(labels)} LABELS and {len(scores)} SCORES")
        description, source, usage_text = (_text(_one(result, name), name)
                                           for name in ("DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE"))
        usage = _usage(usage_text)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as error:  # AttributeError: a JSON array
        raise _bad_answer(error) from error
    return Result(labels=labels, scores=scores, description=description, description_source=source,
                  usage=usage, latency_ms=latency_ms)


def _row(result, name):
    """The one row of a [1, k] output."""
    array = result.as_numpy(name)
    if array is None or array.ndim != 2 or array.shape[0] != 1:
        raise ValueError(f"output {name} is {'missing' if array is None else f'of shape {list(array.shape)}'}, "
                         "not [1, k]")
    return array[0]


def _one(result, name):
    row = _row(result, name)
    if len(row) != 1:
        raise ValueError(f"output {name} has {len(row)} values, not 1")
    return row[0]


def _bad_answer(error):
    return TritonRequestError(f"the server's answer is not the ensemble's outputs: {str(error)[:200]}",
                              answered=True)


def _key_headers(protocol, inference_key):
    """The header a server whose inference is closed by a key wants
    (TRITON_INFERENCE_KEY): `inference-key`, over gRPC with Triton's prefix. The key is stripped
    (one read from a file ends with a newline)."""
    inference_key = (inference_key or "").strip()
    if not inference_key:
        return None
    if not (inference_key.isascii() and inference_key.isprintable()):
        # Refused here, and without the key: the transport's own error would print it.
        raise ValueError("inference_key holds a control or non-ASCII character, which a header cannot carry "
                         "(the key is not shown)")
    return {"inference-key" if protocol == "http" else "triton-grpc-protocol-inference-key": inference_key}


def _copy(headers):
    # tritonclient's HTTP infer writes its own headers into the dict it is given.
    return dict(headers) if headers else None


class _Throttling:
    """The clients' adaptive throttle (classify_describe/throttle.py): on by
    default; `throttle=False` turns it off, an AdaptiveThrottle instance tunes
    it or shares it between clients of one server."""

    def _init_throttle(self, throttle):
        self.throttle = AdaptiveThrottle() if throttle is True else (throttle or None)
        self.throttled = 0  # attempts refused here, unsent

    def _allow(self):
        if self.throttle is not None and not self.throttle.allow():
            self.throttled += 1
            raise Throttled()

    def _count_accepted(self, error):
        """After an attempt: `error` None for an answer."""
        if self.throttle is not None and (error is None or _server_took(error, self._module)):
            self.throttle.accepted()


class Client(_Throttling):
    """Blocking client. `protocol` is "http" (url host:8000) or "grpc" (host:8001)."""

    def __init__(self, url="127.0.0.1:8000", protocol="http", model_name=MODEL_NAME,
                 timeout_s=120.0, retries=0, retry_backoff_s=0.5, inference_key=None, throttle=True,
                 max_answer_bytes=MAX_ANSWER_BYTES):
        """`inference_key`: for a server whose inference needs one
        (TRITON_INFERENCE_KEY); sent with every request, never printed. Surrounding
        whitespace is dropped; a control or non-ASCII character in it is a ValueError here.

        `retries`: how many times to resend a request that got no answer
        (connection refused or broken, e.g. while the server restarts) or
        UNAVAILABLE; 0 (the default) never resends: each attempt is sent once (a
        kept-alive connection the server closed while idle is noticed before
        sending, and a new one made). Errors about the request
        itself (INVALID_ARG: a bad image, a limit) are never resent, nor is a
        request that timed out (the server may still be working on it).
        Attempts the throttle holds back unsent do not use a resend (up to
        HELD_BACK_PER_RESEND x `retries` of them), so under a long overload a
        call may wait up to retries x (1 + HELD_BACK_PER_RESEND) back-offs.
        Over HTTP a resend never comes sooner than the server's Retry-After (up to
        RETRY_AFTER_CAP_S); one that asks for longer than `timeout_s` is not waited
        for: the call fails at once with the server's error.

        `timeout_s`: for the whole of one attempt (the name lookup, connect, send, the whole
        answer; for `stream`, the whole stream), not for each read; None: no
        limit. Threads may share a Client; over HTTP their requests take turns
        on its one connection.

        `max_answer_bytes`: the most bytes of an HTTP answer read, once inflated
        (default MAX_ANSWER_BYTES, 16 MiB: over a hundred times the largest answer
        the ensemble gives); a larger one is a TritonRequestError that names it.
        A stream's events are bounded too, to MAX_EVENT_LINE_BYTES each.

        `infer` raises TritonRequestError when the server answered with an
        error, and the connection's own error (ConnectionError, TimeoutError...)
        when no answer came."""
        _check_retries(retries, retry_backoff_s)
        self._retries, self._retry_backoff_s = retries, retry_backoff_s
        self.retried = 0  # resends so far of attempts that were sent, for callers who count them
        self._init_throttle(throttle)
        self._module = _protocol_module(protocol, asynchronous=False)
        self._protocol = protocol
        self._headers = _key_headers(protocol, inference_key)
        self._url = url
        self._model_name = model_name
        self._timeout_s = timeout_s
        self._max_answer_bytes = max_answer_bytes
        if protocol == "http":
            # Our own transport, not tritonclient's (geventhttpclient): that one resends on its
            # own and bounds each read, not the exchange (classify_describe/http_transport.py).
            self._client = http_transport.HttpTransport(url, timeout_s, max_answer_bytes)
        else:
            self._client = self._module.InferenceServerClient(url)

    def infer(self, image, prompt=None, parameters=None):
        """`parameters`: optional per-request LLM overrides, e.g. {"temperature": 0.2}."""
        inputs, outputs = _build_inputs(self._module, image, prompt)
        started = time.perf_counter()
        attempts = _Attempts(self)
        while True:
            try:
                attempts.begin()
                if self._protocol == "grpc":
                    result = self._client.infer(self._model_name, inputs, outputs=outputs, parameters=parameters,
                                                headers=_copy(self._headers), client_timeout=self._timeout_s)
                else:
                    answer = self._http_infer(inputs, outputs, parameters)
            except Exception as error:
                wait_s = attempts.after_failure(error)
            else:
                attempts.answered()
                if self._protocol == "http":
                    result = _http_result(*answer, self._max_answer_bytes)
                return _parse(result, (time.perf_counter() - started) * 1e3)
            time.sleep(wait_s)

    def _http_infer(self, inputs, outputs, parameters):
        """One POST to Triton's infer endpoint: (body, headers) of a 200, else the
        InferenceServerException tritonclient would raise."""
        body, headers = _http_request_body(inputs, outputs, parameters, self._headers)
        try:
            status, response_headers, data = self._client.request(
                "POST", f"/v2/models/{quote(self._model_name)}/infer", body=body, headers=headers)
        except http_transport.BodyTooLarge:
            raise _too_large(self._max_answer_bytes) from None
        if status != 200:
            raise _http_error(status, response_headers, data, self._module)
        return data, response_headers

    def stream(self, image, prompt=None, parameters=None, model_name=STREAM_MODEL_NAME):
        """Yield StreamEvents of one classify_and_describe_stream request: the
        labels as soon as they are known, the description chunk by chunk, then
        "done" with the whole Result. gRPC streams; HTTP uses generate_stream.
        Leaving the loop early cancels the request (over gRPC the server then
        stops the LLM call). An error answer raises TritonRequestError."""
        state = _StreamState()
        if self._protocol == "grpc":
            responses = self._grpc_stream(image, prompt, parameters, model_name)
        else:
            responses = self._http_stream(image, prompt, parameters, model_name)
        for outputs in responses:
            yield from state.events(outputs)
            if state.done:  # "done" is the last event, whatever the server sends after it
                return

    def _grpc_stream(self, image, prompt, parameters, model_name):
        import queue

        inputs, _ = _build_inputs(self._module, image, prompt)
        answers = queue.Queue()
        self._client.start_stream(callback=lambda result, error: answers.put((result, error)),
                                  stream_timeout=self._timeout_s, headers=_copy(self._headers))
        try:
            try:
                self._client.async_stream_infer(model_name, inputs, parameters=parameters,
                                                enable_empty_final_response=True)
            except self._module.InferenceServerException as error:
                # The stream failed before the request went (refused at its start,
                # e.g. a missing inference key): the callback got the reason.
                try:
                    error = answers.get(timeout=1)[1] or error
                except queue.Empty:
                    pass
                raise _request_error(error, self._module, self._timeout_s) from None
            while True:
                try:
                    result, error = answers.get(timeout=self._timeout_s)
                except queue.Empty:
                    raise TritonRequestError(f"the stream sent nothing more for {self._timeout_s:g} s and no "
                                             "final response", retryable=True) from None
                if error is not None:
                    raise _request_error(error, self._module, self._timeout_s) from None
                outputs, final = _stream_response(result)
                if outputs:
                    yield outputs
                if final:
                    return
        finally:
            # Cancels what is still running, when the caller stopped early.
            self._client.stop_stream(cancel_requests=True)

    def _http_stream(self, image, prompt, parameters, model_name):
        # timeout_s bounds the whole stream, as over gRPC and in AsyncClient, not each read.
        connection = http_transport.connect(self._url, http_transport.deadline_after(self._timeout_s))
        try:
            connection.request("POST", f"{self._client.base_path}/v2/models/{quote(model_name)}/generate_stream",
                               body=_generate_body(image, prompt, parameters),
                               headers={"Content-Type": "application/json", **(self._headers or {})})
            response = connection.getresponse()
            if response.status != 200:  # before any event: a failed request's body is no stream
                raise _http_refusal(response.status, response.read(ERROR_BODY_BYTES))
            # A line at a time, as long as AsyncClient's may be: one that never ends would fill memory.
            while raw := response.readline(MAX_EVENT_LINE_BYTES + 1):
                if len(raw) > MAX_EVENT_LINE_BYTES:
                    raise _bad_answer(ValueError(f"an event line is longer than {MAX_EVENT_LINE_BYTES} bytes"))
                outputs = _sse_outputs(raw.decode("utf-8", "replace").strip())
                if outputs is not None:
                    yield outputs
        finally:
            connection.close()  # early: the server sees the connection go

    def is_ready(self):
        if self._protocol == "grpc":
            return self._client.is_server_ready() and self._client.is_model_ready(self._model_name)
        deadline = http_transport.deadline_after(self._timeout_s)  # one timeout_s for both questions
        return all(self._client.request("GET", path, deadline=deadline)[0] == 200
                   for path in ("/v2/health/ready", f"/v2/models/{quote(self._model_name)}/ready"))

    def close(self):
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Throttling):
    """asyncio client that keeps up to `concurrency` requests in flight.

    `infer_many` starts a new request as soon as any finishes (a sliding
    window), unlike sending a batch with gather and waiting for its slowest
    member before the next batch.
    """

    def __init__(self, url="127.0.0.1:8000", protocol="http", model_name=MODEL_NAME,
                 concurrency=8, timeout_s=120.0, retries=0, retry_backoff_s=0.5, inference_key=None,
                 throttle=True, max_answer_bytes=MAX_ANSWER_BYTES):
        """`retries`: as for Client (no answer and UNAVAILABLE only, never a timeout, and
        Retry-After honoured); `inference_key`, `throttle` and `max_answer_bytes` too."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        _check_retries(retries, retry_backoff_s)
        self._retries, self._retry_backoff_s = retries, retry_backoff_s
        self.retried = 0
        self._init_throttle(throttle)
        self._module = _protocol_module(protocol, asynchronous=True)
        self._protocol = protocol
        self._headers = _key_headers(protocol, inference_key)
        if protocol == "http":
            http_transport.split_url(url)  # the sync client's url forms, and its errors for others
        self._url = url.rstrip("/")
        self._model_name = model_name
        self._timeout_s = timeout_s
        self._max_answer_bytes = max_answer_bytes
        self._concurrency = concurrency
        self._limit = asyncio.Semaphore(concurrency)
        if protocol == "http":
            # Our own session, not tritonclient's aio client: its session follows redirects, which
            # would send the photo and the inference key to whatever host a 307 names. The body is
            # still built and read by tritonclient (generate_request_body, parse_response_body).
            # auto_decompress=False: the requests ask for identity, and an answer compressed anyway
            # is inflated within max_answer_bytes (_inflated). aiohttp refuses a line longer than
            # twice read_bufsize: the stream's MAX_EVENT_LINE_BYTES whatever aiohttp's default.
            import aiohttp
            self._client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                                 timeout=aiohttp.ClientTimeout(total=timeout_s),
                                                 auto_decompress=False, read_bufsize=MAX_EVENT_LINE_BYTES // 2)
        else:
            self._client = self._module.InferenceServerClient(url)

    async def infer(self, image, prompt=None, parameters=None):
        inputs, outputs = _build_inputs(self._module, image, prompt)
        async with self._limit:
            started = time.perf_counter()
            attempts = _Attempts(self)
            while True:
                try:
                    attempts.begin()
                    if self._protocol == "grpc":
                        result = await self._client.infer(self._model_name, inputs, outputs=outputs,
                                                          parameters=parameters, headers=_copy(self._headers),
                                                          client_timeout=self._timeout_s)
                    else:
                        answer = await self._http_infer(inputs, outputs, parameters)
                except Exception as error:
                    wait_s = attempts.after_failure(error)
                else:
                    attempts.answered()
                    if self._protocol == "http":
                        result = _http_result(*answer, self._max_answer_bytes)
                    return _parse(result, (time.perf_counter() - started) * 1e3)
                await asyncio.sleep(wait_s)

    async def _http_infer(self, inputs, outputs, parameters):
        """One POST to Triton's infer endpoint, as tritonclient's aio client makes it but for
        redirects: (body, headers) of a 200, else the InferenceServerException it would raise."""
        body, headers = _http_request_body(inputs, outputs, parameters, self._headers)
        async with self._client.post(f"http://{self._url}/v2/models/{quote(self._model_name)}/infer", data=body,
                                     headers=headers, allow_redirects=False) as response:
            if response.status != 200:
                raise _http_error(response.status, response.headers, await _body_start(response, ERROR_BODY_BYTES),
                                  self._module)
            body = await _body_start(response, self._max_answer_bytes + 1)
            if len(body) > self._max_answer_bytes:
                raise _too_large(self._max_answer_bytes)
            return body, response.headers

    async def infer_many(self, images, prompt=None):
        """Yield (index, Result or TritonRequestError) for each image, in completion order.

        `images`: an iterable of encoded bytes or file paths. It is consumed only
        as the window frees and a path is read just before its request is sent,
        so a directory of thousands of photos is never all in memory. A failed
        image never ends the others: its TritonRequestError says what went wrong
        (after the retries) and whether it is `retryable`.
        """

        async def one(index, image):
            if isinstance(image, (str, os.PathLike)):
                try:
                    image = pathlib.Path(image).read_bytes()
                except OSError as error:
                    failure = TritonRequestError(f"cannot read the file: {error.strerror or error}")
                    failure.__cause__ = error
                    return index, failure
            try:
                return index, await self.infer(image, prompt)
            except TritonRequestError as error:
                return index, error
            except Exception as error:  # noqa: BLE001 - whatever failed, it failed this image only
                return index, _request_error(error, self._module, self._timeout_s)

        numbered = enumerate(images)
        in_flight = set()
        try:
            while True:
                for index, image in itertools.islice(numbered, self._concurrency - len(in_flight)):
                    in_flight.add(asyncio.ensure_future(one(index, image)))
                if not in_flight:
                    return
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield task.result()
        finally:
            for task in in_flight:
                task.cancel()

    async def stream(self, image, prompt=None, parameters=None, model_name=STREAM_MODEL_NAME):
        """As Client.stream, as an async generator; counts against `concurrency`."""
        state = _StreamState()
        async with self._limit:
            if self._protocol == "grpc":
                responses = self._grpc_stream(image, prompt, parameters, model_name)
            else:
                responses = self._http_stream(image, prompt, parameters, model_name)
            async for outputs in responses:
                for event in state.events(outputs):
                    yield event
                if state.done:  # "done" is the last event, whatever the server sends after it
                    return

    async def _grpc_stream(self, image, prompt, parameters, model_name):
        inputs, _ = _build_inputs(self._module, image, prompt)

        async def requests():
            yield {"model_name": model_name, "inputs": inputs, "parameters": parameters,
                   "enable_empty_final_response": True}
            await asyncio.Event().wait()  # keep the stream open until the answer is complete

        stream = self._client.stream_infer(requests(), stream_timeout=self._timeout_s, headers=_copy(self._headers))
        try:
            async for result, error in stream:
                if error is not None:
                    raise _request_error(error, self._module, self._timeout_s) from None
                outputs, final = _stream_response(result)
                if outputs:
                    yield outputs
                if final:
                    return
        finally:
            stream.cancel()  # ends the call; the server cancels what still runs

    async def _http_stream(self, image, prompt, parameters, model_name):
        import aiohttp

        # No redirect followed: it would send the photo and the inference key to another host.
        # Accept-Encoding identity: the session inflates nothing, and the events are read as lines.
        async with self._client.post(f"http://{self._url}/v2/models/{quote(model_name)}/generate_stream",
                                     data=_generate_body(image, prompt, parameters), allow_redirects=False,
                                     headers={"Content-Type": "application/json", "Accept-Encoding": "identity",
                                              **(self._headers or {})}) as response:
            if response.status != 200:  # before any event: a failed request's body is no stream
                raise _http_refusal(response.status, await _body_start(response, ERROR_BODY_BYTES))
            try:
                async for raw in response.content:
                    outputs = _sse_outputs(raw.decode("utf-8", "replace").strip())
                    if outputs is not None:
                        yield outputs
            except aiohttp.http_exceptions.LineTooLong as error:
                raise _bad_answer(error) from error

    async def close(self):
        await self._client.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
