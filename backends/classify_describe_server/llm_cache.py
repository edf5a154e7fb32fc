"""A bounded LRU of LLM answers with a time to live.

Only answers that came from the LLM are stored: a fallback written during a
transient outage must not outlive it. (Triton's own response cache would
store every successful response, fallbacks included, and its key ignores
request parameters such as a `model` override; see docs/llm-endpoints.md.)
"""

import collections
import hashlib
import json
import time


def cache_key(model, temperature, max_tokens, messages, response_format=None):
    blob = json.dumps([model, temperature, max_tokens, messages, response_format], sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class LRUCache:
    def __init__(self, max_entries, ttl_s, clock=time.monotonic):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries = collections.OrderedDict()  # key -> (stored_at, value)

    def get(self, key):
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored_at, value = entry
        if self._clock() - stored_at > self.ttl_s:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key, value):
        self._entries[key] = (self._clock(), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self):
        return len(self._entries)
