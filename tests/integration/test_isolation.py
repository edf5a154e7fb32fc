"""A bad request fails alone, for every public model, every input and both
protocols: malformed requests (lying BYTES lengths, stray or missing bytes,
the wrong datatype or shape, empty, oversized, not UTF-8, not finite, too
many rows) are sent among valid ones at a concurrency where the classifier
forms batches. Every valid request must get its correct answer, every
malformed one a 400 / INVALID_ARGUMENT that names what is wrong, and the
server must stay ready with bounded memory.

Cases are listed per input type, not per test that once failed, so a model
or input added to MODELS gets the whole class (docs/troubleshooting.md#one-bad-request-fails-its-neighbours).
"""

import collections
import struct
import threading
import time
import zlib

import pytest

from serving.procfs import http_json, rss_mb

from .public_models import MODELS
from .raw_infer import Answer, GrpcInfer, Tensor, element, fp32_tensor, http_infer

VALID_THREADS = 6
MALFORMED_THREADS = 2
SENDS_PER_CASE = 2  # at least; malformed requests go on until MIN_VALID valid ones were answered
MIN_VALID = 60
DEADLINE_S = 90
# Seven stub processes and the server each settle their allocators under the
# first concurrent load (412 MB in all in one CI run); a leak of a megabyte per
# request would pass 1.5 GB over the ~2,700 requests here.
RSS_GROWTH_LIMIT_MB = 800

BYTES_INPUTS = {  # model -> its client-supplied BYTES inputs
    "classify_and_describe": ("IMAGE", "PROMPT"),
    "classify": ("IMAGE",),
    "classify_with_view": ("IMAGE",),
    "preprocess": ("IMAGE",),
    "describe": ("LABELS", "PROMPT"),
    "classifier": (),
}
FP32_INPUTS = {"describe": ("SCORES",)}
UINT8_INPUTS = {"classifier": ("PIXELS",)}


def lying_bytes(length_claimed=0x7FFFFFFF, actual=b"abcd"):
    """One BYTES element whose 4-byte length prefix claims more than follows."""
    return struct.pack("<I", length_claimed) + actual


def png_header(width, height):
    """The first bytes of a PNG that claims width x height pixels: a
    decompression bomb has to be refused from its header."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def bytes_cases(name, valid):
    """(case, malformed tensor, text the error must contain) for one BYTES input."""
    shape, raw = valid.shape, valid.raw
    count = shape[0] * shape[1]
    first = struct.unpack_from("<I", raw)[0]
    cases = [
        ("lying_length", Tensor(name, "BYTES", shape, lying_bytes() + raw[4 + first:]), name),
        ("stray_bytes", Tensor(name, "BYTES", shape, raw + b"\x01\x02\x03"), name),
        ("extra_element", Tensor(name, "BYTES", shape, raw + element(b"extra")), name),
        ("empty_body", Tensor(name, "BYTES", shape, b""), name),
        ("wrong_datatype", Tensor(name, "INT32", shape, b"\x00" * 4 * count), name),
        ("wrong_rank", Tensor(name, "BYTES", [1, 1, count], raw), name),
        ("batch_above_max", Tensor(name, "BYTES", [9, 1], element(b"x") * 9), "batch"),
    ]
    if name == "IMAGE":
        cases += [
            ("not_an_image", Tensor(name, "BYTES", shape, element(b"hello, not a photo")), name),
            ("empty_element", Tensor(name, "BYTES", shape, element(b"")), name),
            ("decompression_bomb", Tensor(name, "BYTES", shape, element(png_header(100_000, 100_000))), name),
            ("wrong_shape", Tensor(name, "BYTES", [1, 2], element(b"a") + element(b"b")), name),
        ]
    else:  # text: PROMPT, LABELS
        cases += [
            ("not_utf8", Tensor(name, "BYTES", shape, element(b"\xff\xfe caf\xe9") * count), name),
            ("oversized", Tensor(name, "BYTES", shape, element(b"x" * 100_000) * count), name),
        ]
        if name == "PROMPT":
            cases.append(("wrong_shape", Tensor(name, "BYTES", [1, 2], element(b"a") + element(b"b")), name))
        else:  # LABELS: any count per row, up to a limit (SCORES sent to match, see malformed_requests)
            cases.append(("too_many_labels", Tensor(name, "BYTES", [1, 1000], element(b"cup") * 1000), name))
    return cases


def fp32_cases(name, valid):
    shape, raw = valid.shape, valid.raw
    nan = struct.pack("<f", float("nan"))
    cases = [
        ("short_body", Tensor(name, "FP32", shape, raw[:-4]), name),
        ("long_body", Tensor(name, "FP32", shape, raw + b"\x00" * 4), name),
        ("empty_body", Tensor(name, "FP32", shape, b""), name),
        ("wrong_datatype", Tensor(name, "FP64", shape, raw + raw), name),
        ("not_finite", Tensor(name, "FP32", shape, nan + raw[4:]), name),
    ]
    cases.append(("wrong_shape", Tensor(name, "FP32", [1, 2], raw[:8]), name))  # SCORES must match LABELS
    return cases


def uint8_cases(name, valid):
    """PIXELS: every byte value is a valid pixel, so the cases are about size, type and shape."""
    shape, raw = valid.shape, valid.raw
    return [
        ("short_body", Tensor(name, "UINT8", shape, raw[:-1]), name),
        ("long_body", Tensor(name, "UINT8", shape, raw + b"\x00"), name),
        ("empty_body", Tensor(name, "UINT8", shape, b""), name),
        ("wrong_datatype", Tensor(name, "FP32", shape, raw * 4), name),
        ("wrong_shape", Tensor(name, "UINT8", [1, 3, 224, 225], b"\x00" * 3 * 224 * 225), name),
        ("batch_above_max", Tensor(name, "UINT8", [9, *shape[1:]], raw * 9), "batch"),
    ]


def malformed_requests(model, valid_requests):
    """Every malformed variant of the model's valid request: one input spoiled at a time."""
    inputs = valid_requests.inputs(model)
    requests = []
    for index, tensor in enumerate(inputs):
        if tensor.name in BYTES_INPUTS[model]:
            cases = bytes_cases(tensor.name, tensor)
        elif tensor.name in FP32_INPUTS.get(model, ()):
            cases = fp32_cases(tensor.name, tensor)
        elif tensor.name in UINT8_INPUTS.get(model, ()):
            cases = uint8_cases(tensor.name, tensor)
        else:
            raise AssertionError(f"{model}: no malformed cases for input {tensor.name}")
        for case, bad, expect in cases:
            spoiled = inputs[:index] + [bad] + inputs[index + 1:]
            if case == "too_many_labels":  # SCORES to match, so that the label limit is what refuses it
                spoiled = [fp32_tensor("SCORES", [[0.001] * 1000]) if t.name == "SCORES" else t for t in spoiled]
            requests.append((f"{tensor.name}:{case}", spoiled, expect))
    return requests


