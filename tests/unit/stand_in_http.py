"""Stand-in HTTP servers for the load generators' tests (tools/overload_client.c,
tools/overload_users.py): a handler base that answers JSON, served on a loopback
port from a thread."""

import contextlib
import http.server
import json
import threading


class StandInHandler(http.server.BaseHTTPRequestHandler):
    """Keep-alive as Triton and the front are; JSON answers; no log lines."""

    protocol_version = "HTTP/1.1"

    def answer(self, status, payload, headers=()):
        body = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving_http(handler):
    """`handler` served on 127.0.0.1 from a thread -> "127.0.0.1:<port>"; stopped on leaving."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
