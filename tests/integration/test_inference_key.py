"""Inference closed by a key: a server started with TRITON_INFERENCE_KEY_FILE
(as a pod with the optional Secret mounted) answers inference on 8000/8001 only
with header `inference-key` (gRPC: `triton-grpc-protocol-inference-key`), for
every model a client can reach, over HTTP and gRPC, the streaming models'
gRPC streams and HTTP generate_stream included; health and metadata (the
probes) stay open; the OpenAI front, which talks to Triton over gRPC, still
answers; the key is in no log, refusal or metric. The supervisor's flags for
this setting are checked without a server in tests/test_control_api_policy.py.

One server of its own (the session server keeps inference open, as `make run`)."""

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from classify_describe import AsyncClient, Client, TritonRequestError
from tools.local_stack import NotReady, TritonServer

from .conftest import REPO, running_triton
from .public_models import COFFEE_TOP1, MODELS, STREAM_MODELS, ValidRequests
from .raw_infer import GrpcInfer, bytes_tensor, fp32_tensor, http_infer
from .test_deploy_probes import manifest_probes

INFERENCE_KEY = "inf-" + uuid.uuid4().hex + uuid.uuid4().hex[:8]
WRONG_KEY = "inf-" + "0" * 40
HTTP_HEADER = "inference-key"
GRPC_HEADER = "triton-grpc-protocol-inference-key"
# (name, HTTP headers, gRPC metadata): the refused attempts. The HTTP spelling
# over gRPC is refused too: Triton wants its prefix.
REFUSED = [("none", {}, {}),
           ("wrong key", {HTTP_HEADER: WRONG_KEY}, {GRPC_HEADER: WRONG_KEY}),
           ("other header", {"admin-key": INFERENCE_KEY}, {HTTP_HEADER: INFERENCE_KEY})]
