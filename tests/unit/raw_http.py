"""Raw-socket HTTP for tests that must see what a plain client sees (a 503 sent before the
body was read, a connection kept or cut), and the kernel's cap on a listen backlog."""

import pathlib


def read_answer(sock):
    """One HTTP answer (headers, Content-Length body) -> (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole answer: {data[:200]!r}"
        data += chunk
    headers, rest = data.split(b"\r\n\r\n", 1)
    length = int(next(line for line in headers.split(b"\r\n") if line.lower().startswith(b"content-length:"))
                 .split(b":")[1])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of an answer"
        rest += chunk
    return int(headers.split()[1]), headers, rest[:length]


def somaxconn():
    """net.core.somaxconn: the largest listen backlog the kernel grants (0 where unreadable)."""
    try:
        return int(pathlib.Path("/proc/sys/net/core/somaxconn").read_text())
    except OSError:
        return 0
