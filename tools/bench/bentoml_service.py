"""The BentoML baseline of `make bench`: BentoML 1.4 serving the same job as the
`classify_and_describe` ensemble, with the same code and model file, so that the
comparison is of the serving, not of the work (docs/benchmarks-method.md#bentoml).

Per request, as the ensemble's three steps do: the photo decoded and resized by
classify_describe_server.image_decode (pixels and the view the LLM is shown), the same
model.onnx in ONNX Runtime through classify_describe_server's classifier runtime with the
classifier config's intra-op threads, the top 5, then one chat completion to the
same upstream with the openai SDK's async client on its aiohttp transport, the
messages built by backends/openai_describe's prompting with its settings and the
same call the describe step makes (client.post with the typed result).

Bench tooling only: it runs in its own venv (build/bentoml-venv, `make
bentoml-baseline`), is started by tools/bench/bentoml_baseline.py with
`bentoml serve tools.bench.bentoml_service:<Service>` and is never imported by
serving code. What it serves comes from the environment variable BENTOML_JOB
(JSON, written by bentoml_baseline.job()); the LLM's address and key from
LLM_BASE_URL and LLM_API_KEY, as the describe step reads them.

Two layouts, BentoML's own ways to use 2 cores (bentoml_baseline.VARIANTS):
  ClassifyDescribe          one service, one worker process per core, the whole
                            job in one async API (no batching)
  BatchedClassifyDescribe   the job in an async API that calls Classifier, a
                            second service whose forward pass is an adaptive-
                            batching API (BentoML batches only across a service
                            boundary or its HTTP entry)
"""

import base64
import json
import os
import pathlib
import time
import typing

import aiohttp
import bentoml
import httpx2
import numpy as np
import openai
from bentoml.validators import ContentType
from openai.types.chat import ChatCompletion

JOB = json.loads(os.environ.get("BENTOML_JOB", "{}"))
# BentoML's defaults, less the per-request access log (Triton keeps none by default).
COMMON = {"traffic": {"timeout": JOB.get("timeout_s", 60)}, "logging": {"access": {"enabled": False}}}
JpegFile = typing.Annotated[pathlib.Path, ContentType("image/jpeg")]


def _preprocessor():
    from classify_describe_server import image_decode
    return image_decode.ImagePreprocessor(image_decode.parse_settings(JOB["preprocess"]))


def _classifier():
    from classify_describe_server import classifier_runtime as runtime
    return runtime.OnnxClassifier(JOB["model_file"], "PIXELS", [3, 224, 224], np.uint8, "SCORES", "LABELS", 5,
                                  intra_op_threads=JOB["intra_op_threads"])


class Describe:
    """The describe step's upstream call: its settings, messages and SDK call."""

    def __init__(self):
        from classify_describe_server import prompting
        from classify_describe_server import settings as settings_module
        self.prompting = prompting
        self.settings = settings_module.parse_settings(JOB["describe"])
        key, _ = self.settings.load_api_key(os.environ)
        # As describer.make_client: the aiohttp transport, a pool as large as the in-flight cap, no SDK retries.
        http_client = openai.DefaultAioHttpClient(
            limits=httpx2.Limits(max_connections=self.settings.max_in_flight,
                                 max_keepalive_connections=self.settings.max_in_flight),
            timeout=httpx2.Timeout(self.settings.timeout_s, connect=min(5.0, self.settings.timeout_s)))
        self.client = openai.AsyncOpenAI(api_key=key, base_url=self.settings.base_url, max_retries=0,
                                         timeout=self.settings.timeout_s, http_client=http_client)

    async def __call__(self, labels, scores, prompt, view):
        s = self.settings
        prompt = self.prompting.read_prompt(prompt, s.max_prompt_chars) or s.default_prompt
        image_url = "data:image/jpeg;base64," + base64.b64encode(view).decode() if view else None
        messages = self.prompting.build_messages(s, labels, scores, prompt, image_url)
        started = time.perf_counter()
        answer = await self.client.post(
            "/chat/completions", cast_to=ChatCompletion, options={"timeout": s.timeout_s},
            body={"model": s.model, "messages": messages, "max_tokens": s.max_tokens, "temperature": s.temperature})
        text = (answer.choices[0].message.content or "").strip()
        if not text:
            raise ValueError("the upstream answered with no text")
        usage = answer.usage
        return {"labels": labels, "scores": scores, "description": text, "description_source": "llm",
                "usage": {"model": answer.model, "prompt_tokens": getattr(usage, "prompt_tokens", 0),
                          "completion_tokens": getattr(usage, "completion_tokens", 0),
                          "latency_ms": round((time.perf_counter() - started) * 1e3, 2)}}


