"""What the front logs and counts for a request that is not HTTP it can parse.

aiohttp answers such a request itself (400, before any handler or middleware:
a header line past 8 KB, two Content-Lengths, a bad chunk size in the same read
as the head) and logs it with its traceback, about ten lines at ERROR level,
each time. A client sending them in a loop would fill the log. Instead: one
line each, naming the error, at most one a second (with how many were left out
since), and a count in openai_front_errors_total{code="malformed_http"}.
Anything else aiohttp logs (a handler's own exception, a bug of ours) passes
unchanged, traceback and all. Nothing the client sent reaches the line: aiohttp's
message quotes the offending bytes (a whole header line, `Authorization: Bearer
<key>` included, for a line that ends in a bare LF), and the line keeps only what
comes before that quote. TLS or another protocol as a connection's first
bytes aiohttp logs at DEBUG only: the front's INFO level never shows it, and
this filter never sees it to count it.
"""

import logging
import re
import time

from aiohttp.http_exceptions import HttpProcessingError

CODE = "malformed_http"
INTERVAL_S = 1.0
SHOWN_CHARS = 200  # of aiohttp's message, up to the bytes it quotes
# Where aiohttp's message starts quoting what the client sent: a bytes repr, b'...' or b"...".
_QUOTED_BYTES = re.compile(r"""\s*:?\s*b['"]""")


class OneLineEach(logging.Filter):
    """On the logger aiohttp's request handlers use (serve() passes it as theirs)."""

    def __init__(self, metrics=None, interval_s=INTERVAL_S, clock=time.monotonic):
        super().__init__()
        self._metrics = metrics
        self._interval_s = interval_s
        self._clock = clock
        self._last = None
        self._left_out = 0

    def filter(self, record):
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        if self._metrics is not None:
            self._metrics.error(400, CODE)  # what aiohttp answers every such request
        now = self._clock()
        if self._last is not None and now - self._last < self._interval_s:
            self._left_out += 1
            return False
        detail = " ".join(_QUOTED_BYTES.split(str(error.message), maxsplit=1)[0].split())[:SHOWN_CHARS]
        text = f"{record.getMessage()}: not HTTP the front can read, answered 400 ({detail})"
        if self._left_out:
            text += f"; {self._left_out} more since the last such line, not logged"
        record.msg, record.args, record.exc_info, record.exc_text = text, (), None, None
        self._last, self._left_out = now, 0
        return True


def logger(metrics=None):
    """The logger for aiohttp's request handlers, with OneLineEach on it."""
    log = logging.getLogger("openai_front.http")
    log.filters.clear()  # one filter per served app
    log.addFilter(OneLineEach(metrics))
    return log