RIGHT = ({HTTP_HEADER: INFERENCE_KEY}, {GRPC_HEADER: INFERENCE_KEY})
# Where inference has a key the front must have its own (it refuses to start open).
FRONT_KEY = "sk-front-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def server(fake_llm, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("inference_key")
    key_file = workdir / "inference-key"
    key_file.write_text(INFERENCE_KEY + "\n")  # as a mounted Secret: the newline is not part of it
    with running_triton(workdir, fake_llm, extra_env={"TRITON_INFERENCE_KEY_FILE": str(key_file),
                                                      "TRITON_INFERENCE_KEY": None,
                                                      "OPENAI_FRONT_API_KEY": FRONT_KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def refusals():
    """Every refusal text a client saw, scanned for the key at the end."""
    return []


@pytest.fixture(scope="module")
def valid(server, photos):
    answer = http_infer(server.http_url, "preprocess", [bytes_tensor("IMAGE", [[photos["coffee"]]])],
                        headers=RIGHT[0])
    assert answer.ok, answer.message
    return ValidRequests(photos["coffee"], answer.outputs["PIXELS"], f"What is it? ({uuid.uuid4().hex[:8]})")


@pytest.fixture(scope="module")
def grpc_infer(server):
    infer = GrpcInfer(server.grpc_url)
    yield infer
    infer.close()


def assert_refused(answer, protocol, refusals, name):
    assert not answer.ok, f"answered without the inference key ({name})"
    refusals.append(answer.message)
    if protocol == "http":
        assert answer.code == "403" and f"expecting header '{HTTP_HEADER}'" in answer.message, (name, answer)
    else:
        assert answer.code == "UNAVAILABLE" and f"expecting header '{GRPC_HEADER}'" in answer.message, (name, answer)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", MODELS)
def test_every_model_answers_only_with_the_key(server, valid, grpc_infer, refusals, model, protocol):
    def send(headers, metadata):
        if protocol == "http":
            return http_infer(server.http_url, model, valid.inputs(model), headers=headers)
        return grpc_infer(model, valid.inputs(model), metadata=metadata)

    for name, headers, metadata in REFUSED:
        assert_refused(send(headers, metadata), protocol, refusals, name)
    answer = send(*RIGHT)
    assert answer.ok, answer.message
    assert answer.outputs and not valid.check(answer.outputs), valid.check(answer.outputs)


def stream_tensors(model, photo, prompt):
    if model == "classify_and_describe_stream":
        return [bytes_tensor("IMAGE", [[photo]]), bytes_tensor("PROMPT", [[prompt.encode()]])]
    return [bytes_tensor("LABELS", [[COFFEE_TOP1, b"cup", b"coffee mug"]]),
            fp32_tensor("SCORES", [[0.9, 0.05, 0.02]]), bytes_tensor("PROMPT", [[prompt.encode()]])]


def grpc_stream(url, model, tensors, metadata):
    """One request on a gRPC ModelStreamInfer: ("ok", final DESCRIPTION_SOURCE)
    or (status code, message) when the call is refused."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for t in tensors:
        request.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        request.raw_input_contents.append(t.raw)
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        names = []
        try:
            for response in stub.ModelStreamInfer(iter([request]), timeout=60, metadata=list(metadata.items())):
                assert not response.error_message, response.error_message
                names += [o.name for o in response.infer_response.outputs]
                if response.infer_response.parameters["triton_final_response"].bool_param:
                    break
        except grpc.RpcError as error:
            return error.code().name, error.details() or ""
    return "ok", names


def http_stream(url, model, photo, prompt, headers):
    """POST generate_stream: ("ok", output names seen) or (status, error)."""
    if model == "classify_and_describe_stream":
        body = {"IMAGE": base64.b64encode(photo).decode(), "PROMPT": prompt}
    else:
        body = {"LABELS": [COFFEE_TOP1.decode(), "cup", "coffee mug"], "SCORES": [0.9, 0.05, 0.02], "PROMPT": prompt}
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            events = [json.loads(line[5:]) for line in response.read().decode().splitlines()
                      if line.startswith("data:")]
    except urllib.error.HTTPError as error:
        return str(error.code), error.read().decode(errors="replace")
    assert not any("error" in e for e in events), events
    return "ok", [name for e in events for name in e if name.isupper()]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", STREAM_MODELS)
def test_streams_answer_only_with_the_key(server, photos, refusals, model, protocol):
    def send(headers, metadata):
        prompt = f"Describe it ({uuid.uuid4().hex[:8]})"
        if protocol == "http":
            return http_stream(server.http_url, model, photos["coffee"], prompt, headers)
        return grpc_stream(server.grpc_url, model, stream_tensors(model, photos["coffee"], prompt), metadata)

    for name, headers, metadata in REFUSED:
        status, detail = send(headers, metadata)
        refusals.append(detail)
        assert status == ("403" if protocol == "http" else "UNAVAILABLE"), (name, status, detail)
        assert "expecting header" in detail, detail
    status, names = send(*RIGHT)
    assert status == "ok", names
    assert {"DESCRIPTION", "DESCRIPTION_SOURCE"} <= set(names), names


@pytest.mark.parametrize("where, probe, path, role", manifest_probes(), ids=lambda value: str(value))
def test_every_manifest_probe_still_answers_200(server, where, probe, path, role):
    """With inference closed, every probe in deploy/ (Triton's /v2/health/* and
    the front's /health/ready, which asks Triton over gRPC) still passes."""
    address = {"http": server.http_url, "openai": f"127.0.0.1:{server.openai_port}"}[role]
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
        assert response.status == 200, (where, probe)


def test_health_and_metadata_stay_open(server):
    """The probes (startup, liveness: /v2/health/*) and clients discovering
    models need no key."""
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/classify",
                 "/v2/models/classify/ready", "/v2/models/classify/config"):
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=10) as response:
            assert response.status == 200, path
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
        assert stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="classify"), timeout=10).name == "classify"


