"""Operating the pipeline on the session's real server and fake LLM upstream:
a request's id flows from the client (an X-Request-ID to the OpenAI front,
or a tritonclient request_id to Triton) to Triton, to the LLM upstream's
X-Request-ID and into the log lines about the request, and comes back to
the front's client; the front's access log has one JSON line per request
and nothing secret; its metrics parse as Prometheus's own client reads
them and count exactly the requests sent.

The describe step's warning about a failed upstream attempt is the log line
about a request checked here. It is rate-limited (one line per failure
reason per 10 s and model instance, describer._warn_rate_limited), so each
test fails the upstream with a reason of its own on a model of its own."""

import json
import re
import time
import urllib.request
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from .test_openai_front import MODEL, data_uri, unique_prompt, user_message

LOG_WAIT_S = 30  # a log line is flushed at once; generous for a loaded machine


def front_post(triton, body, headers=None, timeout=120):
    """(status, response headers, body bytes) of one POST /v1/chat/completions."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{triton.openai_base_url}/chat/completions", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read(), len(data)
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read(), len(data)


def access_lines(log):
    """The front's access log lines in the server's log (the front writes them to its stderr)."""
    lines = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and "request_id" in entry and "status" in entry:
                lines.append(entry)
    return lines


def wait_for(check, what):
    """Poll `check` until it returns something true; fail naming `what` after LOG_WAIT_S."""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"not seen within {LOG_WAIT_S} s: {what}")
        time.sleep(0.2)


def new_id():
    return f"it-{uuid.uuid4()}"


@pytest.mark.parametrize("stream, failure, model_name", [
    (False, "500", "describe"),                         # the ensemble's describe step
    (True, "500", "classify_and_describe_stream"),       # the streaming model the front uses
])
def test_the_clients_id_comes_back_and_reaches_the_upstream_and_the_log_lines(triton, llm, photos, stream,
                                                                              failure, model_name):
    request_id = new_id()
    llm.admin("mode", {"mode": failure, "count": 1})  # the first attempt fails (logged), the retry answers
    body = {"model": MODEL, "stream": stream, "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}
    status, headers, answer, _ = front_post(triton, body, {"X-Request-ID": request_id})
    assert status == 200, answer
    assert headers["X-Request-ID"] == request_id
    assert b"[DONE]" in answer if stream else json.loads(answer)["choices"][0]["message"]["content"]
    sent = llm.admin("stats")["request_ids"]
    assert sent.count(request_id) == 2, f"both attempts carry the id: {sent}"
    line = re.compile(rf"\[{model_name}\] \[request id: {re.escape(request_id)}\] upstream attempt failed")
    wait_for(lambda: line.search(triton.log()), f"the {model_name} warning naming {request_id}")


def test_an_id_the_front_cannot_take_is_replaced_by_a_new_one_everywhere(triton, llm, photos):
    hostile = "x" * 200 + " spaced <script>"
    body = {"model": MODEL, "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}
    status, headers, answer, _ = front_post(triton, body, {"X-Request-ID": hostile})
    assert status == 200, answer
    given = headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", given), given
    assert llm.admin("stats")["request_ids"][-1] == given
    assert "<script>" not in triton.log()
    wait_for(lambda: [e for e in access_lines(triton.log()) if e["request_id"] == given], "the access log line")


def _image_input(module, photo):
    image = module.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[photo]], dtype=np.object_))
    prompt = module.InferInput("PROMPT", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[unique_prompt().encode()]], dtype=np.object_))
    return [image, prompt]


@pytest.mark.parametrize("protocol, failure", [("http", "malformed"), ("grpc", "drop")])
def test_a_tritonclient_request_id_reaches_the_upstream_and_the_describe_steps_log(triton, llm, photos, protocol,
                                                                                   failure):
    request_id = new_id()
    llm.admin("mode", {"mode": failure, "count": 1})
    if protocol == "http":
        client = httpclient.InferenceServerClient(triton.http_url, network_timeout=120)
        result = client.infer(MODEL, _image_input(httpclient, photos["coffee"]), request_id=request_id)
        assert result.get_response()["id"] == request_id
    else:
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        result = client.infer(MODEL, _image_input(grpcclient, photos["coffee"]), request_id=request_id,
                              client_timeout=120)
        assert result.get_response().id == request_id
    client.close()
    assert result.as_numpy("DESCRIPTION_SOURCE")[0][0] == b"llm"
    sent = llm.admin("stats")["request_ids"]
    assert sent.count(request_id) == 2, f"both attempts carry the id: {sent}"
    line = re.compile(rf"\[describe\] \[request id: {re.escape(request_id)}\] upstream attempt failed")
    wait_for(lambda: line.search(triton.log()), f"the describe warning naming {request_id}")


def test_the_access_log_has_one_json_line_per_request_and_nothing_secret(triton, llm, photos):
    secret = "sk-access-log-DO-NOT-LEAK-" + uuid.uuid4().hex[:8]
    ids = {}
    for stream in (False, True):
        request_id = new_id()
        body = {"model": MODEL, "stream": stream, "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}
        status, headers, answer, sent_bytes = front_post(
            triton, body, {"X-Request-ID": request_id, "Authorization": f"Bearer {secret}"})
        assert status == 200, answer
        ids[request_id] = (stream, sent_bytes, len(answer))
    missing = new_id()
    status, _, _, _ = front_post(triton, {"model": "no-such-model", "messages": user_message(data_uri(photos["coffee"]))},
                                 {"X-Request-ID": missing})
    assert status == 404
    with urllib.request.urlopen(urllib.request.Request(
            f"{triton.openai_base_url}/models?key={secret}", headers={"X-Request-ID": (models := new_id())}),
            timeout=10) as response:
        assert response.status == 200
    wanted = {*ids, missing, models}

    def logged():
        found = [e for e in access_lines(triton.log()) if e["request_id"] in wanted]
        return found if {e["request_id"] for e in found} == wanted else None

    entries = wait_for(logged, "four access log lines")
    assert sorted(e["request_id"] for e in entries) == sorted(wanted), "exactly one line each"
    for entry in entries:
        assert set(entry) == {"time", "request_id", "method", "path", "status", "duration_s", "bytes_in",
                              "bytes_out", "model", "stream", "client"}
        assert entry["client"] == "127.0.0.1" and entry["duration_s"] > 0
        if entry["request_id"] in ids:
            stream, sent_bytes, answer_bytes = ids[entry["request_id"]]
            assert (entry["method"], entry["path"], entry["status"], entry["model"], entry["stream"]) == \
                ("POST", "/v1/chat/completions", 200, MODEL, stream)
            assert entry["bytes_in"] == sent_bytes and entry["bytes_out"] == answer_bytes
    by_id = {e["request_id"]: e for e in entries}
    assert (by_id[missing]["status"], by_id[missing]["model"]) == (404, "no-such-model")
    assert (by_id[models]["method"], by_id[models]["path"], by_id[models]["status"]) == ("GET", "/v1/models", 200)
    log = triton.log()
    assert secret not in log, "no key, from a header or a query string"
    assert "base64," not in log and data_uri(photos["coffee"])[40:100] not in log, "no image data"


def scrape(triton):
    with urllib.request.urlopen(triton.openai_base_url.removesuffix("/v1") + "/metrics", timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def values(text):
    """{(sample name, sorted labels): value}, parsed by prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(before, after, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_the_metrics_parse_and_count_exactly_the_requests_sent(triton, llm, photos):
    _, text = scrape(triton)
    before = values(text)
    for stream in (False, False, True):
        body = {"model": MODEL, "stream": stream, "messages": user_message(data_uri(photos["coffee"]), unique_prompt())}
        assert front_post(triton, body)[0] == 200
    assert front_post(triton, {"model": "no-such-model", "messages": user_message(data_uri(photos["coffee"]))})[0] == 404
    content_type, text = scrape(triton)
    after = values(text)
    assert content_type.startswith("text/plain")
    assert delta(before, after, "openai_front_requests_total", model=MODEL, stream="false", status="200") == 2
    assert delta(before, after, "openai_front_requests_total", model=MODEL, stream="true", status="200") == 1
    assert delta(before, after, "openai_front_requests_total", model="other", stream="false", status="404") == 1
    assert delta(before, after, "openai_front_errors_total", status="404", code="model_not_found") == 1
    assert delta(before, after, "openai_front_request_duration_seconds_count", model=MODEL, stream="false") == 2
    assert delta(before, after, "openai_front_request_duration_seconds_bucket", model=MODEL, stream="true",
                 le="+Inf") == 1
    assert delta(before, after, "openai_front_tokens_total", model=MODEL, kind="prompt") > 0
    assert after[("openai_front_in_flight", ())] == 0
    assert after[("process_cpu_seconds_total", ())] > 0 and ("process_resident_memory_bytes", ()) in after
    assert not [name for name, _ in after if name.endswith("_created")]
