"""The ways a soak request reaches the pipeline (tools/soak.py's valid mix).

  infer         classify_and_describe over HTTP (AsyncClient, its own retries)
  grpc_stream   classify_and_describe_stream over gRPC streaming (AsyncClient.stream)
  front         the OpenAI front's POST /v1/chat/completions
  front_stream  the same with "stream": true (server-sent events)

Each returns a classify_describe `Result` (labels, scores, the whole
description, its source, usage), so the soak judges every path's answer the
same way; raises TritonRequestError when the server answered with an error (a
failed request), any other exception when no answer came (lost). Like the
clients' `retries=`, a request that got no answer at all, or UNAVAILABLE /
503, is resent with exponential back-off and full jitter, but only while
nothing of its answer has come: a stream cut after its first response is not
resent (a client would have shown half an answer).
"""

import asyncio
import base64
import json
import time

from classify_describe import AsyncClient, Result, TritonRequestError
from classify_describe.client import backoff_s

EXTRA = "classify_describe"  # the front's extra field (openai_front/responses.py)
MIX = ("infer", "grpc_stream", "infer", "front", "infer", "front_stream", "infer", "front")


class Resend(Exception):
    """Nothing of the answer came and sending again is safe; `cause` is what happened."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


def front_error(status, body):
    """The TritonRequestError for a front answer with an error status (its OpenAI error body)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:300]
    return TritonRequestError(f"HTTP {status}: {message}", retryable=status == 503, answered=True)


def front_result(body, latency_ms):
    """A chat.completion (stream false) -> Result."""
    answer = json.loads(body)
    extra = answer[EXTRA]
    return Result(labels=extra["labels"], scores=extra["scores"],
                  description=answer["choices"][0]["message"]["content"] or "",
                  description_source=extra["description_source"], usage=extra.get("usage") or {},
                  latency_ms=latency_ms)


def front_stream_result(lines, latency_ms):
    """The SSE lines of a streamed chat completion -> Result. An `error` event
    raises TritonRequestError; a stream without its last chunk or [DONE], ValueError."""
    labels = scores = source = None
    usage, parts, done = {}, [], False
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise TritonRequestError(f"error event: {chunk['error'].get('message')}", answered=True)
        extra = chunk.get(EXTRA) or {}
        labels, scores = extra.get("labels", labels), extra.get("scores", scores)
        source, usage = extra.get("description_source", source), extra.get("usage", usage)
        for choice in chunk.get("choices") or []:
            parts.append((choice.get("delta") or {}).get("content") or "")
    if not done or source is None or labels is None:
        raise ValueError("the stream ended without its last chunk and [DONE]")
    return Result(labels=labels, scores=scores, description="".join(parts), description_source=source,
                  usage=usage or {}, latency_ms=latency_ms)


def chat_body(image, prompt, stream):
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    return json.dumps({"model": "classify_and_describe", "stream": stream, "messages": [
        {"role": "user", "content": [{"type": "text", "text": prompt},
                                     {"type": "image_url", "image_url": {"url": uri}}]}]}).encode()


class Paths:
    """One client per path, on one server; `retried` counts resends (all paths)."""

    def __init__(self, server, front_key, scan, concurrency, retries, backoff_base_s=0.5, timeout_s=120.0):
        # throttle=False: the soak judges what the server answers, so every attempt reaches it.
        self.http = AsyncClient(server.http_url, concurrency=concurrency, timeout_s=timeout_s,
                                retries=retries, retry_backoff_s=backoff_base_s, throttle=False)
        self.grpc = AsyncClient(server.grpc_url, protocol="grpc", concurrency=concurrency, timeout_s=timeout_s,
                                throttle=False)
        self.url = f"{server.openai_base_url}/chat/completions"
        self.headers = {"Authorization": f"Bearer {front_key}", "Content-Type": "application/json"}
        self.scan, self.retries, self.backoff_base_s, self.timeout_s = scan, retries, backoff_base_s, timeout_s
        self.resent = 0
        self.session = None

    @property
    def retried(self):
        return self.http.retried + self.resent

    async def infer(self, image, prompt):
        return await self.http.infer(image, prompt=prompt)

    async def grpc_stream(self, image, prompt):
        return await self.resending(lambda: self._grpc_stream(image, prompt))

    async def front(self, image, prompt):
        return await self.resending(lambda: self._front(image, prompt, stream=False))

    async def front_stream(self, image, prompt):
        return await self.resending(lambda: self._front(image, prompt, stream=True))

    async def resending(self, send):
        for attempt in range(self.retries + 1):
            try:
                return await send()
            except Resend as resend:
                if attempt == self.retries:
                    raise resend.cause from None
                self.resent += 1
                await asyncio.sleep(backoff_s(self.backoff_base_s, attempt))
        raise AssertionError("unreachable")

    async def _grpc_stream(self, image, prompt):
        seen = False
        try:
            async for event in self.grpc.stream(image, prompt=prompt):
                seen = True
                if event.kind == "done":
                    return event.result
        except TritonRequestError as error:
            if not seen and error.retryable and "Deadline" not in str(error):
                raise Resend(error) from None
            raise
        raise ValueError("the stream ended without its last response")

    async def _front(self, image, prompt, stream):
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        started = time.perf_counter()
        try:
            async with self.session.post(self.url, data=chat_body(image, prompt, stream),
                                         headers=self.headers) as response:
                return await self._front_answer(response, stream, started)
        except aiohttp.ClientConnectionError as error:  # refused, reset, closed before the status line
            if not getattr(error, "answer_started", False):
                raise Resend(error) from None
            raise

    async def _front_answer(self, response, stream, started):
        if response.status != 200:
            error = front_error(response.status, await response.text())
            self.scan.scan("client_errors", str(error))
            raise Resend(error) if response.status == 503 else error
        try:
            if not stream:
                body = await response.text()
                self.scan.scan("front_bodies", body)
                return front_result(body, (time.perf_counter() - started) * 1e3)
            lines = [raw.decode("utf-8", "replace").strip() async for raw in response.content]
        except Exception as error:
            error.answer_started = True  # the status came: never resent
            raise
        self.scan.scan("front_bodies", "\n".join(lines))
        return front_stream_result(lines, (time.perf_counter() - started) * 1e3)

    async def close(self):
        try:
            await self.http.close()
            await self.grpc.close()
        finally:
            if self.session is not None:
                await self.session.close()
