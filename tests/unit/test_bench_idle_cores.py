"""tools/bench/idle_cores.py reads a scheduler trace: how long cores sat idle, and how much of that
while a task waited on another core's queue (docs/benchmarks-method.md#where-the-cpu-goes). The
lines below are in `perf script`'s format for the events `perf sched record` takes; REAL_TRACE is
an excerpt of one (Linux 6.18, perf 6.1, the ensemble under load on 2 cores)."""

import pytest

from tools.bench.idle_cores import idle_while_queued, shares


def switch(cpu, t, prev, prev_pid, state, nxt, next_pid):
    return (f" {prev} {prev_pid} [{cpu:03d}] {t:.6f}: sched:sched_switch: prev_comm={prev} prev_pid={prev_pid} "
            f"prev_prio=120 prev_state={state} ==> next_comm={nxt} next_pid={next_pid} next_prio=120")


def waking(cpu, t, comm, pid, target, event="sched_waking"):
    return f" waker 7 [{cpu:03d}] {t:.6f}: sched:{event}: comm={comm} pid={pid} prio=120 target_cpu={target:03d}"


def migrate(cpu, t, comm, pid, source, dest):
    return (f" waker 7 [{cpu:03d}] {t:.6f}: sched:sched_migrate_task: comm={comm} pid={pid} prio=120 "
            f"orig_cpu={source} dest_cpu={dest}")


def test_a_core_idle_while_a_preempted_stub_waits_on_the_other_core_counts_for_that_stub():
    lines = [
        switch(0, 1.000, "stub a", 11, "S", "swapper/0", 0),        # core 0 idle from 1.000
        switch(1, 1.001, "stub b", 12, "R", "stub c", 13),          # b preempted on core 1: waits there
        switch(1, 1.005, "stub c", 13, "R", "stub b", 12),          # b runs (waited 4 ms), c waits
        switch(0, 1.009, "swapper/0", 0, "R", "stub c", 13),        # core 0 takes c at last
    ]
    figures = idle_while_queued(lines)
    assert figures["cpus"] == 2 and figures["span_s"] == pytest.approx(0.009)
    assert figures["idle_s"] == pytest.approx(0.009)
    # Core 0 idle 1.000-1.009; someone waited on core 1 during 1.001-1.009 (b, then c): 8 ms, not 4 + 4 twice.
    assert figures["idle_while_queued_elsewhere_s"] == pytest.approx(0.008)
    assert figures["longest_idle_while_queued_elsewhere_s"] == pytest.approx(0.008)
    assert figures["by_task"] == {"stub b": pytest.approx(0.004), "stub c": pytest.approx(0.004)}


def test_a_real_trace_excerpt():
    # Core 0 idle 302336-302966 us; on core 1 stub threads and tritonserver threads wake and
    # preempt each other: someone waited there during 131 us of it (worked out by hand).
    figures = idle_while_queued(REAL_TRACE.splitlines())
    assert figures["cpus"] == 2 and figures["idle_s"] == pytest.approx(630e-6)
    assert figures["idle_while_queued_elsewhere_s"] == pytest.approx(131e-6)
    assert figures["longest_idle_while_queued_elsewhere_s"] == pytest.approx(131e-6)  # one idle span
    assert figures["by_task"] == {"triton_python_b": pytest.approx(128e-6), "tritonserver": pytest.approx(66e-6)}
    named = idle_while_queued(REAL_TRACE.splitlines(), cpus=4, names={23123: "classify_with_view_0_1"})
    assert named["cpus"] == 4
    # Thread 23123 waited 302528-544, 594-597, 892-961 and 963-965; 23114, still by its comm, 553-591.
    assert named["by_task"] == {"classify_with_view_0_1": pytest.approx(90e-6), "tritonserver": pytest.approx(66e-6),
                                "triton_python_b": pytest.approx(38e-6)}


def test_a_wake_up_of_a_running_task_or_one_that_then_sleeps_is_no_wait():
    lines = [
        switch(1, 4.000, "stub b", 12, "S", "stub c", 13),          # c runs on core 1
        switch(0, 4.001, "stub a", 11, "S", "swapper/0", 0),        # core 0 idle from 4.001
        waking(1, 4.002, "stub c", 13, 1),                          # c is running: no wait
        waking(1, 4.003, "tritonserver", 20, 1),                    # running on core 2 since before the trace
        switch(2, 4.004, "tritonserver", 20, "S", "stub e", 15),    # ... it goes to sleep: that wake is spent
        switch(2, 4.005, "stub e", 15, "R+", "stub d", 14),         # e preempted (R+): waits on core 2
        switch(0, 4.007, "swapper/0", 0, "R", "stub a", 11),        # c still running on core 1
    ]
    figures = idle_while_queued(lines)
    assert figures["idle_s"] == pytest.approx(0.006)
    assert figures["idle_while_queued_elsewhere_s"] == pytest.approx(0.002)  # e, 4.005-4.007
    assert figures["by_task"] == {"stub e": pytest.approx(0.002)}


def test_a_task_waiting_on_the_idle_cores_own_queue_is_not_counted():
    lines = [
        switch(0, 2.000, "stub a", 11, "S", "swapper/0", 0),
        waking(1, 2.001, "tritonserver", 20, 0),                    # woken onto core 0, the idle one
        switch(0, 2.002, "swapper/0", 0, "R", "tritonserver", 20),
        switch(1, 2.003, "stub b", 12, "S", "stub c", 13),
    ]
    figures = idle_while_queued(lines)
    assert figures["idle_s"] == pytest.approx(0.002)
    assert figures["idle_while_queued_elsewhere_s"] == 0 and figures["by_task"] == {}


