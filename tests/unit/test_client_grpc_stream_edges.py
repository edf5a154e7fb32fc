"""The clients' gRPC stream against a stand-in GRPCInferenceService on
127.0.0.1 (tritonclient's own service definition): the request sent, the
responses turned into events, the empty final response, and an error
response (found by `make mutants`, docs/mutation.md). Against a real server:
tests/integration."""

import asyncio
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from classify_describe import AsyncClient, Client, TritonRequestError


def response(final=False, error=None, **outputs):
    infer = service_pb2.ModelInferResponse(model_name="classify_and_describe_stream")
    for name, values in outputs.items():
        array = np.array([values], dtype=np.float32 if name == "SCORES" else np.object_)
        tensor = infer.outputs.add(name=name, datatype="FP32" if name == "SCORES" else "BYTES", shape=array.shape)
        assert tensor.name == name
        raw = array.tobytes() if name == "SCORES" else serialize_byte_tensor(array).item()
        infer.raw_output_contents.append(raw)
    infer.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=infer, error_message=error or "")


ANSWER = [
    response(LABELS=[b"tabby", b"tiger cat"], SCORES=[0.75, 0.25]),
    response(DESCRIPTION=[b"A tabby "]),
    response(DESCRIPTION=[b"cat."]),
    response(DESCRIPTION=[b""], DESCRIPTION_SOURCE=[b"llm"], USAGE=[b'{"total_tokens": 9}']),
    response(final=True),  # the empty final response the client asks for
]


class StandIn(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, responses):
        self.responses, self.requests = responses, []

    def ModelStreamInfer(self, request_iterator, context):
        self.requests.append(next(request_iterator))
        yield from self.responses
        # Like Triton, keep the stream open until the client ends it: a client
        # that missed the final flag would wait here, not see the stream end.
        for _ in request_iterator:
            pass


@pytest.fixture
def serve():
    servers = []

    def start(responses=ANSWER):
        stand_in = StandIn(responses)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(stand_in, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return stand_in, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def check(stand_in, events, model="classify_and_describe_stream", asks_for_empty_final=True):
    assert [e.kind for e in events] == ["labels", "text", "text", "done"]
    assert (events[0].labels, events[0].scores) == (["tabby", "tiger cat"], [0.75, 0.25])
    assert [e.text for e in events[1:3]] == ["A tabby ", "cat."]
    result = events[-1].result
    assert (result.description, result.description_source, result.usage) == ("A tabby cat.", "llm", {"total_tokens": 9})
    [request] = stand_in.requests
    assert request.model_name == model
    assert [i.name for i in request.inputs] == ["IMAGE", "PROMPT"]
    assert list(request.raw_input_contents) == [b"\x03\x00\x00\x00img", b"\x04\x00\x00\x00why?"]
    assert request.parameters["temperature"].double_param == 0.5
    # tritonclient's asyncio stream_infer (2.51) does not pass this request option on
    assert request.parameters["triton_enable_empty_final_response"].bool_param is asks_for_empty_final


def test_the_grpc_stream_yields_labels_text_and_done(serve):
    stand_in, url = serve()
    with Client(url, protocol="grpc", timeout_s=10) as client:
        check(stand_in, list(client.stream(b"img", "why?", {"temperature": 0.5})))


def test_the_async_grpc_stream_does_the_same(serve):
    stand_in, url = serve()

    async def main():
        async with AsyncClient(url, protocol="grpc", timeout_s=10) as client:
            async def events():
                return [e async for e in client.stream(b"img", "why?", {"temperature": 0.5}, model_name="describe_stream")]

            return await asyncio.wait_for(events(), 30)  # generous: a client that misses the final flag waits forever

    check(stand_in, asyncio.run(main()), model="describe_stream", asks_for_empty_final=False)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_error_response_is_a_request_error(serve, asynchronous):
    _, url = serve([ANSWER[0], response(error="describe: the LLM step failed")])

    def events():
        if not asynchronous:
            with Client(url, protocol="grpc", timeout_s=10) as client:
                return list(client.stream(b"img"))

        async def main():
            async with AsyncClient(url, protocol="grpc", timeout_s=10) as client:
                return [e async for e in client.stream(b"img")]

        return asyncio.run(main())

    with pytest.raises(TritonRequestError) as info:
        events()
    assert "the LLM step failed" in str(info.value) and not info.value.retryable
