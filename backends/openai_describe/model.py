"""Triton adapter of the openai_describe backend: owns the tensor names and
every pb_utils call but the metrics (metrics.py); the logic lives in the
modules beside it.

Two ways to serve, chosen by the model's transaction policy:
- not decoupled (`describe`): one response per request, so HTTP /infer and
  the classify_and_describe ensemble work;
- decoupled (`describe_stream`, `classify_and_describe_stream`): a stream
  per request, LABELS and SCORES first (with `classify_model`, asked of that
  model for the request's IMAGE), then the description chunk by chunk as the
  LLM writes it, then DESCRIPTION_SOURCE and USAGE with the final flag
  (streaming.py; docs/streaming.md).
Either way the instance never blocks on the network: execute() only
validates and hands each request to an asyncio loop in its own thread, then
returns None; that loop sends the responses through the response sender.
"""

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from describer import NO_KEY_HELP, Cancelled, Describer, Job, make_client
from metrics import Metrics
from prompting import PromptError, read_labels, read_prompt
from scrubbing import Scrubber
from settings import ConfigError, InvalidOverride, Overrides, RequestModels, parse_settings

# Without an API key a local endpoint still wants some bearer string.
NO_KEY_PLACEHOLDER = "no-key-required"
CLASSIFY_THREADS = 32
# Streams: threads that send responses and ask Triton about cancellations, off the loop.
SEND_THREADS = 4


