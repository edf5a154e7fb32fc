"""serving/procfs.py: a process's CPU seconds read from /proc."""

import os
import pathlib
import subprocess
import time

import pytest

from serving import procfs

pytestmark = pytest.mark.skipif(not pathlib.Path(f"/proc/{os.getpid()}/stat").exists(), reason="no /proc")


def test_cpu_seconds_of_a_process_grow_as_it_works():
    before = procfs.cpu_seconds(os.getpid())
    for _ in range(10_000):  # bounded: a clock tick (10 ms) of work is far less than this allows
        sum(range(100_000))
        if procfs.cpu_seconds(os.getpid()) > before:
            break
    after = procfs.cpu_seconds(os.getpid())
    assert after > before
    assert after <= time.process_time() + 0.1  # this process's own user + system time, to a tick or so


def test_a_zombie_still_reads_and_a_reaped_process_is_none():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30  # generous: only a machine too loaded to run `true` waits long
    while procfs.process_state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert procfs.process_state(child.pid) == "Z"
    assert procfs.cpu_seconds(child.pid) >= 0.0  # exited, not reaped: the callers still read its time
    child.wait()
    assert procfs.cpu_seconds(child.pid) is None
