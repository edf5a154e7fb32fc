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
import ipaddress
import socket
import threading
import time
from urllib.parse import urlsplit


class _DeadlineSocket(socket.socket):
    """A socket whose every send and receive waits only until `deadline` (time.monotonic(); None:
    no limit), so the exchange as a whole, not each read, is bounded."""

    deadline = None

    def _arm(self):
        if self.deadline is None:
            self.settimeout(None)
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.settimeout(left)

    def connect(self, address):
        self._arm()
        return super().connect(address)

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
        sent on it would get no answer. Checked before reuse, so that a close that has arrived
        costs a reconnect, not the request. (One that crosses the request on the wire is a
        no-answer error, resent only under the caller's `retries`.)"""
        self.setblocking(False)
        try:
            socket.socket.recv(self, 1, socket.MSG_PEEK)  # b"": closed; bytes: nothing was asked
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True


class _Connection(http.client.HTTPConnection):
    deadline = None

    def connect(self):
        # socket.create_connection gives each of the host's addresses the whole timeout; here
        # they share the deadline, the name lookup's time included.
        error = None
        for family, kind, proto, _, address in addresses(self.host, self.port, self.deadline):
            sock = _DeadlineSocket(family, kind, proto)
            sock.deadline = self.deadline
            try:
                sock.connect(address)
            except TimeoutError:  # the deadline passed: no time for the next address
                sock.close()
                raise
            except OSError as failure:
                sock.close()
                error = failure
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock
            return
        raise error or OSError(f"no address for {self.host}")


def addresses(host, port, deadline):
    """socket.getaddrinfo's TCP addresses of host:port by `deadline` (time.monotonic(); None: no
    limit). The resolver's own timeouts (seconds per name server and try) are not the caller's, so a
    name is looked up on a thread of its own and waited for only until the deadline; a lookup left
    behind ends there within the resolver's timeouts. A literal address needs no lookup and no thread."""
    def lookup():
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)

    if deadline is None or _is_literal(host):
        return lookup()
    outcome, done = {}, threading.Event()

    def run():
        try:
            outcome["addresses"] = lookup()
        except BaseException as error:  # handed to the caller's thread below
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name=f"lookup {host}", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"timed out looking up {host}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["addresses"]


def _is_literal(host):
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def split_url(url):
    """(host, port, base path) of a tritonclient-style url: host:port[/base-path], no scheme."""
    if "://" in url:
        raise ValueError(f"url is host:port[/base-path], without the scheme: {url!r}")
    parts = urlsplit("//" + url)
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError(f"url is host:port[/base-path]; the port of {url!r} is not a number") from None
    if not parts.hostname:
        raise ValueError(f"url is host:port[/base-path], not {url!r}")
    return parts.hostname, port, parts.path.rstrip("/")  # hostname: "[::1]" without its brackets


def connect(url, deadline):
    """A new connection to `url` whose every send and receive waits only until `deadline`
    (time.monotonic(); None: no limit): for one exchange, a stream's included."""
    host, port, _ = split_url(url)
    connection = _Connection(host, port)
    connection.deadline = deadline
    connection.connect()
    return connection


ERROR_BODY_BYTES = 65536  # of a failed request's body: enough for its message


class BodyTooLarge(Exception):
    """A 200's body is longer than the transport's `max_body_bytes` (the rest was not read)."""


def read_at_most(response, limit):
    """Up to `limit` bytes of an http.client response's body, a piece at a time: a body's size is
    known only once read, and one read of `limit` would set `limit` bytes aside for any answer."""
    body = bytearray()
    while len(body) < limit:
        piece = response.read(min(65536, limit - len(body)))
        if not piece:
            if response.length:  # a body cut short: read(amt) returns what came, read() would raise
                raise http.client.IncompleteRead(bytes(body), response.length)
            break
        body += piece
    return bytes(body)


def deadline_after(timeout_s):
    return None if timeout_s is None else time.monotonic() + timeout_s


class HttpTransport:
    """Requests to one server over one kept-alive connection. Threads that share it take turns
    (a connection carries one exchange at a time)."""

    def __init__(self, url, timeout_s, max_body_bytes):
        _, _, self.base_path = split_url(url)  # a malformed url fails here, not at the first request
        self._url = url
        self._timeout_s = timeout_s
        self._max_body_bytes = max_body_bytes
        self._connection = None
        self._lock = threading.Lock()

    def request(self, method, path, body=None, headers=None, deadline=None):
        """(status, headers, body) of one exchange, sent once. No answer within timeout_s (connect,
        send and the whole answer together), or by `deadline` when given, raises TimeoutError; a
        connection refused, reset or closed before the whole answer raises ConnectionError or
        http.client.HTTPException. A 200 whose body is longer than max_body_bytes raises
        BodyTooLarge; of another status only the first ERROR_BODY_BYTES are read (its message):
        a broken server or proxy can send any length, and the body is held in memory."""
        if deadline is None:
            deadline = deadline_after(self._timeout_s)
        with self._lock:
            try:
                connection = self._ready_connection(deadline)
                connection.sock.deadline = deadline
                connection.request(method, self.base_path + path, body=body, headers=headers or {})
                response = connection.getresponse()
                limit = self._max_body_bytes if response.status == 200 else ERROR_BODY_BYTES
                data = read_at_most(response, limit + 1)
                if response.status == 200 and len(data) > limit:
                    raise BodyTooLarge(f"the answer is longer than {limit} bytes")
            except BaseException:
                self._close()  # the framing of whatever was left on it is lost
                raise
            if response.will_close or not response.isclosed():  # an error's body not read to its end: as above
                self._close()
            data = data[:limit]
        return response.status, response.headers, data

    def _ready_connection(self, deadline):
        if self._connection is not None and self._connection.sock.closed_by_peer():
            self._close()
        if self._connection is None:
            self._connection = connect(self._url, deadline)
        return self._connection

    def close(self):
        with self._lock:
            self._close()

    def _close(self):
        if self._connection is not None:
            self._connection.close()
            self._connection = None
