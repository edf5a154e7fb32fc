"""What the stub watchdog (serving/stub_watchdog.py) needs to watch one
tritonserver: its process tree and Python stubs from /proc, and JSON over
HTTP. Ships in the image, so standard library only (the container's system
Python runs it); the tools (tools/local_stack.py) use it too.
Linux only (/proc)."""

import json
import os
import pathlib
import re
import urllib.request

# Never through a proxy: these calls go to the local server, some with the admin key, and a pod's
# http_proxy (set for the LLM's egress) would carry them, in clear text, to the proxy instead.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url, payload=None, timeout=10, headers=None):
    """GET (no payload) or POST JSON, never through a proxy; the decoded answer, or None for an empty body."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with _DIRECT.open(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else None


def children(pid):
    """Direct children of pid (tritonserver's are its Python stub processes)."""
    found = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def process_tree(pid):
    """pid and all its descendants, pid first."""
    seen, todo = [], [pid]
    while todo:
        current = todo.pop()
        seen.append(current)
        todo.extend(children(current))
    return seen


STUB_NAME = "triton_python_backend_stub"
INSTANCE_ARG = 8  # argv index of the instance name in the stub's command line
# Instance stubs are named <model>_<group>_<instance>. A stub named after the
# model alone only checks the config during a load and exits by design.
INSTANCE_RE = re.compile(r"^(.+)_(\d+)_(\d+)$")


def process_state(pid):
    """'Z' for a zombie, another letter when alive, None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def cpu_seconds(pid):
    """User + system CPU seconds process pid has used so far (a zombie's still
    read), or None once it is reaped: a caller that sums processes skips it, one
    that measures a single process sees that it ended rather than a 0."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and ")"
    except OSError:  # a reaped process's /proc entry is gone, or goes while being read (ESRCH)
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: stat fields 14 and 15


def stub_instance(pid):
    """The instance a Python stub process serves (`<model>_<group>_<instance>`),
    or None for any other process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if not argv or not argv[0].endswith(STUB_NAME.encode()) or len(argv) <= INSTANCE_ARG:
        return None
    instance = argv[INSTANCE_ARG].decode(errors="replace")
    return instance if INSTANCE_RE.match(instance) else None


def model_of(instance):
    return INSTANCE_RE.match(instance).group(1)  # a model name may itself contain "_"


def instance_index(instance):
    """(group, instance) numbers of `<model>_<group>_<instance>`."""
    match = INSTANCE_RE.match(instance)
    return int(match.group(2)), int(match.group(3))


def tritonserver_pid(root_pid):
    """The tritonserver process under root_pid (serve.sh / the supervisor), or None."""
    for pid in process_tree(root_pid)[1:]:
        try:
            if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "tritonserver":
                return pid
        except OSError:
            continue
    return None


def front_pid(supervisor_pid):
    """The OpenAI front process the supervisor started beside the server."""
    for pid in children(supervisor_pid):
        try:
            if b"openai_front" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise RuntimeError("no openai_front process beside the server")


def stub_pid(server_pid, instance):
    """The Python stub process of tritonserver serving `instance`, or None."""
    for pid in children(server_pid):
        if stub_instance(pid) == instance:
            return pid
    return None


def rss_mb(pid):
    """Sum of VmRSS over pid and its descendants, in MB (zombies count 0)."""
    total_kb = 0
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
        except OSError:
            continue
    return round(total_kb / 1024, 1)
