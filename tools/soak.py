"""Bounded soak with fault injection (`make soak`; docs/reliability.md).

Starts, on loopback and free ports, the fake OpenAI-compatible upstream
(tools/fake_openai) and one tritonserver through scripts/serve.sh (stub
watchdog on, TRITON_ADMIN_KEY and the OpenAI front's key set), then keeps
`--concurrency` valid requests in flight (distinct prompts, so every one calls
the upstream) for `--duration-s`. They take, in turn, the paths of `--mix`
(tools/soak_paths.py): classify_and_describe over HTTP, the streaming model
classify_and_describe_stream over gRPC streaming, and the OpenAI front's
POST /v1/chat/completions, whole and with "stream": true. Meanwhile, in order:

  1. steady load, with the hostile corpus (>= 200 malformed requests) sent
     alongside; RSS of tritonserver + its stub processes at the start and end;
  2. LLM faults, each for `phase` seconds: 401 that echoes the key, upstream
     refusing connections, slow (3 s), a 429 storm, malformed bodies; then
     recovery: seconds until the first LLM answer and until the circuit gauge
     reads closed again;
  3. a classifier version swap (version 2 loaded, then removed) under load;
  4. SIGKILL of the preprocess stub process: the watchdog reloads the model;
  5. a server restart (SIGTERM, start again on the same ports) with clients
     that retry connection failures and UNAVAILABLE (`retries=`);
  6. steady load until the end.

Every valid request ends, by phase and by path, as a valid answer (labels and
scores, the top label that photo's own, a DESCRIPTION_SOURCE of llm or
fallback, a description, and for llm the fake upstream's answer to that very
prompt, a stream's chunks joined), an error answer with its message
(failed), or lost: no answer (a transport error after the retries, a client
timeout, or still unanswered `drain_s` after the load stops) or an answer that
is not valid. Every client output and error, every hostile answer, every
metrics scrape, every body the front sent and the server logs are scanned for
the LLM key, the admin key and the front's key. At the end the metrics must still show the describe families, and the
fake upstream must have seen the LLM key as `Authorization: Bearer <key>` on
every request it received.

`judge()` turns these observations into the list of problems. Writes a JSON
report (--report) and prints a summary; exits non-zero on any problem: a valid
request lost or failed outside the crash window (a stub killed; a stream the
front ends at its shutdown during the restart, by design), a path of the mix
that never answered, a hostile request not
answered with a clear error, the server not ready at the end, a fault not
recovered, the metrics or the upstream's key check wrong, or a secret found.
Stops by itself; every process it starts is stopped by its PID.
"""

import argparse
import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

from classify_describe import TritonRequestError
from serving.procfs import http_json, rss_mb, stub_pid, tritonserver_pid
from tools import host, soak_paths
from tools.local_stack import FakeLLM, TritonServer

REPO = pathlib.Path(__file__).resolve().parents[1]

ENSEMBLE = "classify_and_describe"


def log(message):
    print(f"soak: {message}", file=sys.stderr, flush=True)


def photos():
    import skimage.data

    data_dir = pathlib.Path(skimage.data.__file__).parent
    return {name: (data_dir / f"{name}.png").read_bytes() for name in ("chelsea", "coffee")}


# -- the processes --------------------------------------------------------------------

class FakeUpstream(FakeLLM):
    def __init__(self, workdir, latency_ms):
        super().__init__(workdir / "fake_llm.log", latency_ms)

    def mode(self, mode, **options):
        deadline = time.monotonic() + 15  # after "refuse" the admin API is back only when it listens
        while True:
            try:
                return self.admin("mode", {"mode": mode, **options})
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


class Server(TritonServer):
    """scripts/serve.sh on fixed ports (a restart comes back on the same ones),
    one log per start."""

    def __init__(self, workdir, env):
        super().__init__(workdir, env)
        self.log_paths = []  # one per start

    def start(self):
        """Seconds until ready."""
        self.log_paths.append(self.workdir / f"tritonserver.{len(self.log_paths) + 1}.log")
        return super().start(log_path=self.log_paths[-1])

    def triton_pid(self):
        return tritonserver_pid(self.process.pid)

    def rss_mb(self):
        pid = self.triton_pid()
        return rss_mb(pid) if pid else None

    def stub_pid(self, instance):
        pid = self.triton_pid()
        return stub_pid(pid, instance) if pid else None

    def repository_call(self, path, payload=None, timeout=120):
        return http_json(f"http://{self.http_url}{path}", payload if payload is not None else {},
                         timeout=timeout, headers=self.admin_headers)

    def logs(self):
        return "\n".join(p.read_text(errors="replace") for p in self.log_paths if p.exists())


def metric_samples(text):
    """(name, labels, value) for each sample line of a Prometheus text page."""
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if match:
            yield match.group(1), dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")), float(match.group(3))


def circuit_state(metrics_text, upstream_model):
    for name, labels, value in metric_samples(metrics_text):
        if name == "describe_circuit_state" and labels.get("upstream_model") == upstream_model:
            return value
    return None


class SecretScan:
    """Looks for each secret in every text it is shown, as the text arrives (so
    nothing has to be kept); `found` names where, `scanned` counts the texts."""

    def __init__(self, secrets):
        self.secrets = dict(secrets)  # name -> value
        self.scanned = {}
        self.found = {}  # where -> {secret names}

    def names_in(self, text):
        return {name for name, secret in self.secrets.items() if secret in text}

    def redacted(self, text):
        """The text with each secret replaced by its name, for the report's own lines."""
        for name, secret in self.secrets.items():
            text = text.replace(secret, f"<{name}>")
        return text

    def scan(self, where, text):
        self.scanned[where] = self.scanned.get(where, 0) + 1
        names = self.names_in(text)
        if names:
            self.found.setdefault(where, set()).update(names)


# -- valid load ---------------------------------------------------------------------

def prompt_for(number):
    # The fake upstream's answer quotes the first line of the user message, which
    # is this prompt: an LLM description that lacks it answers another request.
    return f"Soak request {number}: what is it?"


