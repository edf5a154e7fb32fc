"""The CPU layout on the real server (serving/layout.py): started as `make run` starts it, under
`taskset -c 0` it serves one core's layout and with CPU_CORES=3 three cores', with the rate
limiter's slots on tritonserver's command line to match; every product model answers over HTTP
and gRPC once READY, and the instances a smaller layout retired are gone, not reloaded by the
watchdog. The session's server serves this machine's (on 2 cores: the committed configs, unchanged)."""

import json
import os
import time
import urllib.request

import pytest

from serving import procfs
from tools.local_stack import NotReady, TritonServer

from .conftest import STARTS_ITS_OWN_SERVER, TEST_API_KEY, running_triton
from .raw_infer import GrpcInfer, bytes_tensor, http_infer

SIZED = ("classify_with_view", "preprocess", "classifier")


def served(server, model):
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/config", timeout=10) as answer:
        config = json.load(answer)
    parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
    return config["instance_group"][0]["count"], parameters.get("idle_intra_op_threads")


def server_args(server):
    pid = procfs.tritonserver_pid(server.process.pid)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [arg.decode() for arg in f.read().split(b"\0") if arg.startswith(b"--rate-limit")]


def stubs(server):
    pid = procfs.tritonserver_pid(server.process.pid)
    return sorted(instance for child in procfs.children(pid) if (instance := procfs.stub_instance(child))
                  and procfs.process_state(child) not in (None, "Z"))


def assert_every_product_path_answers(server, photo):
    grpc_infer = GrpcInfer(server.grpc_url)
    try:
        for model, output in (("classify", "LABELS"), ("classify_and_describe", "DESCRIPTION")):
            answer = http_infer(server.http_url, model, [bytes_tensor("IMAGE", [[photo]])])
            assert answer.ok, (model, answer.message)
            assert answer.outputs[output].size, model
            answer = grpc_infer(model, [bytes_tensor("IMAGE", [[photo]])])
            assert answer.ok, (model, answer.message)
    finally:
        grpc_infer.close()


def assert_retired_stubs_exit(server, expected):
    deadline = time.monotonic() + 60
    while stubs(server) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stubs(server) == expected


def expected_stubs(counts):
    fixed = ["classify_and_describe_stream_0_0", "describe_0_0", "describe_stream_0_0"]
    return sorted(fixed + [f"{model}_0_{index}" for model, count in counts.items() for index in range(count)])


def test_the_session_server_serves_this_machines_layout(triton):
    cores = len(os.sched_getaffinity(0))
    assert {model: served(triton, model) for model in SIZED} == {
        "classify_with_view": (cores + 1, str(min(2, cores))), "preprocess": (cores, None), "classifier": (cores, None)}
    assert server_args(triton) == ["--rate-limit=execution_count", f"--rate-limit-resource=cpu:{cores + 1}"]
    log = triton.log()
    assert f"CPU layout for {cores} core(s) (CPU affinity)" in log
    if cores == 2:
        assert "layout: '" not in log, "the committed configs are the 2-core layout: nothing to reload"


@pytest.mark.parametrize("how, cores", [("taskset -c 0", 1), ("CPU_CORES=3", 3)])
@STARTS_ITS_OWN_SERVER
def test_a_server_given_other_cores_serves_their_layout(fake_llm, tmp_path, photos, how, cores):
    prefix = how.split() if how.startswith("taskset") else ()
    env = {"CPU_CORES": str(cores)} if how.startswith("CPU_CORES") else {}
    with running_triton(tmp_path, fake_llm, env, command_prefix=prefix) as server:
        assert {model: served(server, model) for model in SIZED} == {
            "classify_with_view": (cores + 1, str(min(2, cores))), "preprocess": (cores, None),
            "classifier": (cores, None)}
        assert server_args(server) == ["--rate-limit=execution_count", f"--rate-limit-resource=cpu:{cores + 1}"]
        assert_every_product_path_answers(server, photos["coffee"])
        assert_retired_stubs_exit(server, expected_stubs(
            {"classify_with_view": cores + 1, "preprocess": cores, "classifier": cores}))
        log = server.log()
        assert f"layout: 'classify_with_view' now runs {cores + 1} instance(s) (its config.pbtxt: 3)" in log
        assert "died" not in log, "a retired instance is not a dead stub"
        assert log.index("layout: 'classifier' now runs") < log.index("serve: READY")


@STARTS_ITS_OWN_SERVER
def test_layout_off_serves_the_configs_as_written(fake_llm, tmp_path):
    with running_triton(tmp_path, fake_llm, {"CPU_LAYOUT": "0"}, command_prefix=("taskset", "-c", "0")) as server:
        assert served(server, "classify_with_view") == (3, "2")
        assert server_args(server) == []


def test_a_bad_cpu_cores_stops_the_start_and_names_it(tmp_path, fake_llm):
    server = TritonServer(tmp_path, {"LLM_BASE_URL": fake_llm.base_url, "LLM_API_KEY": TEST_API_KEY,
                                     "CPU_CORES": "two"})
    with pytest.raises(NotReady):
        server.start(timeout_s=60)
    assert server.process.wait(30) != 0
    assert "CPU_CORES='two' must be a whole number of cores, at least 1" in server.log()
    assert "serve: READY" not in server.log()
