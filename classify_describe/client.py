"""Sync (HTTP or gRPC) and asyncio clients for the classify_and_describe ensemble.

Both speak the ensemble's public contract (IMAGE, optional PROMPT in; LABELS,
SCORES, DESCRIPTION, DESCRIPTION_SOURCE, USAGE out) and return `Result`.
"""

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np

MODEL_NAME = "classify_and_describe"
OUTPUT_NAMES = ("LABELS", "SCORES", "DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE")


class TritonRequestError(RuntimeError):
    """The server answered this request with an error (bad image, unknown model...)."""


# What `retries=N` resends: the request never got an answer because the
# connection failed (refused while the server restarts, reset, closed), or the
# server said UNAVAILABLE (gRPC status, HTTP 503: stopping, model not ready).
# Never an answer that says the request itself is wrong (INVALID_ARG / 400).
_RETRY_STATUSES = {"StatusCode.UNAVAILABLE", "503"}


def _connection_errors():
    errors = [ConnectionError, TimeoutError]
    try:
        import aiohttp
        errors.append(aiohttp.ClientConnectionError)
    except ImportError:
        pass
    return tuple(errors)


def _retryable(error, module):
    if isinstance(error, module.InferenceServerException):
        return str(error.status()) in _RETRY_STATUSES
    # geventhttpclient raises plain socket errors (ConnectionRefusedError, reset);
    # aiohttp its ClientConnectionError family. A timeout is not resent here: the
    # server may still be working on the request.
    return isinstance(error, _connection_errors()) and not isinstance(error, TimeoutError)


def _backoff_s(base_s, attempt):
    # Exponential with full jitter, capped: clients that lost the same server do
    # not all come back in the same instant.
    return random.uniform(0, min(5.0, base_s * (2 ** attempt)))


def _check_retries(retries, retry_backoff_s):
    if retries < 0 or retry_backoff_s < 0:
        raise ValueError("retries and retry_backoff_s must be >= 0")


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


def _text(value):
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _parse(result, latency_ms):
    labels = [_text(v) for v in result.as_numpy("LABELS")[0]]
    scores = [float(v) for v in result.as_numpy("SCORES")[0]]
    usage_text = _text(result.as_numpy("USAGE")[0][0])
    try:
        usage = json.loads(usage_text)
    except json.JSONDecodeError:
        usage = {"raw": usage_text}
    return Result(
        labels=labels, scores=scores,
        description=_text(result.as_numpy("DESCRIPTION")[0][0]),
        description_source=_text(result.as_numpy("DESCRIPTION_SOURCE")[0][0]),
        usage=usage, latency_ms=latency_ms)


class Client:
    """Blocking client. `protocol` is "http" (url host:8000) or "grpc" (host:8001)."""

    def __init__(self, url="127.0.0.1:8000", protocol="http", model_name=MODEL_NAME,
                 timeout_s=120.0, retries=0, retry_backoff_s=0.5):
        """`retries`: how many times to resend a request that got no answer
        (connection refused or broken, e.g. while the server restarts) or
        UNAVAILABLE; 0 (the default) never resends. Errors about the request
        itself (INVALID_ARG: a bad image, a limit) are never resent."""
        _check_retries(retries, retry_backoff_s)
        self._retries, self._retry_backoff_s = retries, retry_backoff_s
        self.retried = 0  # resends so far, for callers who count them
        self._module = _protocol_module(protocol, asynchronous=False)
        self._protocol = protocol
        self._model_name = model_name
        self._timeout_s = timeout_s
        if protocol == "http":
            self._client = self._module.InferenceServerClient(
                url, connection_timeout=timeout_s, network_timeout=timeout_s)
        else:
            self._client = self._module.InferenceServerClient(url)

    def infer(self, image, prompt=None, parameters=None):
        """`parameters`: optional per-request LLM overrides, e.g. {"temperature": 0.2}."""
        inputs, outputs = _build_inputs(self._module, image, prompt)
        kwargs = {"client_timeout": self._timeout_s} if self._protocol == "grpc" else {}
        started = time.perf_counter()
        for attempt in range(self._retries + 1):
            try:
                result = self._client.infer(self._model_name, inputs, outputs=outputs,
                                            parameters=parameters, **kwargs)
                break
            except Exception as error:
                if attempt < self._retries and _retryable(error, self._module):
                    self.retried += 1
                    time.sleep(_backoff_s(self._retry_backoff_s, attempt))
                    continue
                if isinstance(error, self._module.InferenceServerException):
                    raise TritonRequestError(error.message()) from None
                raise
        return _parse(result, (time.perf_counter() - started) * 1e3)

    def is_ready(self):
        return self._client.is_server_ready() and self._client.is_model_ready(self._model_name)

    def close(self):
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """asyncio client that keeps up to `concurrency` requests in flight.

    `infer_many` starts a new request as soon as any finishes (a sliding
    window), unlike sending a batch with gather and waiting for its slowest
    member before the next batch.
    """

    def __init__(self, url="127.0.0.1:8000", protocol="http", model_name=MODEL_NAME,
                 concurrency=8, timeout_s=120.0, retries=0, retry_backoff_s=0.5):
        """`retries`: as for Client (connection failures and UNAVAILABLE only)."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        _check_retries(retries, retry_backoff_s)
        self._retries, self._retry_backoff_s = retries, retry_backoff_s
        self.retried = 0
        self._module = _protocol_module(protocol, asynchronous=True)
        self._protocol = protocol
        self._model_name = model_name
        self._timeout_s = timeout_s
        self._limit = asyncio.Semaphore(concurrency)
        if protocol == "http":
            self._client = self._module.InferenceServerClient(
                url, conn_limit=concurrency, conn_timeout=timeout_s)
        else:
            self._client = self._module.InferenceServerClient(url)

    async def infer(self, image, prompt=None, parameters=None):
        inputs, outputs = _build_inputs(self._module, image, prompt)
        # gRPC takes a per-call deadline; HTTP's is conn_timeout on the session.
        kwargs = {"client_timeout": self._timeout_s} if self._protocol == "grpc" else {}
        async with self._limit:
            started = time.perf_counter()
            for attempt in range(self._retries + 1):
                try:
                    result = await self._client.infer(
                        self._model_name, inputs, outputs=outputs, parameters=parameters, **kwargs)
                    break
                except Exception as error:
                    if attempt < self._retries and _retryable(error, self._module):
                        self.retried += 1
                        await asyncio.sleep(_backoff_s(self._retry_backoff_s, attempt))
                        continue
                    if isinstance(error, self._module.InferenceServerException):
                        raise TritonRequestError(error.message()) from None
                    raise
            return _parse(result, (time.perf_counter() - started) * 1e3)

    async def infer_many(self, images, prompt=None):
        """Yield (index, Result or TritonRequestError) in completion order."""

        async def one(index, image):
            try:
                return index, await self.infer(image, prompt)
            except TritonRequestError as error:
                return index, error

        tasks = [asyncio.ensure_future(one(i, image)) for i, image in enumerate(images)]
        try:
            for finished in asyncio.as_completed(tasks):
                yield await finished
        finally:
            for task in tasks:
                task.cancel()

    async def close(self):
        await self._client.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
