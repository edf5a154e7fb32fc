"""The client against a server (or a proxy in front of it) that answers what Triton never would:
an answer missing an output or of another shape or type, a stream with malformed events,
events after its final one, a failed status with events in its body, an event line past the
reader's limit, a redirect to another host, a 200 that is no inference answer. Each is a TritonRequestError, or the stream ends
at "done"; never a raw Python error, a Result made of the wrong values, or the photo and
inference key sent to another host (found by an independent review, 2026-12-06; each case
failed before its fix)."""

import asyncio
import gzip
import http.server
import json
import threading

import pytest
from test_client_grpc_stream_edges import ANSWER, StandIn, serve  # noqa: F401 (serve: a fixture)
from tritonclient.grpc import service_pb2

from classify_describe import AsyncClient, Client, TritonRequestError

DONE = {"DESCRIPTION": [""], "DESCRIPTION_SOURCE": ["llm"], "USAGE": ["{}"]}
LABELS = {"LABELS": ["tabby"], "SCORES": [0.9]}


def output(name, datatype, data, shape=None):
    return {"name": name, "datatype": datatype, "shape": shape or [1, len(data)], "data": data}


GOOD = [output("LABELS", "BYTES", ["tabby", "tiger"]), output("SCORES", "FP32", [0.6, 0.3]),
        output("DESCRIPTION", "BYTES", ["d"]), output("DESCRIPTION_SOURCE", "BYTES", ["llm"]),
        output("USAGE", "BYTES", ["{}"])]


