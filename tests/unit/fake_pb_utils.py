"""A stand-in for `triton_python_backend_utils`, so backends run without a server.

The helpers that are plain Python (`get_output_config_by_name`,
`triton_string_to_numpy`, ...) come from the real module that ships with the
server in build/triton; only the classes that the stub implements in C++
(Tensor, InferenceRequest/Response, InferenceTrace, TritonError, Logger, MetricFamily) are
faked here, with the same method names the backends call.
"""

import importlib.util
import json
import pathlib
import sys
import threading

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_UTILS = (
    REPO_ROOT / "build/triton/pytriton/tritonserver/backends/python/triton_python_backend_utils.py"
)


class TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=INTERNAL):
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self):
        return self._message

    def code(self):
        return self._code


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name, array):
        self._name = name
        self._array = array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self):
        return self._outputs

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def output(self, name):
        """Test convenience: the numpy array of one output, or None."""
        for tensor in self._outputs:
            if tensor.name() == name:
                return tensor.as_numpy()
        return None


class ResponseSender:
    """Records what a model sends; `wait()` blocks until the final flag."""

    def __init__(self):
        self.responses = []
        self.flags = []
        self._done = threading.Event()

    def send(self, response=None, flags=0):
        if self._done.is_set():
            raise TritonModelException("response already sent with the final flag")
        self.responses.append(response)
        self.flags.append(flags)
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._done.set()

    def wait(self, timeout=10.0):
        if not self._done.wait(timeout):
            raise TimeoutError(f"no final response within {timeout:.1f}s")
        return self.responses[0]


class InferenceTrace:
    """What request.trace() returns: get_context() is Triton's W3C context as JSON
    ({"traceparent": ...}) in OpenTelemetry mode, else None."""

    def __init__(self, context=None):
        self._context = context

    def get_context(self):
        return self._context


class InferenceRequest:
    # BLS: model name -> function(InferenceRequest) -> InferenceResponse, what exec() asks.
    # Tests set entries with monkeypatch.setitem.
    models = {}

    def __init__(self, inputs, parameters=None, request_id="", requested_outputs=None,
                 model_name=None, requested_output_names=None, trace=None):
        if not isinstance(inputs, dict):  # BLS: a list of Tensors, as a model builds its request
            inputs = {tensor.name(): tensor.as_numpy() for tensor in inputs}
        self._inputs = {name: Tensor(name, array) for name, array in inputs.items()}
        self._parameters = json.dumps(parameters or {})
        self._request_id = request_id
        self._requested_outputs = requested_outputs if requested_outputs is not None else requested_output_names
        self._sender = ResponseSender()
        self.cancelled = False
        self.model_name = model_name
        self._trace = trace or InferenceTrace()

    def exec(self):
        if self.model_name not in InferenceRequest.models:
            return InferenceResponse(error=TritonError(f"Request for unknown model: '{self.model_name}'",
                                                       TritonError.NOT_FOUND))
        return InferenceRequest.models[self.model_name](self)

    def inputs(self):
        return list(self._inputs.values())

    def parameters(self):
        return self._parameters

    def request_id(self):
        return self._request_id

    def requested_output_names(self):
        return self._requested_outputs

    def get_response_sender(self):
        return self._sender

    def is_cancelled(self):
        return self.cancelled

    def trace(self):
        return self._trace


class Logger:
    records = []  # (level, message), shared so tests can scan what was logged

    @classmethod
    def log(cls, message, level=None):
        cls.records.append(("log", str(message)))

    @classmethod
    def log_info(cls, message):
        cls.records.append(("info", str(message)))

    @classmethod
    def log_warn(cls, message):
        cls.records.append(("warn", str(message)))

    @classmethod
    def log_error(cls, message):
        cls.records.append(("error", str(message)))

    @classmethod
    def log_verbose(cls, message):
        cls.records.append(("verbose", str(message)))


class Metric:
    def __init__(self, labels, buckets=None):
        self.labels = dict(labels)
        self.buckets = buckets
        self._value = 0.0
        self.observations = []

    def increment(self, value):
        self._value += value

    def set(self, value):
        self._value = value

    def observe(self, value):
        self.observations.append(value)

    def value(self):
        return self._value


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    families = {}  # name -> family, so tests can read metric values

    def __init__(self, name, description, kind):
        self.name = name
        self.description = description
        self.kind = kind
        self.metrics = []
        MetricFamily.families[name] = self

    def Metric(self, labels=None, buckets=None):
        metric = Metric(labels or {}, buckets)
        self.metrics.append(metric)
        return metric


TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


def install():
    """Put the fake into sys.modules as `triton_python_backend_utils`; return it."""
    if "triton_python_backend_utils" in sys.modules:
        return sys.modules["triton_python_backend_utils"]
    if not REAL_UTILS.exists():
        raise RuntimeError(f"{REAL_UTILS} is missing: run `make build` first")
    spec = importlib.util.spec_from_file_location("triton_python_backend_utils", REAL_UTILS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fakes = {
        name: value
        for name, value in globals().items()
        if name in {
            "TritonError", "TritonModelException", "Tensor", "InferenceResponse",
            "InferenceRequest", "InferenceTrace", "Logger", "MetricFamily",
            "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
        }
    }
    vars(module).update(fakes)
    sys.modules["triton_python_backend_utils"] = module
    return module
