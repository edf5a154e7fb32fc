"""Triton adapter of the openai_describe backend: owns the tensor names and
every pb_utils call but the metrics (metrics.py); the logic lives in the
modules beside it.

Non-decoupled on purpose (HTTP /infer and ensembles keep working), yet the
instance never blocks on the network: execute() only validates and hands
each request to an asyncio loop in its own thread, then returns None; that
loop sends each request's single response through its response sender.
"""

import asyncio
import json
import math
import os
import threading
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from describer import NO_KEY_HELP, Cancelled, Describer, Job, make_client
from metrics import Metrics
from prompting import PromptError, read_labels, read_prompt
from scrubbing import Scrubber
from settings import ConfigError, InvalidOverride, RequestModels, parse_settings

# Without an API key a local endpoint still wants some bearer string.
NO_KEY_PLACEHOLDER = "no-key-required"


class InvalidInput(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = _Log(self.model_name)
        model_config = json.loads(args["model_config"])
        try:
            if model_config.get("model_transaction_policy", {}).get("decoupled"):
                raise ConfigError(
                    "openai_describe is meant to be non-decoupled (one response per request, "
                    "so HTTP /infer and ensembles work); remove model_transaction_policy.decoupled")
            self.settings = parse_settings(config_parameters(model_config), os.environ)
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

        self.metrics = Metrics({"model": self.model_name, "version": args["model_version"]})
        self.closing = False
        self.tasks = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"{self.model_name}-llm", daemon=True)
        self.thread.start()

        async def build():
            client = make_client(s, api_key) if api_key is not None else None
            return Describer(s, client, self.scrub, self.metrics, self.log)

        self.describer = asyncio.run_coroutine_threadsafe(build(), self.loop).result()
        self.flusher = asyncio.run_coroutine_threadsafe(self._flush_metrics(), self.loop)
        self.log.info(
            f"upstream {s.base_url} model {s.model}; key from {key_source}: "
            f"{'found' if api_key not in (None, NO_KEY_PLACEHOLDER) else 'none'}; "
            f"max_in_flight {s.max_in_flight}, timeout {s.timeout_s}s x {s.max_attempts} attempts, "
            f"cache {'on' if s.cache_enabled else 'off'}, on_failure {s.on_failure}"
            + (f"; from environment: {', '.join(s.from_env)}" if s.from_env else ""))

    def execute(self, requests):
        accepted = []
        for request in requests:
            try:
                if self.closing:
                    raise _Reject("the model is unloading", pb_utils.TritonError.UNAVAILABLE)
                accepted.append((request, self._jobs(request)))
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
            self.metrics.flush()
            await self.describer.aclose()

        try:
            asyncio.run_coroutine_threadsafe(drain(), self.loop).result(drain_s + 10.0)
        except Exception as exc:
            self.log.error(f"drain at unload failed: {self.scrub(exc)}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10.0)
        self.loop.close()

    # -- on the loop thread -----------------------------------------------------------

    async def _flush_metrics(self):
        while True:
            await asyncio.sleep(self.metrics.FLUSH_S)
            try:
                self.metrics.flush()
            except Exception as exc:  # metrics must never take the model down
                self.log.error(f"metrics flush failed: {self.scrub(exc)}")

    def _start(self, accepted):
        for request, jobs in accepted:
            task = self.loop.create_task(self._respond(request, jobs))
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
        params = json.loads(request.parameters() or "{}")
        model, temperature, max_tokens, timeout_s = self.settings.resolve_overrides(params)
        jobs = []
        for row in range(labels.shape[0]):
            row_scores = tuple(float(x) for x in scores[row])
            if not all(math.isfinite(x) for x in row_scores):
                raise InvalidInput("SCORES must be finite")
            prompt = read_prompt(prompts[row].reshape(-1)[0] if prompts is not None else None,
                                 self.settings.max_prompt_chars)
            jobs.append(Job(
                labels=read_labels(labels[row], self.settings), scores=row_scores,
                prompt=prompt or self.settings.default_prompt,
                model=model, temperature=temperature, max_tokens=max_tokens, timeout_s=timeout_s))
        # Last, so that a request refused for another reason takes no place under the cap.
        self.request_models.admit(model)
        return jobs

    def _send_error(self, request, message, code):
        request.get_response_sender().send(
            _error_response(message, code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class _Reject(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def config_parameters(model_config):
    """config.pbtxt `parameters` as {key: string value}, what parse_settings takes."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


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
