"""The front's only way to the pipeline: Triton's gRPC endpoint, through a
few tritonclient.grpc.aio channels used in turn (each channel multiplexes
every request in flight on it over HTTP/2). Triton's outputs become a plain
`Answer`; Triton's errors become FrontErrors with the status a client acts on."""

import dataclasses
import itertools
import json

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from .errors import FrontError, invalid, unavailable

OUTPUTS = ("LABELS", "SCORES", "DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE")
# A decoupled model's errors reach a gRPC stream as text only, without a status
# code; these say the server is overloaded or going away (503, retry), others
# are that request's input (400) -- the ensemble's steps refuse bad input with
# messages naming the input.
_UNAVAILABLE_TEXT = ("exceeds maximum queue size", "unavailable", "server is stopping", "not ready")
_INPUT_NAMES = ("IMAGE", "PROMPT", "temperature", "max_tokens")


@dataclasses.dataclass
class Answer:
    labels: list = None
    scores: list = None
    description: str = ""
    source: str = None
    usage: dict = None


def inputs_for(image, prompt):
    tensors = [grpcclient.InferInput("IMAGE", [1, 1], "BYTES")]
    tensors[0].set_data_from_numpy(np.array([[image]], dtype=np.object_))
    if prompt is not None:
        tensors.append(grpcclient.InferInput("PROMPT", [1, 1], "BYTES"))
        tensors[1].set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    return tensors


def read_outputs(result, answer):
    """Copy whichever outputs this response carries into answer; a streamed
    response carries some of them, a plain one all. Returns the DESCRIPTION
    text it carried ('' when none)."""
    text = ""
    outputs = {o.name for o in result.get_response().outputs}
    if "LABELS" in outputs:
        answer.labels = [label.decode() for label in result.as_numpy("LABELS").reshape(-1)]
    if "SCORES" in outputs:
        answer.scores = [round(float(s), 6) for s in result.as_numpy("SCORES").reshape(-1)]
    if "DESCRIPTION" in outputs:
        text = _first_string(result, "DESCRIPTION")
        answer.description += text
    if "DESCRIPTION_SOURCE" in outputs:
        answer.source = _first_string(result, "DESCRIPTION_SOURCE")
    if "USAGE" in outputs:
        try:
            answer.usage = json.loads(_first_string(result, "USAGE"))
        except ValueError:
            answer.usage = {}
    return text


def _first_string(result, name):
    values = result.as_numpy(name).reshape(-1)
    return values[0].decode() if len(values) else ""


def front_error(error):
    """A tritonclient/gRPC error -> FrontError."""
    if isinstance(error, FrontError):
        return error
    if isinstance(error, InferenceServerException):
        status, message = str(error.status() or ""), error.message() or ""
    elif isinstance(error, grpc.RpcError):
        status, message = str(error.code()), error.details() or ""
    else:
        status, message = "", str(error)
    if "INVALID_ARGUMENT" in status:
        return invalid(message)
    if "DEADLINE_EXCEEDED" in status:
        return FrontError(504, "the pipeline did not answer in time", type="timeout", code="timeout")
    if "UNAVAILABLE" in status and "queue" in message.lower():
        return unavailable(f"the server is overloaded ({message}); retry later")
    if any(s in status for s in ("UNAVAILABLE", "NOT_FOUND", "RESOURCE_EXHAUSTED", "CANCELLED")):
        # Triton down or restarting, or the ensemble not loaded (yet).
        return unavailable("the inference server is unavailable; retry later")
    if not status:  # a stream error: text only
        lowered = message.lower()
        if any(s in lowered for s in _UNAVAILABLE_TEXT):
            return unavailable(f"the server is overloaded or restarting ({message}); retry later")
        if any(name in message for name in _INPUT_NAMES):
            return invalid(message)
    return FrontError(500, f"the pipeline failed: {message}", type="server_error", code="server_error")


class TritonPool:
    """Create inside the running event loop (gRPC aio channels belong to it)."""

    def __init__(self, url, channels=2, timeout_s=60.0):
        self.url = url
        self.timeout_s = timeout_s
        self._clients = [grpcclient.InferenceServerClient(url) for _ in range(channels)]
        self._next = itertools.cycle(self._clients)

    async def close(self):
        for client in self._clients:
            await client.close()

    async def is_ready(self):
        try:
            return await next(self._next).is_server_ready(client_timeout=2)
        except (InferenceServerException, grpc.RpcError):
            return False

    async def infer(self, model, image, prompt=None, parameters=None):
        try:
            result = await next(self._next).infer(model, inputs_for(image, prompt), parameters=parameters or None,
                                                   client_timeout=self.timeout_s)
        except (InferenceServerException, grpc.RpcError) as error:
            raise front_error(error) from None
        answer = Answer()
        read_outputs(result, answer)
        return answer

    async def stream(self, model, image, prompt=None, parameters=None):
        """Yield (answer so far, the text chunk it just got) per response of the
        decoupled model; the stream ends after the model's final response
        (one request, then the request side closes)."""
        async def one_request():
            yield {"model_name": model, "inputs": inputs_for(image, prompt), "parameters": parameters or None}

        responses = next(self._next).stream_infer(one_request(), stream_timeout=self.timeout_s)
        answer = Answer()
        try:
            async for result, error in responses:
                if error is not None:
                    raise front_error(error)
                text = read_outputs(result, answer)
                yield answer, text
        except (InferenceServerException, grpc.RpcError) as error:
            raise front_error(error) from None
        finally:
            responses.cancel()  # a client that went away stops the stream at Triton too
