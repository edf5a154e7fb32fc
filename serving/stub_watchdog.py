"""Python-backend stub watchdog for one tritonserver (serving/supervise_tritonserver.sh
starts it, natively and in the container).

Why: every instance of a Python-based model runs in its own stub process, a
child of tritonserver. Since 24.06 (this is 2.51 / 24.10) Triton no longer
restarts a stub that dies (OOM killer, a segfault in a native library, a
stray `kill`), and measured here it also does not say so: /v2/health/ready and
/v2/models/<m>/ready stay 200 while every request to that model fails with
`Stub process '<model>_0_0' is not healthy.` A readiness or liveness probe
therefore never fires; the model stays broken until someone reloads it. A
plain `load` is a no-op (nothing changed on disk), so the reload passes the
model's current config as an override, which makes Triton build new instances
and swap them in (about 1.5 s for `preprocess` on 2 cores).

How: every --interval-s it lists tritonserver's children (/proc/<pid>/task/*/
children), remembers which stub serves which model (the instance name is in
the stub's command line: `<model>_<group>_<instance>`), and when a stub it saw
alive is gone or a zombie while no live stub serves that instance any more and
the repository index still says READY, it reloads that model through the
repository API, with header admin-key: the supervisor restricts that API and
passes the key in this process's TRITON_ADMIN_KEY (not in tritonserver's).
A model unloaded on purpose is not READY in the index and is left alone.
When the server has exited it stops (TERM, then KILL) the stubs it last saw
that are still running: measured on 2.51, a stub started after the server
began listening (any reload: a version swap, this watchdog's own reload)
inherits the server's sockets, listening and client connections included; if
it outlives the server, clients on those connections hang instead of seeing
the connection close, and cannot retry. SIGUSR1 (the supervisor sends
it on shutdown) means: the server is stopping, reload nothing from now on.
Linux only (/proc).
"""

import argparse
import http.client
import json
import os
import signal
import sys
import time
import urllib.error

from serving.procfs import children, http_json, instance_index, model_of, process_state, stub_instance

# What a call to the server can raise when it is busy, stopping or restarting
# (an answer cut short is an http.client.HTTPException, not an OSError).
SERVER_ERRORS = (OSError, urllib.error.URLError, http.client.HTTPException, ValueError)


def log(message):
    print(f"watchdog: {message}", file=sys.stderr, flush=True)


class Server:
    def __init__(self, http_url, admin_key=None, timeout_s=60.0):
        self.base = f"http://{http_url}"
        self.headers = {"admin-key": admin_key} if admin_key else {}
        self.timeout_s = timeout_s

    def call(self, path, payload=None, timeout_s=None):
        return http_json(self.base + path, payload, timeout=timeout_s or self.timeout_s, headers=self.headers)

    def ready_models(self):
        return {m["name"] for m in self.call("/v2/repository/index", {}, timeout_s=10) or []
                if m.get("state") == "READY"}

    def instance_counts(self, model):
        """The count of each of the model's instance groups, as it is served now."""
        config = self.call(f"/v2/models/{model}/config", timeout_s=10) or {}
        return [group.get("count", 1) for group in config.get("instance_group") or []]

    def reload(self, model):
        config = self.call(f"/v2/models/{model}/config", timeout_s=10)
        self.call(f"/v2/repository/models/{model}/load", {"parameters": {"config": json.dumps(config)}})


def retained(instance, counts):
    """Whether the served groups `counts` still have the instance `<model>_<group>_<instance>`."""
    group, index = instance_index(instance)
    return group < len(counts) and index < counts[group]


class Watchdog:
    def __init__(self, server_pid, server, interval_s=1.0):
        self.server_pid = server_pid
        self.server = server
        self.interval_s = interval_s
        self.known = {}  # stub pid -> instance name, for stubs seen alive
        self.reloads = 0
        self.stopping = False  # set on SIGUSR1: the server is shutting down

    def poll(self):
        """One look; returns the models it reloaded."""
        alive, dead = {}, []
        for pid in children(self.server_pid):
            state = process_state(pid)
            if state is None or state == "Z":
                continue
            instance = stub_instance(pid)
            if instance is not None:
                alive[pid] = instance
        for pid, instance in list(self.known.items()):
            if pid not in alive:
                del self.known[pid]
                if instance not in alive.values():
                    dead.append((pid, instance))
        self.known.update(alive)
        if not dead or self.stopping:
            return []
        try:
            ready = self.server.ready_models()
        except SERVER_ERRORS as exc:
            log(f"cannot read the repository index ({exc}); will look again")
            for pid, instance in dead:  # look again next time
                self.known[pid] = instance
            return []
        reloaded = []
        for model in sorted({model_of(instance) for _, instance in dead}):
            if model not in ready:
                continue  # unloaded or being reloaded on purpose
            try:
                counts = self.server.instance_counts(model)
            except SERVER_ERRORS:
                counts = None  # the reload below finds out
            # A reload with fewer instances (serving/layout.py's, or an operator's) retires the rest.
            pids = [pid for pid, instance in dead if model_of(instance) == model
                    and (counts is None or retained(instance, counts))]
            if not pids:
                continue
            log(f"stub process(es) {pids} of model '{model}' died; Triton still reports it ready "
                f"but cannot serve it: reloading '{model}'")
            started = time.monotonic()
            try:
                self.server.reload(model)
            except SERVER_ERRORS as exc:
                log(f"reload of '{model}' failed ({exc}); will try again")
                for pid, instance in dead:
                    if model_of(instance) == model:
                        self.known[pid] = instance
                continue
            self.reloads += 1
            reloaded.append(model)
            log(f"model '{model}' reloaded in {time.monotonic() - started:.1f}s")
        return reloaded

    def run(self):
        while process_state(self.server_pid) not in (None, "Z"):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a watchdog that dies watches nothing
                log(f"a look at the server failed ({type(exc).__name__}: {exc}); still watching")
            time.sleep(self.interval_s)
        self.stop_orphans()

    def stop_orphans(self, grace_s=5.0):
        """Stop the stubs the dead server left running (checked by PID and command line)."""
        left = [pid for pid, instance in self.known.items() if stub_instance(pid) == instance
                and process_state(pid) not in (None, "Z")]
        if not left:
            return []
        log(f"tritonserver exited; stopping {len(left)} stub process(es) it left running {left} "
            "(they hold its sockets open)")
        for pid in left:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(process_state(p) not in (None, "Z") for p in left):
            time.sleep(0.1)
        for pid in left:
            if process_state(pid) not in (None, "Z") and stub_instance(pid) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return left


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--http-url", default="127.0.0.1:8000")
    parser.add_argument("--interval-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    server = Server(args.http_url, admin_key=os.environ.get("TRITON_ADMIN_KEY") or None)
    log(f"watching the Python backend stubs of tritonserver pid {args.server_pid} "
        f"every {args.interval_s:g}s")
    watchdog = Watchdog(args.server_pid, server, args.interval_s)

    def stopping(*_):
        watchdog.stopping = True

    # SIGUSR1 (the supervisor on shutdown) and SIGINT (Ctrl-C reaches the whole process
    # group): keep watching until the server is gone, then stop its orphans.
    # SIGTERM ends the watchdog at once.
    signal.signal(signal.SIGUSR1, stopping)
    signal.signal(signal.SIGINT, stopping)
    watchdog.run()


if __name__ == "__main__":
    main()
