"""The description as a stream of text chunks (the describe_stream model).

Same settings, limits, cache, circuit breaker, retries, fallback and
accounting as Describer.describe, through the same Describer: the upstream
is asked with stream=True (and stream_options.include_usage, so the last
chunk bills the tokens). Retries happen only before the first piece of text;
once text went out, a failure ends the stream with what was sent, flagged
DESCRIPTION_SOURCE "llm_partial". A cached answer is replayed as one chunk.
Knows nothing about Triton: `emit(text)` sends one chunk.
"""

import asyncio

from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk

from accounting import Usage
from describer import Cancelled, MalformedResponse, Result
from prompting import build_messages


async def describe_stream(describer, job, emit, is_cancelled=lambda: False):
    """Send the description through `emit` chunk by chunk; return the Result
    (its description is the whole text sent; USAGE with the time to the first
    chunk and the number of chunks). Raises Cancelled."""
    clock = describer.clock
    started = clock()
    sent = []  # when each chunk went out

    def send(text):
        emit(text)
        sent.append(clock())

    result = await _describe(describer, job, send, is_cancelled, started)
    if sent:
        result.usage.time_to_first_token_ms = (sent[0] - started) * 1000.0
        result.usage.chunks = len(sent)
    return result


async def _describe(describer, job, emit, is_cancelled, started):
    clock = describer.clock
    messages = build_messages(describer.settings, job.labels, job.scores, job.prompt)
    key, text = describer.lookup(job, messages)
    if text is not None:
        emit(text)
        return describer.done(job, Result(text, "llm", Usage(job.model, cached=True), "cached"))
    if describer.client is None:
        return _fallback(describer, job, Usage(job.model), "no_api_key", emit)

    usage = Usage(job.model)
    try:
        answer = await describer.attempts(
            job, usage, is_cancelled, lambda timeout: _open(describer, job, messages, usage, timeout, is_cancelled),
            keep_slot=True)
    except Cancelled:
        describer.observer.request_done(job.model, "cancelled", usage)
        raise
    if isinstance(answer, str):
        return _fallback(describer, job, usage, answer, emit)

    first, stream = answer.value
    parts = [first]
    emit(first)
    read_from = clock()
    try:
        failure = await _read_rest(describer, job, stream, usage, parts, emit, started, is_cancelled)
    except Cancelled:
        describer.observer.request_done(job.model, "cancelled", usage)
        raise
    finally:
        # Closing the response closes its connection: the upstream stops generating (and billing).
        await _close(stream)
        describer.release_slot()
        usage.upstream_latency_ms += (clock() - read_from) * 1000.0
    text = "".join(parts)
    if failure is not None:
        if failure.upstream_fault:
            answer.breaker.record_failure(answer.ticket)
        usage.fallback_reason = failure.reason
        return describer.done(job, Result(text, "llm_partial", usage, "partial"))
    if key is not None:
        describer.cache.put(key, text)
    return describer.done(job, Result(text, "llm", usage, "ok" if usage.attempts == 1 else "retried"))


def _fallback(describer, job, usage, reason, emit):
    result = describer.fallback(job, usage, reason)
    if result.outcome != "error":  # on_failure=error: the adapter ends the stream with an error instead
        emit(result.description)
    return result


async def _open(describer, job, messages, usage, timeout, is_cancelled):
    """One streaming attempt, up to its first piece of text within `timeout`:
    (that text, the open stream). Raises like one plain attempt does, and
    MalformedResponse for a stream that ends without text."""
    end = describer.clock() + timeout
    call = describer.client.post(
        "/chat/completions", cast_to=ChatCompletionChunk, stream=True, stream_cls=AsyncStream[ChatCompletionChunk],
        options={"timeout": timeout},
        body={"model": job.model, "messages": messages, "max_tokens": job.max_tokens,
              "temperature": job.temperature, "stream": True, "stream_options": {"include_usage": True}})
    stream = await describer.wait(asyncio.ensure_future(call), timeout, is_cancelled)
    try:
        while True:
            chunk = await describer.wait(asyncio.ensure_future(_next(stream)),
                                         end - describer.clock(), is_cancelled)
            if chunk is None:
                raise MalformedResponse("the stream ended without text")
            _bill(describer, job, usage, chunk)
            text = _delta_text(chunk).lstrip()
            if text:
                return text, stream
    except BaseException:
        await _close(stream)
        raise


async def _read_rest(describer, job, stream, usage, parts, emit, started, is_cancelled):
    """Read and emit the rest of the stream: None when it ended well, else
    the Failure that cut it short. Every chunk must come within timeout_s of
    the previous one, the whole stream within total_timeout_s; the client's
    cancellation is checked at every chunk, and every cancel_poll_s between them."""
    settings, clock = describer.settings, describer.clock
    deadline = started + settings.total_timeout_s
    while True:
        if is_cancelled():  # cheap here: the adapter's flag, refreshed every cancel_poll_s
            raise Cancelled()
        now = clock()
        try:
            chunk = await describer.wait(asyncio.ensure_future(_next(stream)),
                                         min(job.timeout_s, deadline - now), is_cancelled)
        except Cancelled:
            raise
        except Exception as exc:
            return describer.classify(exc)
        if chunk is None:
            return None
        _bill(describer, job, usage, chunk)
        text = _delta_text(chunk)
        if text:
            parts.append(text)
            emit(text)


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


def _bill(describer, job, usage, chunk):
    if getattr(chunk, "usage", None) is not None:
        describer.bill(job, usage, chunk.usage)


def _delta_text(chunk):
    try:
        text = chunk.choices[0].delta.content
    except (AttributeError, IndexError, TypeError):
        return ""
    return text if isinstance(text, str) else ""
