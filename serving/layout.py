"""The CPU layout: instances, threads and rate-limiter slots from the cores this server is given.

One rule (`Layout`), applied at every start by serving/supervise_tritonserver.sh, natively, in the
container and in the pods: the rate limiter's "cpu" slots go on tritonserver's command line
(`server-args`), and once the server is ready every model the rule sizes that does not already run
that way is reloaded with its sized config as an override (`apply`). Triton builds the new
instances before it lets the old ones go, so nothing is refused meanwhile, and
/v2/models/<m>/config shows what runs. The committed configs hold what the rule gives on 2 cores,
where nothing is reloaded. The rule and its measurements: docs/scaling.md#cpu-layout.

The cores, first found wins: CPU_CORES (a whole number; the Deployment passes its CPU request),
else this process's CPU affinity (`taskset`, a cpuset) capped by its cgroup's CPU quota, rounded up
(a container's --cpus, a pod's CPU limit).

  python3 -m serving.layout show          the layout for this process's cores, as JSON
  python3 -m serving.layout server-args   the tritonserver flags of the layout
  python3 -m serving.layout apply --http-url HOST:PORT   (admin key in TRITON_ADMIN_KEY)

Standard library only: the supervisor runs it with whatever python3 the image has.
"""

import argparse
import collections
import copy
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
import urllib.error

from serving.procfs import children, http_json, model_of, process_state, stub_instance

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


class LayoutError(ValueError):
    """A setting the layout cannot use; the message names it."""


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    count: int  # instances of the model's one KIND_CPU group
    parameters: tuple = ()  # (key, value) pairs, set where the model's config has the key


@dataclasses.dataclass(frozen=True)
class Layout:
    """What runs on `cores` cores. Every decode and forward pass is single-threaded and holds one
    "cpu" slot; one slot and one classify_with_view instance more than the cores keep the cores
    busy while the describe step and the LLM call take their turns (measured on 2 cores: the
    ensemble 1.17x with the third, `classify` unchanged; docs/benchmarks-method.md). A lone pass
    may take a second thread when every neighbour is idle (idle_intra_op_threads), never more
    than the cores. The describe and streaming models keep one instance: their execute() never
    waits, every call runs on one asyncio loop."""

    cores: int
    source: str = "CPU_CORES"

    @property
    def cpu_slots(self):
        return self.cores + 1

    def models(self):
        return {
            "classify_with_view": ModelLayout(self.cores + 1, (("intra_op_threads", "1"),
                                                               ("idle_intra_op_threads", str(min(2, self.cores))))),
            # The two-model chain (the GPU layout's, and the classifier served on its own): one of each a core.
            "preprocess": ModelLayout(self.cores),
            "classifier": ModelLayout(self.cores, (("intra_op_threads", "1"),)),
        }

    def as_dict(self):
        return {"cores": self.cores, "source": self.source, "cpu_slots": self.cpu_slots,
                "models": {name: {"count": model.count, "parameters": dict(model.parameters)}
                           for name, model in self.models().items()}}

    def server_args(self):
        return ["--rate-limit=execution_count", f"--rate-limit-resource=cpu:{self.cpu_slots}"]


def cgroup_cpu_quota(root=CGROUP_ROOT, proc_cgroup="/proc/self/cgroup"):
    """The tightest CPU quota (cores, a float) on this process's cgroup and its parents, None if
    none: cgroup v2 `cpu.max` ("max 100000" or "150000 100000"); on a cgroup v1 host the cpu
    controller's `cpu.cfs_quota_us` as a container sees it."""
    folders = []
    try:
        for line in pathlib.Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):  # v2: ours, then each parent up to the root
                ours = root / line[3:].strip().lstrip("/")
                folders = [folder for folder in (ours, *ours.parents) if folder == root or root in folder.parents]
    except OSError:
        pass
    quotas = [_v2_quota(folder / "cpu.max") for folder in folders] + [_v1_quota(root / "cpu")]
    quotas = [quota for quota in quotas if quota is not None]
    return min(quotas) if quotas else None


