"""Processes a benchmark run needs, each on free loopback ports and stopped by
its PID: the fake OpenAI-compatible upstream (tools/fake_openai) and a
tritonserver started by scripts/serve.sh on a temp copy of model_repository/.
Plus perf_analyzer runs (bounded in time) and Triton's statistics API."""

import csv
import os
import pathlib
import resource
import subprocess
import time

from serving.procfs import children, http_json, model_of, stub_instance, tritonserver_pid
from serving.procfs import cpu_seconds as process_cpu_seconds
from tools.local_stack import FakeLLM as _FakeLLM
from tools.local_stack import NotReady, TritonServer, free_port, log_tail

REPO = pathlib.Path(__file__).resolve().parents[2]

PERF_ANALYZER = REPO / "build/perf_analyzer/bin/perf_analyzer"
BENCH_API_KEY = "sk-bench-not-a-real-key"


class FakeLLM(_FakeLLM):
    """tools/fake_openai as its own process; its latency is changed through its admin API."""

    def __init__(self, workdir, latency_ms=0.0):
        super().__init__(pathlib.Path(workdir) / "fake_llm.log", latency_ms)

    def reset(self):
        """Back to how it started: answers at once and whole, no fault, stats cleared."""
        self.admin("reset", {}, timeout=30)

    def set_latency(self, latency_ms):
        self.admin("mode", {"mode": "ok", "latency_ms": latency_ms}, timeout=30)

    def stats(self):
        return self.admin("stats", timeout=30)


# After a model's reload, Triton 2.51 still unloads the old versions (Triton.load).
RELOAD_SETTLE_S = 3.0


class Triton(TritonServer):
    """scripts/serve.sh on a temp copy of model_repository/ (so configs can be swapped)."""

    def __init__(self, workdir, llm_base_url, extra_env=None, ready_timeout_s=300):
        workdir = pathlib.Path(workdir)
        env = {"LLM_BASE_URL": llm_base_url, "LLM_API_KEY": BENCH_API_KEY, **(extra_env or {}),
               # the key comes from LLM_API_KEY only
               "LLM_API_KEY_FILE": None}
        super().__init__(workdir, env)
        started = time.monotonic()
        deadline = started + ready_timeout_s
        # A free port can be taken by another process between our probe and the
        # server's bind (other test servers start on this machine too): one
        # retry on new ports when it exited early, none when it timed out.
        for attempt in range(2):
            try:
                self.start(timeout_s=deadline - time.monotonic(),
                           log_path=workdir / f"tritonserver_{self.http_port}.log")
                break
            except NotReady:
                if attempt == 1 or time.monotonic() > deadline:
                    raise
                self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
                self.openai_port = free_port()
        self.startup_s = time.monotonic() - started

    def stats(self):
        """{model: {count, exec_count, queue_ms, compute_ms (input+infer+output) summed}}."""
        out = {}
        for entry in http_json(f"http://{self.http_url}/v2/models/stats", timeout=30)["model_stats"]:
            inference = entry["inference_stats"]
            out[entry["name"]] = {
                "count": inference["success"]["count"],
                "exec_count": entry.get("execution_count", 0),
                "inference_count": entry.get("inference_count", 0),
                "queue_ms": inference["queue"]["ns"] / 1e6,
                "compute_ms": sum(inference[k]["ns"] for k in
                                  ("compute_input", "compute_infer", "compute_output")) / 1e6,
                "request_ms": inference["success"]["ns"] / 1e6,
            }
        return out

    def load(self, model):
        """(Re)load a model from the temp repository (after its config.pbtxt changed);
        the repository API needs this server's admin key."""
        http_json(f"http://{self.http_url}/v2/repository/models/{model}/load", {}, timeout=300,
                  headers=self.admin_headers)
        # The call returns once the model and the ensembles that use it are loaded again, but
        # Triton 2.51 unloads their old versions after it (about 1 s for a change of instance
        # count); a perf_analyzer started then fails "failed to find the requested model version".
        time.sleep(RELOAD_SETTLE_S)


def stats_delta(before, after):
    delta = {}
    for name, now in after.items():
        then = before.get(name, {})
        delta[name] = {key: now[key] - then.get(key, 0) for key in now}
    return delta


