"""tools/soak_paths.py without a server: the front's answers (whole and
streamed) read into the Result the soak judges, its errors, and which failures
are resent."""

import asyncio
import json

import pytest

from classify_describe import TritonRequestError
from tools import soak_paths

EXTRA = {"labels": ["espresso", "cup"], "scores": [0.9, 0.05]}
LAST = {"description_source": "llm", "usage": {"model": "gpt-4o-mini", "completion_tokens": 7}}


def sse(chunk):
    return "data: " + json.dumps(chunk)


def stream_lines(*texts, done=True):
    lines = [sse({"choices": [{"delta": {"role": "assistant", "content": ""}}], "classify_describe": EXTRA}), ""]
    lines += [sse({"choices": [{"delta": {"content": text}}]}) for text in texts]
    lines.append(sse({"choices": [{"delta": {}, "finish_reason": "stop"}], "classify_describe": LAST}))
    return lines + (["data: [DONE]", ""] if done else [])


def test_a_whole_completion():
    body = json.dumps({"choices": [{"message": {"content": "An espresso."}}],
                       "classify_describe": {**EXTRA, **LAST}})
    result = soak_paths.front_result(body, 12.5)
    assert (result.labels, result.scores, result.description) == (EXTRA["labels"], EXTRA["scores"], "An espresso.")
    assert result.description_source == "llm" and result.usage["completion_tokens"] == 7 and result.latency_ms == 12.5


def test_a_streamed_completion_joins_its_chunks():
    result = soak_paths.front_stream_result(stream_lines("An ", "espresso", "."), 30.0)
    assert result.labels == EXTRA["labels"] and result.description == "An espresso."
    assert result.description_source == "llm" and result.usage == LAST["usage"]


def test_a_stream_without_done_is_not_an_answer():
    with pytest.raises(ValueError, match="without its last chunk"):
        soak_paths.front_stream_result(stream_lines("An ", done=False), 1.0)
    with pytest.raises(ValueError):
        soak_paths.front_stream_result(stream_lines("An ")[:3] + ["data: [DONE]"], 1.0)


def test_an_error_event_is_an_error_answer():
    lines = stream_lines("An ")[:3] + [sse({"error": {"message": "the OpenAI front is shutting down"}})]
    with pytest.raises(TritonRequestError, match="shutting down") as caught:
        soak_paths.front_stream_result(lines, 1.0)
    assert caught.value.answered


def test_an_error_status_keeps_the_front_message():
    error = soak_paths.front_error(503, json.dumps({"error": {"message": "Triton is overloaded"}}))
    assert str(error) == "HTTP 503: Triton is overloaded" and error.retryable and error.answered
    assert not soak_paths.front_error(400, "not json").retryable


class Sends:
    def __init__(self, *outcomes):
        self.outcomes, self.calls = list(outcomes), 0

    async def __call__(self):
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def paths(retries):
    instance = soak_paths.Paths.__new__(soak_paths.Paths)
    instance.retries, instance.backoff_base_s, instance.resent = retries, 0.0, 0
    return instance


def test_no_answer_yet_is_resent_until_the_retries_are_spent():
    refused = ConnectionRefusedError(111, "refused")
    client = paths(retries=2)
    assert asyncio.run(client.resending(Sends(soak_paths.Resend(refused), "answer"))) == "answer"
    assert client.resent == 1
    with pytest.raises(ConnectionRefusedError):
        asyncio.run(client.resending(Sends(*[soak_paths.Resend(refused)] * 3)))
    assert client.resent == 3


def test_an_answer_cut_short_is_not_resent():
    client, sends = paths(retries=5), Sends(ValueError("the stream ended without its last response"), "answer")
    with pytest.raises(ValueError):
        asyncio.run(client.resending(sends))
    assert sends.calls == 1 and client.resent == 0
