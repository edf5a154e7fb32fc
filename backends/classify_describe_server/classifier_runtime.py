"""The classifier's two runtimes behind one interface; plain Python, no Triton import (model.py is the adapter).

`parameters { key: "runtime" }` picks one per model:
- "onnxruntime": the shipped EfficientNet-Lite0 graph (scripts/export_onnx.py). It takes the
  pixels, normalises them inside the graph and returns the top-k scores and their class names
  (a string tensor), so the same file also serves in Triton's own onnxruntime backend (GPU config).
- "torchscript": any TorchScript classifier returning logits, plus a labels file (README: Bring
  your own model); pixels are normalised here with `mean` and `std`, (x - mean) / std per channel.

Each runtime imports its library only when a model asks for it: an onnxruntime instance's
stub never loads torch, which halves its resident memory (docs/classifier-runtime.md).
Both check the file against the config's tensors with one dry run at load, so a mismatch
fails the load, not a request.
"""

import dataclasses
import pathlib
from typing import ClassVar

import numpy as np

from . import config
from .config import ConfigError


@dataclasses.dataclass(frozen=True)
class Tensors:
    """What config.pbtxt declares: the input (dims without the batch) and the outputs' k (-1: variable)."""

    input_name: str
    input_shape: tuple
    input_dtype: np.dtype
    scores_name: str
    labels_name: str
    k: int


@dataclasses.dataclass(frozen=True)
class OnnxRuntimeSettings:
    runtime: ClassVar[str] = "onnxruntime"
    # Inside the version folder (model_repository/<model>/<version>/). fp32: the int8 file misses
    # the 99 % top-1 agreement target (docs/classifier-runtime.md), so it is never the default.
    model_file: str = "model.onnx"
    # One thread per instance: several single-thread instances use a small CPU better than
    # one wide one (docs/classifier-runtime.md), and a thread pool of one never spins.
    intra_op_threads: int = 1
    # Threads for a forward pass that starts while no other instance on the server's busy board
    # is executing or finished within the last 2 ms (busy_board.py): a lone request uses the idle
    # core too, and a loaded server keeps one thread per instance. 1 (or <= intra_op_threads):
    # always intra_op_threads.
    idle_intra_op_threads: int = 1


@dataclasses.dataclass(frozen=True)
class TorchScriptSettings:
    runtime: ClassVar[str] = "torchscript"
    model_file: str = "model.pt"  # inside the version folder
    labels_file: str = "labels.txt"  # relative to the model folder, one class name per line
    torch_num_threads: int = 1
    top_k: int = 5  # used only when the outputs' dims are -1; otherwise the dims decide
    # EfficientNet-Lite's TF transform (image_decode.py says why);
    # torchvision-style models want 123.675,116.28,103.53 and 58.395,57.12,57.375.
    mean: tuple = (127.0, 127.0, 127.0)  # per RGB channel, 0..255 pixel units
    std: tuple = (128.0, 128.0, 128.0)

    def __post_init__(self):
        if any(s <= 0 for s in self.std):
            raise ConfigError(f"std values must be > 0, got {self.std}")


RUNTIMES = {settings.runtime: settings for settings in (OnnxRuntimeSettings, TorchScriptSettings)}


def parse_settings(parameters: dict[str, str]):
    """The chosen runtime's settings from config.pbtxt `parameters` ({key: string value}); unknown keys fail."""
    runtime = parameters.get("runtime", "").strip()
    if runtime not in RUNTIMES:
        choices = " or ".join(f'"{name}"' for name in RUNTIMES)
        found = f"is {parameters['runtime']!r}" if "runtime" in parameters else "is missing"
        raise ConfigError(f"parameter runtime {found}: set it to {choices} "
                          f'(parameters {{ key: "runtime" value: {{ string_value: "onnxruntime" }} }})')
    return config.parse(RUNTIMES[runtime], parameters, f" for runtime {runtime}", also_known=("runtime",))


def load(settings, model_dir, version, tensors: Tensors, device="cpu"):
    """The classifier `settings` name, on model_dir/<version>/<model_file>, checked against `tensors`.

    Either runtime's classify(pixels [N, C, H, W]) gives (labels object [N, k] of bytes, scores float32 [N, k]).
    """
    model_path = pathlib.Path(model_dir) / str(version) / settings.model_file
    if settings.runtime == "onnxruntime":
        if device != "cpu":
            raise ConfigError("runtime onnxruntime runs on the CPU; on a GPU serve the same file with Triton's "
                              "onnxruntime backend (configs/gpu.pbtxt, scripts/make_gpu_config.py)")
        if tensors.k <= 0:
            raise ConfigError(f"outputs {tensors.labels_name} and {tensors.scores_name} must both have dims [k], "
                              "k > 0 (the graph's k)")
        return OnnxClassifier(model_path, tensors.input_name, tensors.input_shape, tensors.input_dtype,
                              tensors.scores_name, tensors.labels_name, tensors.k, settings.intra_op_threads,
                              settings.idle_intra_op_threads)
    labels = load_labels(pathlib.Path(model_dir) / settings.labels_file)
    return TorchScriptClassifier(model_path, labels, tensors.input_shape, settings.top_k if tensors.k == -1 else tensors.k,
                                 device, mean=settings.mean, std=settings.std, threads=settings.torch_num_threads)


