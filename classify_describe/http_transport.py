"""The sync client's HTTP transport: one kept-alive connection (the standard library's
http.client), each request sent once, and one deadline for the whole exchange.

Why not tritonclient.http's own transport (geventhttpclient): it sends a request again, up to
twice, when its connection closes before an answer, whatever the caller's `retries` (a resend
may call the LLM again, and under overload it comes back at once, past the client's back-off);
and its timeouts apply to each socket read, so a server that trickles its answer holds the
caller for as long as it likes. The body is still built and read by tritonclient, as for
AsyncClient (generate_request_body, parse_response_body).
"""

import http.client
import socket
import time


class _DeadlineSocket(socket.socket):
    """A socket whose every send and receive waits only until `deadline` (time.monotonic()),
    so the exchange as a whole, not each read, is bounded."""

    deadline = 0.0

    def _arm(self):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.settimeout(left)

    def sendall(self, data, *flags):
        self._arm()
        return super().sendall(data, *flags)

    def recv_into(self, buffer, *args):
        self._arm()
        return super().recv_into(buffer, *args)

    def recv(self, size, *flags):
        self._arm()
        return super().recv(size, *flags)

    def closed_by_peer(self):
        """Whether the server closed this idle connection (or sent something unasked): a request
        sent on it would get no answer. Checked before reuse, so that the request is not lost
        to a connection the server had already dropped, without ever sending it twice."""
        self.setblocking(False)
        try:
            socket.socket.recv(self, 1, socket.MSG_PEEK)  # b"": closed; bytes: nothing was asked
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True


class _Connection(http.client.HTTPConnection):
    def connect(self):
        super().connect()
        self.sock = _DeadlineSocket(fileno=self.sock.detach())


class HttpTransport:
    """Requests to one server over one kept-alive connection; not thread-safe (one per Client)."""

    def __init__(self, url, timeout_s):
        host, _, port = url.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"url must be host:port, not {url!r}")
        self._host, self._port = host.strip("[]"), int(port)  # "[::1]:8000": IPv6
        self._timeout_s = timeout_s
        self._connection = None

    def request(self, method, path, body=None, headers=None):
        """(status, headers, body) of one exchange, sent once. No answer within timeout_s (connect,
        send and the whole answer together) raises TimeoutError; a connection refused, reset or
        closed before the whole answer raises ConnectionError or http.client.HTTPException."""
        deadline = time.monotonic() + self._timeout_s
        try:
            connection = self._ready_connection(deadline)
            connection.sock.deadline = deadline
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            data = response.read()
        except BaseException:
            self.close()  # the framing of whatever was left on it is lost
            raise
        if response.will_close:
            self.close()
        return response.status, response.headers, data

    def _ready_connection(self, deadline):
        if self._connection is not None and self._connection.sock.closed_by_peer():
            self.close()
        if self._connection is None:
            connection = _Connection(self._host, self._port, timeout=max(deadline - time.monotonic(), 1e-3))
            connection.connect()
            self._connection = connection
        return self._connection

    def close(self):
        if self._connection is not None:
            self._connection.close()
            self._connection = None