def batch_counts(server, model):
    """{batch size: executions} of one model since the server started."""
    stats = http_json(f"http://{server.http_url}/v2/models/{model}/stats", timeout=30)["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


@pytest.fixture(scope="module")
def memory(triton):
    """The server's RSS (all processes) before and after the module."""
    readings = {"rss_mb": rss_mb(triton.process.pid),
                **{model: batch_counts(triton, model) for model in ("classifier", "preprocess", "describe")}}
    yield readings


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", MODELS)
def test_a_bad_request_fails_alone(triton, valid_requests, memory, model, protocol):
    grpc = GrpcInfer(triton.grpc_url)

    def send(tensors):
        try:
            if protocol == "http":
                return http_infer(triton.http_url, model, tensors)
            return grpc(model, tensors)
        except Exception as error:  # no answer at all (reset, timeout): recorded, not lost in a thread
            return Answer(False, {}, "no answer", f"{type(error).__name__}: {error}")

    malformed = malformed_requests(model, valid_requests)
    next_case = iter(range(10**9))
    lock = threading.Lock()
    valid_wrong, bad_wrong, counts = [], {}, collections.Counter()
    valid_done = threading.Event()
    deadline = time.monotonic() + DEADLINE_S

    def valid_sender():
        while not valid_done.is_set() and time.monotonic() < deadline:
            answer = send(valid_requests.inputs(model))
            problems = [f"{answer.code}: {answer.message[:200]}"] if not answer.ok \
                else valid_requests.check(answer.outputs)
            with lock:
                counts["valid"] += 1
                if problems:
                    valid_wrong.append(problems)

    def malformed_sender():
        # Round-robin over the cases for as long as valid traffic flows, so
        # malformed requests land among valid ones all the way through.
        while time.monotonic() < deadline:
            with lock:
                index = next(next_case)
                if index >= len(malformed) * SENDS_PER_CASE and counts["valid"] >= MIN_VALID:
                    return
            case, tensors, expect = malformed[index % len(malformed)]
            answer = send(tensors)
            with lock:
                counts["malformed"] += 1
            if answer.ok or not answer.invalid_argument or expect.lower() not in answer.message.lower():
                bad_wrong[case] = "answered" if answer.ok else f"{answer.code}: {answer.message[:200]}"

    valid_threads = [threading.Thread(target=valid_sender) for _ in range(VALID_THREADS)]
    bad_threads = [threading.Thread(target=malformed_sender) for _ in range(MALFORMED_THREADS)]
    try:
        for thread in valid_threads + bad_threads:
            thread.start()
        for thread in bad_threads:
            thread.join(DEADLINE_S + 30)
        valid_done.set()
        for thread in valid_threads:
            thread.join(DEADLINE_S + 30)
    finally:
        valid_done.set()
        grpc.close()
    print(f"\n{model}/{protocol}: {dict(counts)} ({len(malformed)} malformed cases)")
    assert counts["malformed"] >= len(malformed) * SENDS_PER_CASE and counts["valid"] >= MIN_VALID, \
        f"ran out of time: {dict(counts)}"
    assert bad_wrong == {}, f"malformed requests not refused as invalid, naming the input: {bad_wrong}"
    assert valid_wrong == [], \
        f"{len(valid_wrong)} of {counts['valid']} valid requests failed beside malformed ones: {valid_wrong[:3]}"
    assert triton.is_ready()


def test_batches_formed_and_memory_stayed_bounded(triton, memory):
    """Runs after the isolation tests (pytest keeps file order): during them the
    classifier, the one model that batches, did batch; the models that take
    client BYTES only ever ran one request at a time; the server's memory did
    not grow without bound."""
    def batches_since(model):  # executions of more than one request during this module
        before, after = memory[model], batch_counts(triton, model)
        return sum(after.get(size, 0) - before.get(size, 0) for size in after if size > 1)

    assert batches_since("classifier") > 0
    for model in ("preprocess", "describe"):  # every request here is one row
        assert batches_since(model) == 0, f"{model} ran batches: {batch_counts(triton, model)}"
    rss = rss_mb(triton.process.pid)
    assert rss - memory["rss_mb"] < RSS_GROWTH_LIMIT_MB, f"RSS {memory['rss_mb']:.0f} -> {rss:.0f} MB"