def classify_rows(classifier, batches, idle=False):
    """Several requests' pixels ([n, C, H, W] each) through one forward pass, the point of a dynamic
    batch -> each request's (labels [n, k], scores [n, k]), in order. A failure raises for all of them.
    idle: no other instance is executing, so the pass may take the idle cores (OnnxClassifier.idle_threads)."""
    pixels = np.concatenate(batches)
    wide = idle and classifier.idle_threads is not None
    labels, scores = classifier.classify(pixels, idle=True) if wide else classifier.classify(pixels)
    ends = np.cumsum([len(pixels) for pixels in batches])[:-1]  # where each request's rows end
    return list(zip(np.split(labels, ends), np.split(scores, ends)))


# ---------------------------------------------------------------- onnxruntime

# ONNX element type (as onnxruntime names it) of each numpy dtype a config may declare.
_ONNX_TYPES = {np.dtype(np.uint8): "tensor(uint8)", np.dtype(np.float32): "tensor(float)"}


class OnnxClassifier:
    """Loads the graph once, checks it against the model's tensors, then classifies batches.

    input_name, input_shape (without the batch dim) and input_dtype come from config.pbtxt;
    the graph must have that one input and float `scores_name` and string `labels_name`
    outputs of `top_k` columns.
    """

    def __init__(self, model_path, input_name, input_shape, input_dtype, scores_name, labels_name, top_k,
                 intra_op_threads=1, idle_intra_op_threads=1):
        model_path = pathlib.Path(model_path)
        if not model_path.is_file():
            raise ConfigError(f"model file {model_path} not found (set parameter model_file, or run scripts/export_onnx.py)")
        self.session = _onnx_session(model_path, intra_op_threads)
        # A second session of the same graph with a wider thread pool, for a pass that starts while
        # the other instances are idle (onnxruntime fixes a session's threads when it is made).
        self.idle_threads = idle_intra_op_threads if idle_intra_op_threads > intra_op_threads else None
        self.idle_session = _onnx_session(model_path, self.idle_threads, spin=True) if self.idle_threads else self.session
        self.input_name, self.scores_name, self.labels_name = input_name, scores_name, labels_name
        self.input_dtype = np.dtype(input_dtype)
        self.intra_op_threads = intra_op_threads
        self._check_signature(model_path.name, list(input_shape))
        # One dry run on each session: proves the graph runs on this input and tells its k, so a
        # config whose dims disagree fails at load, not on a request.
        for idle in (False, True) if self.idle_threads else (False,):
            labels, scores = self.classify(np.zeros((1, *input_shape), dtype=input_dtype), idle=idle)
            if labels.shape != (1, top_k) or scores.shape != (1, top_k):
                raise ConfigError(
                    f"{model_path.name} returns {scores.shape[1:]} scores and {labels.shape[1:]} labels per image; "
                    f"the config's outputs ask for {top_k}"
                )
        self.top_k = top_k
        self.details = f"{intra_op_threads} onnxruntime thread(s)" + (
            f", {self.idle_threads} when the other instances are idle" if self.idle_threads else "")

    def _check_signature(self, file_name, input_shape):
        inputs = self.session.get_inputs()
        if len(inputs) != 1 or inputs[0].name != self.input_name:
            raise ConfigError(f"{file_name} must have one input named {self.input_name}, has {[i.name for i in inputs]}")
        expected = _ONNX_TYPES.get(self.input_dtype)
        if expected is None:
            raise ConfigError(f"input {self.input_name} must be TYPE_UINT8 or TYPE_FP32, the config declares {self.input_dtype}")
        if inputs[0].type != expected:
            raise ConfigError(f"{file_name} input {self.input_name} is {inputs[0].type}; the config declares "
                              f"{self.input_dtype} ({expected}); they must match")
        graph_dims = inputs[0].shape[1:]  # after the batch dim; a name or None is a free dim
        if len(graph_dims) != len(input_shape) or any(
                isinstance(g, int) and g != c for g, c in zip(graph_dims, input_shape)):
            raise ConfigError(f"{file_name} input {self.input_name} has dims {graph_dims} after the batch; "
                              f"the config has {input_shape}")
        outputs = {output.name: output.type for output in self.session.get_outputs()}
        for name, kind in ((self.scores_name, "tensor(float)"), (self.labels_name, "tensor(string)")):
            if outputs.get(name) != kind:
                raise ConfigError(f"{file_name} must have a {kind} output named {name}; it has {outputs}")

    def classify(self, pixels, idle=False):
        """pixels [N, C, H, W] (cast to the config's input type) -> (labels object [N, k] of bytes, scores float32 [N, k]).
        idle: on the idle_intra_op_threads session."""
        pixels = pixels.astype(self.input_dtype, copy=False)
        session = self.idle_session if idle else self.session
        scores, labels = session.run([self.scores_name, self.labels_name], {self.input_name: pixels})
        # onnxruntime hands strings back as str; Triton's BYTES tensors take bytes.
        encoded = np.array([label.encode("utf-8") for label in labels.ravel()], dtype=np.object_).reshape(labels.shape)
        return encoded, scores.astype(np.float32, copy=False)


