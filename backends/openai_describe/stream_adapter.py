"""The streamed ways to serve (a decoupled model: describe_stream,
classify_and_describe_stream): one stream per request, LABELS and SCORES
first, then the description chunk by chunk as the LLM writes it, then
DESCRIPTION_SOURCE and USAGE with the final flag (docs/streaming.md).
Sends go through an outbox on a few sender threads and the client's
cancellation is polled off the loop: each is a round trip to Triton, which
the asyncio loop must never wait on."""

import asyncio
import concurrent.futures
import functools
import os
import threading
import time
import traceback

from classify_describe_server.describer import Cancelled
from classify_describe_server.prompting import PromptError

import triton_io as io

# Threads that send responses and ask Triton about cancellations, off the loop.
SEND_THREADS = 4
# The supervisor (serving/supervise_tritonserver.sh) creates this file just before it
# sends TERM to tritonserver. Triton cannot unload a decoupled model while one of its
# streams is open, so it would wait out --exit-timeout-secs; seeing the file, every
# open stream ends within cancel_poll_s with UNAVAILABLE (retry elsewhere).
STOPPING_FILE_ENV = "TRITON_STOPPING_FILE"


class StreamAdapter:
    """A stream per request whose LABELS and SCORES come with it (describe_stream)."""

    def __init__(self, model_name, settings, describer, metrics, log, scrub, loop, request_models):
        self.settings, self.describer, self.metrics = settings, describer, metrics
        self.log, self.scrub, self.loop, self.request_models = log, scrub, loop, request_models
        self.watched = set()
        # Admission: a stream beyond max_open_streams is refused in execute(), before
        # it holds anything, rather than queued behind the others without bound.
        self.open_streams = _Gate(settings.max_open_streams, "max_open_streams", "streams open")
        self.send_pool = concurrent.futures.ThreadPoolExecutor(max_workers=SEND_THREADS,
                                                               thread_name_prefix=f"{model_name}-send")
        self.watcher = asyncio.run_coroutine_threadsafe(self._watch_cancellations(), loop)

    def take(self, request):
        """On the model thread: the request's Job; raises one of io.REFUSALS, or
        io.Reject (UNAVAILABLE) when max_open_streams are open."""
        job = io.read_jobs(request, self.settings, self.request_models)[0]
        self._admit(self.open_streams)
        return job

    def _admit(self, gate):
        if not gate.enter():
            self.metrics.request_done(None, "overloaded", None)
            raise io.overloaded(gate.refusal())

    async def _labels(self, work, out, cancelled):
        """The stream's first response, LABELS and SCORES; the Job to describe,
        or None if the client left first. Whether it left is asked of Triton
        after the labels, from the thread that sent them: no LLM call for a
        client that is gone, however long the request waited for the loop."""
        def send():
            io.send(out.sender, io.response(io.labels_tensors([work])), final=False)
            return None if cancelled.refresh() else work
        return await self.loop.run_in_executor(self.send_pool, send)

    def stop(self):
        self.watcher.cancel()

    def shutdown(self):
        self.send_pool.shutdown(wait=False)

    async def serve(self, request, work, received):
        """LABELS and SCORES first, then the description chunk by chunk
        (DESCRIPTION), then DESCRIPTION_SOURCE and USAGE with the final flag.
        An error before the labels (a photo the classifier refused) is the
        stream's only response; one after them (cancelled, on_failure=error,
        unloading, a bug) its last."""
        out = _Outbox(request.get_response_sender(), self.loop, self.send_pool)
        stats = self.metrics.stream_started()
        cancelled = _Watch(request)
        self.watched.add(cancelled)
        # Left before the final response: a client that sends its next stream at once finds the place free.
        leave = _once(self.open_streams.leave)

        def stop():  # the client left, or a chunk was lost: either way, no more text is worth paying for
            return cancelled() or out.failure is not None

        def emit(text):
            out.text(text)
            stats.chunk(time.monotonic() - received)

        response = None
        try:
            job = await self._labels(work, out, cancelled)
            if job is None:  # the client left before its photo was classified, or while: no LLM call
                self.metrics.request_done(None, "cancelled", None)
                raise Cancelled()
            stats.labels(time.monotonic() - received)
            result = await self.describer.describe(job, stop, emit)
            await out.drain()
            if result.outcome == "error":  # on_failure=error
                response = io.upstream_failed(result.usage.fallback_reason)
            else:
                if result.usage.chunks is not None:
                    result.usage.chunks = out.text_responses  # text that came together went out together
                cancelled.close()
                leave()
                await out.send([io.bytes_tensor("DESCRIPTION_SOURCE", [result.source]),
                                io.bytes_tensor("USAGE", [result.usage.to_json()])], final=True)
        except io.Reject as exc:
            if exc.invalid:
                self.metrics.request_done(None, "invalid", None)
            response = exc.response()
        except Cancelled:  # counted by the describer, with what it had billed
            if cancelled.server_stopping:
                response = io.server_stopping().response()
            elif out.failure is not None and not cancelled():
                response = self._chunk_lost(out.failure, work.request_id)
            else:
                response = io.cancelled()
        except _ChunkLost as exc:
            response = self._chunk_lost(exc.__cause__, work.request_id)
        except asyncio.CancelledError:
            response = io.unloading().response()
        except Exception:  # a bug must cost one stream, not the instance
            self.metrics.request_done(None, "error", None)
            self.log.error(f"describe stream failed:\n{self.scrub(traceback.format_exc())}", work.request_id)
            response = io.internal().response()
        finally:
            cancelled.close()
            self.watched.discard(cancelled)
            leave()
            stats.done(time.monotonic() - received)
        if response is not None:
            try:
                await out.drain()  # nothing may follow the final response
            except Exception:
                pass
            try:
                await out.send([], error=response)
            except Exception as exc:
                self.log.error(f"could not send a response: {self.scrub(exc)}", work.request_id)

    def _chunk_lost(self, failure, request_id):
        """The stream's end after a DESCRIPTION chunk could not be sent: the text the
        client joined has a hole, so it must not end as a whole description."""
        self.log.error(f"a DESCRIPTION chunk could not be sent, the stream ends with an error: "
                       f"{self.scrub(failure)}", request_id)
        return io.internal("a DESCRIPTION chunk could not be sent: the text streamed is incomplete").response()

    async def _watch_cancellations(self):
        """Refresh every open stream's cancelled flag every cancel_poll_s, in a
        sender thread: each is_cancelled() is a round trip to Triton, which the
        loop must not wait on 500 times a poll."""
        stopping_file = os.environ.get(STOPPING_FILE_ENV, "")
        while True:
            await asyncio.sleep(self.settings.cancel_poll_s)
            open_streams = [watch for watch in self.watched if not watch.cancelled]
            if open_streams and stopping_file and os.path.exists(stopping_file):
                for watch in open_streams:
                    watch.server_stopping = True
            if open_streams:
                try:
                    await self.loop.run_in_executor(self.send_pool, _poll_cancelled, open_streams)
                except Exception as exc:  # a failed poll must not end the polling
                    self.log.error(f"cancellation poll failed: {self.scrub(exc)}")


