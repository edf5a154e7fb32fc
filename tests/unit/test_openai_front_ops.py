"""Operating the front: request ids (taken, checked, made, sent to
Triton, returned on every answer), the access log (one JSON line a request,
nothing secret), and /metrics served by prometheus_client. The same against
the real server and fake upstream: tests/integration/test_request_ids.py."""

import asyncio
import json
import logging
import re
import socket
import threading

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from classify_describe_server import request_id as ids
from prometheus_client.parser import text_string_to_metric_families

from openai_front import access_log, errors, settings
from openai_front.triton import TritonPool

from .test_openai_front import StalledPool, body, front_with
from .test_openai_front_fields import RecordingPool

NEW_ID = re.compile(r"[0-9a-f]{32}")


@pytest.mark.parametrize("given, kept", [
    ("3f2a9c1e-77b0-4a51-9c1d-0c2a4c6b8e10", True),
    ("req_01HZX:trace/span+b64=@.", True),
    ("a" * ids.MAX_CHARS, True),
    ("a" * (ids.MAX_CHARS + 1), False),   # too long: replaced, never cut to something that looks like the client's
    ("", False),
    (None, False),
    ("two words", False),
    ("line\nbreak", False),
    ("[request id: forged]", False),
    ('quote"', False),
    ("caf\u00e9", False),
    ("\udcff\udcfe", False),               # bytes outside ASCII, as aiohttp decodes them
])
def test_an_id_is_kept_only_when_short_and_plain(given, kept):
    taken = ids.accept(given)
    assert (taken == given) is kept
    if not kept:
        assert NEW_ID.fullmatch(taken)
    assert ids.accept(None) != ids.accept(None), "each new id is new"


async def _ask(app, requests):
    """[(status, headers, body)] of each (method, path, headers, data) through the app."""
    answers = []
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for method, path, headers, data in requests:
            response = await client.request(method, path, headers=headers, data=data,
                                            timeout=aiohttp.ClientTimeout(total=20))
            answers.append((response.status, response.headers, await response.read()))
    return answers


def chat_request(request_id=None, **extra):
    headers = {"Content-Type": "application/json", **({ids.HEADER: request_id} if request_id is not None else {})}
    return "POST", "/v1/chat/completions", headers, json.dumps(body(**extra))


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_id_is_triton_request_id_and_comes_back(stream):
    pool = RecordingPool()
    (status, headers, answer), = asyncio.run(_ask(front_with(pool), [chat_request("client-id-1", stream=stream)]))
    assert status == 200, answer
    assert headers[ids.HEADER] == "client-id-1"
    assert [call["request_id"] for call in pool.calls] == ["client-id-1"]


def test_without_an_id_or_with_a_bad_one_the_front_makes_one_and_sends_that_one_everywhere():
    pool = RecordingPool()
    answers = asyncio.run(_ask(front_with(pool), [chat_request(), chat_request("x" * 500), chat_request("a b")]))
    given = [headers[ids.HEADER] for _, headers, _ in answers]
    assert all(NEW_ID.fullmatch(g) for g in given) and len(set(given)) == 3
    assert [call["request_id"] for call in pool.calls] == given


def test_error_answers_carry_the_id_too():
    app = front_with(StalledPool(), api_key="sk-unit-key")
    keyed = {"Authorization": "Bearer sk-unit-key"}
    answers = asyncio.run(_ask(app, [
        ("GET", "/v1/models", {ids.HEADER: "e-401"}, None),                                  # no key
        ("GET", "/no/such/route", {ids.HEADER: "e-404", **keyed}, None),                     # aiohttp's own 404
        ("POST", "/v1/chat/completions", {ids.HEADER: "e-400", **keyed}, b"not json"),
        ("GET", "/metrics", {ids.HEADER: "e-metrics"}, None),
    ]))
    assert [(status, headers[ids.HEADER]) for status, headers, _ in answers] == \
        [(401, "e-401"), (404, "e-404"), (400, "e-400"), (200, "e-metrics")]


def test_a_raw_header_with_bytes_outside_ascii_is_replaced_not_echoed():
    """What a hostile client can put on the wire that an HTTP library would refuse to send
    (control bytes aiohttp refuses itself, 400, before the app)."""
    app = front_with(StalledPool())

    async def main():
        async with TestServer(app, host="127.0.0.1") as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Request-ID: a\xffb\xfe c\r\nConnection: close\r\n\r\n")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return answer

    answer = asyncio.run(main())
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    assert head.startswith("HTTP/1.1 200"), head
    given = re.search(r"(?im)^X-Request-ID: (.*)$", head).group(1)
    assert NEW_ID.fullmatch(given), given


def test_the_front_names_the_request_in_its_log_lines(caplog):
    class FailingPool(StalledPool):
        async def infer(self, *args, **kwargs):
            raise errors.unavailable("the inference server is unavailable; retry later")

    with caplog.at_level(logging.WARNING, logger="openai_front"):
        (status, _, _), = asyncio.run(_ask(front_with(FailingPool()), [chat_request("logged-id")]))
    assert status == 503
    assert [r.getMessage() for r in caplog.records if r.name == "openai_front"] == \
        ["openai_front: [request id: logged-id] 503 the inference server is unavailable; retry later"]


# -- the access log -----------------------------------------------------------------

def access_entries(caplog):
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "openai_front.access"]


