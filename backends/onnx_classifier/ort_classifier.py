"""Run an ONNX image classifier with ONNX Runtime on the CPU.

Plain Python (onnxruntime + numpy), no Triton import: model.py is the adapter.

The graph does the whole step, as scripts/export_onnx.py builds it: one input
(pixels, normalised inside the graph) and two outputs named like the model's
outputs, the top-k scores and their class names (a string tensor), so the
same file also serves in Triton's own onnxruntime backend (the GPU config).
"""

import dataclasses
import pathlib

import numpy as np
import onnxruntime as ort


class ConfigError(ValueError):
    """A config.pbtxt parameter or a model file is wrong; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class OnnxClassifierSettings:
    # Inside the version folder (model_repository/<model>/<version>/). fp32: the int8 file misses
    # the 99 % top-1 agreement target (docs/classifier-runtime.md), so it is never the default.
    model_file: str = "model.onnx"
    # One thread per instance: several single-thread instances use a small CPU better than
    # one wide one (docs/classifier-runtime.md), and a thread pool of one never spins.
    intra_op_threads: int = 1


def parse_settings(parameters: dict[str, str]) -> OnnxClassifierSettings:
    """Build settings from config.pbtxt `parameters` ({key: string value}); unknown keys fail."""
    known = {field.name for field in dataclasses.fields(OnnxClassifierSettings)}
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; known: {sorted(known)}")
    values = {}
    if "model_file" in parameters:
        if not parameters["model_file"].strip():
            raise ConfigError("parameter model_file must not be empty")
        values["model_file"] = parameters["model_file"].strip()
    if "intra_op_threads" in parameters:
        raw = parameters["intra_op_threads"]
        try:
            values["intra_op_threads"] = int(raw)
        except ValueError:
            raise ConfigError(f"parameter intra_op_threads must be a positive integer, got {raw!r}") from None
        if values["intra_op_threads"] <= 0:
            raise ConfigError(f"parameter intra_op_threads must be a positive integer, got {raw!r}")
    return OnnxClassifierSettings(**values)


# ONNX element type (as onnxruntime names it) of each numpy dtype a config may declare.
_ONNX_TYPES = {np.dtype(np.uint8): "tensor(uint8)", np.dtype(np.float32): "tensor(float)"}


class OnnxClassifier:
    """Loads the graph once, checks it against the model's tensors, then classifies batches.

    input_name, input_shape (without the batch dim) and input_dtype come from config.pbtxt;
    the graph must have that one input and float `scores_name` and string `labels_name`
    outputs of `top_k` columns.
    """

    def __init__(self, model_path, input_name, input_shape, input_dtype, scores_name, labels_name, top_k,
                 intra_op_threads=1):
        model_path = pathlib.Path(model_path)
        if not model_path.is_file():
            raise ConfigError(f"model file {model_path} not found (set parameter model_file, or run scripts/export_onnx.py)")
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1  # the graph is a chain: nothing to run side by side
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # With more than one thread, workers that spin between ops take CPU the other
        # instances and preprocess need on a small machine.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph types
            raise ConfigError(f"{model_path.name} cannot be loaded by onnxruntime {ort.__version__}: {error}") from None
        self.input_name, self.scores_name, self.labels_name = input_name, scores_name, labels_name
        self.intra_op_threads = intra_op_threads
        self._check_signature(model_path.name, list(input_shape), np.dtype(input_dtype))
        # One dry run: proves the graph runs on this input and tells its k, so a config
        # whose dims disagree fails at load, not on a request.
        labels, scores = self.classify(np.zeros((1, *input_shape), dtype=input_dtype))
        if labels.shape != (1, top_k) or scores.shape != (1, top_k):
            raise ConfigError(
                f"{model_path.name} returns {scores.shape[1:]} scores and {labels.shape[1:]} labels per image; "
                f"the config's outputs ask for {top_k}"
            )
        self.top_k = top_k

    def _check_signature(self, file_name, input_shape, input_dtype):
        inputs = self.session.get_inputs()
        if len(inputs) != 1 or inputs[0].name != self.input_name:
            raise ConfigError(f"{file_name} must have one input named {self.input_name}, has {[i.name for i in inputs]}")
        expected = _ONNX_TYPES.get(input_dtype)
        if expected is None:
            raise ConfigError(f"input {self.input_name} must be TYPE_UINT8 or TYPE_FP32, the config declares {input_dtype}")
        if inputs[0].type != expected:
            raise ConfigError(f"{file_name} input {self.input_name} is {inputs[0].type}; the config declares {input_dtype} "
                              f"({expected}); they must match")
        graph_dims = inputs[0].shape[1:]  # after the batch dim; a name or None is a free dim
        if len(graph_dims) != len(input_shape) or any(
                isinstance(g, int) and g != c for g, c in zip(graph_dims, input_shape)):
            raise ConfigError(f"{file_name} input {self.input_name} has dims {graph_dims} after the batch; "
                              f"the config has {input_shape}")
        outputs = {output.name: output.type for output in self.session.get_outputs()}
        for name, kind in ((self.scores_name, "tensor(float)"), (self.labels_name, "tensor(string)")):
            if outputs.get(name) != kind:
                raise ConfigError(f"{file_name} must have a {kind} output named {name}; it has {outputs}")

    def classify(self, pixels):
        """pixels [N, C, H, W] -> (labels object [N, k] of bytes, scores float32 [N, k])."""
        scores, labels = self.session.run([self.scores_name, self.labels_name], {self.input_name: pixels})
        # onnxruntime hands strings back as str; Triton's BYTES tensors take bytes.
        encoded = np.array([label.encode("utf-8") for label in labels.ravel()], dtype=np.object_).reshape(labels.shape)
        return encoded, scores.astype(np.float32, copy=False)
