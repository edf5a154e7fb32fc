"""Every model a client can reach, with a valid request for each and a check of
its answer. Tests that promise something "for every model" iterate over
MODELS; test_every_model_of_the_repository_is_listed keeps the list complete
when a model is added to model_repository/."""

import pathlib

import numpy as np

from .raw_infer import bytes_tensor, fp32_tensor, uint8_tensor

REPO = pathlib.Path(__file__).resolve().parents[2]
MODELS = ("classify_and_describe", "classify", "classify_with_view", "preprocess", "classifier", "describe")
# Decoupled: no HTTP /infer, so the suites above do not apply; tests/integration/test_streaming.py
# sends them the same classes of requests over gRPC streams and HTTP generate_stream.
STREAM_MODELS = ("classify_and_describe_stream", "describe_stream")
COFFEE_TOP1 = b"espresso"
PIXEL_TOLERANCE = 1  # levels of 0..255 between the server's PIXELS and the reference decode


def repository_models():
    return sorted(p.parent.name for p in (REPO / "model_repository").glob("*/config.pbtxt"))


class ValidRequests:
    """Valid inputs for each model, built from one real photo (the coffee cup);
    `pixels` ([1, 3, 224, 224]) is the reference decode of it (tools/reference.py,
    written apart from the server's preprocess), which preprocess must answer."""

    def __init__(self, coffee_png, pixels, prompt):
        self.coffee = coffee_png
        self.pixels = pixels
        self.prompt = prompt.encode()

    def inputs(self, model):
        image = bytes_tensor("IMAGE", [[self.coffee]])
        if model == "classify_and_describe":
            return [image, bytes_tensor("PROMPT", [[self.prompt]])]
        if model in ("classify", "classify_with_view", "preprocess"):
            return [image]
        if model == "classifier":
            return [uint8_tensor("PIXELS", self.pixels)]
        if model == "describe":
            return [bytes_tensor("LABELS", [[COFFEE_TOP1, b"cup", b"coffee mug"]]),
                    fp32_tensor("SCORES", [[0.9, 0.05, 0.02]]),
                    bytes_tensor("PROMPT", [[self.prompt]])]
        raise KeyError(model)

    def check(self, outputs):
        """A list of what is wrong with an answer's outputs, whichever model gave them (empty: correct)."""
        problems = []
        if "PIXELS" in outputs:
            pixels = outputs["PIXELS"]
            if pixels.shape != self.pixels.shape:
                problems.append(f"PIXELS have shape {pixels.shape}, the reference decode {self.pixels.shape}")
            # The same resampling (Pillow's bicubic): one level leaves room for rounding, no more.
            elif (worst := np.abs(pixels.astype(int) - self.pixels.astype(int)).max()) > PIXEL_TOLERANCE:
                problems.append(f"PIXELS differ from the reference decode by up to {worst} levels")
        if "LABELS" in outputs:
            labels = outputs["LABELS"]
            if labels.shape[-1] == 0 or labels.reshape(-1)[0] != COFFEE_TOP1:
                problems.append(f"LABELS {labels.tolist()[:1]} do not start with {COFFEE_TOP1!r}")
        if "SCORES" in outputs:
            scores = outputs["SCORES"].reshape(-1)
            if not (np.all(np.isfinite(scores)) and np.all(np.diff(scores) <= 0) and 0 < scores[0] <= 1):
                problems.append(f"SCORES {scores.tolist()} are not sorted probabilities")
        if "VIEW" in outputs:
            view = outputs["VIEW"].reshape(-1)[0]
            if not view.startswith(b"\xff\xd8\xff"):
                problems.append(f"VIEW is not a JPEG: {view[:8]!r}")
        if "DESCRIPTION_SOURCE" in outputs and outputs["DESCRIPTION_SOURCE"].reshape(-1)[0] != b"llm":
            problems.append(f"DESCRIPTION_SOURCE {outputs['DESCRIPTION_SOURCE'].reshape(-1)[0]!r}")
        if "DESCRIPTION" in outputs and not outputs["DESCRIPTION"].reshape(-1)[0].startswith(b"Fake answer #"):
            problems.append(f"DESCRIPTION {outputs['DESCRIPTION'].reshape(-1)[0][:60]!r}")
        return problems
