"""Inference requests built byte by byte, over HTTP and gRPC, so a test can send
what tritonclient refuses to build: BYTES elements whose length prefix lies,
a datatype or shape the model does not declare, a body shorter than it says.

Both protocols answer with the same `Answer`, so one test body covers both.
"""

import dataclasses
import json
import struct
import urllib.error
import urllib.request

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc


@dataclasses.dataclass
class Tensor:
    name: str
    datatype: str
    shape: list
    raw: bytes  # the wire bytes, exactly as sent


def element(data):
    """One BYTES element on the wire: its 4-byte little-endian length, then the bytes."""
    return struct.pack("<I", len(data)) + data


def bytes_tensor(name, rows, shape=None):
    """A BYTES tensor from a list of rows of bytes elements, each with its true length."""
    raw = b"".join(element(e) for row in rows for e in row)
    return Tensor(name, "BYTES", shape or [len(rows), len(rows[0])], raw)


def fp32_tensor(name, array):
    array = np.ascontiguousarray(array, dtype=np.float32)
    return Tensor(name, "FP32", list(array.shape), array.tobytes())


def uint8_tensor(name, array):
    array = np.ascontiguousarray(array, dtype=np.uint8)
    return Tensor(name, "UINT8", list(array.shape), array.tobytes())


@dataclasses.dataclass
class Answer:
    ok: bool
    outputs: dict  # name -> numpy array (BYTES as an object array of bytes)
    code: str = ""  # "400", "503", ... over HTTP; "INVALID_ARGUMENT", ... over gRPC
    message: str = ""

    @property
    def invalid_argument(self):
        return self.code in ("400", "INVALID_ARGUMENT")


def _decode_bytes(raw, count):
    values, offset = [], 0
    for _ in range(count):
        (length,) = struct.unpack_from("<I", raw, offset)
        values.append(raw[offset + 4:offset + 4 + length])
        offset += 4 + length
    return np.array(values, dtype=np.object_)


def _from_wire(datatype, shape, raw):
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        return _decode_bytes(raw, count).reshape(shape)
    return np.frombuffer(raw, dtype=np.float32 if datatype == "FP32" else np.dtype(datatype.lower())).reshape(shape)


def http_infer(url, model, tensors, outputs=None, headers=None, timeout_s=60, parameters=None):
    """POST /v2/models/<model>/infer with binary tensor data, outputs in binary too."""
    header = {"inputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape,
                          "parameters": {"binary_data_size": len(t.raw)}} for t in tensors]}
    if outputs is not None:
        header["outputs"] = [{"name": name, "parameters": {"binary_data": True}} for name in outputs]
    else:
        header["parameters"] = {"binary_data_output": True}
    if parameters:
        header.setdefault("parameters", {}).update(parameters)
    head = json.dumps(header).encode()
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/infer", data=head + b"".join(t.raw for t in tensors), method="POST",
        headers={"Inference-Header-Content-Length": str(len(head)), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
            json_size = int(response.headers.get("Inference-Header-Content-Length", len(body)))
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
        try:
            text = json.loads(text)["error"]
        except (ValueError, KeyError):
            pass
        return Answer(False, {}, str(error.code), text)
    meta, offset, result = json.loads(body[:json_size]), json_size, {}
    for output in meta.get("outputs", []):
        size = output.get("parameters", {}).get("binary_data_size")
        if size is None:  # JSON data (the server may answer so for some types)
            result[output["name"]] = np.array(output["data"]).reshape(output["shape"])
            continue
        result[output["name"]] = _from_wire(output["datatype"], output["shape"], body[offset:offset + size])
        offset += size
    return Answer(True, result)


class GrpcInfer:
    """ModelInfer with raw_input_contents over one channel (thread-safe)."""

    def __init__(self, url):
        self.channel = grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 64 << 20),
                                                           ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def close(self):
        self.channel.close()

    def __call__(self, model, tensors, outputs=None, metadata=None, timeout_s=60, parameters=None):
        request = service_pb2.ModelInferRequest(model_name=model)
        for t in tensors:
            request.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
            request.raw_input_contents.append(t.raw)
        for name in outputs or ():
            request.outputs.add(name=name)
        for key, value in (parameters or {}).items():
            request.parameters[key].string_param = value
        try:
            response = self.stub.ModelInfer(request, timeout=timeout_s, metadata=list((metadata or {}).items()))
        except grpc.RpcError as error:
            return Answer(False, {}, error.code().name, error.details() or "")
        return Answer(True, {o.name: _from_wire(o.datatype, list(o.shape), raw)
                             for o, raw in zip(response.outputs, response.raw_output_contents)})
