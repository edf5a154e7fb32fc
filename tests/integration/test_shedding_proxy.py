"""The shipped shedding proxy (deploy/nginx/triton-shed.conf.template; nginx
from tools/nginx.py) in front of the session's Triton: past its in-flight
limit it answers 503 with Retry-After from the headers alone, before a byte
of the body arrives, and what it admits reaches Triton and is answered.
`make overload` measures what that is worth under load."""

import http.client
import json
import time

import pytest

from tools.nginx import ShedProxy

from .raw_infer import bytes_tensor, http_infer

ENSEMBLE = "classify_and_describe"
HOLD_TIMEOUT_S = 30  # generous: a loaded 2-core machine; only a hang reaches it


def infer_body(photo, prompt):
    tensors = [bytes_tensor("IMAGE", [[photo]]), bytes_tensor("PROMPT", [[prompt.encode()]])]
    header = json.dumps({"inputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape,
                                     "parameters": {"binary_data_size": len(t.raw)}} for t in tensors]}).encode()
    return header, header + b"".join(t.raw for t in tensors)


def start_infer(url, header, body_length, source="127.0.0.1"):
    """An infer request whose headers are sent and whose body is not, yet; from `source`
    (another loopback address is another client to the proxy)."""
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=HOLD_TIMEOUT_S, source_address=(source, 0))
    connection.putrequest("POST", f"/v2/models/{ENSEMBLE}/infer")
    connection.putheader("Content-Length", str(body_length))
    connection.putheader("Inference-Header-Content-Length", str(len(header)))
    connection.endheaders()
    return connection


def probe_status(url):
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=HOLD_TIMEOUT_S)
    try:
        connection.request("GET", "/v2")
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


@pytest.fixture
def proxy(triton, tmp_path):
    with ShedProxy(tmp_path, triton.http_url, max_in_flight=1) as running:
        yield running


def test_the_proxy_refuses_before_the_body_and_admits_the_rest(proxy, triton, photos):
    header, body = infer_body(photos["coffee"], "What is it? (shedding proxy)")
    # One request holds the only slot: its headers are in, its body only begun.
    holder = start_infer(proxy.url, header, len(body))
    holder.send(body[:1024])
    # An event, not a sleep: the slot is taken once a cheap request is shed.
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while probe_status(proxy.url) != 503:
        assert time.monotonic() < deadline, "the proxy never counted the held request"

    # Headers only, the body never sent: an answer now proves the refusal
    # came before the body was read.
    refused = start_infer(proxy.url, header, len(body))
    answer = refused.getresponse()
    assert answer.status == 503
    assert answer.getheader("Retry-After") == "1"
    assert "in-flight limit" in json.loads(answer.read())["error"]  # Triton's error format
    refused.close()

    # The held request, once whole, passes to Triton and is answered.
    holder.send(body[1024:])
    admitted = holder.getresponse()
    payload = admitted.read()
    assert admitted.status == 200, payload[:300]
    outputs = json.loads(payload)["outputs"]  # no binary output asked for: all JSON
    assert {o["name"] for o in outputs} >= {"LABELS", "DESCRIPTION"}
    holder.close()

    # The slot is free again: an ordinary request through the proxy is answered.
    again = http_infer(proxy.url, ENSEMBLE, [bytes_tensor("IMAGE", [[photos["chelsea"]]])])
    assert again.ok, again.message
    assert probe_status(proxy.url) == 200
    assert triton.is_ready()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "identity"])
def test_the_proxy_refuses_compressed_bodies_from_the_headers_alone(proxy, triton, photos, encoding):
    """Triton 2.51 leaks the inflated body of every compressed request it fails
    to parse (a gzip bomb: its whole inflated size, each time;
    docs/reliability.md#hostile-clients-on-every-port), so the shipped proxy
    refuses any Content-Encoding with 415 before a byte of the body arrives,
    and Triton never sees it; uncompressed requests beside it are answered."""
    host, port = proxy.url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=HOLD_TIMEOUT_S)
    connection.putrequest("POST", f"/v2/models/{ENSEMBLE}/infer")
    connection.putheader("Content-Encoding", encoding)
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(1 << 20))
    connection.endheaders()
    answer = connection.getresponse()
    assert answer.status == 415, answer.status
    assert answer.getheader("Content-Type") == "application/json"
    assert "Content-Encoding" in json.loads(answer.read())["error"]  # Triton's error format
    connection.close()
    assert http_infer(proxy.url, "classify", [bytes_tensor("IMAGE", [[photos["coffee"]]])]).ok


def test_a_body_larger_than_triton_takes_is_refused_from_its_length_alone(proxy, triton, photos):
    """client_max_body_size: past 21 MiB (preprocess's 20 MiB image and 1 MiB of header) a 413
    before a byte of the body is read, never buffered to disk."""
    host, port = proxy.url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=HOLD_TIMEOUT_S)
    connection.putrequest("POST", f"/v2/models/{ENSEMBLE}/infer")
    connection.putheader("Content-Length", str(1 << 30))
    connection.endheaders()
    assert connection.getresponse().status == 413
    connection.close()
    assert http_infer(proxy.url, "classify", [bytes_tensor("IMAGE", [[photos["coffee"]]])]).ok


def test_slow_bodies_from_one_client_hold_its_share_of_slots_and_others_are_served(triton, tmp_path, photos):
    """A client that sends its bodies slowly takes at most NGINX_MAX_IN_FLIGHT_PER_CLIENT of the
    slots (the proxy counts a request from its headers, before its body): its next ones are
    refused at once, and another client's request is served beside them."""
    header, body = infer_body(photos["coffee"], "What is it? (slow bodies)")
    with ShedProxy(tmp_path, triton.http_url, max_in_flight=8, per_client=3) as proxy:
        slow = []
        try:
            for _ in range(3):
                slow.append(start_infer(proxy.url, header, len(body)))
                slow[-1].send(body[:512])  # and then nothing, for now
            deadline = time.monotonic() + HOLD_TIMEOUT_S
            while True:  # the three are counted once nginx has their headers
                extra = start_infer(proxy.url, header, len(body))
                answer = extra.getresponse()
                extra.close()
                if answer.status == 503:
                    break
                assert time.monotonic() < deadline, "the proxy never counted the slow bodies"
            assert answer.getheader("Retry-After") == "1"
            # Another client (another address) is served while the slow bodies hold their slots.
            other = start_infer(proxy.url, header, len(body), source="127.0.0.2")
            other.send(body)
            served = other.getresponse()
            assert served.status == 200, served.read()[:300]
            other.close()
        finally:
            for connection in slow:
                connection.close()