def test_a_wakeup_then_a_migration_moves_the_wait_to_the_new_queue():
    lines = [
        switch(1, 3.000, "stub b", 12, "R", "stub c", 13),
        waking(1, 3.001, "tritonserver", 20, 1, event="sched_wakeup"),                   # waits on core 1 from 3.001
        switch(0, 3.002, "stub a", 11, "S", "swapper/0", 0),       # core 0 idle from 3.002
        migrate(0, 3.004, "tritonserver", 20, 1, 0),                # pulled to core 0's queue at 3.004
        switch(0, 3.005, "swapper/0", 0, "R", "tritonserver", 20),
    ]
    figures = idle_while_queued(lines)
    assert figures["idle_s"] == pytest.approx(0.003)
    # Core 0 idle 3.002-3.005: b waited on core 1 throughout (preempted at 3.000), tritonserver 3.002-3.004.
    assert figures["idle_while_queued_elsewhere_s"] == pytest.approx(0.003)
    assert figures["by_task"]["tritonserver"] == pytest.approx(0.002)
    assert figures["by_task"]["stub b"] == pytest.approx(0.003)


def test_no_events_no_figures_and_the_machines_idle_and_steal_shares():
    assert idle_while_queued(["not an event", ""])["span_s"] == 0
    # tools.process_cpu.machine_seconds() snapshots: 10 s of the machine, 2 idle, 1 stolen
    split = shares({"idle": 5.0, "steal": 1.0, "all": 50.0}, {"idle": 7.0, "steal": 2.0, "all": 60.0})
    assert split == {"idle": 0.2, "steal": 0.1}


REAL_TRACE = """\
 triton_python_b 22977 [000] 47439.302336:       sched:sched_switch: prev_comm=triton_python_b prev_pid=22977 prev_prio=120 prev_state=S ==> next_comm=swapper/0 next_pid=0 next_prio=120
 triton_python_b 23114 [001] 47439.302528:       sched:sched_waking: comm=triton_python_b pid=23123 prio=120 target_cpu=001
 triton_python_b 23114 [001] 47439.302544:       sched:sched_switch: prev_comm=triton_python_b prev_pid=23114 prev_prio=120 prev_state=S ==> next_comm=triton_python_b next_pid=23123 next_prio=120
 triton_python_b 23123 [001] 47439.302549:       sched:sched_switch: prev_comm=triton_python_b prev_pid=23123 prev_prio=120 prev_state=S ==> next_comm=tritonserver next_pid=23165 next_prio=120
    tritonserver 23165 [001] 47439.302553:       sched:sched_waking: comm=triton_python_b pid=23114 prio=120 target_cpu=001
    tritonserver 23165 [001] 47439.302591:       sched:sched_switch: prev_comm=tritonserver prev_pid=23165 prev_prio=120 prev_state=S ==> next_comm=triton_python_b next_pid=23114 next_prio=120
 triton_python_b 23114 [001] 47439.302594:       sched:sched_waking: comm=triton_python_b pid=23123 prio=120 target_cpu=001
 triton_python_b 23114 [001] 47439.302597:       sched:sched_switch: prev_comm=triton_python_b prev_pid=23114 prev_prio=120 prev_state=S ==> next_comm=triton_python_b next_pid=23123 next_prio=120
 triton_python_b 23123 [001] 47439.302890:       sched:sched_waking: comm=tritonserver pid=23111 prio=120 target_cpu=001
 triton_python_b 23123 [001] 47439.302892:       sched:sched_switch: prev_comm=triton_python_b prev_pid=23123 prev_prio=120 prev_state=R ==> next_comm=tritonserver next_pid=23111 next_prio=120
    tritonserver 23111 [001] 47439.302896:       sched:sched_waking: comm=tritonserver pid=23156 prio=120 target_cpu=001
    tritonserver 23111 [001] 47439.302897:       sched:sched_switch: prev_comm=tritonserver prev_pid=23111 prev_prio=120 prev_state=R ==> next_comm=tritonserver next_pid=23156 next_prio=120
    tritonserver 23156 [001] 47439.302949:       sched:sched_waking: comm=tritonserver pid=23352 prio=120 target_cpu=000
    tritonserver 23156 [001] 47439.302959:       sched:sched_switch: prev_comm=tritonserver prev_pid=23156 prev_prio=120 prev_state=S ==> next_comm=tritonserver next_pid=23111 next_prio=120
    tritonserver 23111 [001] 47439.302961:       sched:sched_switch: prev_comm=tritonserver prev_pid=23111 prev_prio=120 prev_state=S ==> next_comm=triton_python_b next_pid=23123 next_prio=120
 triton_python_b 23123 [001] 47439.302962:       sched:sched_waking: comm=tritonserver pid=23156 prio=120 target_cpu=001
 triton_python_b 23123 [001] 47439.302963:       sched:sched_switch: prev_comm=triton_python_b prev_pid=23123 prev_prio=120 prev_state=R ==> next_comm=tritonserver next_pid=23156 next_prio=120
    tritonserver 23156 [001] 47439.302965:       sched:sched_switch: prev_comm=tritonserver prev_pid=23156 prev_prio=120 prev_state=S ==> next_comm=triton_python_b next_pid=23123 next_prio=120
         swapper     0 [000] 47439.302966:       sched:sched_switch: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=tritonserver next_pid=23352 next_prio=120
"""  # noqa: E501 (perf's lines as they are)