def chat(server, stream):
    body = {"model": "classify_and_describe", "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "text", "text": f"What is it? ({uuid.uuid4().hex[:8]})"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode((REPO / "docs/sample/coffee.png").read_bytes())
                                            .decode()}}]}]}
    request = urllib.request.Request(f"{server.openai_base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {FRONT_KEY}"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status, response.read().decode()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_openai_front_still_answers(server, stream):
    """The supervisor hands the key to the front, which sends it on every call."""
    status, body = chat(server, stream)
    assert status == 200
    if stream:
        assert body.rstrip().endswith("data: [DONE]"), body[-300:]
        events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data: {")]
        text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
        assert "Fake answer #" in text, body[-300:]
    else:
        assert "Fake answer #" in json.loads(body)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_repositorys_client_sends_the_key_it_is_given(server, photos, refusals, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    with Client(url, protocol) as client:
        with pytest.raises(TritonRequestError, match="expecting header") as error:
            client.infer(photos["coffee"])
        refusals.append(str(error.value))
        with pytest.raises(TritonRequestError):
            list(client.stream(photos["coffee"], "What is it?"))
    with Client(url, protocol, inference_key=INFERENCE_KEY) as client:
        assert client.infer(photos["coffee"]).labels[0] == "espresso"
        events = list(client.stream(photos["coffee"], f"What is it? ({uuid.uuid4().hex[:8]})"))
        assert events[-1].kind == "done" and events[-1].result.description_source == "llm"

    async def asynchronous():
        async with AsyncClient(url, protocol, inference_key=INFERENCE_KEY) as client:
            result = await client.infer(photos["coffee"])
            events = [e async for e in client.stream(photos["coffee"], f"What? ({uuid.uuid4().hex[:8]})")]
        return result, events

    result, events = asyncio.run(asynchronous())
    assert result.labels[0] == "espresso"
    assert events[-1].kind == "done" and events[-1].result.description_source == "llm"


def documented_example():
    """The tritonclient example of docs/reliability.md, on this server's ports."""
    text = (REPO / "docs/reliability.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if GRPC_HEADER in b]
    return textwrap.dedent(block)  # it sits in a list item


def test_the_documented_tritonclient_example_runs(server):
    code = documented_example().replace("127.0.0.1:8000", server.http_url).replace("127.0.0.1:8001", server.grpc_url)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_INFERENCE_KEY": INFERENCE_KEY})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("espresso") == 2, done.stdout


def test_the_key_is_in_no_log_refusal_or_metric(server, refusals):
    """Runs last in this file: after every refusal above was collected."""
    assert len(refusals) >= 3 * len(MODELS) * 2, "the refusals above were not collected"
    front_metrics = urllib.request.urlopen(f"{server.openai_base_url.removesuffix('/v1')}/metrics",
                                           timeout=10).read().decode()
    log = server.log()
    assert "inference needs header 'inference-key'" in log and "TRITON_INFERENCE_KEY_FILE" in log
    for where, text in (("log", log), ("refusals", "\n".join(refusals)), ("metrics", server.metrics()),
                        ("front metrics", front_metrics)):
        assert INFERENCE_KEY not in text, f"the inference key is in the {where}"


def test_a_server_whose_inference_has_a_key_does_not_start_with_an_open_front(fake_llm, tmp_path):
    """The key closes 8000/8001; the front on 8003 would answer anyone with it: the start stops
    and says what to set, unless OPENAI_FRONT_OPEN=1 says the front is open on purpose."""
    server = TritonServer(tmp_path, {"LLM_BASE_URL": fake_llm.base_url, "LLM_API_KEY": "sk-x",
                                     "TRITON_INFERENCE_KEY": INFERENCE_KEY, "OPENAI_FRONT_API_KEY": None,
                                     "OPENAI_FRONT_API_KEY_FILE": None})
    try:
        with pytest.raises(NotReady):
            server.start(timeout_s=180)
    finally:
        server.stop()
    log = server.log()
    assert "OPENAI_FRONT_API_KEY" in log and "OPENAI_FRONT_OPEN=1" in log and INFERENCE_KEY not in log
