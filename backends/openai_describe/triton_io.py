"""Triton I/O of the openai_describe backend, shared by both ways to serve:
requests read into Jobs (every refusal names its field), tensors and responses
written and sent, the BLS call to the classifier, errors answered in the error
contract (classify_describe_server.error_contract), the log. With model.py, the
only module of this backend that touches triton_python_backend_utils."""

import base64
import binascii
import dataclasses
import json
import math

import numpy as np
import triton_python_backend_utils as pb_utils
from classify_describe_server import error_contract as contract
from classify_describe_server import request_id as ids
from classify_describe_server.config import model_parameters  # noqa: F401 - io.model_parameters
from classify_describe_server.describer import Job
from classify_describe_server.dialogue import read_conversation, read_response_format
from classify_describe_server.metrics import Metrics
from classify_describe_server.model_log import Log
from classify_describe_server.prompting import PromptError, read_labels, read_prompt
from classify_describe_server.settings import InvalidOverride, Overrides

JPEG_START = b"\xff\xd8\xff"


class InvalidInput(ValueError):
    def __init__(self, message, field):
        super().__init__(message)
        self.field = field  # the input tensor at fault


# What execute() refuses (INVALID_ARG), each with the field it names.
REFUSALS = (InvalidInput, PromptError, InvalidOverride)


class Reject(Exception):
    """A request ends with this Triton error; its message is in the error contract already."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code

    def response(self):
        return error_response(str(self), self.code)

    @property
    def invalid(self):
        """The request's own fault (INVALID_ARG)."""
        return self.code == pb_utils.TritonError.INVALID_ARG


@dataclasses.dataclass(frozen=True)
class PhotoJob:
    """A request to a model with classify_model: a Job once its photo is classified."""

    image: np.ndarray  # the IMAGE input, copied out of the request
    prompt: object     # the raw PROMPT element, or None
    overrides: Overrides
    dialogue: "Dialogue"
    request_id: str = ""
    trace: tuple = ()  # upstream_trace(request)


@dataclasses.dataclass(frozen=True)
class Dialogue:
    """What the OpenAI front passes besides the question, as request parameters."""

    conversation: tuple = ()
    response_format: dict = None


# -- requests in -------------------------------------------------------------------

def read_parameters(request, settings):
    """(Overrides, Dialogue) from the request parameters; raises InvalidOverride."""
    try:
        params = json.loads(request.parameters() or "{}")
    except UnicodeDecodeError:  # Triton passes an HTTP client's bytes on as they came
        raise InvalidOverride("a request parameter is not valid UTF-8", "parameters") from None
    overrides = settings.resolve_overrides(params)
    return overrides, Dialogue(read_conversation(params, settings), read_response_format(params, settings))


def read_request_id(request):
    """The request's id for its log lines and its LLM call: Triton's request id
    (the OpenAI front's X-Request-ID, a tritonclient caller's request_id) when
    it is a valid one, else a new id (request_id.py)."""
    try:
        return ids.accept(request.request_id())
    except UnicodeDecodeError:  # not a valid id either: the request gets a new one
        return ids.new()


def read_jobs(request, settings, request_models):
    """One Job per batch row; raises one of REFUSALS."""
    labels = input_array(request, "LABELS")
    scores = input_array(request, "SCORES")
    if labels is None or scores is None:
        raise InvalidInput("LABELS and SCORES are required", "LABELS" if labels is None else "SCORES")
    prompts = input_array(request, "PROMPT")
    views = input_array(request, "VIEW")
    if labels.shape != scores.shape or labels.ndim != 2 or labels.shape[1] == 0:
        raise InvalidInput(f"LABELS {list(labels.shape)} and SCORES {list(scores.shape)} "
                           "must have the same non-empty shape", "LABELS")
    overrides, dialogue = read_parameters(request, settings)
    request_id = read_request_id(request)
    trace = upstream_trace(request)
    jobs = [job_from(labels[row], scores[row], prompts[row].reshape(-1)[0] if prompts is not None else None,
                     overrides, settings, views[row].reshape(-1)[0] if views is not None else None, dialogue,
                     request_id, trace)
            for row in range(labels.shape[0])]
    # Last, so that a request refused for another reason takes no place under the cap.
    request_models.admit(overrides.model)
    return jobs


def read_photo_job(request, settings, request_models):
    """A request to a model with classify_model (IMAGE, optional PROMPT): what
    its Job needs besides the labels, checked now; raises one of REFUSALS."""
    image = input_array(request, "IMAGE")
    if image is None or image.size != 1:
        raise InvalidInput("IMAGE is required: one encoded photo per request", "IMAGE")
    prompts = input_array(request, "PROMPT")
    prompt = prompts.reshape(-1)[0] if prompts is not None else None
    read_prompt(prompt, settings.max_prompt_chars)
    overrides, dialogue = read_parameters(request, settings)
    request_models.admit(overrides.model)
    return PhotoJob(_photo(image), prompt, overrides, dialogue, read_request_id(request), upstream_trace(request))


def upstream_trace(request):
    """The W3C trace context to send the LLM upstream with this request's call:
    ((header, value), ...), or () when Triton is not tracing this request. Its
    parent is Triton's span for this model step (what request.trace() holds in
    OpenTelemetry mode), so the upstream's spans join the request's trace under
    this step (docs/tracing.md)."""
    try:
        context = request.trace().get_context()
    except UnicodeDecodeError:  # a client's traceparent bytes, passed on as they came
        return ()
    if not context:
        return ()
    try:
        fields = json.loads(context)
    except ValueError:
        return ()
    return tuple((name, fields[name]) for name in ("traceparent", "tracestate")
                 if isinstance(fields.get(name), str) and fields[name])