# The top label each soak photo gets (tests/integration/test_classification.py).
TOP_LABELS = {"chelsea": {"Egyptian cat", "tabby", "tiger cat"}, "coffee": {"espresso"}}


def answer_problem(result, number, top_labels=None):
    """Why `result` is not a valid answer to soak request `number`, or None;
    with `top_labels`, its first label must be one of them (the photo's own)."""
    if not result.labels or len(result.scores) != len(result.labels):
        return f"{len(result.labels)} LABELS for {len(result.scores)} SCORES"
    if not all(isinstance(label, str) and label.strip() for label in result.labels):
        return "an empty label"
    if top_labels is not None and result.labels[0] not in top_labels:
        return f"top label {result.labels[0][:40]!r}, not this photo's"
    if not all(-1e-6 <= score <= 1 + 1e-6 for score in result.scores):  # also false for NaN
        return "a score outside [0, 1]"
    if result.description_source not in ("llm", "fallback"):
        return f"DESCRIPTION_SOURCE {result.description_source!r}"
    if not result.description.strip():
        return "an empty DESCRIPTION"
    if result.description_source == "llm" and prompt_for(number) not in result.description:
        return "an LLM DESCRIPTION that does not answer this request's prompt"
    return None


def _quantile(ordered, q):
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else None


class Tally:
    """Every valid request's fate, by phase: a valid answer (llm or fallback),
    failed (an error answer, with its message), or lost (no valid answer). Every
    output and error a client sees goes through `scan` as it arrives."""

    def __init__(self, scan):
        self.scan = scan
        self.phase = "warmup"
        self.by_phase = {}
        self.errors = []  # failed: {"phase", "error", "path"}
        self.lost_requests = []  # {"phase", "kind", "detail", "path"}
        self.by_path = {}  # path -> {"sent", "answered", "failed", "lost"}

    def row(self, phase=None):
        """The counts of a phase (the current one by default), created empty:
        a phase may be read before any of its requests has been sent."""
        return self.by_phase.setdefault(phase or self.phase,
                                        {"sent": 0, "llm": 0, "fallback": 0, "failed": 0, "lost": 0,
                                         "fallback_reasons": {}, "latency_ms": []})

    def count(self, path, outcome):
        row = self.by_path.setdefault(path, {"sent": 0, "answered": 0, "failed": 0, "lost": 0})
        row[outcome] += 1

    def sent(self, path="infer"):
        self.row()["sent"] += 1
        self.count(path, "sent")
        return self.phase

    def answered(self, phase, number, result, top_labels=None, path="infer"):
        output = json.dumps(result.as_dict())
        self.scan.scan("client_outputs", output)
        problem = answer_problem(result, number, top_labels)
        if problem:
            self.lost(phase, "invalid answer", problem, path)
            return
        self.count(path, "answered")
        row = self.by_phase[phase]
        row[result.description_source] += 1
        if result.description_source == "fallback":
            reason = str(result.usage.get("fallback_reason"))
            row["fallback_reasons"][reason] = row["fallback_reasons"].get(reason, 0) + 1
        row["latency_ms"].append(result.latency_ms)

    def failed(self, phase, error, path="infer"):
        self.by_phase[phase]["failed"] += 1
        self.count(path, "failed")
        message = f"{type(error).__name__}: {error}"
        self.scan.scan("client_errors", message)
        self.errors.append({"phase": phase, "error": message[:300], "path": path})

    def lost(self, phase, kind, detail="", path="infer"):
        """`kind` is a fixed phrase (it goes into the verdict); `detail` only
        into the report's sample, after the secret scan."""
        self.by_phase[phase]["lost"] += 1
        self.count(path, "lost")
        self.scan.scan("client_errors", detail)
        self.lost_requests.append({"phase": phase, "kind": kind, "detail": detail[:300], "path": path})

    def totals(self):
        """Counts over all phases; `lost` is what the sends leave unaccounted for
        by an answer or an error, whatever the reason was recorded or not."""
        total = {"sent": 0, "llm": 0, "fallback": 0, "failed": 0}
        for row in self.by_phase.values():
            for key in total:
                total[key] += row[key]
        total["answered"] = total["llm"] + total["fallback"]
        total["lost"] = total["sent"] - total["answered"] - total["failed"]
        return total

    def summary(self):
        out = {}
        for phase, row in self.by_phase.items():
            latencies = sorted(row["latency_ms"])
            out[phase] = {k: v for k, v in row.items() if k != "latency_ms"}
            out[phase].update(p50_ms=_quantile(latencies, 0.5), p99_ms=_quantile(latencies, 0.99))
        return out


