"""Pipeline outputs -> OpenAI's chat.completion and chat.completion.chunk
objects. The labels, scores, description source and the describe step's full
USAGE (cost, attempts, cache) travel in the extra field `classify_describe`,
which the openai SDK keeps (`completion.classify_describe`, or model_extra)."""

import json
import time
import uuid

EXTRA = "classify_describe"


def completion_id():
    return "chatcmpl-" + uuid.uuid4().hex


def openai_usage(usage):
    """OpenAI's three token counts from the describe step's USAGE JSON."""
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": int(usage.get("total_tokens") or prompt + completion)}


def finish_reason(usage):
    """The LLM's own finish_reason, as the describe step passed it on in USAGE
    ("length": cut at max_tokens); "stop" when there is none (a fallback, a
    stream cut short upstream: `classify_describe.description_source` says which)."""
    return (usage or {}).get("finish_reason") or "stop"


def completion(id, model, answer, created=None):
    return {
        "id": id,
        "object": "chat.completion",
        "created": int(created if created is not None else time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.description, "refusal": None},
                     "logprobs": None,
                     "finish_reason": finish_reason(answer.usage)}],
        "usage": openai_usage(answer.usage),
        EXTRA: {"labels": answer.labels, "scores": answer.scores,
                "description_source": answer.source, "usage": answer.usage},
    }


class ChunkWriter:
    """The chunks of one streamed completion, as SSE `data:` lines (bytes).
    With include_usage every chunk carries "usage": null and one last chunk
    with no choices carries the totals, as OpenAI does."""

    def __init__(self, id, model, include_usage, created=None):
        self.id, self.model, self.include_usage = id, model, include_usage
        self.created = int(created if created is not None else time.time())

    def _chunk(self, choices, **extra):
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return sse(chunk)

    def _choice(self, delta, finish_reason=None):
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]

    def first(self, labels, scores):
        return self._chunk(self._choice({"role": "assistant", "content": ""}), **{EXTRA: {"labels": labels, "scores": scores}})

    def text(self, text):
        return self._chunk(self._choice({"content": text}))

    def last(self, source, usage):
        out = self._chunk(self._choice({}, finish_reason(usage)),
                          **{EXTRA: {"description_source": source, "usage": usage}})
        if self.include_usage:
            out += self._chunk([], usage=openai_usage(usage))
        return out + b"data: [DONE]\n\n"


def sse(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def models_list(models, created=0):
    return {"object": "list",
            "data": [{"id": m.id, "object": "model", "created": created, "owned_by": "classify-describe"} for m in models]}
