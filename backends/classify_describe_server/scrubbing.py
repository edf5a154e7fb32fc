"""Keep the API key out of everything we log or return.

The SDK's exception text can quote the upstream's error body, and some
upstreams echo the key they were given ("Incorrect API key provided: sk-...").
So every message derived from an exception goes through `scrub` first.
Upstreams that quote the request back (validation errors) may quote the
photo's data URI too: it is masked as well, and so is any long base64 run.
"""

import re

# Bearer tokens and the common provider key shapes, for keys we were not told about
# (e.g. a proxy echoing a key of its own).
_PATTERNS = [
    re.compile(r"(?i)(bearer\s+)[^\s\"',]+"),
    re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}"),
    re.compile(r"(?i)(api[_-]?key[\"']?\s*[:=]\s*[\"']?)[^\s\"',]+"),
    re.compile(r"(?i)(data:[\w/+.-]*;base64,)[A-Za-z0-9+/=]+"),
    re.compile(r"[A-Za-z0-9+/]{200,}={0,2}"),
]
MASK = "***"


class Scrubber:
    def __init__(self, *secrets):
        # Longest first, so a secret that contains another is masked whole.
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def __call__(self, text):
        text = str(text)
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        for pattern in _PATTERNS:
            text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + MASK, text)
        return text