async def valid_load(client, images, concurrency, tally, stop, drain_s=180.0, mix=("infer",), top_labels=None):
    """`concurrency` closed-loop workers sending through `client` until `stop`
    is set; each request has a distinct prompt and goes by the path `mix`
    names for its number (a method of `client`: tools/soak_paths.py), with
    the photo `images` names for it (`top_labels`: each photo's top labels).
    Then every worker finishes the request it has in flight; one still
    unanswered `drain_s` later is cancelled and counted lost."""
    numbers = itertools.count()

    async def worker():
        while not stop.is_set():
            number = next(numbers)
            path = mix[number % len(mix)]
            photo = (number + number // len(mix)) % len(images)  # each path sends every photo
            expected = top_labels[photo] if top_labels else None
            phase = tally.sent(path)
            try:
                result = await getattr(client, path)(images[photo], prompt=prompt_for(number))
            except asyncio.CancelledError:
                tally.lost(phase, "no answer when the load stopped", path=path)
                raise
            except TritonRequestError as error:  # the server answered with an error
                tally.failed(phase, error, path)
                await asyncio.sleep(0.05)
            except Exception as error:  # noqa: BLE001 - no answer at all (after the client's retries)
                tally.lost(phase, f"no answer ({type(error).__name__})", str(error), path)
                await asyncio.sleep(0.05)
            else:
                tally.answered(phase, number, result, expected, path)

    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    try:
        await stop.wait()
        await asyncio.wait(workers, timeout=drain_s)
    finally:
        for task in workers:
            task.cancel()
        results = await asyncio.gather(*workers, return_exceptions=True)
    for result in results:  # a bug in the worker itself ends the soak, not passes as lost requests
        if isinstance(result, Exception):
            raise result


# -- hostile input ------------------------------------------------------------------

class Case:
    def __init__(self, name, category, *, inputs=None, parameters=None, protocol="http",
                 raw_body=None, raw_headers=None, model=ENSEMBLE, expect="error", mention=None):
        self.name, self.category = name, category
        self.inputs = inputs or []  # [(name, datatype, numpy array)]
        self.parameters = parameters
        self.protocol = protocol
        self.raw_body, self.raw_headers = raw_body, raw_headers or {}
        self.model = model
        self.expect = expect  # "error", or "ok" for inputs that are odd but valid (empty prompt)
        self.mention = mention  # a word the error message must contain


def _image(data):
    return ("IMAGE", "BYTES", np.array([[data]], dtype=np.object_))


def _prompt(data):
    return ("PROMPT", "BYTES", np.array([[data]], dtype=np.object_))


def hostile_corpus(images, seed=0):
    """At least 200 malformed requests, generated (seeded, reproducible: the generators below
    draw from one random generator, in this order)."""
    rng = np.random.default_rng(seed)
    cat, coffee = images["chelsea"], images["coffee"]
    return [*_image_cases(cat, coffee, rng), *_prompt_cases(cat, rng), *_parameter_cases(coffee),
            *_protocol_cases("http", cat), *_protocol_cases("grpc", cat), *_raw_cases(rng), *_utf8_cases(coffee)]


def _image_cases(cat, coffee, rng):
    """Undecodable images: known bad files, random bytes, truncated photos, lying headers, too many bytes."""
    from tools.reference import bad_images, png_with_header_size

    cases = []
    for name, (data, _words) in bad_images().items():
        cases.append(Case(f"bad_image:{name}", "image", inputs=[_image(data)], mention=None))
    for i in range(60):  # random bytes of random sizes
        size = int(rng.choice([1, 2, 7, 64, 512, 4096, 65536, 300000]))
        data = rng.bytes(size)
        if i % 5 == 0:  # random bytes behind a real signature
            data = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBP")[i % 4] + data
        cases.append(Case(f"random_bytes:{i}:{len(data)}", "image", inputs=[_image(data)]))
    for cut in np.linspace(0.02, 0.97, 20):  # truncated real photos
        for label, photo in (("chelsea", cat), ("coffee", coffee)):
            cases.append(Case(f"truncated:{label}:{cut:.2f}", "image",
                              inputs=[_image(photo[:int(len(photo) * cut)])]))
    for width, height in [(100000, 100000), (65535, 65535), (40001, 1000), (1000, 40001),
                          (2 ** 31 - 1, 2 ** 31 - 1), (10 ** 6, 1), (1, 10 ** 6), (50000, 50000),
                          (7000, 7000), (0, 0), (0, 100), (100, 0), (1, 1), (3, 3), (7, 7000),
                          (20000, 2001), (2 ** 24, 2 ** 24), (12345, 54321), (46341, 46341), (8, 7)]:
        cases.append(Case(f"header_dims:{width}x{height}", "image",
                          inputs=[_image(png_with_header_size(width, height))]))
    cases.append(Case("image_21MiB", "image", inputs=[_image(b"\xff\xd8\xff\xe0" + bytes(21 * 1024 * 1024))],
                      mention="bytes"))
    return cases


def _prompt_cases(cat, rng):
    """Prompts on a valid image, so the error comes from the describe step."""
    cases = []
    cases.append(Case("prompt_empty", "prompt", inputs=[_image(cat), _prompt(b"")], expect="ok"))
    cases.append(Case("prompt_whitespace", "prompt", inputs=[_image(cat), _prompt(b"  \n\t ")], expect="ok"))
    for size in (2001, 5000, 65536, 1 << 20):
        cases.append(Case(f"prompt_{size}_chars", "prompt", inputs=[_image(cat), _prompt(b"a" * size)],
                          mention="max_prompt_chars"))
    cases.append(Case("prompt_1MB_multibyte", "prompt",
                      inputs=[_image(cat), _prompt(("猫" * 350000).encode())], mention="max_prompt_chars"))
    for i in range(20):
        junk = bytearray(rng.bytes(32))
        junk[int(rng.integers(0, 32))] = 0xFF  # 0xFF never occurs in UTF-8
        cases.append(Case(f"prompt_invalid_utf8:{i}", "prompt", inputs=[_image(cat), _prompt(bytes(junk))],
                          mention="UTF-8"))
    for seq in (b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"abc\x80"):
        cases.append(Case(f"prompt_bad_sequence:{seq.hex()}", "prompt", inputs=[_image(cat), _prompt(seq)],
                          mention="UTF-8"))
    return cases


def _parameter_cases(coffee):
    cases = []
    for params, word in [({"temperature": 5.0}, "temperature"), ({"temperature": -1}, "temperature"),
                         ({"temperature": "hot"}, "temperature"), ({"max_tokens": 100000}, "max_tokens"),
                         ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
                         ({"model": "gpt-4"}, "not allowed"), ({"model": "o1-pro"}, "not allowed"),
                         ({"model": ""}, "model"), ({"timeout_s": 1000}, "timeout_s"),
                         ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1}, "timeout_s"),
                         ({"max_tokens": "lots"}, "max_tokens"), ({"temperature": True}, "temperature"),
                         ({"max_tokens": 10.5}, "max_tokens")]:
        cases.append(Case(f"parameters:{json.dumps(params)}", "parameters",
                          inputs=[_image(coffee), _prompt(b"what is it?")], parameters=params, mention=word))
    # What the OpenAI front never passes on but a direct client can: JSON that is nested too deeply
    # or cannot be sent upstream as it came, and a model name a glob would let through. Each once
    # failed outside the error contract or opened the LLM's circuit for the valid traffic beside it.
    for name, params, word in [
            ("conversation_nested", {"conversation": "[" * 1000 + "]" * 1000}, "nested too deeply"),
            ("response_format_nan", {"response_format": '{"type":"text","x":NaN}'}, "NaN"),
            ("response_format_int65", {"response_format": json.dumps({"type": "json_object", "x": 2 ** 64})},
             "cannot be sent on as JSON"),
            ("model_newline", {"model": "gpt-4o-mini\n[describe] forged"}, "model id")]:
        for protocol in ("http", "grpc"):
            cases.append(Case(f"parameters:{protocol}:{name}", "parameters", protocol=protocol,
                              inputs=[_image(coffee), _prompt(b"what is it?")], parameters=params, mention=word))
    return cases