def _top5(labels, scores):
    return [label.decode() for label in labels], [float(score) for score in scores]


@bentoml.service(workers=JOB.get("workers", 1), **COMMON)
class ClassifyDescribe:
    """The whole job in each worker: decode and forward on the worker's event loop (one
    worker a core, one intra-op thread, so a thread hand-off would buy nothing), the
    LLM call awaited."""

    def __init__(self):
        self.preprocess = _preprocessor()
        self.classifier = _classifier()
        self.describe = Describe()

    @bentoml.api
    async def classify_and_describe(self, image: JpegFile, prompt: str = "") -> dict:
        pixels, view = self.preprocess.with_view(image.read_bytes())
        labels, scores = self.classifier.classify(pixels[np.newaxis])
        return await self.describe(*_top5(labels[0], scores[0]), prompt, view)


@bentoml.service(workers=JOB.get("classifier_workers", 1), **COMMON)
class Classifier:
    """The forward pass as BentoML's adaptive batching API: requests from every caller
    worker are gathered into batches of up to max_batch_size."""

    def __init__(self):
        self.classifier = _classifier()
        self.index = {label: number for number, label in enumerate(LABELS)}

    @bentoml.api(batchable=True, max_batch_size=JOB.get("max_batch_size", 4),
                 max_latency_ms=JOB.get("max_latency_ms", 60000))
    def classify(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [N, 3, 224, 224] -> [N, 10]: per image the 5 class indices, then their 5 scores (one
        float array, so that BentoML's batching splits it by rows as it does its input)."""
        labels, scores = self.classifier.classify(pixels)
        indices = np.array([[self.index[label] for label in row] for row in labels], dtype=np.float32)
        return np.concatenate([indices, scores], axis=1)


@bentoml.service(workers=JOB.get("workers", 1), **COMMON)
class BatchedClassifyDescribe:
    """Decode and the LLM call here, the forward pass in Classifier's batches."""

    classifier = bentoml.depends(Classifier)

    def __init__(self):
        self.preprocess = _preprocessor()
        self.describe = Describe()

    @bentoml.api
    async def classify_and_describe(self, image: JpegFile, prompt: str = "") -> dict:
        pixels, view = self.preprocess.with_view(image.read_bytes())
        row = (await self._classify(pixels[np.newaxis]))[0]
        labels = [LABELS[int(index)].decode() for index in row[:5]]
        return await self.describe(labels, [float(score) for score in row[5:]], prompt, view)

    async def _classify(self, pixels, attempts=3):
        # BentoML 1.4.30 and later renew their client session to a dependency every 100 calls and close
        # the old one under the calls still using it: those fail with "Connector is closed" (about a
        # quarter of the requests at 16 in flight here; bentoml/BentoML#5544). The retry of BentoML's
        # own proposed fix (#5698): the call never reached the classifier, so it is safe to send again.
        for attempt in range(attempts):
            try:
                return await self.classifier.to_async.classify(pixels)
            except aiohttp.ClientConnectionError:
                if attempt == attempts - 1:
                    raise


def _labels():
    """The class names in the graph's order (labels.txt beside the model's version folder), as the graph returns them."""
    path = pathlib.Path(JOB["model_file"]).parents[1] / "labels.txt" if JOB else None
    return [line.strip().encode() for line in path.read_text().splitlines()] if path and path.is_file() else []


LABELS = _labels()