class InvalidInput(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = _Log(self.model_name)
        model_config = json.loads(args["model_config"])
        self.decoupled = bool(model_config.get("model_transaction_policy", {}).get("decoupled"))
        try:
            if self.decoupled and model_config.get("max_batch_size") != 1:
                raise ConfigError(
                    "a decoupled (streaming) describe model streams one description per request: "
                    "set max_batch_size: 1")
            self.settings = parse_settings(config_parameters(model_config), os.environ)
            if self.settings.classify_model and not self.decoupled:
                raise ConfigError("classify_model is for a streaming (decoupled) model; without streaming, "
                                  "compose classify and describe in an ensemble (classify_and_describe)")
        except ConfigError as error:
            raise pb_utils.TritonModelException(f"{self.model_name}: {error}") from None
        s = self.settings
        self.request_models = RequestModels(s)

        api_key, key_source = s.load_api_key(os.environ)
        self.scrub = Scrubber(api_key)
        if api_key is None and not s.api_key_required:
            api_key = NO_KEY_PLACEHOLDER
        if api_key is None:
            # Said once, at load: every request would otherwise repeat it.
            self.log.warn(NO_KEY_HELP.format(where=key_source, prefix=s.env_prefix))

        self.metrics = Metrics({"model": self.model_name, "version": args["model_version"]}, streams=self.decoupled)
        self.closing = False
        self.tasks = set()
        self.loop = asyncio.new_event_loop()
        if s.classify_model:
            # A BLS call blocks one executor thread until the photo is classified:
            # enough threads to keep the classifier's batches full.
            self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
                max_workers=CLASSIFY_THREADS, thread_name_prefix=f"{self.model_name}-classify"))
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"{self.model_name}-llm", daemon=True)
        self.thread.start()

        async def build():
            client = make_client(s, api_key) if api_key is not None else None
            return Describer(s, client, self.scrub, self.metrics, self.log)

        self.describer = asyncio.run_coroutine_threadsafe(build(), self.loop).result()
        self.flusher = asyncio.run_coroutine_threadsafe(self._flush_metrics(), self.loop)
        if self.decoupled:
            self.watched = set()
            self.send_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=SEND_THREADS, thread_name_prefix=f"{self.model_name}-send")
            self.watcher = asyncio.run_coroutine_threadsafe(self._watch_cancellations(), self.loop)
        self.log.info(
            f"upstream {s.base_url} model {s.model}; key from {key_source}: "
            f"{'found' if api_key not in (None, NO_KEY_PLACEHOLDER) else 'none'}; "
            f"max_in_flight {s.max_in_flight}, timeout {s.timeout_s}s x {s.max_attempts} attempts, "
            f"cache {'on' if s.cache_enabled else 'off'}, on_failure {s.on_failure}"
            + ("; streaming (decoupled)" if self.decoupled else "")
            + (f"; from environment: {', '.join(s.from_env)}" if s.from_env else ""))

    def execute(self, requests):
        accepted = []
        for request in requests:
            try:
                if self.closing:
                    raise _Reject("the model is unloading", pb_utils.TritonError.UNAVAILABLE)
                work = self._photo_job(request) if self.settings.classify_model else self._jobs(request)
                accepted.append((request, work, time.monotonic()))
            except (InvalidInput, PromptError, InvalidOverride) as exc:
                self.metrics.request_done(None, "invalid", None)
                self._send_error(request, str(exc), pb_utils.TritonError.INVALID_ARG)
            except _Reject as exc:
                self._send_error(request, str(exc), exc.code)
        if accepted:
            # One wake-up of the loop per batch, not per request.
            self.loop.call_soon_threadsafe(self._start, accepted)
        return None

    def finalize(self):
        """Stop taking requests, let in-flight ones finish (bounded), then stop the loop."""
        self.closing = True
        drain_s = self.settings.total_timeout_s + 5.0

        async def drain():
            if self.tasks:
                _, pending = await asyncio.wait(set(self.tasks), timeout=drain_s)
                for task in pending:
                    task.cancel()  # each still sends its response (UNAVAILABLE)
                if pending:
                    await asyncio.wait(pending, timeout=5.0)
            self.flusher.cancel()
            if self.decoupled:
                self.watcher.cancel()
            self.metrics.flush()
            await self.describer.aclose()

        try:
            asyncio.run_coroutine_threadsafe(drain(), self.loop).result(drain_s + 10.0)
        except Exception as exc:
            self.log.error(f"drain at unload failed: {self.scrub(exc)}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10.0)
        self.loop.close()  # shuts the BLS executor down too
        if self.decoupled:
            self.send_pool.shutdown(wait=False)

    # -- on the loop thread -----------------------------------------------------------

    async def _flush_metrics(self):
        while True:
            await asyncio.sleep(self.metrics.FLUSH_S)
            try:
                self.metrics.flush()
            except Exception as exc:  # metrics must never take the model down
                self.log.error(f"metrics flush failed: {self.scrub(exc)}")

    def _start(self, accepted):
        for request, work, received in accepted:
            if not self.decoupled:
                task = self.loop.create_task(self._respond(request, work))
            else:
                task = self.loop.create_task(
                    self._stream(request, work if isinstance(work, _PhotoJob) else work[0], received))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _respond(self, request, jobs):
        try:
            results = await asyncio.gather(
                *(self.describer.describe(job, request.is_cancelled) for job in jobs))
            failed = [r.usage.fallback_reason for r in results if r.outcome == "error"]
            if failed:
                # on_failure=error: the caller asked for an error instead of a fallback.
                response = _error_response(f"the LLM upstream could not answer ({failed[0]})",
                                           pb_utils.TritonError.UNAVAILABLE)
            else:
                # LABELS and SCORES pass through: every output of the ensemble then comes
                # from this step, which is what makes output selection work (see
                # docs/troubleshooting.md#asking-for-some-of-the-outputs).
                response = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("LABELS", np.array([[x.encode("utf-8") for x in job.labels] for job in jobs],
                                                       dtype=np.object_)),
                    pb_utils.Tensor("SCORES", np.array([job.scores for job in jobs], dtype=np.float32)),
                    _bytes_tensor("DESCRIPTION", [r.description for r in results]),
                    _bytes_tensor("DESCRIPTION_SOURCE", [r.source for r in results]),
                    _bytes_tensor("USAGE", [r.usage.to_json() for r in results]),
                ])
        except Cancelled:  # counted by the describer, with what it had billed
            response = _error_response("request cancelled", pb_utils.TritonError.CANCELLED)
        except asyncio.CancelledError:
            response = _error_response("the model is unloading", pb_utils.TritonError.UNAVAILABLE)
        except Exception:  # a bug must cost one response, not the instance
            self.metrics.request_done(None, "error", None)
            # The traceback goes to the log (scrubbed: SDK errors may quote the key), not to the client.
            self.log.error(f"describe failed:\n{self.scrub(traceback.format_exc())}")
            response = _error_response("internal error in the describe step", pb_utils.TritonError.INTERNAL)
        try:
            request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            self.log.error(f"could not send a response: {self.scrub(exc)}")

    async def _stream(self, request, work, received):
        """LABELS and SCORES first, then the description chunk by chunk
        (DESCRIPTION), then DESCRIPTION_SOURCE and USAGE with the final flag.
        An error before the labels (a photo the classifier refused) is the
        stream's only response; one after them (cancelled, on_failure=error,
        unloading, a bug) its last."""
        out = _Outbox(request.get_response_sender(), self.loop, self.send_pool)
        stats = self.metrics.stream_started()
        cancelled = _Watch(request)
        self.watched.add(cancelled)

        def stop():  # the client left, or a chunk was lost: either way, no more text is worth paying for
            return cancelled() or out.failure is not None

        def emit(text):
            out.text(text)
            stats.chunk(time.monotonic() - received)

        response = None
        try:
            if isinstance(work, _PhotoJob):
                # One executor thread classifies and sends the labels: no hop back to the loop between.
                job = await self.loop.run_in_executor(None, self._classify, work, out.sender)
            else:
                job = work
                await out.send(_labels_tensors(job))
            stats.labels(time.monotonic() - received)
            if cancelled():  # the client left while its photo was classified: no LLM call
                self.metrics.request_done(None, "cancelled", None)
                raise Cancelled()
            result = await self.describer.describe(job, stop, emit)
            await out.drain()
            if result.outcome == "error":  # on_failure=error
                response = _error_response(f"the LLM upstream could not answer ({result.usage.fallback_reason})",
                                           pb_utils.TritonError.UNAVAILABLE)
            else:
                if result.usage.chunks is not None:
                    result.usage.chunks = out.text_responses  # text that came together went out together
                cancelled.close()
                await out.send([_bytes_tensor("DESCRIPTION_SOURCE", [result.source]),
                                _bytes_tensor("USAGE", [result.usage.to_json()])], final=True)
        except _Reject as exc:
            if exc.code == pb_utils.TritonError.INVALID_ARG:
                self.metrics.request_done(None, "invalid", None)
            response = _error_response(str(exc), exc.code)
        except Cancelled:  # counted by the describer, with what it had billed
            if out.failure is not None and not cancelled():
                response = self._chunk_lost(out.failure)
            else:
                response = _error_response("request cancelled", pb_utils.TritonError.CANCELLED)
        except _ChunkLost as exc:
            response = self._chunk_lost(exc.__cause__)
        except asyncio.CancelledError:
            response = _error_response("the model is unloading", pb_utils.TritonError.UNAVAILABLE)
        except Exception:  # a bug must cost one stream, not the instance
            self.metrics.request_done(None, "error", None)
            self.log.error(f"describe stream failed:\n{self.scrub(traceback.format_exc())}")
            response = _error_response("internal error in the describe step", pb_utils.TritonError.INTERNAL)
        finally:
            cancelled.close()
            self.watched.discard(cancelled)
            stats.done(time.monotonic() - received)
        if response is not None:
            try:
                await out.drain()  # nothing may follow the final response
            except Exception:
                pass
            try:
                await out.send([], error=response)
            except Exception as exc:
                self.log.error(f"could not send a response: {self.scrub(exc)}")

    def _chunk_lost(self, failure):
        """The stream's end after a DESCRIPTION chunk could not be sent: the text the
        client joined has a hole, so it must not end as a whole description."""
        self.log.error(f"a DESCRIPTION chunk could not be sent, the stream ends with an error: "
                       f"{self.scrub(failure)}")
        return _error_response("a DESCRIPTION chunk could not be sent: the text streamed is incomplete",
                               pb_utils.TritonError.INTERNAL)

    async def _watch_cancellations(self):
        """Refresh every open stream's cancelled flag every cancel_poll_s, in a
        sender thread: each is_cancelled() is a round trip to Triton, which the
        loop must not wait on 500 times a poll."""
        while True:
            await asyncio.sleep(self.settings.cancel_poll_s)
            open_streams = [watch for watch in self.watched if not watch.cancelled]
            if open_streams:
                try:
                    await self.loop.run_in_executor(self.send_pool, _poll_cancelled, open_streams)
                except Exception as exc:  # a failed poll must not end the polling
                    self.log.error(f"cancellation poll failed: {self.scrub(exc)}")

    def _classify(self, work, sender):
        """On an executor thread: LABELS and SCORES of the photo from
        classify_model (BLS), sent as the stream's first response; the Job.
        Raises _Reject with the classifier's own error (a photo that is not
        one: INVALID_ARG), or INTERNAL naming it when its output is unusable."""
        response = pb_utils.InferenceRequest(
            model_name=self.settings.classify_model, inputs=[pb_utils.Tensor("IMAGE", work.image)],
            requested_output_names=["LABELS", "SCORES"]).exec()
        if response.has_error():
            error = response.error()
            code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL
            raise _Reject(error.message(), code)
        labels = pb_utils.get_output_tensor_by_name(response, "LABELS").as_numpy()
        scores = pb_utils.get_output_tensor_by_name(response, "SCORES").as_numpy()
        try:
            job = self._job(labels[0], scores[0], work.prompt, work.overrides)
        except (InvalidInput, PromptError) as exc:
            # The PROMPT passed these checks in execute(): what fails is the classifier's
            # output (a bring-your-own one with long labels or NaN scores), the server's fault.
            raise _Reject(f"the classifier {self.settings.classify_model!r} returned output the describe step "
                          f"cannot use: {exc}", pb_utils.TritonError.INTERNAL) from None
        sender.send(pb_utils.InferenceResponse(output_tensors=_labels_tensors(job)))
        return job

    # -- on the model thread --------------------------------------------------------

    def _jobs(self, request):
        """One Job per batch row; raises InvalidInput, PromptError or InvalidOverride (all INVALID_ARG)."""
        labels = _input(request, "LABELS")
        scores = _input(request, "SCORES")
        if labels is None or scores is None:
            raise InvalidInput("LABELS and SCORES are required")
        prompts = _input(request, "PROMPT")
        if labels.shape != scores.shape or labels.ndim != 2 or labels.shape[1] == 0:
            raise InvalidInput(f"LABELS {list(labels.shape)} and SCORES {list(scores.shape)} "
                               "must have the same non-empty shape")
        overrides = self.settings.resolve_overrides(json.loads(request.parameters() or "{}"))
        jobs = [self._job(labels[row], scores[row], prompts[row].reshape(-1)[0] if prompts is not None else None,
                          overrides)
                for row in range(labels.shape[0])]
        # Last, so that a request refused for another reason takes no place under the cap.
        self.request_models.admit(overrides.model)
        return jobs

    def _photo_job(self, request):
        """A request to a model with classify_model (IMAGE, optional PROMPT): what
        its Job needs besides the labels, checked now (INVALID_ARG as _jobs)."""
        image = _input(request, "IMAGE")
        if image is None or image.size != 1:
            raise InvalidInput("IMAGE is required: one encoded photo per request")
        prompts = _input(request, "PROMPT")
        prompt = prompts.reshape(-1)[0] if prompts is not None else None
        read_prompt(prompt, self.settings.max_prompt_chars)
        overrides = self.settings.resolve_overrides(json.loads(request.parameters() or "{}"))
        self.request_models.admit(overrides.model)
        return _PhotoJob(_photo(image), prompt, overrides)

    def _job(self, labels, scores, raw_prompt, overrides):
        row_scores = tuple(float(x) for x in scores)
        if not all(math.isfinite(x) for x in row_scores):
            raise InvalidInput("SCORES must be finite")
        prompt = read_prompt(raw_prompt, self.settings.max_prompt_chars)
        return Job(labels=read_labels(labels, self.settings), scores=row_scores,
                   prompt=prompt or self.settings.default_prompt, overrides=overrides)

    def _send_error(self, request, message, code):
        request.get_response_sender().send(
            _error_response(message, code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class _Outbox:
    """One stream's responses, sent in order from the sender threads so that the
    loop never waits on Triton (each send is a round trip to the server).
    Text that comes while an earlier send is still on its way goes out
    together in the next response: under load a chunk holds several tokens
    instead of the stream falling behind.

    A chunk that could not be sent leaves a hole in the text: the first such
    failure is kept, later text is dropped, and drain() raises _ChunkLost so the
    stream ends with an error rather than as a whole description."""

    def __init__(self, sender, loop, pool):
        self.sender, self.loop, self.pool = sender, loop, pool
        self.pending = []
        self.flushing = None
        self.text_responses = 0
        self.failure = None  # the exception of the first DESCRIPTION send that failed

    def text(self, text):
        if self.failure is not None:
            return
        self.pending.append(text)
        if self.flushing is None or self.flushing.done():
            self.flushing = self.loop.create_task(self._flush())

    async def _flush(self):
        while self.pending:
            text = "".join(self.pending)
            self.pending.clear()
            try:
                await self.send([_bytes_tensor("DESCRIPTION", [text])])
            except Exception as exc:
                self.failure = exc
                self.pending.clear()
                return
            self.text_responses += 1

    async def drain(self):
        """Wait for the text sent so far; raises _ChunkLost if any of it was lost."""
        if self.flushing is not None:
            await self.flushing
        if self.failure is not None:
            raise _ChunkLost() from self.failure

    async def send(self, tensors, final=False, error=None):
        response = error if error is not None else pb_utils.InferenceResponse(output_tensors=tensors)
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final or error is not None else 0
        await self.loop.run_in_executor(self.pool, functools.partial(self.sender.send, response, flags=flags))


class _Watch:
    """A stream's is_cancelled() as a flag the loop reads for free; the
    model's watcher refreshes it (_poll_cancelled) until close().

    close() comes before the stream's final response: asking Triton about a
    request whose final response went out crashes the server (2.51 segfaults
    in TRITONBACKEND_ResponseFactoryIsCancelled), so the lock keeps a poll
    and the final send apart."""

    def __init__(self, request):
        self.request = request
        self.cancelled = False
        self.closed = False
        self.lock = threading.Lock()

    def __call__(self):
        return self.cancelled

    def close(self):
        with self.lock:  # waits for at most one poll in progress
            self.closed = True


def _poll_cancelled(watches):
    for watch in watches:
        with watch.lock:
            if not watch.closed:
                watch.cancelled = watch.request.is_cancelled()


@dataclasses.dataclass(frozen=True)
class _PhotoJob:
    image: np.ndarray  # the IMAGE input, copied out of the request
    prompt: object     # the raw PROMPT element, or None
    overrides: Overrides


class _ChunkLost(Exception):
    """A DESCRIPTION chunk could not be sent (the send's exception is the __cause__)."""


class _Reject(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def config_parameters(model_config):
    """config.pbtxt `parameters` as {key: string value}, what parse_settings takes."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def _labels_tensors(job):
    return [pb_utils.Tensor("LABELS", np.array([[x.encode("utf-8") for x in job.labels]], dtype=np.object_)),
            pb_utils.Tensor("SCORES", np.array([job.scores], dtype=np.float32))]


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


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _bytes_tensor(name, texts):
    return pb_utils.Tensor(name, np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))


def _error_response(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class _Log:
    """pb_utils.Logger with "[<model name>] " in front: the server log interleaves every model."""

    def __init__(self, model_name):
        self.prefix = f"[{model_name}] "

    def info(self, message):
        pb_utils.Logger.log_info(self.prefix + message)

    def warn(self, message):
        pb_utils.Logger.log_warn(self.prefix + message)

    def error(self, message):
        pb_utils.Logger.log_error(self.prefix + message)