def job_from(labels, scores, raw_prompt, overrides, settings, raw_view=None, dialogue=Dialogue(), request_id="",
             trace=()):
    row_scores = tuple(float(x) for x in scores)
    if not all(math.isfinite(x) for x in row_scores):
        raise InvalidInput("SCORES must be finite", "SCORES")
    prompt = read_prompt(raw_prompt, settings.max_prompt_chars)
    image, skipped = read_view(raw_view, settings)
    return Job(labels=read_labels(labels, settings), scores=row_scores,
               prompt=prompt or settings.default_prompt, overrides=overrides, image=image, vision_skipped=skipped,
               conversation=dialogue.conversation, response_format=dialogue.response_format, request_id=request_id,
               trace=trace)


def read_view(raw, settings):
    """(the VIEW's JPEG bytes or None, why none). A VIEW comes from preprocess, but
    describe is public: a caller's own must be a JPEG within max_view_bytes. The
    message never quotes its bytes."""
    if settings.vision == "off":
        return None, "off"
    if raw is None or len(raw) == 0:
        return None, "no_view"
    view = bytes(raw)
    if not view.startswith(JPEG_START):
        raise InvalidInput("VIEW must be a JPEG (the photo as preprocess re-encodes it)", "VIEW")
    if len(view) > settings.max_view_bytes:
        raise InvalidInput(f"VIEW is {len(view)} bytes, more than the limit max_view_bytes="
                           f"{settings.max_view_bytes} (model config)", "VIEW")
    return view, None


def input_array(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _photo(image):
    """IMAGE as sent, or decoded when it is base64 text: HTTP generate_stream
    takes JSON only, where a photo can only travel as base64. A photo's own
    bytes are never all base64 characters, so nothing else is decoded."""
    raw = image.reshape(-1)[0]
    if isinstance(raw, (bytes, bytearray)) and raw:
        try:
            decoded = base64.b64decode(bytes(raw), validate=True)
        except binascii.Error:
            return image
        return np.array([[decoded]], dtype=np.object_)
    return image


def log(model_name):
    """The backend's log: Triton's server log, each line naming the model."""
    return Log(model_name, pb_utils.Logger)


def metrics(labels, streams):
    return Metrics(pb_utils.MetricFamily, labels, streams=streams)


def classify(model_name, image, wanted, request_id):
    """A BLS call to the classify model: (labels [k], scores [k], the view's bytes or None).
    Raises Reject with the classifier's own error, which is in the error contract already
    (backends/image)."""
    # Without trace=: the request was released when execute() returned (decoupled),
    # and a BLS call traced under it crashed Triton 2.51 (SIGSEGV in the release).
    response = pb_utils.InferenceRequest(model_name=model_name, inputs=[pb_utils.Tensor("IMAGE", image)],
                                         requested_output_names=wanted, request_id=request_id).exec()
    if response.has_error():
        error = response.error()
        raise Reject(error.message(), error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL)
    labels = pb_utils.get_output_tensor_by_name(response, "LABELS").as_numpy()
    scores = pb_utils.get_output_tensor_by_name(response, "SCORES").as_numpy()
    view = pb_utils.get_output_tensor_by_name(response, "VIEW")
    return labels[0], scores[0], view.as_numpy().reshape(-1)[0] if view is not None else None


# -- responses out -------------------------------------------------------------------

def labels_tensors(jobs):
    return [pb_utils.Tensor("LABELS", np.array([[x.encode("utf-8") for x in job.labels] for job in jobs],
                                               dtype=np.object_)),
            pb_utils.Tensor("SCORES", np.array([job.scores for job in jobs], dtype=np.float32))]


def bytes_tensor(name, texts):
    return pb_utils.Tensor(name, np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))


def response(tensors):
    return pb_utils.InferenceResponse(output_tensors=tensors)


def send(sender, response, final):
    """One response of a stream; `final` closes it."""
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)


def error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def refused(exc):
    """The INVALID_ARG response for one of REFUSALS, naming its field."""
    code = contract.INVALID_PARAMETER if isinstance(exc, InvalidOverride) else contract.INVALID_INPUT
    return error_response(contract.tagged(code, str(exc), exc.field), pb_utils.TritonError.INVALID_ARG)


def upstream_failed(reason):
    """on_failure=error: the caller asked for an error instead of a fallback."""
    return error_response(contract.tagged(contract.UPSTREAM_UNAVAILABLE, f"the LLM upstream could not answer ({reason})"),
                          pb_utils.TritonError.UNAVAILABLE)


def unloading():
    return Reject(contract.tagged(contract.MODEL_UNLOADING, "the model is unloading; retry later"),
                  pb_utils.TritonError.UNAVAILABLE)


def server_stopping():
    """An open stream ended because the server is stopping (stream_adapter.STOPPING_FILE_ENV)."""
    return Reject(contract.tagged(contract.MODEL_UNLOADING, "the server is shutting down: retry on another replica"),
                  pb_utils.TritonError.UNAVAILABLE)


def overloaded(text):
    """A streaming model at its max_open_streams or max_photos_waiting: refused at once, retry later."""
    return Reject(contract.tagged(contract.OVERLOADED, text), pb_utils.TritonError.UNAVAILABLE)


def cancelled():
    return error_response(contract.tagged(contract.REQUEST_CANCELLED, "request cancelled"),
                          pb_utils.TritonError.CANCELLED)


def internal(text="internal error in the describe step"):
    return Reject(contract.tagged(contract.INTERNAL, text), pb_utils.TritonError.INTERNAL)


def send_final(request, response):
    request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
