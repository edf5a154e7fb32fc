"""tools/process_cpu.py: which process is which, and the cores a group used."""

import subprocess
import sys

from tools import process_cpu


def test_stubs_are_grouped_by_model_and_the_rest_by_process():
    stub = "/b/triton_python_backend_stub /tmp/overload-x/model_repository/{}/1/model.py shm 1048576"
    assert process_cpu.group(stub.format("classify_with_view")) == "stub:classify_with_view"
    assert process_cpu.group(stub.format("describe")) == "stub:describe"
    assert process_cpu.group(stub.format("describe_stream")) == "stub:other"
    assert process_cpu.group("/w/build/triton/bin/tritonserver --model-repository m") == "tritonserver"
    assert process_cpu.group("nginx: worker process") == "nginx"
    assert process_cpu.group("/usr/bin/python3 -m pytest") is None


def test_cores_used_sums_a_group_and_counts_a_new_process_from_zero():
    before = {("stub:describe", "1"): 10.0, ("stub:describe", "2"): 5.0, ("nginx", "3"): 1.0}
    after = {("stub:describe", "1"): 11.0, ("stub:describe", "2"): 5.5, ("nginx", "4"): 0.5}
    assert process_cpu.cores_used(before, after, 2.0) == {"nginx": 0.25, "stub:describe": 0.75}


def test_a_busy_process_is_seen_using_a_core():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass",
                             "fake_openai"])
    try:
        before = process_cpu.cpu_seconds()
        subprocess.run(["sleep", "1"], check=True)
        after = process_cpu.cpu_seconds()
        assert process_cpu.cores_used(before, after, 1.0)["fake_openai"] > 0.1  # a core, less a loaded machine's share
    finally:
        busy.kill()
        busy.wait()
