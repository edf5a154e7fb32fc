"""The front's only way to the pipeline: Triton's gRPC endpoint, through a
few tritonclient.grpc.aio channels used in turn (each channel multiplexes
every request in flight on it over HTTP/2). Requests go out as bytes built
here (build_request); Triton's outputs become a plain `Answer`; Triton's
errors become FrontErrors with the status a client acts on."""

import asyncio
import contextlib
import dataclasses
import itertools
import json
import re

import grpc
import tritonclient.grpc.aio as grpcclient
from classify_describe_server import error_contract as contract
from tritonclient.grpc import InferResult, model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from .errors import FrontError, invalid, unavailable

OUTPUTS = ("LABELS", "SCORES", "DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE")
# serving/supervise_tritonserver.sh restricts inference with header `inference-key`;
# over gRPC Triton 2.51 expects it with this prefix.
INFERENCE_KEY_HEADER = "triton-grpc-protocol-inference-key"

# Our backends' errors carry a code and the field at fault (error_contract.py,
# shared with them); Triton's own errors are known by their texts (Triton 2.51's core):
UNKNOWN_MODEL = "Request for unknown model"              # Triton: the model is not loaded (NOT_FOUND)
NO_VERSIONS = "has no available versions"                # Triton: loading or unloading (NOT_FOUND)
QUEUE_FULL = "Exceeds maximum queue size"                # Triton: the queue is full (UNAVAILABLE)
QUEUE_TIMEOUT = "Request timeout expired"                # Triton: waited its queue's time limit (UNAVAILABLE)
SERVER_STOPPING = "Server is stopping"                   # Triton: shutting down (UNAVAILABLE)
# The parameter by which a model of the describe backend names the model it calls (BLS): that
# callee's queue is on the path of the caller's requests (classify_and_describe_stream).
BLS_CALLEE = "classify_model"
# The pipeline's inputs and parameters -> the request field they came from.
REQUEST_FIELDS = {"IMAGE": "messages", "PROMPT": "messages", "conversation": "messages",
                  "response_format": "response_format", "temperature": "temperature", "max_tokens": "max_tokens"}
# Triton puts these before a step's message: "in ensemble 'x', " and "[request id: y] ".
_PREFIXES = re.compile(r"^(?:in ensemble '[^']*', |\[request id: [^\]]*\] )*")
# The tag on the wire of ModelInferRequest.raw_input_contents (grpc_service.proto: field 7,
# length-delimited), the one field build_request writes itself.
RAW_INPUT_CONTENTS_TAG = bytes([7 << 3 | 2])
SERVICE = "/inference.GRPCInferenceService/"


@dataclasses.dataclass
class Answer:
    labels: list = None
    scores: list = None
    description: str = ""
    source: str = None
    usage: dict = None


def request_parameters(chat_request):
    """The Triton request parameters of one chat.ChatRequest: the sampling
    overrides; the client's system messages and earlier turns as `conversation`
    and its response_format as `response_format`, each a JSON string, sent only
    when there is one (the describe step's contract: docs/DESIGN.md)."""
    parameters = dict(chat_request.parameters)
    if chat_request.conversation:
        parameters["conversation"] = _json(list(chat_request.conversation))
    if chat_request.response_format is not None:
        parameters["response_format"] = _json(chat_request.response_format)
    return parameters


def _json(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def queue_timeout_us(config):
    """A model's queue time limit (microseconds): the longest of its policies that refuse on
    timeout (REJECT; DELAY does not refuse), every priority level's; 0 without one."""
    batching = config.dynamic_batching
    policies = [batching.default_queue_policy, *batching.priority_queue_policy.values()]
    return max([0, *(policy.default_timeout_microseconds for policy in policies
                     if policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT)])


def build_request(model, image, prompt=None, parameters=None, request_id=""):
    """The ModelInferRequest, serialized (bytes), built here in the handler: an
    input that cannot be sent is that request's 400, never an error inside
    gRPC's request iterator (which the stream swallows and answers with a
    cancelled call). request_id becomes Triton's request id, which the
    describe step passes on to the LLM upstream and puts in its log lines.

    Every field but the tensors' contents is set through the protobuf message
    (service_pb2, the generated API tritonclient ships); the contents follow
    as raw_input_contents written here, each a BYTES tensor's one element (its
    4-byte little-endian length, then its bytes). In protobuf's encoding,
    fields written after a serialized message are fields of that message, a
    repeated field's values adding up in order, so Triton reads the same
    request (tests/unit/test_openai_front.py compares it with tritonclient's
    own). The photo is copied once, into the bytes sent, where tritonclient
    and protobuf copied it three times (the length-prefixed join, protobuf's
    copy in, its serialization out): docs/benchmarks-method.md#the-openai-fronts-cpu."""
    try:
        contents = [image] if prompt is None else [image, prompt.encode("utf-8")]
        request = service_pb2.ModelInferRequest(model_name=model, id=request_id, inputs=[
            service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=[1, 1])
            for name in ("IMAGE", "PROMPT")[:len(contents)]])
        for key, value in (parameters or {}).items():
            _set_parameter(request.parameters[key], key, value)
        parts = [request.SerializeToString()]
        for content in contents:
            length = len(content)  # past 4 GiB to_bytes raises OverflowError: that request's 400
            parts += (RAW_INPUT_CONTENTS_TAG, _varint(length + 4), length.to_bytes(4, "little"), content)
    except UnicodeEncodeError:
        raise invalid("the text parts are not valid Unicode (a lone surrogate?)", param="messages") from None
    except (ValueError, TypeError, OverflowError, InferenceServerException) as error:
        message = error.message() if isinstance(error, InferenceServerException) else str(error)
        raise invalid(f"the request cannot be sent to the pipeline: {message}") from None
    return b"".join(parts)