def _v2_quota(path):
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder):
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def host_layout(environ=os.environ, affinity=None, quota=None):
    """The layout for this process: CPU_CORES, else its affinity capped by its cgroup's quota."""
    raw = environ.get("CPU_CORES", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise LayoutError(f"CPU_CORES={raw!r} must be a whole number of cores, at least 1")
        return Layout(int(raw), "CPU_CORES")
    affinity = len(os.sched_getaffinity(0)) if affinity is None else affinity
    quota = cgroup_cpu_quota() if quota is None else quota
    if quota is not None and math.ceil(quota) < affinity:
        return Layout(max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g}")
    return Layout(affinity, "CPU affinity")


def sized(config, model):
    """The served config `config` (Triton's JSON) with `model`'s layout; None if it has no one
    KIND_CPU instance group to size (a GPU config, a user's own layout of several groups)."""
    groups = config.get("instance_group") or []
    if len(groups) != 1 or groups[0].get("kind") != "KIND_CPU":
        return None
    config = copy.deepcopy(config)
    config["instance_group"][0]["count"] = model.count
    parameters = config.get("parameters") or {}
    for key, value in model.parameters:
        if key in parameters:
            parameters[key] = {"string_value": value}
    return config


def apply(layout, http_url, admin_key=None, log=print, server_pid=None, settle_s=60.0):
    """Reload each model the layout sizes whose served config differs from it; returns the names
    reloaded. A model that is not loaded is left alone; a reload that fails keeps the model as it
    ran (Triton keeps the loaded version) and is reported. With `server_pid`, it returns once the
    replaced instances' stubs have exited (at most `settle_s`): until then Triton 2.51 is still
    unloading the old versions, and a request can fail "failed to find the requested model version"."""
    headers = {"admin-key": admin_key} if admin_key else {}
    reloaded = []
    for name, model in layout.models().items():
        try:
            served = http_json(f"http://{http_url}/v2/models/{name}/config", headers=headers)
        except urllib.error.HTTPError:
            continue  # not loaded (unloaded on purpose, or a repository without it)
        wanted = sized(served, model)
        if wanted is None or wanted == served:
            continue
        try:
            http_json(f"http://{http_url}/v2/repository/models/{name}/load",
                      {"parameters": {"config": json.dumps(wanted)}}, timeout=300, headers=headers)
        except (OSError, ValueError) as error:
            log(f"layout: could not resize '{name}' ({error}); it runs as its config.pbtxt says")
            continue
        log(f"layout: '{name}' now runs {model.count} instance(s) (its config.pbtxt: "
            f"{served['instance_group'][0]['count']})")
        reloaded.append(name)
    if server_pid is not None and reloaded:
        settle(server_pid, {name: layout.models()[name].count for name in reloaded}, settle_s)
    return reloaded


def settle(server_pid, counts, timeout_s):
    """Until tritonserver `server_pid` has exactly counts[model] live stubs of each model."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = collections.Counter(model_of(instance) for pid in children(server_pid)
                                   if process_state(pid) not in (None, "Z") and (instance := stub_instance(pid)))
        if all(live[model] == count for model, count in counts.items()):
            return True
        time.sleep(0.2)
    return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("show", "server-args", "apply"))
    parser.add_argument("--http-url", default="127.0.0.1:8000")
    args = parser.parse_args(argv)
    try:
        layout = host_layout()
    except LayoutError as error:
        sys.exit(f"serve: {error}")
    if args.command == "show":
        print(json.dumps(layout.as_dict(), indent=2))
    elif args.command == "server-args":
        print(" ".join(layout.server_args()))
    else:
        apply(layout, args.http_url, os.environ.get("TRITON_ADMIN_KEY") or None,
              log=lambda line: print(f"serve: {line}", file=sys.stderr, flush=True))


if __name__ == "__main__":
    main()