def _protocol_cases(protocol, cat):
    """Wrong dtypes and shapes, missing and unknown inputs, an unknown model."""
    cases = []
    for dtype, array in [("FP32", np.zeros((1, 1), np.float32)), ("INT8", np.zeros((1, 1), np.int8)),
                         ("UINT8", np.frombuffer(cat[:1024], np.uint8).reshape(1, 1024)),
                         ("BOOL", np.ones((1, 1), bool)), ("INT64", np.zeros((1, 1), np.int64))]:
        cases.append(Case(f"dtype:{protocol}:IMAGE:{dtype}", "dtype", protocol=protocol,
                          inputs=[("IMAGE", dtype, array)]))
    cases.append(Case(f"dtype:{protocol}:PROMPT:INT32", "dtype", protocol=protocol,
                      inputs=[_image(cat), ("PROMPT", "INT32", np.zeros((1, 1), np.int32))]))
    for label, array in [("1x2", np.array([[cat, cat]], dtype=np.object_)),
                         ("1x1x1", np.array([[[cat]]], dtype=np.object_)),
                         ("flat_1", np.array([cat], dtype=np.object_)),
                         ("batch_9", np.array([[cat]] * 9, dtype=np.object_)),
                         ("batch_64", np.array([[b"x"]] * 64, dtype=np.object_))]:
        cases.append(Case(f"shape:{protocol}:IMAGE:{label}", "shape", protocol=protocol,
                          inputs=[("IMAGE", "BYTES", array)]))
    cases.append(Case(f"shape:{protocol}:PROMPT:1x3", "shape", protocol=protocol,
                      inputs=[_image(cat), ("PROMPT", "BYTES", np.array([[b"a", b"b", b"c"]], np.object_))]))
    cases.append(Case(f"missing:{protocol}:IMAGE", "shape", protocol=protocol,
                      inputs=[_prompt(b"where is the image?")]))
    cases.append(Case(f"unknown_input:{protocol}", "shape", protocol=protocol,
                      inputs=[_image(cat), ("IMAGEZ", "BYTES", np.array([[b"x"]], np.object_))]))
    cases.append(Case(f"unknown_model:{protocol}", "shape", protocol=protocol, model="no_such_model",
                      inputs=[_image(cat)]))
    return cases


def _utf8_cases(coffee):
    """Bytes that are not UTF-8 where Triton's HTTP front end passes them on as they came: a request
    parameter failed the describe step outside its error contract (a 500 with its traceback); an id
    or a trace header that is not text gets a new id and no trace."""
    import tritonclient.http as httpclient

    image = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[coffee]], dtype=np.object_), binary_data=True)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=False) for name in ("DESCRIPTION", "USAGE")]
    body, header_length = httpclient.InferenceServerClient.generate_request_body(
        [image], outputs, request_id="MARKER-ID", parameters={"model": "MARKER"})
    header, rest = body[:header_length], body[header_length:]
    cases = []
    for name, old, new, expect, word in [
            ("parameter_model", b'"model":"MARKER"', b'"model":"gpt-4o-mini\xff\xfe"', "error", "UTF-8"),
            ("parameter_conversation", b'"model":"MARKER"', b'"conversation":"[\xff]"', "error", "UTF-8"),
            ("request_id", b'"MARKER-ID"', b'"id-\xff\xfe"', "ok", None)]:
        changed = header.replace(old, new).replace(b'"model":"MARKER"', b'"temperature":0.5')
        cases.append(Case(f"raw:not_utf8:{name}", "raw", raw_body=changed + rest, expect=expect, mention=word,
                          raw_headers={"Inference-Header-Content-Length": str(len(changed))}))
    return cases