# What Triton's gRPC protocol reserves for itself (tritonclient refuses them too).
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "binary_data_output"})


def _set_parameter(parameter, key, value):
    """A request parameter in its InferParameter field, by type (bool before int: a bool is an int)."""
    if key in RESERVED_PARAMETERS:
        raise ValueError(f"parameter {key!r} is reserved by Triton")
    if isinstance(value, str):
        parameter.string_param = value
    elif isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value  # past 2**63 protobuf raises ValueError: that request's 400
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        raise TypeError(f"parameter {key!r} is a {type(value).__name__}, not a string, number or boolean")


def _varint(number):
    """A non-negative integer in protobuf's base-128 varint: 7 bits a byte, low first."""
    encoded = bytearray()
    while number > 0x7F:
        encoded.append(number & 0x7F | 0x80)
        number >>= 7
    encoded.append(number)
    return bytes(encoded)


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
    """A tritonclient/gRPC error -> FrontError: by the error contract's code
    when one of our backends sent it (a stream's errors have no status code),
    else by Triton's known texts, then by the gRPC status."""
    if isinstance(error, FrontError):
        return error
    if isinstance(error, InferenceServerException):
        status, message = str(error.status() or ""), error.message() or ""
    elif isinstance(error, grpc.RpcError):
        status, message = str(error.code()), error.details() or ""
    else:
        status, message = "", str(error)
    text = _PREFIXES.sub("", message)
    coded = contract.read(text)
    if coded is not None:
        return _coded_error(coded)
    if text.startswith(UNKNOWN_MODEL) or NO_VERSIONS in text:
        return unavailable("the model is not loaded on the inference server (loading or unloading); retry later")
    if QUEUE_FULL in text or QUEUE_TIMEOUT in text:
        return unavailable(f"the server is overloaded ({text}); retry later", overload=True)
    if text.startswith(SERVER_STOPPING):
        return unavailable(f"the server is restarting ({text}); retry later")
    if "INVALID_ARGUMENT" in status:
        return invalid(message)
    if "DEADLINE_EXCEEDED" in status:
        return FrontError(504, "the pipeline did not answer in time", type="timeout", code="timeout")
    if any(s in status for s in ("UNAVAILABLE", "NOT_FOUND", "RESOURCE_EXHAUSTED", "CANCELLED")):
        # Triton down or restarting, or the ensemble not loaded (yet).
        return unavailable("the inference server is unavailable; retry later")
    return FrontError(500, f"the pipeline failed: {message}", type="server_error", code="server_error")


def _coded_error(coded):
    if coded.code in (contract.INVALID_INPUT, contract.INVALID_PARAMETER):
        return invalid(coded.text, param=REQUEST_FIELDS.get(coded.field))
    if coded.code == contract.UPSTREAM_UNAVAILABLE:
        return FrontError(503, f"{coded.text}; retry later", type="service_unavailable", code="upstream_unavailable",
                          retry_after_s=1)
    if coded.code == contract.OVERLOADED:
        return unavailable(f"{coded.text}; retry later", overload=True)
    if coded.code == contract.MODEL_UNLOADING:
        # Its text says which (the model unloading, or the server shutting down:
        # go to another replica) and what to do; the client needs both.
        return unavailable(coded.text)
    if coded.code == contract.REQUEST_CANCELLED:
        return unavailable("the inference server is unavailable; retry later")
    return FrontError(500, f"the pipeline failed: {coded.text}", type="server_error", code="server_error")


def _call_cancelled():
    """A CancelledError out of a gRPC call that is not this task's own
    cancellation (the client left: re-raise that one): gRPC cancelled the call
    itself, for example as the channel closed at shutdown."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return None
    return unavailable("the call to the inference server was cancelled; retry later")


def inference_metadata(key):
    """The gRPC metadata of every inference call: the key's header where Triton
    restricts inference (TRITON_INFERENCE_KEY), else none. Health stays open."""
    return ((INFERENCE_KEY_HEADER, key),) if key else ()


@contextlib.contextmanager
def _front_errors():
    """A call's gRPC error as the FrontError a client acts on; its cancellation by our own
    deadline or shutdown (_call_cancelled) too, a client's own passed on as it is."""
    try:
        yield
    except grpc.RpcError as error:
        raise front_error(error) from None
    except asyncio.CancelledError:
        error = _call_cancelled()
        if error is None:
            raise
        raise error from None