class Canned(http.server.BaseHTTPRequestHandler):
    """Answers every POST with the server's `status` and `body`, and notes what it was sent."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        headers = {key.lower(): value for key, value in self.headers.items()}
        server.seen.append((self.path, headers, self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(server.status)
        for key, value in server.headers:
            self.send_header(key, value)
        body = server.body
        # As Triton answers an infer: gzip when the client accepts it (aiohttp's default does).
        if server.compress and "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def canned():
    servers = []

    def start(body=b"", status=200, headers=(), compress=False):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Canned)
        server.daemon_threads = True
        server.body = body if isinstance(body, bytes) else json.dumps(body).encode()
        server.status, server.headers, server.seen, server.compress = status, headers, [], compress
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server, f"127.0.0.1:{server.server_address[1]}"
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def sse(*events):
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def stream(url, asynchronous, **options):
    if not asynchronous:
        with Client(url, timeout_s=5, **options) as client:
            return [event.kind for event in client.stream(b"img")]

    async def main():
        async with AsyncClient(url, timeout_s=5, **options) as client:
            return [event.kind async for event in client.stream(b"img")]
    return asyncio.run(main())


BAD_ANSWERS = {
    "an output missing": {"outputs": GOOD[:2] + GOOD[3:]},
    "no outputs": {"model_name": "x"},
    "outputs null": {"outputs": None},
    "SCORES that are not numbers": {"outputs": [GOOD[0], output("SCORES", "BYTES", ["abc"])] + GOOD[2:]},
    "LABELS of shape [2], not [1, 2]": {"outputs": [output("LABELS", "BYTES", ["tabby", "tiger"], shape=[2])]
                                       + GOOD[1:]},
    "2 LABELS and 1 SCORE": {"outputs": [GOOD[0], output("SCORES", "FP32", [0.6])] + GOOD[2:]},
}


def infer(url, asynchronous, **options):
    if not asynchronous:
        with Client(url, timeout_s=5, **options) as client:
            return client.infer(b"img")

    async def main():
        async with AsyncClient(url, timeout_s=5, **options) as client:
            return await client.infer(b"img")
    return asyncio.run(main())


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
@pytest.mark.parametrize("case", BAD_ANSWERS, ids=list(BAD_ANSWERS))
def test_an_answer_that_is_not_the_ensembles_outputs_is_a_request_error(canned, case, asynchronous):
    _, url = canned(BAD_ANSWERS[case])
    with pytest.raises(TritonRequestError, match="not the ensemble's outputs") as raised:
        infer(url, asynchronous)
    assert raised.value.answered and not raised.value.retryable


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
@pytest.mark.parametrize("body", [b"<html>proxy login</html>", b"", b"[1, 2]"], ids=["HTML", "empty", "a JSON array"])
def test_a_200_that_is_no_inference_answer_is_a_request_error(canned, body, asynchronous):
    _, url = canned(body)
    with pytest.raises(TritonRequestError, match="not the ensemble's outputs") as raised:
        infer(url, asynchronous)
    assert raised.value.answered and not raised.value.retryable


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
def test_the_same_answer_well_formed_is_a_result(canned, asynchronous):
    server, url = canned({"outputs": GOOD})
    result = infer(url, asynchronous, inference_key="s3cret-key")
    assert (result.labels, result.scores, result.description) == (["tabby", "tiger"], pytest.approx([0.6, 0.3]), "d")
    path, headers, body = server.seen[-1]
    assert path == "/v2/models/classify_and_describe/infer" and headers["inference-key"] == "s3cret-key"
    header = json.loads(body[:int(headers["inference-header-content-length"])])
    assert [i["name"] for i in header["inputs"]] == ["IMAGE"] and body.endswith(b"img")
    assert {o["name"] for o in header["outputs"]} == {"LABELS", "SCORES", "DESCRIPTION", "DESCRIPTION_SOURCE", "USAGE"}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
def test_an_answer_compressed_as_triton_compresses_it_is_read(canned, asynchronous):
    server, url = canned({"outputs": GOOD}, compress=True)
    assert infer(url, asynchronous).labels == ["tabby", "tiger"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
def test_a_model_name_is_quoted_into_the_path(canned, asynchronous):
    name = "my model#1?x"
    server, url = canned({"outputs": GOOD})
    infer(url, asynchronous, model_name=name)
    events, streamed = canned(sse(LABELS, DONE))
    if asynchronous:
        async def main():
            async with AsyncClient(streamed, timeout_s=5) as client:
                return [event async for event in client.stream(b"img", model_name=name)]
        asyncio.run(main())
    else:
        with Client(streamed, timeout_s=5) as client:
            list(client.stream(b"img", model_name=name))
    assert [server.seen[-1][0], events.seen[-1][0]] == ["/v2/models/my%20model%231%3Fx/infer",
                                                        "/v2/models/my%20model%231%3Fx/generate_stream"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
def test_a_failed_infer_keeps_tritons_message_and_says_whether_to_retry(canned, asynchronous):
    _, url = canned({"error": "[code=invalid_input field=IMAGE] IMAGE is not a recognised image file"}, status=400)
    with pytest.raises(TritonRequestError, match="IMAGE is not a recognised image file") as raised:
        infer(url, asynchronous, retries=2, retry_backoff_s=0)
    assert raised.value.answered and not raised.value.retryable
    server, url = canned({"error": "Exceeds maximum queue size"}, status=503)
    with pytest.raises(TritonRequestError, match="Exceeds maximum queue size") as raised:
        infer(url, asynchronous, retries=2, retry_backoff_s=0, throttle=False)
    assert raised.value.answered and raised.value.retryable and len(server.seen) == 3


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
@pytest.mark.parametrize("bad", [b"not json", b"5", b'"error"', json.dumps({"LABELS": ["x"]}).encode(),
                                 json.dumps({"LABELS": ["x"], "SCORES": ["abc"]}).encode(), b"\xff\xfe"],
                         ids=["not JSON", "a number", "a string", "LABELS without SCORES", "a score not a number",
                              "not UTF-8"])
def test_a_malformed_stream_event_is_a_request_error(canned, asynchronous, bad):
    _, url = canned(sse(LABELS, bad, DONE))
    with pytest.raises(TritonRequestError):
        stream(url, asynchronous)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
def test_a_stream_ends_at_done_whatever_the_server_sends_after_it(canned, asynchronous):
    _, url = canned(sse(LABELS, DONE, {"DESCRIPTION": ["injected"]}, DONE))
    assert stream(url, asynchronous) == ["labels", "done"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
def test_a_failed_status_is_an_error_before_any_event_its_message_kept(canned, asynchronous):
    _, url = canned(sse(LABELS, DONE), status=500)
    with pytest.raises(TritonRequestError, match="HTTP 500"):
        stream(url, asynchronous)
    _, url = canned({"error": "model is not ready"}, status=503)
    with pytest.raises(TritonRequestError, match="HTTP 503: model is not ready") as raised:
        stream(url, asynchronous)
    assert raised.value.retryable and raised.value.answered
    # How Triton refuses a bad image: 400, its message as the stream's one event.
    _, url = canned(sse({"error": "[code=invalid_input field=IMAGE] IMAGE is not a recognised image file"}),
                    status=400)
    with pytest.raises(TritonRequestError, match="HTTP 400: .*IMAGE is not a recognised") as raised:
        stream(url, asynchronous)
    assert not raised.value.retryable and raised.value.answered


def test_an_event_line_past_the_async_readers_limit_is_a_request_error(canned):
    _, url = canned(sse(LABELS, {"DESCRIPTION": ["x" * 3_000_000]}, DONE))
    with pytest.raises(TritonRequestError):
        stream(url, asynchronous=True)


@pytest.mark.parametrize("call", [stream, infer])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_does_not_take_the_photo_and_key_to_another_host(canned, status, asynchronous, call):
    elsewhere, elsewhere_url = canned({"outputs": GOOD})
    _, url = canned(status=status, headers=[("Location", f"http://localhost:{elsewhere_url.split(':')[1]}"
                                                         "/v2/models/x/infer")])
    with pytest.raises(TritonRequestError, match=f"HTTP {status}") as raised:
        call(url, asynchronous, inference_key="s3cret-key", retries=2, retry_backoff_s=0)
    assert elsewhere.seen == [] and not raised.value.retryable


class EndsWithoutFinal(StandIn):
    def ModelStreamInfer(self, request_iterator, context):
        self.requests.append(next(request_iterator))
        yield from self.responses  # and the stream ends: no "done", no response flagged final


def test_a_grpc_stream_that_ends_without_its_final_response_is_a_request_error(serve, monkeypatch):  # noqa: F811
    import test_client_grpc_stream_edges as edges
    monkeypatch.setattr(edges, "StandIn", EndsWithoutFinal)
    _, url = serve(ANSWER[:3])  # the labels and the text, then nothing (the sync client waited on a queue)
    with Client(url, protocol="grpc", timeout_s=1) as client:
        with pytest.raises(TritonRequestError, match="no final response"):
            list(client.stream(b"img"))


def test_a_grpc_stream_output_with_no_rows_is_a_request_error(serve):  # noqa: F811
    infer = service_pb2.ModelInferResponse(model_name="x")
    infer.outputs.add(name="LABELS", datatype="BYTES", shape=[0, 0])
    infer.raw_output_contents.append(b"")
    infer.parameters["triton_final_response"].bool_param = True
    _, url = serve([service_pb2.ModelStreamInferResponse(infer_response=infer)])
    with Client(url, protocol="grpc", timeout_s=5) as client:
        with pytest.raises(TritonRequestError, match="not the ensemble's outputs"):
            list(client.stream(b"img"))