def _raw_cases(rng):
    """Raw HTTP bodies that no client library would build."""
    cases = []

    def raw(name, body, headers=None, model=ENSEMBLE, expect="error"):
        cases.append(Case(f"raw:{name}", "raw", raw_body=body, raw_headers=headers, model=model,
                          expect=expect))
    raw("truncated_json", b'{"inputs": [')
    raw("not_json", rng.bytes(2048))
    raw("empty_body", b"")
    raw("no_inputs", b"{}")
    raw("inputs_not_a_list", b'{"inputs": {"name": "IMAGE"}}')
    raw("data_missing", json.dumps({"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES"}]}).encode())
    raw("data_shorter_than_shape",
        json.dumps({"inputs": [{"name": "IMAGE", "shape": [4, 1], "datatype": "BYTES", "data": ["x"]}]}).encode())
    raw("huge_declared_shape",
        json.dumps({"inputs": [{"name": "IMAGE", "shape": [1000000000, 1], "datatype": "BYTES",
                                "data": ["x"]}]}).encode())
    raw("negative_shape",
        json.dumps({"inputs": [{"name": "IMAGE", "shape": [-1, 1], "datatype": "BYTES", "data": ["x"]}]}).encode())
    raw("unknown_datatype",
        json.dumps({"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "COMPLEX", "data": ["x"]}]}).encode())
    raw("parameters_not_object",
        json.dumps({"parameters": 7, "inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES",
                                                  "data": ["x"]}]}).encode())
    header = json.dumps({"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 10 ** 9}}]}).encode()
    raw("binary_size_beyond_body", header + b"\x04\x00\x00\x00abcd",
        {"Inference-Header-Content-Length": str(len(header))})
    raw("binary_header_length_beyond_body", header, {"Inference-Header-Content-Length": str(10 ** 6)})
    element_claim = json.dumps({"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES",
                                            "parameters": {"binary_data_size": 8}}]}).encode()
    raw("bytes_element_length_lies", element_claim + b"\xff\xff\xff\x7fabcd",
        {"Inference-Header-Content-Length": str(len(element_claim))})
    # libevent refuses a request line this long by closing the connection.
    raw("model_name_10k", b"{}", model="m" * 10000, expect="closed")
    return cases


def send_case(case, http_url, grpc_url, timeout_s=60.0):
    """-> dict(name, category, outcome 'error'|'ok'|'no_answer', code, message, seconds)."""
    started = time.monotonic()
    outcome = {"name": case.name, "category": case.category, "expect": case.expect}
    try:
        if case.raw_body is not None:
            outcome.update(_send_raw(case, http_url, timeout_s))
        else:
            outcome.update(_send_with_tritonclient(case, http_url, grpc_url, timeout_s))
    except Exception as error:  # noqa: BLE001 - no answer at all is a finding
        outcome.update(outcome="no_answer", code=None, message=f"{type(error).__name__}: {error}"[:300])
    outcome["seconds"] = round(time.monotonic() - started, 3)
    outcome["clear"] = is_clear(case, outcome)
    return outcome


def _send_raw(case, http_url, timeout_s):
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{case.model}/infer", data=case.raw_body, method="POST",
        headers={"Content-Type": "application/octet-stream", **case.raw_headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return {"outcome": "ok", "code": response.status, "message": ""}
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")
        try:
            message = json.loads(body).get("error", body)
        except ValueError:
            message = body
        return {"outcome": "error", "code": error.code, "message": message}


def _send_with_tritonclient(case, http_url, grpc_url, timeout_s):
    if case.protocol == "http":
        import tritonclient.http as module
        client = module.InferenceServerClient(http_url, network_timeout=timeout_s, connection_timeout=timeout_s)
    else:
        import tritonclient.grpc as module
        client = module.InferenceServerClient(grpc_url)
    tensors = []
    for name, datatype, array in case.inputs:
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    kwargs = {"client_timeout": timeout_s} if case.protocol == "grpc" else {}
    try:
        client.infer(case.model, tensors, parameters=case.parameters, **kwargs)
        return {"outcome": "ok", "code": 200, "message": ""}
    except module.InferenceServerException as error:
        return {"outcome": "error", "code": str(error.status()), "message": error.message() or ""}
    finally:
        client.close()


SERVER_SIDE_CODES = {"500", "StatusCode.INTERNAL", "StatusCode.UNKNOWN"}
# Triton 2.51's HTTP front end answers a body it cannot parse as the KServe JSON
# with 500 (not 400), but with a message that says what it could not parse.
TRITON_PARSE_ERRORS = ("parse", "attempt to", "request params")


def is_clear(case, outcome):
    """An expected error, with a message that says what is wrong, and a client-side code."""
    if case.expect == "ok":
        return outcome["outcome"] == "ok"
    if case.expect == "closed":
        # The server drops the connection: seen as a close or, when the client
        # is still writing, as a reset; either way no answer and nothing leaks.
        message = str(outcome["message"]).lower()
        return outcome["outcome"] == "no_answer" and ("closed" in message or "reset by peer" in message)
    if outcome["outcome"] != "error":
        return False
    message = str(outcome["message"])
    if not message.strip() or "Traceback" in message:
        return False
    server_side = str(outcome["code"]) in SERVER_SIDE_CODES or (
        isinstance(outcome["code"], int) and outcome["code"] >= 500)
    if server_side and not (case.raw_body is not None and any(w in message for w in TRITON_PARSE_ERRORS)):
        return False
    return case.mention is None or case.mention.lower() in message.lower()


async def run_corpus(cases, http_url, grpc_url, workers=4):
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return await asyncio.gather(*(loop.run_in_executor(pool, send_case, case, http_url, grpc_url)
                                      for case in cases))


def corpus_summary(results):
    by_category = {}
    for r in results:
        row = by_category.setdefault(r["category"], {"sent": 0, "clear": 0})
        row["sent"] += 1
        row["clear"] += bool(r["clear"])
    unclear = [r for r in results if not r["clear"]]
    return {"sent": len(results), "clear": len(results) - len(unclear),
            "expected_errors": sum(r["expect"] == "error" for r in results),
            "by_category": by_category, "unclear": unclear[:20],
            "max_seconds": max((r["seconds"] for r in results), default=0)}


# -- the run ------------------------------------------------------------------------

class SoakRun:
    """One soak: the processes, the valid load and what it saw, with one method per phase."""

    def __init__(self, args, workdir):
        self.args = args
        self.llm_key = "sk-soak-" + os.urandom(12).hex()
        admin_key = "adm-soak-" + os.urandom(12).hex()
        front_key = "sk-front-soak-" + os.urandom(12).hex()
        self.images = photos()
        self.report = {"faults": [], "rss_mb": []}
        self.fake = FakeUpstream(workdir, args.llm_latency_ms)
        self.server = Server(workdir, {"LLM_BASE_URL": self.fake.base_url, "LLM_API_KEY": self.llm_key,
                                       "TRITON_ADMIN_KEY": admin_key, "OPENAI_FRONT_API_KEY": front_key})
        self.scan = SecretScan({"LLM key": self.llm_key, "admin key": admin_key, "front key": front_key})
        self.tally = Tally(self.scan)
        self.mix = tuple(args.mix.split(","))
        self.client = soak_paths.Paths(self.server, front_key, self.scan, args.concurrency, args.retries)
        self.stop = asyncio.Event()
        self.started = time.monotonic()
        self.deadline = self.started + args.duration_s
        self.phase_s = max(args.min_phase_s, args.duration_s * 0.03)

    # -- helpers of the phases

    def sample_rss(self, label):
        value = self.server.rss_mb()
        self.report["rss_mb"].append({"t_s": round(time.monotonic() - self.started, 1), "label": label, "mb": value})
        return value

    async def sleep_until(self, t):
        while time.monotonic() < t and not self.stop.is_set():
            await asyncio.sleep(min(1.0, max(0.0, t - time.monotonic())))

    async def sleep(self, seconds):
        await self.sleep_until(time.monotonic() + seconds)

    def fault(self, name, **figures):
        entry = {"fault": name, "t_s": round(time.monotonic() - self.started, 1), **figures}
        self.report["faults"].append(entry)
        log(f"fault {name}: {figures}")

    @staticmethod
    async def in_thread(function, *a):
        return await asyncio.get_running_loop().run_in_executor(None, function, *a)

    def scrape_metrics(self):
        text = self.server.metrics()
        self.scan.scan("metrics", text)
        return text

    # -- the run

    async def run(self):
        try:
            self.report["server_start_s"] = round(await self.in_thread(self.server.start), 1)
            load = asyncio.ensure_future(valid_load(
                self.client, [self.images["chelsea"], self.images["coffee"]], self.args.concurrency, self.tally,
                self.stop, mix=self.mix, top_labels=[TOP_LABELS["chelsea"], TOP_LABELS["coffee"]]))
            await asyncio.sleep(min(10.0, self.args.duration_s * 0.05))  # warm-up
            await self.steady_with_hostile_corpus()
            await self.llm_faults()
            await self.llm_recovery()
            await self.classifier_version_swap()
            await self.stub_kill()
            await self.restart()
            observed = await self.steady_until_the_end(load)
        finally:
            self.stop.set()
            try:
                await self.client.close()
            finally:  # the processes stop even if closing the client fails
                self.server.stop()
                self.fake.stop()
        self.report.update(judge(Observed(**observed, server_logs=self.server.logs())))
        self.report["wall_s"] = round(time.monotonic() - self.started, 1)
        return self.report

    async def steady_with_hostile_corpus(self):
        """1. steady load, the hostile corpus sent alongside."""
        self.tally.phase = "steady"
        self.report["rss_start_mb"] = self.sample_rss("steady start")
        steady_end = self.started + self.args.duration_s * self.args.steady_fraction
        corpus_started = time.monotonic()
        results = await run_corpus(hostile_corpus(self.images), self.server.http_url, self.server.grpc_url)
        for result in results:
            self.scan.scan("hostile_answers", json.dumps(result))
        hostile = self.report["hostile"] = corpus_summary(results)
        hostile["seconds"] = round(time.monotonic() - corpus_started, 1)
        hostile["server_ready_after"] = self.server.is_ready()
        log(f"hostile corpus: {hostile['clear']}/{hostile['sent']} answered clearly")
        while time.monotonic() < steady_end:
            await self.sleep_until(min(steady_end, time.monotonic() + max(10.0, self.args.duration_s / 20)))
            self.sample_rss("steady")
        self.report["rss_steady_end_mb"] = self.sample_rss("steady end")

    async def llm_faults(self):
        """2. the LLM upstream's faults, one phase each. 401 first: a client error does not count
        towards the circuit, so the recovery is measured after the faults that open it."""
        for mode, options in [("401", {}), ("refuse", {"duration_s": self.phase_s}), ("ok", {"latency_ms": 3000}),
                              ("429", {"retry_after": 1}), ("malformed", {})]:
            self.tally.phase = f"llm_{mode}" if mode != "ok" else "llm_slow"
            self.fake.mode(mode, **options)
            await self.sleep(self.phase_s)
            self.fault(self.tally.phase, seconds=round(self.phase_s, 1))

    async def llm_recovery(self):
        """The upstream answers again: seconds to the first LLM answer and to the circuit closed."""
        self.tally.phase = "llm_recovery"
        self.fake.mode("ok", latency_ms=self.args.llm_latency_ms)
        recovered_at = time.monotonic()
        first_llm = circuit_closed = None
        before = self.tally.by_phase.get("llm_recovery", {}).get("llm", 0)
        while time.monotonic() - recovered_at < 60 and (first_llm is None or circuit_closed is None):
            await asyncio.sleep(0.25)
            if first_llm is None and self.tally.by_phase.get("llm_recovery", {}).get("llm", 0) > before:
                first_llm = time.monotonic() - recovered_at
            if circuit_closed is None and circuit_state(await self.in_thread(self.scrape_metrics),
                                                        "gpt-4o-mini") == 0:
                circuit_closed = time.monotonic() - recovered_at
        self.fault("llm_recovered", first_llm_answer_s=round(first_llm, 1) if first_llm is not None else None,
                   circuit_closed_s=round(circuit_closed, 1) if circuit_closed is not None else None,
                   circuit_cooldown_s=10)

    async def classifier_version_swap(self):
        """3. classifier version 2 loaded under load, then removed."""
        self.tally.phase = "version_swap"
        repository = self.server.repository / "classifier"
        shutil.copytree(repository / "1", repository / "2")
        started = time.monotonic()
        await self.in_thread(self.server.repository_call, "/v2/repository/models/classifier/load")
        swap_s = time.monotonic() - started
        await self.sleep(self.phase_s / 2)
        shutil.rmtree(repository / "2")
        await self.in_thread(self.server.repository_call, "/v2/repository/models/classifier/load")
        self.fault("classifier_version_swap", load_v2_s=round(swap_s, 1), back_to_v1=True)
        await self.sleep(self.phase_s / 2)

    async def stub_kill(self):
        """4. the preprocess stub process SIGKILLed; the watchdog reloads the model."""
        self.tally.phase = "stub_kill"
        stub = self.server.stub_pid("preprocess_0_0")
        killed_at = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        recovered = await self.serving_again(stub, killed_at)
        await self.sleep(2)
        self.fault("preprocess_stub_sigkill", stub_pid=stub,
                   serving_again_s=round(recovered, 1) if recovered else None,
                   failed_requests=self.tally.row("stub_kill")["failed"])

    async def serving_again(self, killed_stub, killed_at):
        """Seconds from the kill until a new stub runs and an answer came after it; None after 60 s."""
        while time.monotonic() - killed_at < 60:
            await asyncio.sleep(0.2)
            new_stub = await self.in_thread(self.server.stub_pid, "preprocess_0_0")
            if new_stub in (None, killed_stub):
                continue
            row = self.tally.row("stub_kill")
            marker = row["llm"] + row["fallback"]
            while time.monotonic() - killed_at < 60:  # the new stub serves
                await asyncio.sleep(0.1)
                if row["llm"] + row["fallback"] > marker:  # the same dict, updated as answers come
                    return time.monotonic() - killed_at
            return None
        return None

    async def restart(self):
        """5. a server restart; the clients retry connection failures and UNAVAILABLE."""
        self.tally.phase = "restart"
        self.report["rss_before_restart_mb"] = self.sample_rss("before restart")
        started = time.monotonic()
        await self.in_thread(self.server.stop)
        stopped_s = time.monotonic() - started
        ready_s = await self.in_thread(self.server.start)
        self.fault("server_restart", stop_s=round(stopped_s, 1), start_to_ready_s=round(ready_s, 1),
                   down_s=round(time.monotonic() - started, 1))
        await self.sleep(self.phase_s)

    async def steady_until_the_end(self, load):
        """6. steady load until the deadline; then the load drains and the end state is read:
        Observed's fields but the server logs (read once the server has stopped)."""
        self.tally.phase = "steady_after"
        await self.sleep_until(self.deadline)
        self.report["rss_end_mb"] = self.sample_rss("end")
        self.stop.set()
        await load
        self.report["client_retries"] = self.client.retried
        server_ready_at_end = self.server.is_ready()
        try:
            metrics = await self.in_thread(self.server.metrics)  # judge() checks and scans it
        except OSError as error:
            log(f"metrics at the end: {error}")
            metrics = None
        try:
            upstream = self.fake.admin("stats")
        except OSError as error:
            log(f"fake upstream stats: {error}")
            upstream = None
        return dict(llm_key=self.llm_key, tally=self.tally, scan=self.scan, hostile=self.report["hostile"],
                    faults=self.report["faults"], server_ready_at_end=server_ready_at_end, metrics=metrics,
                    upstream=upstream, mix=self.mix)


async def soak(args, workdir):
    return await SoakRun(args, workdir).run()


# -- the verdict ----------------------------------------------------------------------

# All written by the describe model's Metrics (backends/classify_describe_server/metrics.py)
# once it has served one LLM answer (some from its load on); by the end of the
# run the server restarted in phase 5 has served many.
DESCRIBE_FAMILIES = ("describe_requests_total", "describe_prompt_tokens_total", "describe_completion_tokens_total",
                     "describe_cost_usd_total", "describe_upstream_latency_seconds", "describe_circuit_state",
                     "describe_upstream_in_flight", "describe_upstream_queued", "describe_cache_lookups_total")


@dataclasses.dataclass
class Observed:
    """What a soak run saw, for `judge`. It holds the LLM key: never written out."""

    llm_key: str
    tally: Tally  # every valid request's fate
    scan: SecretScan  # the secrets, and the texts scanned during the run (outputs, errors, scrapes)
    hostile: dict  # corpus_summary() of the hostile corpus
    faults: list  # the fault entries of the report
    server_ready_at_end: bool
    metrics: str | None  # the last metrics scrape; None when the endpoint did not answer
    upstream: dict | None  # the fake upstream's /_admin/stats at the end; None when unreadable
    server_logs: str  # every start's log
    mix: tuple = ()  # the paths of the valid load (tools/soak_paths.py): each must answer


def metrics_check(text):
    """-> (figures, problems) for the metrics page at the end of the run."""
    if text is None:
        return {"answered": False}, ["the metrics endpoint did not answer at the end"]
    names = {name for name, _, _ in metric_samples(text)}
    missing = [family for family in DESCRIBE_FAMILIES
               if not names & {family, f"{family}_bucket", f"{family}_sum", f"{family}_count"}]
    llm_ok = sum(value for name, labels, value in metric_samples(text)
                 if name == "describe_requests_total" and labels.get("outcome") == "ok")
    problems = []
    if missing:
        problems.append(f"metrics at the end lack {', '.join(missing)}")
    elif not llm_ok:  # the restarted server served LLM answers: its page must count them
        problems.append('metrics at the end count no describe_requests_total{outcome="ok"}')
    return {"answered": True, "missing_families": missing, "requests_ok": llm_ok}, problems


def upstream_key_check(stats, llm_key):
    """-> (figures, problems): did every request the fake upstream received carry
    `Authorization: Bearer <LLM key>`? The figures hold counts only, never a header."""
    if stats is None:
        return {"requests": None}, ["the fake upstream's stats could not be read"]
    received = stats.get("requests", 0)
    with_key = stats.get("authorizations", {}).get(f"Bearer {llm_key}", 0)
    figures = {"requests": received, "with_key": with_key}
    if not received:
        return figures, ["the fake upstream received no request"]
    if with_key != received:
        return figures, [f"{received - with_key} of {received} upstream request(s) without "
                         "'Authorization: Bearer <LLM key>'"]
    return figures, []


# How a stream open at the restart ends, by design: the front's error event
# (openai_front/handlers.py SHUTTING_DOWN) on its own streams, and the streaming
# model's UNAVAILABLE (triton_io.server_stopping) on streams opened on Triton
# directly; the describe step's "unloading" for a request that came as it began to
# unload, or that its drain cut short (triton_io.unloading). The server shuts down
# only in the restart, but a request sent in the phase before may still be open then.
SHUTDOWN_ENDINGS = ("the OpenAI front is shutting down", "the server is shutting down: retry on another replica",
                    "the model is unloading")


def _met_stub_down(error):
    return "is not healthy" in error["error"]


def _ended_by_shutdown(error):
    return any(ending in error["error"] for ending in SHUTDOWN_ENDINGS)


def expected_failures(tally):
    """(met the killed stub, streams ended by the restart's shutdown): the failures that are by design."""
    return sum(map(_met_stub_down, tally.errors)), sum(map(_ended_by_shutdown, tally.errors))


def unexpected_errors(tally, most=3):
    """The distinct texts of the first failures not by design, so a red run says what failed
    (a leaked secret shows as its name: the leak is reported as such, not printed)."""
    texts = [tally.scan.redacted(f"{e['phase']}/{e['path']}: {e['error']}") for e in tally.errors
             if not (_met_stub_down(e) or _ended_by_shutdown(e))]
    return list(dict.fromkeys(texts))[:most]


def path_problems(tally, mix):
    """One line per path of the mix that gave no valid answer in the whole run."""
    return [f"no valid answer by the {path} path" for path in dict.fromkeys(mix)
            if not tally.by_path.get(path, {}).get("answered")]


def judge(seen):
    """The report's findings from what the run observed, with `problems`: one
    line per check that failed (empty when the soak passed)."""
    tally = seen.tally
    valid = tally.totals()
    # Requests that met the killed stub (sent just before or during the kill).
    stub_down, shutdown = expected_failures(tally)
    metrics, metrics_problems = metrics_check(seen.metrics)
    upstream, upstream_problems = upstream_key_check(seen.upstream, seen.llm_key)
    found = {where: set(names) for where, names in seen.scan.found.items()}
    scanned = dict(seen.scan.scanned)
    for where, text in (("metrics", seen.metrics), ("server_logs", seen.server_logs)):
        if text is not None:
            scanned[where] = scanned.get(where, 0) + 1
            found.setdefault(where, set()).update(seen.scan.names_in(text))
    found = {where: names for where, names in found.items() if names}
    leaks = [f"{where}: {', '.join(sorted(names))}" for where, names in sorted(found.items())]
    problems = []
    if valid["lost"]:
        kinds = {}
        for entry in tally.lost_requests:
            kinds[entry["kind"]] = kinds.get(entry["kind"], 0) + 1
        if valid["lost"] > len(tally.lost_requests):
            kinds["sent, then nothing recorded"] = valid["lost"] - len(tally.lost_requests)
        problems.append(f"{valid['lost']} valid request(s) lost (no valid answer): {kinds}")
    if valid["failed"] - stub_down - shutdown:
        problems.append(f"{valid['failed'] - stub_down - shutdown} valid request(s) failed other than on the "
                        f"killed stub or a stream the restart's shutdown ended: {unexpected_errors(tally)}")
    problems += path_problems(tally, seen.mix)
    if seen.hostile["clear"] != seen.hostile["sent"]:
        problems.append(f"{seen.hostile['sent'] - seen.hostile['clear']} hostile request(s) "
                        "without a clear error")
    if seen.hostile["sent"] < 200:
        problems.append("hostile corpus smaller than 200")
    if not seen.server_ready_at_end:
        problems.append("server not ready at the end")
    problems += metrics_problems + upstream_problems
    problems += [f"secret found in {leak}" for leak in leaks]
    for entry in seen.faults:
        if entry["fault"] == "preprocess_stub_sigkill" and not entry.get("serving_again_s"):
            problems.append("preprocess not serving again after its stub was killed")
        if entry["fault"] == "llm_recovered" and entry.get("circuit_closed_s") is None:
            problems.append("circuit did not close after the upstream recovered")
    return {"valid": valid, "valid_by_phase": tally.summary(), "valid_errors_sample": tally.errors[:20],
            "valid_lost_sample": tally.lost_requests[:20], "valid_failed_stub_down": stub_down,
            "valid_failed_front_shutdown": shutdown, "valid_by_path": tally.by_path,
            "server_ready_at_end": seen.server_ready_at_end,
            "metrics_tail": metrics, "metrics_tail_ok": not metrics_problems and "metrics" not in found,
            "upstream_key": upstream, "upstream_saw_key": not upstream_problems,
            "secrets_scanned": scanned, "secret_leaks": leaks, "problems": problems}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=16,
                        help="valid requests in flight (16 saturates the ensemble on 2 cores: docs/benchmarks.md)")
    parser.add_argument("--llm-latency-ms", type=float, default=200.0)
    # 40 resends (about 80 s with back-off): the restart keeps the front's port and Triton's
    # gRPC port closed for about 47 s on 2 cores (docs/reliability.md#the-soak-run), longer
    # than 20 resends cover; a client of the front or of gRPC needs that budget too.
    parser.add_argument("--retries", type=int, default=40, help="client retries (connection failures, UNAVAILABLE)")
    parser.add_argument("--mix", default=",".join(soak_paths.MIX),
                        help="the valid requests' paths, in turn (tools/soak_paths.py): infer, grpc_stream, "
                             "front, front_stream")
    parser.add_argument("--steady-fraction", type=float, default=0.5,
                        help="share of the run spent in steady load before the faults")
    parser.add_argument("--min-phase-s", type=float, default=5.0, help="shortest fault phase")
    parser.add_argument("--report", type=pathlib.Path, default=REPO / "build/soak/report.json")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="logs and the repository copy (default: a temporary folder, kept)")
    args = parser.parse_args(argv)
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="soak_"))
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"{args.duration_s:g}s at concurrency {args.concurrency}; logs in {workdir}")
    report = asyncio.run(soak(args, workdir))
    report["host"] = host.describe()
    report["config"] = {k: str(v) for k, v in vars(args).items()}
    report["workdir"] = str(workdir)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1))
    valid = report["valid"]
    print(json.dumps({"valid": valid, "hostile": {k: report["hostile"][k] for k in ("sent", "clear")},
                      "faults": report["faults"], "rss_start_mb": report.get("rss_start_mb"),
                      "rss_steady_end_mb": report.get("rss_steady_end_mb"),
                      "rss_end_mb": report.get("rss_end_mb"), "client_retries": report.get("client_retries"),
                      "secret_leaks": report["secret_leaks"], "problems": report["problems"]}, indent=1))
    log(f"report: {args.report}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