def test_one_json_line_per_request_with_its_facts_and_nothing_secret(caplog):
    secret = "sk-DO-NOT-LOG-1234"
    payload = chat_request("acc-1")
    with caplog.at_level(logging.INFO, logger="openai_front.access"):
        answers = asyncio.run(_ask(front_with(RecordingPool()), [
            ("POST", "/v1/chat/completions", {**payload[2], "Authorization": f"Bearer {secret}"}, payload[3]),
            chat_request("acc-2", stream=True),
            chat_request("acc-3", model="client-chosen-model"),
            ("GET", f"/v1/models?api_key={secret}", {ids.HEADER: "acc-4"}, None),
        ]))
    entries = access_entries(caplog)
    assert [e["request_id"] for e in entries] == ["acc-1", "acc-2", "acc-3", "acc-4"]
    whole, streamed, unknown, models = entries
    assert set(whole) == {"time", "request_id", "method", "path", "status", "duration_s", "bytes_in", "bytes_out",
                          "model", "stream", "client"}
    assert (whole["method"], whole["path"], whole["status"], whole["model"], whole["stream"]) == \
        ("POST", "/v1/chat/completions", 200, "classify_and_describe", False)
    assert whole["bytes_in"] == len(payload[3]) and whole["bytes_out"] == len(answers[0][2])
    assert whole["client"] == "127.0.0.1" and whole["duration_s"] >= 0 and whole["time"].endswith("+00:00")
    assert (streamed["stream"], streamed["status"], streamed["bytes_out"]) == (True, 200, len(answers[1][2]))
    assert (unknown["status"], unknown["model"]) == (404, "client-chosen-model")
    assert (models["path"], models["bytes_in"], models["model"]) == ("/v1/models", 0, None)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert secret not in logged and "base64" not in logged and "Bearer" not in logged


def test_a_client_that_leaves_is_logged_as_499():
    pool = StalledPool()
    app = front_with(pool)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    access_log.log.addHandler(handler)

    async def main():
        async with TestServer(app, host="127.0.0.1", handler_cancellation=True) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            payload = json.dumps(body()).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-ID: gone-1\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            await writer.drain()
            await asyncio.wait_for(pool.started.wait(), 5)
            writer.close()
            await asyncio.wait_for(pool.cancelled.wait(), 5)
            for _ in range(100):  # the middleware's finally runs as the cancellation unwinds
                if records:
                    break
                await asyncio.sleep(0.01)

    try:
        access_log.log.setLevel(logging.INFO)
        asyncio.run(main())
    finally:
        access_log.log.removeHandler(handler)
        access_log.log.setLevel(logging.NOTSET)
    entry, = [json.loads(r) for r in records]
    assert (entry["request_id"], entry["status"], entry["model"]) == ("gone-1", 499, "classify_and_describe")


def test_the_setting_turns_the_access_log_off(caplog):
    assert settings.from_environ({}).access_log is True
    assert settings.from_environ({"OPENAI_FRONT_ACCESS_LOG": "0"}).access_log is False
    with pytest.raises(settings.ConfigError):
        settings.from_environ({"OPENAI_FRONT_ACCESS_LOG": "maybe"})
    with caplog.at_level(logging.INFO, logger="openai_front.access"):
        (status, headers, _), = asyncio.run(_ask(front_with(RecordingPool(), access_log=False), [chat_request("off")]))
    assert status == 200 and headers[ids.HEADER] == "off", "the id still comes back"
    assert access_entries(caplog) == []


# -- /metrics -----------------------------------------------------------------------

def test_metrics_are_the_standard_exposition_with_process_metrics_and_count_each_request():
    answers = asyncio.run(_ask(front_with(RecordingPool()), [
        chat_request(), chat_request(stream=True), chat_request(model="nope"),
        ("GET", "/metrics", {}, None),
        ("GET", "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}, None),
    ]))
    (_, plain_headers, plain), (_, open_headers, openmetrics) = answers[3], answers[4]
    assert plain_headers["Content-Type"].startswith("text/plain") and plain_headers["X-Content-Type-Options"] == "nosniff"
    assert open_headers["Content-Type"].startswith("application/openmetrics-text")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(plain.decode()) for s in family.samples}
    requests = {labels: v for (name, labels), v in samples.items() if name == "openai_front_requests_total"}
    assert requests == {(("model", "classify_and_describe"), ("status", "200"), ("stream", "false")): 1,
                        (("model", "classify_and_describe"), ("status", "200"), ("stream", "true")): 1,
                        (("model", "other"), ("status", "404"), ("stream", "false")): 1}
    assert samples[("process_cpu_seconds_total", ())] > 0
    assert openmetrics.decode().rstrip().endswith("# EOF")


def test_the_front_reaches_triton_directly_whatever_http_proxy_says(monkeypatch):
    """gRPC takes http_proxy from the environment: a pod's, set for the LLM's egress,
    had every inference tunnelled (CONNECT) to the proxy. Nothing reaches it now."""
    proxy = socket.create_server(("127.0.0.1", 0))
    proxy.settimeout(3)
    seen = []

    def record():
        try:
            connection, _ = proxy.accept()
            seen.append(connection.recv(200))
            connection.close()
        except OSError:
            pass
    listener = threading.Thread(target=record, daemon=True)
    listener.start()
    with socket.create_server(("127.0.0.1", 0)) as closed:  # a port nothing listens on once closed
        triton_port = closed.getsockname()[1]
    for name in ("http_proxy", "https_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("no_grpc_proxy", raising=False)

    async def main():
        pool = TritonPool(f"127.0.0.1:{triton_port}", channels=1)
        try:
            return await pool.is_ready()
        finally:
            await pool.close()
    assert asyncio.run(main()) is False
    listener.join()
    proxy.close()
    assert seen == []
