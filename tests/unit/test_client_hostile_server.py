"""The clients against a hostile or broken server (or proxy): an answer that would take unbounded
memory (a gzip bomb, a huge body or error body, an event line that never ends), a 503 that asks
for a later resend (Retry-After), outputs of the wrong datatype, USAGE that is not a JSON object or
JSON nested too deep to read; and an inference key read from a file. Each is a TritonRequestError
or is honoured; never memory the answer chooses, a raw Python error, a Result made of the wrong
values, or the key in an error message (found by an independent review; each test failed before
its fix)."""

import asyncio
import email.utils
import json
import time
import tracemalloc
import zlib

import pytest
import test_client_misbehaving_server as misbehaving
from stand_in_http import StandInHandler, serving_http
from test_client_misbehaving_server import DONE, GOOD, LABELS, infer, output, sse, stream

from classify_describe import AsyncClient, Client, TritonRequestError
from classify_describe import __main__ as cli
from classify_describe import client as client_module
from classify_describe.client import MAX_EVENT_LINE_BYTES

CLIENTS = {"argnames": "asynchronous", "argvalues": [False, True], "ids": ["Client", "AsyncClient"]}
canned = misbehaving.canned  # the fixture: a stand-in that answers every POST with the body given


def sending(status, body):
    """A stand-in that answers every POST with `status` and `body`, however little of it the client
    reads (it stops writing when the client closes)."""

    class Handler(StandInHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                self.close_connection = True

    return Handler


def peak_mib(call):
    """The most memory `call` held at once, in MiB, measured on its second run (the first imports
    modules and warms up)."""
    call()
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def gzip_of_zeros(size):
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join(packer.compress(bytes(2**20)) for _ in range(size >> 20)) + packer.flush()


@pytest.mark.parametrize(**CLIENTS)
def test_both_clients_ask_for_an_uncompressed_answer(canned, asynchronous):
    server, url = canned({"outputs": GOOD})
    infer(url, asynchronous)
    assert server.seen[-1][1]["accept-encoding"] == "identity"  # AsyncClient sent aiohttp's "gzip, deflate"


@pytest.mark.parametrize(**CLIENTS)
def test_a_gzip_bomb_is_refused_at_max_answer_bytes_without_inflating_it(canned, asynchronous):
    bomb = gzip_of_zeros(64 * 2**20)  # 64 KB that inflate to 64 MiB (tritonclient inflated it whole)
    _, url = canned(bomb, headers=[("Content-Encoding", "gzip")])

    def call():
        with pytest.raises(TritonRequestError, match=r"larger than max_answer_bytes \(1048576 bytes\)") as raised:
            infer(url, asynchronous, max_answer_bytes=2**20)
        assert raised.value.answered and not raised.value.retryable

    assert peak_mib(call) < 16


@pytest.mark.parametrize(**CLIENTS)
def test_an_answer_larger_than_max_answer_bytes_is_not_read(canned, asynchronous):
    def call():
        with pytest.raises(TritonRequestError, match=r"larger than max_answer_bytes \(1048576 bytes\)"):
            infer(url, asynchronous, max_answer_bytes=2**20)

    with serving_http(sending(200, json.dumps({"outputs": GOOD, "padding": "x" * 2**25}).encode())) as url:
        assert peak_mib(call) < 8  # both clients read all 32 MiB
    _, url = canned({"outputs": GOOD})  # the default limit leaves a real answer alone
    assert infer(url, asynchronous).labels == ["tabby", "tiger"]


@pytest.mark.parametrize(**CLIENTS)
def test_only_the_start_of_an_error_answer_is_read(asynchronous):
    def call():
        with pytest.raises(TritonRequestError, match="HTTP 503"):
            infer(url, asynchronous)

    with serving_http(sending(503, b"x" * (32 * 2**20))) as url:
        assert peak_mib(call) < 8  # the sync client read all 32 MiB, then kept 64 KiB


@pytest.mark.parametrize(**CLIENTS)
def test_an_event_line_is_bounded_alike_in_both_clients(canned, asynchronous):
    def line(length):  # an event whose line, its newline included, is `length` bytes
        overhead = len(b'data: {"DESCRIPTION": [""]}\n')
        return {"DESCRIPTION": ["x" * (length - overhead)]}

    _, url = canned(sse(LABELS, line(MAX_EVENT_LINE_BYTES), DONE))
    assert stream(url, asynchronous) == ["labels", "text", "done"]
    _, url = canned(sse(LABELS, line(MAX_EVENT_LINE_BYTES + 1), DONE))
    with pytest.raises(TritonRequestError):
        stream(url, asynchronous)


def test_an_event_line_past_the_sync_readers_limit_is_a_request_error(canned):
    # The sync client read a line of any length (the async one's test: test_client_misbehaving_server.py).
    _, url = canned(sse(LABELS, {"DESCRIPTION": ["x" * 3_000_000]}, DONE))
    with pytest.raises(TritonRequestError, match=f"longer than {MAX_EVENT_LINE_BYTES} bytes"):
        stream(url, asynchronous=False)


def refused_once(retry_after):
    """A stand-in that answers the first infer 503 with `Retry-After: <retry_after>` and the
    ensemble's answer after; and the list of when each request came."""
    arrivals = []

    class Handler(StandInHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            arrivals.append(time.monotonic())
            if len(arrivals) == 1:
                self.answer(503, {"error": "Exceeds maximum queue size"}, [("Retry-After", retry_after)])
            else:
                self.answer(200, {"outputs": GOOD})

    return Handler, arrivals


@pytest.mark.parametrize(**CLIENTS)
def test_a_resend_waits_for_the_servers_retry_after(asynchronous):
    handler, arrivals = refused_once("1")
    with serving_http(handler) as url:
        # no back-off of the client's own: the wait is the server's
        result = infer(url, asynchronous, retries=1, retry_backoff_s=0, throttle=False)
    assert result.labels == ["tabby", "tiger"] and len(arrivals) == 2
    assert 0.95 <= arrivals[1] - arrivals[0] < 4  # resent at once before


@pytest.mark.parametrize(**CLIENTS)
def test_a_retry_after_longer_than_timeout_s_fails_at_once_with_the_servers_error(asynchronous):
    handler, arrivals = refused_once("30")
    with serving_http(handler) as url:
        started = time.monotonic()
        with pytest.raises(TritonRequestError, match="Exceeds maximum queue size") as raised:
            infer(url, asynchronous, retries=1, retry_backoff_s=0, throttle=False)  # timeout_s=5
    assert time.monotonic() - started < 3 and len(arrivals) == 1
    assert raised.value.retryable and raised.value.answered


@pytest.mark.parametrize("value, seconds", [
    ("1", 1.0), (" 2.5 ", 2.5), ("-3", 0.0), ("soon", None), ("inf", None), ("nan", None), (None, None),
])
def test_retry_after_is_read_as_seconds(value, seconds):
    assert client_module._retry_after_s(value) == seconds


def test_retry_after_is_read_as_a_date():
    in_20_s = email.utils.formatdate(time.time() + 20, usegmt=True)  # whole seconds
    assert client_module._retry_after_s(in_20_s) == pytest.approx(20, abs=1.5)


@pytest.mark.parametrize(**CLIENTS)
def test_an_inference_key_read_from_a_file_is_sent_without_its_newline(canned, asynchronous):
    server, url = canned({"outputs": GOOD})
    infer(url, asynchronous, inference_key=" s3cret\n")  # was: ValueError: Invalid header value b's3cret\n'
    assert server.seen[-1][1]["inference-key"] == "s3cret"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("key", ["s3c\nret", "s3c\x00ret", "s3c\u00e9ret"])
def test_a_key_no_header_can_carry_is_refused_at_construction_without_showing_it(protocol, key):
    async def construct():
        for cls in (Client, AsyncClient):
            with pytest.raises(ValueError, match="inference_key holds a control or non-ASCII character") as raised:
                cls("127.0.0.1:1", protocol=protocol, inference_key=key)
            assert "s3c" not in str(raised.value)

    asyncio.run(construct())


WRONG_DATATYPES = {
    "LABELS as INT32": ([output("LABELS", "INT32", [1, 2])] + GOOD[1:], "output LABELS"),
    "LABELS numbers as BYTES": ([output("LABELS", "BYTES", [1, 2])] + GOOD[1:], "output LABELS"),
    "SCORES as text": ([GOOD[0], output("SCORES", "BYTES", ["0.6", "0.3"])] + GOOD[2:], "output SCORES"),
    "SCORES as BOOL": ([GOOD[0], output("SCORES", "BOOL", [True, False])] + GOOD[2:], "output SCORES"),
    "DESCRIPTION as FP32": (GOOD[:2] + [output("DESCRIPTION", "FP32", [1.5])] + GOOD[3:], "output DESCRIPTION"),
    "DESCRIPTION_SOURCE as INT32": (GOOD[:3] + [output("DESCRIPTION_SOURCE", "INT32", [1]), GOOD[4]],
                                    "output DESCRIPTION_SOURCE"),
    "USAGE a JSON list": (GOOD[:4] + [output("USAGE", "BYTES", ["[1,2]"])], "output USAGE is a JSON list"),
    "USAGE null": (GOOD[:4] + [output("USAGE", "BYTES", ["null"])], "output USAGE is a JSON NoneType"),
    "USAGE a number": (GOOD[:4] + [output("USAGE", "BYTES", ["5"])], "output USAGE is a JSON int"),
}


@pytest.mark.parametrize(**CLIENTS)
@pytest.mark.parametrize("case", WRONG_DATATYPES, ids=list(WRONG_DATATYPES))
def test_an_output_of_the_wrong_datatype_is_a_request_error_naming_it(canned, case, asynchronous):
    outputs, names = WRONG_DATATYPES[case]
    _, url = canned({"outputs": outputs})
    with pytest.raises(TritonRequestError, match=f"not the ensemble's outputs: {names}") as raised:
        infer(url, asynchronous)
    assert raised.value.answered and not raised.value.retryable


WRONG_EVENTS = {
    "LABELS numbers": {"LABELS": [1], "SCORES": [0.5]},
    "SCORES as text": {"LABELS": ["x"], "SCORES": ["0.5"]},
    "a DESCRIPTION number": {"DESCRIPTION": [5]},
    "USAGE null": {**DONE, "USAGE": ["null"]},
}


@pytest.mark.parametrize(**CLIENTS)
@pytest.mark.parametrize("case", WRONG_EVENTS, ids=list(WRONG_EVENTS))
def test_a_stream_event_of_the_wrong_datatype_is_a_request_error(canned, case, asynchronous):
    _, url = canned(sse(LABELS, WRONG_EVENTS[case], DONE))
    with pytest.raises(TritonRequestError, match="not the ensemble's outputs: output "):
        stream(url, asynchronous)


DEEP = "[" * 100_000 + "]" * 100_000  # past what json.loads can nest: RecursionError, not JSONDecodeError


@pytest.mark.parametrize(**CLIENTS)
def test_json_nested_too_deep_to_read_is_no_raw_recursion_error(canned, asynchronous):
    _, url = canned({"outputs": GOOD[:4] + [output("USAGE", "BYTES", [DEEP])]})
    assert infer(url, asynchronous).usage == {"raw": DEEP}  # as USAGE that is not JSON
    _, url = canned(sse(LABELS, DEEP.encode(), DONE))
    with pytest.raises(TritonRequestError, match="not the ensemble's outputs"):
        stream(url, asynchronous)
    _, url = canned(DEEP[:60_000].encode(), status=503)  # an error's body, read for its message
    with pytest.raises(TritonRequestError, match="^HTTP 503$"):
        infer(url, asynchronous)


@pytest.mark.parametrize("usage, code", [('{"cost_usd": "0.1", "total_tokens": "many"}', 0), ("null", 1), ("[1]", 1)])
def test_the_cli_reports_odd_usage_and_goes_on_with_the_batch(canned, tmp_path, capsys, usage, code):
    _, url = canned({"outputs": GOOD[:4] + [output("USAGE", "BYTES", [usage])]})
    paths = [tmp_path / f"{n}.jpg" for n in range(3)]
    for path in paths:
        path.write_bytes(b"img")
    assert cli.main(["--url", url] + [str(p) for p in paths]) == code  # format_text raised, ending the batch
    out, err = capsys.readouterr()
    if code == 0:
        assert out.count("cost n/a") == 3
    else:
        assert err.count("not the ensemble's outputs: output USAGE") == 3


def test_a_streams_first_token_time_that_is_not_a_number_is_left_out(capsys):
    result = client_module.Result(["x"], [1.0], "d", "llm", usage={"time_to_first_token_ms": "5", "total_tokens": 3})
    cli.print_event("p.jpg", client_module.StreamEvent("done", result=result), as_json=False)
    assert "tokens 3" in capsys.readouterr().out


def test_the_cli_sends_the_inference_key_the_supervisor_reads(monkeypatch, tmp_path):
    """With TRITON_INFERENCE_KEY(_FILE) exported, the server closes inference to others: the
    command sent no key and every image got 403. It reads the same two names (the file first)."""
    passed = []

    class Recording:
        def __init__(self, *args, **kwargs):
            passed.append(kwargs.get("inference_key"))

        async def __aenter__(self):
            raise ConnectionError("recorded")  # the key is all this test wants

        async def __aexit__(self, *exc):
            return False

    monkeypatch.setattr(cli, "AsyncClient", Recording)
    image = tmp_path / "cat.jpg"
    image.write_bytes(b"\xff\xd8\xff")
    key_file = tmp_path / "inference-key"
    key_file.write_text("from-the-file\n")
    cases = [({"TRITON_INFERENCE_KEY": "from-the-variable"}, "from-the-variable"),
             ({"TRITON_INFERENCE_KEY": "from-the-variable", "TRITON_INFERENCE_KEY_FILE": str(key_file)},
              "from-the-file\n"),
             ({}, None)]
    for environ, expected in cases:
        for name in ("TRITON_INFERENCE_KEY", "TRITON_INFERENCE_KEY_FILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        for mode in ([], ["--stream"]):
            with pytest.raises(ConnectionError):
                cli.main([*mode, str(image)])
            assert passed.pop() == expected, (environ, mode)
    # A file that is not there counts as unset, as in the supervisor; one that is not text stops the command.
    monkeypatch.setenv("TRITON_INFERENCE_KEY", "from-the-variable")
    monkeypatch.setenv("TRITON_INFERENCE_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConnectionError):
        cli.main([str(image)])
    assert passed.pop() == "from-the-variable"
    key_file.write_bytes(b"\xff\xfe not text")
    monkeypatch.setenv("TRITON_INFERENCE_KEY_FILE", str(key_file))
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(image)])
    assert exit_.value.code == cli.EXIT_USAGE


def test_a_retry_after_date_past_every_calendar_is_no_wait_not_an_error():
    assert client_module._retry_after_s("Fri, 31 Dec 99999999999999999999 23:59:59 GMT") is None