class PhotoStreamAdapter(StreamAdapter):
    """A stream per photo (classify_and_describe_stream): its LABELS and
    SCORES are asked of classify_model by BLS first."""

    def __init__(self, *args):
        super().__init__(*args)
        # Photos waiting for the classifier each hold their IMAGE: a bound of their own.
        self.photos_waiting = _Gate(self.settings.max_photos_waiting, "max_photos_waiting",
                                    "photos waiting for the classifier")

    def take(self, request):
        work = io.read_photo_job(request, self.settings, self.request_models)
        self._admit(self.photos_waiting)
        try:
            self._admit(self.open_streams)
        except io.Reject:
            self.photos_waiting.leave()
            raise
        return work

    async def _labels(self, work, out, cancelled):
        # One executor thread classifies and sends the labels: no hop back to the loop between.
        try:
            return await self.loop.run_in_executor(None, self._classify, work, out.sender, cancelled)
        finally:
            self.photos_waiting.leave()

    def _classify(self, work, sender, cancelled):
        """On an executor thread: LABELS and SCORES of the photo from
        classify_model (BLS), sent as the stream's first response; the Job, or
        None when the client left before the classification or during it.
        Raises io.Reject with the classifier's own error (a photo that is not
        one: INVALID_ARG), or INTERNAL naming it when its output is unusable."""
        if cancelled.refresh():  # it waited for a thread: the client may have gone meanwhile
            return None
        # VIEW (the photo as the LLM sees it) only when the LLM may see it.
        wanted = ["LABELS", "SCORES"] + (["VIEW"] if self.settings.vision != "off" else [])
        labels, scores, view = io.classify(self.settings.classify_model, work.image, wanted, work.request_id)
        try:
            job = io.job_from(labels, scores, work.prompt, work.overrides, self.settings, view, work.dialogue,
                              work.request_id, work.trace)
        except (io.InvalidInput, PromptError) as exc:
            # The PROMPT passed these checks in execute(): what fails is the classifier's
            # output (a bring-your-own one with long labels or NaN scores), the server's fault.
            raise io.internal(f"the classifier {self.settings.classify_model!r} returned output the describe "
                              f"step cannot use: {exc}") from None
        io.send(sender, io.response(io.labels_tensors([job])), final=False)
        return None if cancelled.refresh() else job


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
                await self.send([io.bytes_tensor("DESCRIPTION", [text])])
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
        response = error if error is not None else io.response(tensors)
        await self.loop.run_in_executor(self.pool, functools.partial(io.send, self.sender, response, final or error is not None))


