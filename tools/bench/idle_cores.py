"""Why a saturated server leaves cores idle: /proc/stat's idle share under load beside the in-process
loop's, and a scheduler trace that says what was waiting while a core sat idle
(docs/benchmarks-method.md#where-the-cpu-goes).

Per model, in turns: perf_analyzer at --concurrency on one server (the fake LLM answering at once),
then the in-process limit's loop (2 processes x 1 thread on 2 cores: tools/bench/inprocess.py, batch 1),
each with the machine's idle and steal shares from /proc/stat over its run. Then one `perf sched
record` of --trace-s seconds under the same load, read back by `idle_while_queued`: every span a core
sat idle while some task was runnable on another core's queue (woken there, or preempted, and not
yet running), by that task (a stub by its model instance, as classify_with_view_0_2). A task left
waiting beside a busy core while another core idles is a task the kernel's load balancer did not
move; the trace shows that it waited, not why (docs/benchmarks-method.md#where-the-cpu-goes).

    python -m tools.bench.idle_cores [--models classify,classify_and_describe] [--concurrency 8]
        [--turns 3] [--seconds 9] [--trace-s 3] [--env KEY=VALUE ...] [--results FILE]

The trace needs `perf` and permission to trace scheduler events (root, or perf_event_paranoid -1);
without them the figures from /proc/stat stand alone.
"""

import argparse
import collections
import contextlib
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from serving.procfs import stub_instance
from tools import host
from tools.bench import harness, inprocess, inputs
from tools.process_cpu import machine_seconds

IDLE_PID = 0  # the swapper: a core switched to pid 0 is idle
LOAD_START_MS = 2000  # perf_analyzer's start and first requests, left out of the trace