def perf_analyzer(model, url, input_data, concurrency, workdir, protocol="http",
                  window_ms=3000, trials=3, batch_size=1, timeout_s=None):
    """One perf_analyzer measurement at one concurrency, bounded in time.

    Stability is not required (-s 1000): on a shared 2-core machine the load from
    other processes varies more than perf_analyzer's default 10 %, and a run that
    never stabilises would measure nothing. (A window in which at most one
    request finished still counts as unstable; that run is repeated with longer
    windows.) The figure is the last of `trials`
    windows (the first ones warm up), as perf_analyzer reports it.
    Returns a dict with throughput (infer/s) and latencies (ms), or raises."""
    workdir = pathlib.Path(workdir)
    tag = f"{model}_{protocol}_c{concurrency}_b{batch_size}_{time.monotonic_ns()}"
    csv_path = workdir / f"pa_{tag}.csv"
    log_path = workdir / f"pa_{tag}.log"
    command = [str(PERF_ANALYZER), "-m", model, "-u", url, "-i", protocol,
               "--input-data", str(input_data), "-b", str(batch_size),
               "--concurrency-range", str(concurrency),
               "--measurement-mode", "time_windows", "--measurement-interval", str(window_ms),
               "-s", "1000", "-r", str(trials), "--percentile", "50",
               "--max-threads", str(max(16, concurrency)), "-f", str(csv_path)]
    if concurrency > 16:
        command.append("--async")
    if timeout_s is None:
        timeout_s = 60 + (trials + 2) * window_ms / 1000 * 6
    run_until_windows_hold(command, log_path, timeout_s)
    with open(csv_path) as handle:
        row = next(csv.DictReader(handle))
    us = lambda key: float(row[key]) / 1000.0  # noqa: E731
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": us("p50 latency"), "p90_ms": us("p90 latency"), "p99_ms": us("p99 latency"),
        "server_queue_ms": us("Server Queue"),
        "server_compute_ms": us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output"),
        "command": "perf_analyzer " + " ".join(_display(a) for a in command[1:]),
    }


def run_until_windows_hold(command, log_path, timeout_s, attempts=3):
    """Run a perf_analyzer `command` (time windows) to its end, its output in log_path.
    Windows too short for the load (a loaded machine, an oversubscribed tuning variant,
    a slow LLM, a stream that lasts a second): no request finished in one, or only one did,
    and perf_analyzer calls that unstable whatever -s says (one sample has no standard
    deviation): run again with windows twice as long. Any other failure raises at once.
    `command` keeps the windows of the run that held."""
    for attempt in range(attempts):
        with open(log_path, "w") as log:
            try:
                subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=True)
                return
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"perf_analyzer ran past {timeout_s:.0f}s: {' '.join(command)}\n"
                                   f"{log_tail(log_path, 40)}") from None
            except subprocess.CalledProcessError as exc:
                if attempt < attempts - 1 and _window_too_short(pathlib.Path(log_path).read_text(errors="replace")):
                    index = command.index("--measurement-interval") + 1
                    command[index] = str(int(command[index]) * 2)
                    continue
                raise RuntimeError(f"perf_analyzer failed ({exc.returncode}): {' '.join(command)}\n"
                                   f"{log_tail(log_path, 40)}") from None


def _window_too_short(log_text):
    return "No valid requests recorded" in log_text or "Failed to obtain stable measurement" in log_text


def _display(arg):
    """Command lines in the report name paths relative to the run's work dir."""
    text = str(arg)
    if text.startswith("/"):
        return pathlib.Path(text).name
    return text


def cpu_seconds(server_root_pid, llm_pid):
    """CPU seconds used so far, by where they were spent: the whole machine
    (/proc/stat, every process on it), this process (the Python load
    generator), tritonserver itself, each model's Python stubs summed over
    its instances, and the fake upstream. Differences of two of these around
    a run, divided by its requests, say what one request costs where."""
    tick = os.sysconf("SC_CLK_TCK")

    def process(pid):
        return process_cpu_seconds(pid) or 0.0  # a process gone (a stub restarted) counts nothing

    with open("/proc/stat") as f:
        jiffies = [int(v) for v in f.readline().split()[1:]]
    spent = {"machine": (sum(jiffies) - jiffies[3] - jiffies[4]) / tick,  # all but idle and iowait
             "load generator": time.process_time(), "fake upstream": process(llm_pid)}
    server = tritonserver_pid(server_root_pid)
    if server is not None:
        spent["tritonserver"] = process(server)
        for pid in children(server):
            instance = stub_instance(pid)
            if instance is not None:
                name = f"{model_of(instance)} stubs"
                spent[name] = spent.get(name, 0.0) + process(pid)
    return spent


def children_cpu_seconds():
    """CPU seconds of this process's finished children (perf_analyzer runs), user + system."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3