class _Watch:
    """A stream's is_cancelled() as a flag the loop reads for free; the
    adapter's watcher refreshes it (_poll_cancelled) until close().

    close() comes before the stream's final response: asking Triton about a
    request whose final response went out crashes the server (2.51 segfaults
    in TRITONBACKEND_ResponseFactoryIsCancelled), so the lock keeps a poll
    and the final send apart."""

    def __init__(self, request):
        self.request = request
        self.cancelled = False
        self.server_stopping = False  # set by the watcher: the stream must end, its client did not leave
        self.closed = False
        self.lock = threading.Lock()

    def __call__(self):
        return self.cancelled or self.server_stopping

    def refresh(self):
        """Ask Triton now (a round trip: never on the loop); the flag."""
        _poll_cancelled([self])
        return self.cancelled

    def close(self):
        with self.lock:  # waits for at most one poll in progress
            self.closed = True


def _poll_cancelled(watches):
    for watch in watches:
        with watch.lock:
            if not watch.closed:
                watch.cancelled = watch.request.is_cancelled()


def _once(action):
    done = []

    def call():
        if not done:
            done.append(True)
            action()
    return call


class _Gate:
    """At most `limit` holders at once, entered on the model thread and left
    from the loop or an executor thread."""

    def __init__(self, limit, setting, what):
        self.limit, self.setting, self.what = limit, setting, what
        self.count = 0
        self.lock = threading.Lock()

    def enter(self):
        with self.lock:
            if self.count >= self.limit:
                return False
            self.count += 1
            return True

    def leave(self):
        with self.lock:
            self.count -= 1

    def refusal(self):
        return (f"{self.limit} {self.what} on this instance ({self.setting}={self.limit} in the model config): "
                f"the model is at capacity")


class _ChunkLost(Exception):
    """A DESCRIPTION chunk could not be sent (the send's exception is the __cause__)."""
