"""tools/process_cpu.py: which process is which, and the cores a group used."""

import contextlib
import subprocess
import sys

from serving import procfs
from tools import process_cpu

STUB = "/b/backends/python/triton_python_backend_stub"


@contextlib.contextmanager
def running(argv0, *args):
    """The PID of a real process whose command line is argv0 `-c` <script> args: a
    shell that waits on its stdin until the test is done with it."""
    process = subprocess.Popen([argv0, "-c", "echo up; read line", *args], executable="/bin/sh",
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        # Popen may return while the exec is under way (vfork), before the new command line is in /proc.
        assert process.stdout.readline() == b"up\n"
        yield process.pid
    finally:
        process.stdin.close()
        process.stdout.close()
        process.wait()


def stub_of(instance):
    """A stub's command line as tritonserver starts it: the instance its argv[8]."""
    model_py = "/tmp/overload-x/model_repository/describe/1/model.py"  # a path names no model: the instance does
    return running(STUB, model_py, "shm", "1048576", "1048576", "1", instance)


def test_stubs_are_grouped_by_the_model_of_their_instance():
    for instance, name in (("describe_stream_0_0", "stub:describe_stream"),
                           ("classify_with_view_0_3", "stub:classify_with_view"),
                           ("a_brought_model_2_1_0", "stub:a_brought_model_2")):
        with stub_of(instance) as pid:
            assert procfs.stub_instance(pid) == instance  # the command line stands for a stub's
            assert process_cpu.group(pid) == name
    with stub_of("describe_stream") as pid:  # named after the model alone: a config check during a load
        assert process_cpu.group(pid) == "stub:other"


def test_the_rest_by_process_and_an_ended_one_by_none():
    for argv0, args, name in (("/w/build/triton/bin/tritonserver", ("--model-repository", "m"), "tritonserver"),
                              ("nginx: worker process", (), "nginx"),
                              ("/usr/bin/python3", ("-m", "pytest"), None)):
        with running(argv0, *args) as pid:
            assert process_cpu.group(pid) == name
    with running("/w/build/triton/bin/tritonserver") as pid:
        pass
    assert process_cpu.group(pid) is None


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


def test_a_window_counts_what_its_counters_grew_by_within_it_and_skips_an_unreadable_read():
    reads = iter([{"answered": 5.0, "gone": 1.0}, {"answered": 12.0, "new": 3.0}])
    counted = process_cpu.Window(0.0, 0.05, counters=lambda: next(reads)).start().result()["counted"]
    assert counted == {"answered": 7.0}  # only what both ends could read

    def unreadable():
        raise OSError("the server is not answering its metrics")

    assert process_cpu.Window(0.0, 0.05, counters=unreadable).start().result()["counted"] == {}
    assert "counted" not in process_cpu.Window(0.0, 0.05).start().result()
