"""A streamed answer: what Describer.describe(job, emit=...) does differently
when the text goes out as the upstream writes it. The upstream is asked with
stream=True (and stream_options.include_usage, so the last chunk bills the
tokens); an attempt lasts until the first piece of text, so retries happen
only before it. Knows nothing about Triton.
"""


from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk

from .accounting import finish_reason_of
from .resilience import ANSWER_TOO_LONG, Cancelled, EmptyStream


class StreamedAnswer:
    """The reader of one streamed request (describer.Call): attempt() opens
    the stream up to its first text and keeps the slot; read() emits that text
    and the rest, then closes the stream and gives the slot back."""

    keeps_slot = True

    def __init__(self, call, emit):
        self.call = call
        self.emit = emit
        self.chars = 0  # of text kept and emitted
        self.billed = False  # whether the open stream was billed (at its end)
        self.reported = None  # the open stream's last usage chunk
        self.read_chars = 0  # of text the open stream sent, kept or not

    async def attempt(self, timeout):
        """One streaming attempt, up to its first piece of text within `timeout`:
        (that text, the open stream, the finish_reason so far). Raises like one
        plain attempt does, and EmptyStream (a MalformedResponse) for a stream that ends without text."""
        c = self.call
        end = c.clock() + timeout
        stream = await c.wait(c.client.post(
            "/chat/completions", cast_to=ChatCompletionChunk, stream=True, stream_cls=AsyncStream[ChatCompletionChunk],
            options=c.job.options(timeout),
            body=c.job.body(c.messages, stream=True, stream_options={"include_usage": True})), timeout)
        self.billed, self.reported, self.read_chars = False, None, 0
        try:
            while True:
                chunk = await c.wait(_next(stream), end - c.clock())
                if chunk is None:
                    raise EmptyStream()
                self._note_usage(chunk)
                text = _delta_text(chunk)
                self.read_chars += len(text)
                text = text.lstrip()
                if text:
                    return text, stream, finish_reason_of(chunk)
        except BaseException:
            await _close(stream)
            self._settle()
            raise

    async def read(self, answer):
        """Emit the first text and read the rest: (the whole text, the upstream's
        finish_reason, the Failure that cut the stream short or None)."""
        c = self.call
        first, stream, finish_reason = answer.value
        parts = []
        read_from = c.clock()
        try:
            if self._keep(parts, first):
                failure, finish_reason = await self._read_rest(stream, parts, finish_reason)
            else:
                failure, finish_reason = ANSWER_TOO_LONG, "length"
        finally:
            try:
                # Closing the response closes its connection: the upstream stops generating (and billing).
                await _close(stream)
            finally:  # a cancellation while it closes must not keep the slot or skip the bill
                self._settle()
                c.release_slot()
                c.usage.upstream_latency_ms += (c.clock() - read_from) * 1000.0
        return "".join(parts), finish_reason, failure

    async def _read_rest(self, stream, parts, finish_reason):
        """(None or the Failure that cut the stream short, the finish_reason
        seen). Every chunk must come within timeout_s of the previous one, the
        whole stream within total_timeout_s; the client's cancellation is
        checked at every chunk, and every cancel_poll_s between them."""
        c = self.call
        while True:
            if c.is_cancelled():  # cheap here: the adapter's flag, refreshed every cancel_poll_s
                raise Cancelled()
            try:
                chunk = await c.wait(_next(stream), min(c.job.overrides.timeout_s, c.deadline - c.clock()))
            except Cancelled:
                raise
            except Exception as exc:
                return c.classify_failure(exc), finish_reason
            if chunk is None:
                return None, finish_reason
            self._note_usage(chunk)
            finish_reason = finish_reason_of(chunk) or finish_reason
            text = _delta_text(chunk)
            self.read_chars += len(text)
            if text and not self._keep(parts, text):
                # Past what max_tokens allows: stop reading, and the upstream writing (read() closes it).
                return ANSWER_TOO_LONG, "length"

    def _keep(self, parts, text):
        """Emit and keep `text`, up to the answer's limit; False when it went past (the rest dropped)."""
        room = self.call.max_chars - self.chars
        kept = text[:room]
        if kept:
            parts.append(kept)
            self.chars += len(kept)
            self.emit(kept)
        return len(text) <= room

    def _note_usage(self, chunk):
        # The last one counts: an upstream may repeat the running total on every chunk
        # (vLLM's continuous_usage_stats), where summing them would bill it many times over.
        if getattr(chunk, "usage", None) is not None:
            self.reported = chunk.usage

    def _settle(self):
        """Bill the stream once, as it closes: its last usage chunk, or, without one (a
        server that sends none, a stream cut, timed out or cancelled before it, which the
        upstream billed all the same), the estimate from the prompt and the text it sent
        (accounting.billed_tokens, as a whole answer without usage)."""
        if self.billed:
            return
        self.billed = True
        self.call.bill(self.reported, self.read_chars)


async def _next(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _close(stream):
    try:
        await stream.close()
    except Exception:  # the connection may already be gone; nothing left to free
        pass


def _delta_text(chunk):
    try:
        text = chunk.choices[0].delta.content
    except (AttributeError, IndexError, TypeError):
        return ""
    return _whole_characters(text) if isinstance(text, str) else ""


def _whole_characters(text):
    """`text` with each lone UTF-16 surrogate (JSON lets "\\ud83d" through alone, as when a
    gateway splits an emoji's pair across two chunks) as U+FFFD: one would fail the
    chunk's UTF-8 encoding on its way out, and the stream with it."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")

