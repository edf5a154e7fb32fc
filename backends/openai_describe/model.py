"""Triton adapter of the openai_describe backend: the model's lifecycle and
the batched way to serve; the logic lives in the modules beside it.

The way to serve is chosen once, at load, from the model's config:
- not decoupled (`describe`): one response per request, so HTTP /infer and
  the classify_and_describe ensemble work (BatchedDescribe, here);
- decoupled (`describe_stream`, `classify_and_describe_stream` with
  `classify_model`): a stream per request (stream_adapter.py).
Either way the instance never blocks on the network: execute() only
validates and hands each request to an asyncio loop in its own thread, then
returns None; that loop sends the responses through the response sender.
"""

import asyncio
import concurrent.futures
import json
import os
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils
from classify_describe_server import llm_span
from classify_describe_server.describer import NO_KEY_HELP, Cancelled, Describer, make_client
from classify_describe_server.scrubbing import Scrubber
from classify_describe_server.settings import ConfigError, RequestModels, parse_settings, shown_url

import triton_io as io
from stream_adapter import PhotoStreamAdapter, StreamAdapter

# Without an API key a local endpoint still wants some bearer string.
CLASSIFY_THREADS = 32
# The longest finalize waits for the LLM-call spans still queued to leave.
SPANS_FLUSH_S = 5.0


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]
        self.log = io.log(self.model_name)
        model_config = json.loads(args["model_config"])
        decoupled = bool(model_config.get("model_transaction_policy", {}).get("decoupled"))
        try:
            if decoupled and model_config.get("max_batch_size") != 1:
                raise ConfigError(
                    "a decoupled (streaming) describe model streams one description per request: "
                    "set max_batch_size: 1")
            self.settings = parse_settings(io.model_parameters(model_config), os.environ)
            if self.settings.classify_model and not decoupled:
                raise ConfigError("classify_model is for a streaming (decoupled) model; without streaming, "
                                  "compose classify and describe in an ensemble (classify_and_describe)")
        except ConfigError as error:
            raise pb_utils.TritonModelException(f"{self.model_name}: {error}") from None
        s = self.settings

        api_key, key_source = s.load_api_key(os.environ)
        self.scrub = Scrubber(api_key)
        # Without a key: an endpoint that needs one gets no call at all (the flagged no_api_key
        # fallback, said once here); any other is called without Authorization.
        keyless = api_key is None and not s.needs_key()
        if api_key is None and not keyless:
            self.log.warn(NO_KEY_HELP.format(where=key_source, prefix=s.env_prefix, url=shown_url(s.base_url)))

        self.metrics = io.metrics({"model": self.model_name, "version": args["model_version"]}, streams=decoupled)
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

        # The LLM call's own span when tracing is on (the supervisor passes the collector's URL).
        self.spans = llm_span.from_environment(os.environ, self.log)

        async def build():
            client = make_client(s, api_key) if api_key is not None or keyless else None
            return Describer(s, client, self.scrub, self.metrics, self.log, spans=self.spans)

        describer = asyncio.run_coroutine_threadsafe(build(), self.loop).result()
        self.flusher = asyncio.run_coroutine_threadsafe(self._flush_metrics(), self.loop)
        parts = (self.settings, describer, self.metrics, self.log, self.scrub, self.loop, RequestModels(s))
        if not decoupled:
            self.handler = BatchedDescribe(*parts)
        else:
            self.handler = (PhotoStreamAdapter if s.classify_model else StreamAdapter)(self.model_name, *parts)
        self.log.info(
            f"upstream {self.scrub(shown_url(s.base_url))} model {s.model}; key from {key_source}: "
            f"{'found' if api_key is not None else 'none, called without one' if keyless else 'none'}; "
            f"max_in_flight {s.max_in_flight}, timeout {s.timeout_s}s x {s.max_attempts} attempts, "
            f"cache {'on' if s.cache_enabled else 'off'}, on_failure {s.on_failure}"
            + ("; streaming (decoupled)" if decoupled else "")
            + (f"; from environment: {', '.join(s.from_env)}" if s.from_env else ""))

    def execute(self, requests):
        accepted = []
        for request in requests:
            try:
                if self.closing:
                    raise io.unloading()
                accepted.append((request, self.handler.take(request), time.monotonic()))
            except io.REFUSALS as exc:
                self.metrics.request_done(None, "invalid", None)
                io.send_final(request, io.refused(exc))
            except io.Reject as exc:
                io.send_final(request, exc.response())
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
            self.handler.stop()
            self.metrics.flush()
            await self.handler.describer.aclose()

        try:
            asyncio.run_coroutine_threadsafe(drain(), self.loop).result(drain_s + 10.0)
        except Exception as exc:
            self.log.error(f"drain at unload failed: {self.scrub(exc)}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10.0)
        self.loop.close()  # shuts the BLS executor down too
        self.handler.shutdown()
        if self.spans is not None:
            # Bounded: a dead collector costs spans, not a slow unload.
            self.spans.flush(SPANS_FLUSH_S)

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
            task = self.loop.create_task(self.handler.serve(request, work, received))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


class BatchedDescribe:
    """One response per request, one Job per batch row (the `describe` model)."""

    def __init__(self, settings, describer, metrics, log, scrub, loop, request_models):
        self.settings, self.describer, self.metrics = settings, describer, metrics
        self.log, self.scrub, self.request_models = log, scrub, request_models

    def take(self, request):
        """On the model thread: the request's Jobs; raises one of io.REFUSALS."""
        return io.read_jobs(request, self.settings, self.request_models)

    def stop(self):
        pass

    def shutdown(self):
        pass

    async def serve(self, request, jobs, received):
        request_id = jobs[0].request_id  # one request's rows: one id
        try:
            results = await asyncio.gather(
                *(self.describer.describe(job, request.is_cancelled) for job in jobs))
            failed = [r.usage.fallback_reason for r in results if r.outcome == "error"]
            if failed:
                response = io.upstream_failed(failed[0])
            else:
                # LABELS and SCORES pass through: every output of the ensemble then comes
                # from this step, which is what makes output selection work (see
                # docs/troubleshooting.md#asking-for-some-of-the-outputs).
                response = pb_utils.InferenceResponse(output_tensors=io.labels_tensors(jobs) + [
                    io.bytes_tensor("DESCRIPTION", [r.description for r in results]),
                    io.bytes_tensor("DESCRIPTION_SOURCE", [r.source for r in results]),
                    io.bytes_tensor("USAGE", [r.usage.to_json() for r in results]),
                ])
        except Cancelled:  # counted by the describer, with what it had billed
            response = io.cancelled()
        except asyncio.CancelledError:
            response = io.unloading().response()
        except Exception:  # a bug must cost one response, not the instance
            self.metrics.request_done(None, "error", None)
            # The traceback goes to the log (scrubbed: SDK errors may quote the key), not to the client.
            self.log.error(f"describe failed:\n{self.scrub(traceback.format_exc())}", request_id)
            response = io.internal().response()
        try:
            io.send_final(request, response)
        except Exception as exc:
            self.log.error(f"could not send a response: {self.scrub(exc)}", request_id)
