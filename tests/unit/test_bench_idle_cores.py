"""tools/bench/idle_cores.py reads a scheduler trace: how long cores sat idle, and how much of that
while a task waited on another core's queue (docs/benchmarks-method.md#where-the-cpu-goes). The
lines below are in `perf script`'s format for the events `perf sched record` takes."""

import pytest

from tools.bench.idle_cores import idle_while_queued, shares


def switch(cpu, t, prev, prev_pid, state, nxt, next_pid):
    return (f" {prev} {prev_pid} [{cpu:03d}] {t:.6f}: sched:sched_switch: prev_comm={prev} prev_pid={prev_pid} "
            f"prev_prio=120 prev_state={state} ==> next_comm={nxt} next_pid={next_pid} next_prio=120")


def wakeup(cpu, t, comm, pid, target):
    return f" waker 7 [{cpu:03d}] {t:.6f}: sched:sched_wakeup: comm={comm} pid={pid} prio=120 target_cpu={target:03d}"


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
    assert figures["by_task"] == {"stub b": pytest.approx(0.004), "stub c": pytest.approx(0.004)}


def test_a_task_waiting_on_the_idle_cores_own_queue_is_not_counted():
    lines = [
        switch(0, 2.000, "stub a", 11, "S", "swapper/0", 0),
        wakeup(1, 2.001, "tritonserver", 20, 0),                    # woken onto core 0, the idle one
        switch(0, 2.002, "swapper/0", 0, "R", "tritonserver", 20),
        switch(1, 2.003, "stub b", 12, "S", "stub c", 13),
    ]
    figures = idle_while_queued(lines)
    assert figures["idle_s"] == pytest.approx(0.002)
    assert figures["idle_while_queued_elsewhere_s"] == 0 and figures["by_task"] == {}


def test_a_wakeup_then_a_migration_moves_the_wait_to_the_new_queue():
    lines = [
        switch(1, 3.000, "stub b", 12, "R", "stub c", 13),
        wakeup(1, 3.001, "tritonserver", 20, 1),                   # waits on core 1 from 3.001
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


def test_no_events_no_figures_and_proc_stat_shares_sum_to_one():
    assert idle_while_queued(["not an event", ""])["span_s"] == 0
    split = shares([0, 0, 0, 0, 0, 0, 0, 0], [6, 0, 1, 2, 0, 0, 0, 1])
    assert split["user"] == 0.6 and split["idle"] == 0.2 and split["steal"] == 0.1
    assert sum(split.values()) == pytest.approx(1.0)