def _onnx_session(model_path, intra_op_threads, spin=False):
    """spin: the pool's workers spin between the ops of a pass and stop when it ends. For the idle
    session only, whose pass has the other core to itself: a worker put to sleep after each op and
    woken for the next made a lone decode and forward pass take 1.2x as long, and a lone ensemble
    request's p50 1.19x (docs/benchmarks-method.md#where-the-cpu-goes). Spinning left on after a
    pass took a core's CPU in the gaps between requests; the narrow sessions never spin, their
    neighbours need the other cores."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1  # the graph is a chain: nothing to run side by side
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    try:
        return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph types
        raise ConfigError(f"{model_path.name} cannot be loaded by onnxruntime {ort.__version__}: {error}") from None


# ---------------------------------------------------------------- torchscript

def load_labels(path):
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"labels file {path} not found (set parameter labels_file, or run scripts/export_classifier.py)")
    labels = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    if not labels or not all(labels):
        raise ConfigError(f"labels file {path} must hold one non-empty class name per line")
    return labels


class TorchScriptClassifier:
    """Loads the model once, checks it against the labels, then classifies batches.

    Pixels arrive as preprocess hands them over, RGB 0..255 (uint8, or the same values as
    float32), and are normalised in float32 before the forward pass.
    """

    idle_threads = None  # torch's thread pool is one per process: no wider pass when the others are idle

    def __init__(self, model_path, labels, input_shape, top_k, device="cpu", mean=(127.0,) * 3, std=(128.0,) * 3,
                 threads=None):
        import torch

        model_path = pathlib.Path(model_path)
        if not model_path.is_file():
            raise ConfigError(f"model file {model_path} not found (set parameter model_file, or run scripts/export_classifier.py)")
        if threads is not None:
            # A model that sets few threads should not have torch's pool take every core:
            # on a small CPU the preprocess model and the server need some too.
            torch.set_num_threads(threads)
            try:
                torch.set_num_interop_threads(1)  # only one op runs at a time in a traced forward
            except RuntimeError:
                pass  # already set in this process; harmless
        self.device = torch.device(device)
        self.model = torch.jit.load(str(model_path), map_location=self.device).eval()
        channels = input_shape[0]
        if len(mean) != channels or len(std) != channels:
            raise ConfigError(f"mean and std need one value per input channel ({channels})")
        # Shaped [1, C, 1, 1] so they broadcast over the NCHW batch.
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).reshape(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).reshape(1, -1, 1, 1)
        self.labels = np.array([label.encode("utf-8") for label in labels], dtype=np.object_)
        # One dry forward: proves the file runs on this input shape and tells how many
        # classes it has, so a labels/model mismatch fails at load, not on a request.
        with torch.inference_mode():
            logits = self.model(torch.zeros((1, *input_shape), device=self.device))
        if logits.ndim != 2 or logits.shape[0] != 1:
            raise ConfigError(f"{model_path.name} must return logits [batch, classes], got {list(logits.shape)}")
        num_classes = logits.shape[1]
        if num_classes != len(labels):
            raise ConfigError(
                f"{model_path.name} has {num_classes} outputs but the labels file has {len(labels)} lines; "
                "they must match one label per class index"
            )
        if not 0 < top_k <= num_classes:
            raise ConfigError(f"top_k {top_k} must be between 1 and the {num_classes} classes")
        self.top_k = top_k
        self.details = f"{num_classes} classes, device {self.device}, {torch.get_num_threads()} torch thread(s)"

    def classify(self, pixels):
        """pixels uint8 or float32 [N, C, H, W], 0..255 -> (labels object [N, k] of bytes, scores float32 [N, k])."""
        import torch

        with torch.inference_mode():
            normalised = (torch.from_numpy(pixels).to(self.device).float() - self.mean) / self.std
            logits = self.model(normalised)
            probs = torch.softmax(logits.float(), dim=1)
            scores, indices = probs.topk(self.top_k, dim=1)
        return self.labels[indices.cpu().numpy()], scores.cpu().numpy().astype(np.float32)