# `perf script`'s default lines for sched events: "<comm> <pid> [<cpu>] <seconds>: sched:<event>: <fields>".
# A comm may hold spaces, so each field is matched by what follows it.
EVENT = re.compile(r"^\s*.+?\s+\d+\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
# sched_waking where the kernel has it (perf sched record takes it then, not sched_wakeup).
WAKE_EVENTS = ("sched_waking", "sched_wakeup", "sched_wakeup_new")
WAKEUP = re.compile(r"comm=(.*) pid=(\d+) prio=-?\d+ target_cpu=(\d+)")
MIGRATE = re.compile(r"comm=(.*) pid=(\d+) prio=-?\d+ orig_cpu=(\d+) dest_cpu=(\d+)")
SWITCH = re.compile(r"prev_comm=(.*) prev_pid=(\d+) prev_prio=-?\d+ prev_state=(\S+) ==> "
                    r"next_comm=(.*) next_pid=(\d+) next_prio=-?\d+")


def log(message):
    print(f"idle_cores: {message}", file=sys.stderr, flush=True)


def shares(before, after):
    """{"idle", "steal"}: their shares of the machine's CPU time between two
    tools.process_cpu.machine_seconds() snapshots (idle with iowait)."""
    total = (after["all"] - before["all"]) or 1
    return {key: round((after[key] - before[key]) / total, 4) for key in ("idle", "steal")}


def _merged_length(spans):
    """Total length of the union of (start, end) spans."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def idle_while_queued(lines, cpus=None, names=None):
    """`perf script` lines of sched_switch, sched_waking (or sched_wakeup), sched_wakeup_new and
    sched_migrate_task events -> {"span_s", "cpus", "idle_s", "idle_while_queued_elsewhere_s",
    "longest_idle_while_queued_elsewhere_s", "by_task": {name: s}}: how long the cores sat idle, and how
    much of it while a task waited on another core's queue (in all, the most within one idle span, and
    by the waiting task; one span can count for several tasks).
    cpus: the machine's cores (default: those in the events); names: {tid: name} (default: the comm
    in the events). A core's time before its first switch is not counted: its state is unknown. A
    wake-up that races with its task's own switch-out (the task switches out asleep after it, then runs
    without another) is not counted either: a few microseconds in a 3 s trace of this server."""
    queued = {}  # tid -> (since, cpu, name): runnable, not running
    queued_spans = []  # (start, end, cpu, name)
    running = {}  # cpu -> tid
    idle_since, idle_spans = {}, []  # cpu -> since; (start, end, cpu)
    first = last = None
    seen = set()
    name_of = (lambda tid, comm: names.get(tid, comm)) if names else (lambda tid, comm: comm)
    for line in lines:
        event = EVENT.match(line)
        if not event:
            continue
        cpu, now, kind, fields = int(event[1]), float(event[2]), event[3], event[4]
        first, last = first if first is not None else now, now
        seen.add(cpu)
        if kind in WAKE_EVENTS and (wakeup := WAKEUP.search(fields)):
            tid = int(wakeup[2])
            # A wake-up of a task that is running or already waiting changes nothing. sched_waking
            # names the task's last core; a sched_migrate_task follows when the kernel picks another.
            if tid not in running.values():
                queued.setdefault(tid, (now, int(wakeup[3]), name_of(tid, wakeup[1])))
        elif kind == "sched_migrate_task" and (move := MIGRATE.search(fields)):
            tid = int(move[2])
            if tid in queued:  # a waiting task moved: its wait goes on on the other queue
                since, source, name = queued[tid]
                queued_spans.append((since, now, source, name))
                queued[tid] = (now, int(move[4]), name)
        elif kind == "sched_switch" and (switch := SWITCH.search(fields)):
            previous, following = int(switch[2]), int(switch[5])
            running[cpu] = following
            if previous == IDLE_PID and cpu in idle_since:
                idle_spans.append((idle_since.pop(cpu), now, cpu))
            if following == IDLE_PID:
                idle_since[cpu] = now
            if previous != IDLE_PID:
                if switch[3].startswith("R"):  # preempted (R, R+): still runnable, on this core
                    queued[previous] = (now, cpu, name_of(previous, switch[1]))
                else:  # asleep (S, D, I...): a wake-up it had pending is spent
                    queued.pop(previous, None)
            if following in queued:
                since, source, name = queued.pop(following)
                queued_spans.append((since, now, source, name))
    if first is None:
        return {"span_s": 0.0, "cpus": cpus or 0, "idle_s": 0.0, "idle_while_queued_elsewhere_s": 0.0,
                "longest_idle_while_queued_elsewhere_s": 0.0, "by_task": {}}
    idle_spans += [(since, last, cpu) for cpu, since in idle_since.items()]
    queued_spans += [(since, last, cpu, name) for since, cpu, name in queued.values()]
    overlap_all, longest, overlap_by = 0.0, 0.0, collections.Counter()
    for start, end, cpu in idle_spans:
        elsewhere = [(max(start, s), min(end, e), name) for s, e, c, name in queued_spans
                     if c != cpu and s < end and e > start]
        overlap = _merged_length([(s, e) for s, e, _ in elsewhere])
        overlap_all, longest = overlap_all + overlap, max(longest, overlap)
        for name in {name for _, _, name in elsewhere}:
            overlap_by[name] += _merged_length([(s, e) for s, e, n in elsewhere if n == name])
    return {"span_s": round(last - first, 6), "cpus": cpus or len(seen),
            "idle_s": round(sum(end - start for start, end, _ in idle_spans), 6),
            "idle_while_queued_elsewhere_s": round(overlap_all, 6),
            "longest_idle_while_queued_elsewhere_s": round(longest, 6),
            "by_task": {name: round(seconds, 6) for name, seconds in overlap_by.most_common()}}


def task_names():
    """{tid: name} of every thread on the machine now: a Python backend stub's threads by the model
    instance it serves, others by their process's name. perf's comm is per thread and cut to 15
    characters ("triton_python_b")."""
    names = {}
    for process in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            name = stub_instance(int(process.name)) or (process / "comm").read_text().strip()
            for task in (process / "task").iterdir():
                names[int(task.name)] = name
        except (OSError, ValueError):  # gone meanwhile
            continue
    return names


def traced(server, model, input_data, concurrency, trace_s, workdir):
    """A scheduler trace of the whole machine for `trace_s` under perf_analyzer's load, read by
    idle_while_queued; None when perf is missing, may not trace or recorded nothing (the reason
    logged)."""
    if not shutil.which("perf"):
        log("no perf on PATH: no scheduler trace")
        return None
    names = task_names()  # the server's threads are all there once it has answered
    data = pathlib.Path(workdir) / f"sched_{model}.data"
    # -D: start recording once perf_analyzer, started right after, is past its start.
    record = subprocess.Popen(["perf", "sched", "record", "-D", str(LOAD_START_MS), "-o", str(data), "--", "sleep",
                               str(trace_s + LOAD_START_MS / 1000)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    harness.perf_analyzer(model, server.http_url, input_data, concurrency, workdir,
                          window_ms=int((trace_s * 1000 + LOAD_START_MS) / 2), trials=3)
    _, errors = record.communicate()
    script = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True) \
        if record.returncode == 0 else subprocess.CompletedProcess(record.args, record.returncode, "", errors)
    if script.returncode != 0:
        log(f"perf sched failed ({script.stderr.strip()[-300:]}): no scheduler trace")
        return None
    lines = script.stdout.splitlines()
    figures = idle_while_queued(lines, cpus=os.cpu_count(), names=names)
    core_s = figures["span_s"] * figures["cpus"]
    if not core_s:
        log("perf sched recorded no scheduler events: no scheduler trace")
        return None
    figures["idle_share"] = round(figures["idle_s"] / core_s, 4)
    figures["idle_while_queued_elsewhere_share"] = round(figures["idle_while_queued_elsewhere_s"] / core_s, 4)
    figures["events"] = dict(collections.Counter(match[3] for match in map(EVENT.match, lines) if match))
    figures["perf"] = subprocess.run(["perf", "--version"], capture_output=True, text=True).stdout.strip()
    return figures


def served_turn(server, model, input_data, concurrency, seconds, workdir):
    before = machine_seconds()
    result = harness.perf_analyzer(model, server.http_url, input_data, concurrency, workdir,
                                   window_ms=int(seconds * 1000 / 3), trials=3)
    return {"per_s": result["throughput"], "p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"],
            **shares(before, machine_seconds())}


def inprocess_turn(repository, jpeg_paths, seconds):
    before = machine_seconds()
    row = inprocess.measure_layout(inprocess.served_runtime(repository), repository, jpeg_paths, 2, 1, [1], seconds,
                                   e2e_only=True)
    return {"per_s": row["e2e"][1], **shares(before, machine_seconds())}


def measure(args, workdir):
    jpegs = inputs.photo_jpegs()
    jpeg_paths = inputs.write_jpegs(workdir, jpegs)
    input_data = inputs.write_input_data(workdir, jpegs)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "host": host.describe(), "settings": {key: value for key, value in vars(args).items()
                                                    if key != "results"}, "models": {}}
    with contextlib.ExitStack() as stack:
        llm = harness.FakeLLM(workdir)
        stack.callback(llm.stop)
        server = harness.Triton(workdir, llm.base_url, extra_env={"LLM_CACHE_ENABLED": "false", **args.env})
        stack.callback(server.stop)
        for model in args.models.split(","):
            harness.perf_analyzer(model, server.http_url, input_data[model], args.concurrency, workdir,
                                  window_ms=1000, trials=3)  # warm-up
            turns = []
            for number in range(args.turns):
                turn = {"served": served_turn(server, model, input_data[model], args.concurrency, args.seconds,
                                              workdir),
                        "inprocess": inprocess_turn(server.repository, jpeg_paths, args.seconds)}
                turn["served_over_inprocess"] = round(turn["served"]["per_s"] / turn["inprocess"]["per_s"], 3)
                turns.append(turn)
                log(f"{model} turn {number + 1}: served {turn['served']['per_s']:.1f}/s idle "
                    f"{turn['served']['idle']:.3f} steal {turn['served']['steal']:.3f}; in-process "
                    f"{turn['inprocess']['per_s']:.1f}/s idle {turn['inprocess']['idle']:.3f}")
            figures = traced(server, model, input_data[model], args.concurrency, args.trace_s, workdir)
            if figures:
                log(f"{model} trace: idle {figures['idle_share']:.3f} of the cores, "
                    f"{figures['idle_while_queued_elsewhere_share']:.3f} while a task waited on another core")
            results["models"][model] = {"turns": turns, "trace": figures}
    return results


def environment_item(text):
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="classify,classify_and_describe")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=9.0, help="each turn's served and in-process runs")
    parser.add_argument("--trace-s", type=float, default=3.0)
    parser.add_argument("--env", action="append", default=[], type=environment_item, metavar="KEY=VALUE",
                        help="the server's environment")
    parser.add_argument("--results", type=pathlib.Path)
    args = parser.parse_args(argv)
    args.env = dict(args.env)
    with tempfile.TemporaryDirectory(prefix="idle-cores-") as workdir:
        results = measure(args, pathlib.Path(workdir))
    text = json.dumps(results, indent=1)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
