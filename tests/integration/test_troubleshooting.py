"""The failures Triton users hit, each reproduced as docs/troubleshooting.md
describes it, with the fix checked where the fix is ours to make."""

import uuid

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.integration.conftest import running_triton

# Enough /dev/shm for the stubs and single requests, too little for a batch of
# 8 images through preprocess (8 x 467 KB of PNG in, 8 x 3x224x224 UINT8 = 1.2 MB
# out, through the Python backend's shared-memory pool; 12 MB was enough once the
# pixels went uint8): the situation of a container started with a small
# --shm-size (Docker's default is 64 MB).
SMALL_SHM = "12m"  # 8 MB until the two streaming models added their stubs


def classify(client, images):
    tensor = httpclient.InferInput("IMAGE", [len(images), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image] for image in images], dtype=object))
    return client.infer("classify", [tensor]).as_numpy("LABELS")[:, 0]


@pytest.fixture(scope="module")
def small_shm_triton(fake_llm, tmp_path_factory):
    """A second server whose /dev/shm is a 12 MB tmpfs in its own mount namespace."""
    mount_small_shm = ["unshare", "--mount", "sh", "-c",
                       f'mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm && exec "$0"']
    with running_triton(tmp_path_factory.mktemp("small_shm"), fake_llm,
                        command_prefix=mount_small_shm) as server:
        yield server


def test_out_of_shared_memory_fails_the_batch_not_the_server(small_shm_triton, photos):
    client = httpclient.InferenceServerClient(small_shm_triton.http_url)
    assert list(classify(client, [photos["coffee"]])) == [b"espresso"]

    with pytest.raises(httpclient.InferenceServerException) as error:
        classify(client, [photos["coffee"]] * 8)
    message = error.value.message()
    assert "Failed to increase the shared memory pool size" in message
    assert "--shm-size" in message

    assert small_shm_triton.is_ready()
    assert list(classify(client, [photos["coffee"]] * 2)) == [b"espresso"] * 2


def test_batch_above_max_batch_size_is_refused_up_front(triton, photos):
    client = httpclient.InferenceServerClient(triton.http_url)
    with pytest.raises(httpclient.InferenceServerException) as error:
        classify(client, [photos["coffee"]] * 9)
    assert "batch-size must be <= 8" in error.value.message()
    assert triton.is_ready()


def test_http_network_timeout_shorter_than_the_llm(triton, photos, llm):
    llm.admin("mode", {"mode": "ok", "latency_ms": 3000})
    client = httpclient.InferenceServerClient(triton.http_url, network_timeout=0.5)
    image = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[photos["chelsea"]]], dtype=object))
    prompt = httpclient.InferInput("PROMPT", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[f"slow {uuid.uuid4()}".encode()]], dtype=object))
    with pytest.raises(Exception) as error:
        client.infer("classify_and_describe", [image, prompt])
    assert "timed out" in str(error.value).lower() or "timeout" in type(error.value).__name__.lower()
    assert triton.is_ready()


def test_unknown_model_names_the_model(triton):
    client = httpclient.InferenceServerClient(triton.http_url)
    with pytest.raises(httpclient.InferenceServerException) as error:
        client.infer("clasify_and_describe", [])
    assert "clasify_and_describe" in error.value.message()


def test_a_lying_bytes_element_fails_only_its_own_request(triton, photos):
    """A BYTES element whose 4-byte length prefix claims 2 GB, sent over raw HTTP
    while valid requests flow: only the liar gets the error. With dynamic
    batching on `preprocess`, Triton 2.51 failed the whole batch it landed in."""
    import json
    import threading
    import time
    import urllib.error
    import urllib.request

    header = json.dumps({"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 8}}]}).encode()
    body = header + b"\xff\xff\xff\x7fabcd"
    deadline = time.monotonic() + 5
    liar_errors, valid_ok, valid_failed = [], [], []

    def liar():
        while time.monotonic() < deadline:
            request = urllib.request.Request(
                f"http://{triton.http_url}/v2/models/classify/infer", data=body, method="POST",
                headers={"Inference-Header-Content-Length": str(len(header))})
            try:
                urllib.request.urlopen(request, timeout=30).read()
            except urllib.error.HTTPError as error:
                liar_errors.append(error.code)

    def valid():
        client = httpclient.InferenceServerClient(triton.http_url)
        while time.monotonic() < deadline:
            try:
                valid_ok.append(classify(client, [photos["coffee"]])[0])
            except httpclient.InferenceServerException as error:
                valid_failed.append(error.message())

    threads = [threading.Thread(target=liar) for _ in range(2)]
    threads += [threading.Thread(target=valid) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert liar_errors and set(liar_errors) == {400}
    assert valid_failed == []
    assert valid_ok and set(valid_ok) == {b"espresso"}
