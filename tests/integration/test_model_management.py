"""Model management under traffic (explicit model control, as `make run` starts it):
a new classifier version loads while requests flow, none is lost and the pipelines
answer with it; a model unloaded while in use lets its in-flight requests finish."""

import os
import re
import shutil
import threading
import time
import uuid

import numpy as np
import tritonclient.http as httpclient

from classify_describe import Client


def classify_once(client, image):
    tensor = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image]], dtype=object))
    return client.infer("classify", [tensor]).as_numpy("LABELS")[0, 0].decode()


def classify_scores(client, image):
    tensor = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image]], dtype=object))
    return client.infer("classify", [tensor]).as_numpy("SCORES")[0]


def reload_classify_with_view(admin, triton):
    """README (Bring your own model), step 4 on the CPU layout: classify_with_view reads the classifier's
    newest version when it loads; Triton reloads a loaded model only when its version folder changed."""
    os.utime(triton.repository / "classify_with_view" / "1")
    admin.load_model("classify_with_view", headers=triton.admin_headers)


class Traffic:
    """Sends classify requests from a thread until stopped; records every outcome."""

    def __init__(self, url, image):
        self.client = httpclient.InferenceServerClient(url)
        self.image = image
        self.answers, self.errors = [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.answers.append(classify_once(self.client, self.image))
            except Exception as error:  # every failure is a finding
                self.errors.append(repr(error))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)


def wait_until(predicate, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_new_classifier_version_loads_under_traffic(triton, photos):
    admin = httpclient.InferenceServerClient(triton.http_url)
    version_2 = triton.repository / "classifier" / "2"
    shutil.copytree(triton.repository / "classifier" / "1", version_2)
    # Version 2 is the int8 graph: its scores tell which weights answered.
    shutil.copyfile(version_2 / "model.int8.onnx", version_2 / "model.onnx")
    scores_before = classify_scores(admin, photos["coffee"])
    try:
        with Traffic(triton.http_url, photos["coffee"]) as traffic:
            wait_until(lambda: len(traffic.answers) >= 5)
            admin.load_model("classifier", headers=triton.admin_headers)
            assert admin.is_model_ready("classifier", "2")
            reload_classify_with_view(admin, triton)
            served_before = len(traffic.answers)
            wait_until(lambda: len(traffic.answers) >= served_before + 5)
        assert traffic.errors == []
        assert set(traffic.answers) == {"espresso"}
        assert not admin.is_model_ready("classifier", "1")  # latest-only version policy
        # The pipelines (classify here) answer with version 2, and the log says which one was loaded.
        assert re.search(r"\[classify_with_view\] ready: .*; classifier/2/model\.onnx", triton.log())
        assert not np.allclose(classify_scores(admin, photos["coffee"]), scores_before)
    finally:
        shutil.rmtree(version_2, ignore_errors=True)
        admin.load_model("classifier", headers=triton.admin_headers)
        reload_classify_with_view(admin, triton)
        wait_until(lambda: admin.is_model_ready("classifier", "1"))
    assert np.allclose(classify_scores(admin, photos["coffee"]), scores_before)


def test_unloading_a_model_in_use_lets_in_flight_requests_finish(triton, photos, llm):
    admin = httpclient.InferenceServerClient(triton.http_url)
    llm.admin("mode", {"mode": "ok", "latency_ms": 2000})
    outcome = {}

    def slow_request():
        try:
            with Client(triton.http_url) as client:
                outcome["result"] = client.infer(photos["chelsea"], prompt=f"slow {uuid.uuid4()}")
        except Exception as error:
            outcome["error"] = repr(error)

    request = threading.Thread(target=slow_request)
    request.start()
    try:
        wait_until(lambda: llm.admin("stats")["in_flight"] >= 1, timeout_s=30)
        # Returns at once; the unload waits for in-flight work.
        admin.unload_model("describe", headers=triton.admin_headers)
        request.join(60)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["result"].description_source == "llm"
        wait_until(lambda: not admin.is_model_ready("describe"))
    finally:
        llm.admin("reset", {})
        admin.load_model("describe", headers=triton.admin_headers)
        admin.load_model("classify_and_describe", headers=triton.admin_headers)
        wait_until(lambda: admin.is_model_ready("classify_and_describe"))
    with Client(triton.http_url) as client:
        assert client.infer(photos["coffee"], prompt=f"after {uuid.uuid4()}").labels[0] == "espresso"