class InferenceCalls:
    """Triton's two inference calls on a channel of our own (grpc.aio's public API), as
    tritonclient's stub makes them but sending requests serialized beforehand
    (build_request): tritonclient's own stream_infer builds the request inside gRPC's
    request iterator, where an error is swallowed and the call cancelled."""

    def __init__(self, channel):
        self.channel = channel
        self.ModelInfer = channel.unary_unary(  # noqa: N815 - the service's own names, as in the stub
            SERVICE + "ModelInfer", response_deserializer=service_pb2.ModelInferResponse.FromString)
        self.ModelStreamInfer = channel.stream_stream(  # noqa: N815
            SERVICE + "ModelStreamInfer", response_deserializer=service_pb2.ModelStreamInferResponse.FromString)


def channel_args(*extra):
    """tritonclient's own channel options (it drops them all when given any), never
    through a proxy, and `extra`. gRPC takes http_proxy from the environment, and a
    pod's (set for the LLM's egress) had every inference tunnelled to the proxy, or
    refused where the proxy cannot reach this host's Triton."""
    keepalive = grpcclient.KeepAliveOptions()
    return [("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.enable_http_proxy", 0), *extra]


class TritonPool:
    """Create inside the running event loop (gRPC aio channels belong to it)."""

    def __init__(self, url, channels=2, timeout_s=60.0, inference_key=None):
        self.url = url
        self.timeout_s = timeout_s
        self._metadata = inference_metadata(inference_key)
        self._calls_on = [InferenceCalls(grpc.aio.insecure_channel(url, options=channel_args())) for _ in range(channels)]
        self._calls = itertools.cycle(self._calls_on)
        self._health = grpcclient.InferenceServerClient(url, channel_args=channel_args())
        # The config reads (longest_queue_time_s) start while Triton may still be loading: on a
        # channel of their own, with its own subchannel (gRPC shares one per address across a
        # process's channels), so that its reconnect back-off after refused connections never
        # delays an inference (the first answers through the front were 503 for seconds).
        self._configs = grpcclient.InferenceServerClient(url, channel_args=channel_args(("grpc.use_local_subchannel_pool", 1)))

    async def close(self):
        for calls in self._calls_on:
            await calls.channel.close()
        for client in (self._health, self._configs):
            await client.close()

    async def is_ready(self):
        try:
            return await self._health.is_server_ready(client_timeout=2)
        except (InferenceServerException, grpc.RpcError):
            return False

    def _stub(self):
        return next(self._calls)

    async def longest_queue_time_s(self, models):
        """The longest a request of ours may wait in Triton's queues (seconds), read from the
        served models' configs: along each model's path its own queue time limit plus those of
        its ensemble's steps (summed: an upper bound where steps run side by side) and of its
        BLS callee (BLS_CALLEE), the longest path of `models`; 0.0 where none has a time limit.
        InferenceServerException while Triton cannot say (not up yet, a model not loaded)."""
        configs = {}
        try:
            return max([await self._queue_time_us(name, configs) for name in models]) / 1e6
        except grpc.RpcError as error:
            raise InferenceServerException(msg=f"{type(error).__name__}: {error}") from None

    async def _queue_time_us(self, name, configs, path=()):
        if name in path:
            return 0  # a BLS callee naming its caller: never loop
        if name not in configs:
            configs[name] = (await self._configs.get_model_config(name, client_timeout=2)).config
        config = configs[name]
        callees = [step.model_name for step in config.ensemble_scheduling.step]
        bls_callee = config.parameters[BLS_CALLEE].string_value.strip() if BLS_CALLEE in config.parameters else ""
        if bls_callee:
            callees.append(bls_callee)
        waits = [await self._queue_time_us(callee, configs, (*path, name)) for callee in callees]
        return queue_timeout_us(config) + sum(waits)

    async def infer(self, model, image, prompt=None, parameters=None, request_id="", metadata=()):
        """metadata: more gRPC metadata for Triton (the client's trace context, trace_context.py)."""
        request = build_request(model, image, prompt, parameters, request_id)
        with _front_errors():
            response = await self._stub().ModelInfer(request=request, timeout=self.timeout_s,
                                                     metadata=(*self._metadata, *metadata))
        answer = Answer()
        read_outputs(InferResult(response), answer)
        return answer

    async def stream(self, model, image, prompt=None, parameters=None, request_id="", metadata=()):
        """Yield (answer so far, the text chunk it just got) per response of the
        decoupled model; the stream ends after the model's final response
        (one request, then the request side closes)."""
        request = build_request(model, image, prompt, parameters, request_id)

        async def one_request():
            yield request

        call = self._stub().ModelStreamInfer(one_request(), timeout=self.timeout_s,
                                             metadata=(*self._metadata, *metadata))
        answer = Answer()
        try:
            with _front_errors():
                async for response in call:
                    if response.error_message:
                        raise front_error(InferenceServerException(msg=response.error_message))
                    text = read_outputs(InferResult(response.infer_response), answer)
                    yield answer, text
        finally:
            call.cancel()  # a client that went away stops the stream at Triton too
