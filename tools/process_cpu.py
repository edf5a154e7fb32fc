"""CPU by serving process while a load runs (docs/reliability.md#overload).

Samples /proc every `--interval-s` for `--seconds` and prints one JSON line per
interval: the cores each group of processes used in it (user + system time of
/proc/<pid>/stat), summed over the group's processes:

  stub:<model>     each model's Python stubs (classify_with_view, describe, ...),
                   named by the instance each serves (serving/procfs.py)
  tritonserver     the server itself (HTTP/gRPC frontends, ensemble, queues)
  openai_front, nginx, fake_openai, overload_client, overload_users: the rest of a
                   `make overload` stack and its load generators

The kernel's own time (loopback networking in softirq) belongs to no process:
2 cores minus the groups' sum is that plus idle.

  .venv/bin/python -m tools.process_cpu --seconds 150 [--interval-s 5] > cpu.jsonl
"""

import argparse
import json
import os
import threading
import time

from serving import procfs

PROCESSES = ("tritonserver", "openai_front", "nginx", "fake_openai", "overload_client", "overload_users")


def group(pid):
    """The group process pid belongs to, or None (also once it has ended)."""
    instance = procfs.stub_instance(pid)
    if instance is not None:
        return f"stub:{procfs.model_of(instance)}"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if procfs.STUB_NAME in cmdline:
        return "stub:other"  # a stub serving no instance: a model's config check during a load
    return next((name for name in PROCESSES if name in cmdline), None)


def cpu_seconds():
    """{(group, pid): CPU seconds so far} of every process in a group."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        name = group(pid)
        seconds = None if name is None else procfs.cpu_seconds(pid)
        if seconds is not None:  # None: it ended since it was listed
            found[(name, pid)] = seconds
    return found


def cores_used(before, after, seconds):
    """{group: cores used} between two cpu_seconds() snapshots `seconds` apart; a
    process that started in between counts from 0, one that ended is not counted."""
    used = {}
    for key, value in after.items():
        used[key[0]] = used.get(key[0], 0.0) + (value - before.get(key, 0.0)) / seconds
    return {name: round(cores, 3) for name, cores in sorted(used.items())}


def machine_seconds():
    """{"idle", "steal", "all"}: the machine's CPU seconds so far, all cores (/proc/stat's
    first line; idle includes iowait, steal is time the hypervisor gave to other guests)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {"idle": (idle + iowait) / hz, "steal": steal / hz,
            "all": (user + nice + system + idle + iowait + irq + softirq + steal) / hz}


SERVER_GROUPS = ("tritonserver", "openai_front", "nginx")  # and every stub:<model>
GENERATOR_GROUPS = ("overload_client", "overload_users")


class Window:
    """The cores each group used within one window of a load, from `start_after_s` after
    start() for `seconds`, sampled by a thread of its own so that a load run as one
    subprocess (its warm-up and its measured window) is split where the window begins.

    result(): {"cores": {group: cores}, "server_cores", "generator_cores", "idle_cores",
    "steal_cores"} (server: tritonserver, its stubs, the front, nginx; generator: the load
    generators), or None if the load ended before the window did. With `counters` (a
    callable: {name: count so far}) also "counted": how much each grew within the same
    window (a counter it cannot read then is left out)."""

    def __init__(self, start_after_s, seconds, counters=None):
        self.start_after_s, self.seconds = start_after_s, seconds
        self.counters = counters
        self.figures = None
        self.thread = threading.Thread(target=self._sample, name="cpu-window", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def _sample(self):
        time.sleep(self.start_after_s)
        counted_before = self._count()
        before, machine_before, at = cpu_seconds(), machine_seconds(), time.monotonic()
        time.sleep(self.seconds)
        after, machine_after, now = cpu_seconds(), machine_seconds(), time.monotonic()
        figures = window_figures(before, after, machine_before, machine_after, now - at)
        if self.counters is not None:
            counted_after = self._count()
            figures["counted"] = {name: counted_after[name] - counted_before[name]
                                  for name in counted_after if name in counted_before}
        self.figures = figures

    def _count(self):
        """The counters now; {} when there are none or they cannot be read (a scrape
        lost under load is a gap in the figures, not a failure of the load)."""
        if self.counters is None:
            return {}
        try:
            return self.counters()
        except OSError:
            return {}

    def result(self, timeout_s=5.0):
        self.thread.join(timeout_s)
        return self.figures


def window_figures(before, after, machine_before, machine_after, seconds):
    cores = cores_used(before, after, seconds)
    machine = {key: (machine_after[key] - machine_before[key]) / seconds for key in machine_before}
    return {"cores": cores,
            "server_cores": round(sum(v for k, v in cores.items() if k in SERVER_GROUPS or k.startswith("stub:")), 3),
            "generator_cores": round(sum(v for k, v in cores.items() if k in GENERATOR_GROUPS), 3),
            "idle_cores": round(machine["idle"], 3), "steal_cores": round(machine["steal"], 3),
            "machine_cores": round(machine["all"], 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, required=True, help="how long to sample (it stops by itself)")
    parser.add_argument("--interval-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    before, at = cpu_seconds(), started
    while at - started < args.seconds:
        time.sleep(args.interval_s)
        after, now = cpu_seconds(), time.monotonic()
        print(json.dumps({"t_s": round(now - started, 1), **cores_used(before, after, now - at)}), flush=True)
        before, at = after, now


if __name__ == "__main__":
    main()
