"""tools/local_stack.free_port: two probes in a row may get the same free port from
the kernel; a server told to use one port twice (gRPC and metrics) will not start."""

from tools import local_stack


def test_a_port_is_never_handed_out_twice(monkeypatch):
    given = iter([40001, 40001, 40002, 40001, 40003])

    class Probe:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(given)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local_stack.socket, "socket", Probe)
    monkeypatch.setattr(local_stack, "_HANDED_OUT", set())
    assert [local_stack.free_port() for _ in range(3)] == [40001, 40002, 40003]
