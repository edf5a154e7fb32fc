"""What a refusal costs the OpenAI front's process (docs/reliability.md#overload).

The front served as `python -m openai_front` serves it (openai_front/__main__.py's
serve), with OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT at 0 so that every chat request
is refused from its headers (no Triton needed), and its access log on as in
production (to /dev/null). The C load generator (tools/overload_client.c, openai
mode, the `make overload` photo) resends at once: without Expect (`body`: each
refused body is sent, and drained by the front) and with Expect: 100-continue
(`expect`: no body is sent), in `--rounds` short rounds, the modes taking turns.
The CPU is the front process's own, user + system from /proc/<pid>/stat, so the
generator's is not counted; per refusal and, for `body`, per refused MB. Each
mode reports its rounds' median and least: on a machine shared with other jobs
the least is the steadier figure (contention only adds). A measurement, not a
test.

  .venv/bin/python -m tools.refusal_cost [--users 8] [--seconds 3] [--rounds 5] [--modes body,expect]
"""

import argparse
import json
import logging
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from serving.procfs import cpu_seconds
from tools import host, overload

MODES = ("body", "expect")


def serve(port):
    """The child: the front on 127.0.0.1:port, refusing every chat request."""
    from openai_front import __main__ as front_main
    from openai_front.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # as __main__: the access log
    front_main.serve(Settings(port=port, max_requests_in_flight=0))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port, process, bound_s=60):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"refusal_cost: the front did not listen on {port}")


def body_bytes(photo):
    """The generator's chat body for this photo: its base64 (4/3) and about 200 bytes of JSON."""
    return 4 * ((photo.stat().st_size + 2) // 3) + 200


def one_round(binary, port, pid, photo, users, seconds, mode):
    """(refusals, other outcomes, the front's CPU seconds, wall seconds) of one run of the generator."""
    with tempfile.NamedTemporaryFile("r", suffix=".attempts") as out:
        before, started = cpu_seconds(pid), time.monotonic()
        subprocess.run([str(binary), "127.0.0.1", str(port), overload.ENSEMBLE, str(users), str(seconds), "0",
                        "30000", str(photo), out.name, "openai", *(["expect"] if mode == "expect" else [])],
                       check=True, timeout=seconds + 90)
        # Never None: the front, our child, is not reaped before the end (a dead one reads as a zombie).
        elapsed, used = time.monotonic() - started, cpu_seconds(pid) - before
        admitted, rejected, lost, retries = overload.parse_attempts(out)  # every attempt, drain included
    return len(rejected), len(admitted) + len(lost) + retries, used, elapsed


def figures_of(mode, runs, users, photo):
    """A mode's figures from its rounds' (refusals, other outcomes, front CPU s, wall s)."""
    rounds = len(runs)
    per_refusal_ms = [1000 * used / refused for refused, _, used, _ in runs if refused]
    refused = sum(r[0] for r in runs)
    figures = {"mode": mode, "users": users, "rounds": rounds, "refused": refused,
               "not_refused": sum(r[1] for r in runs),  # answers, losses, retries: none expected
               "refused_per_s": round(refused / sum(r[3] for r in runs), 1),
               "front_cpu_share": round(sum(r[2] for r in runs) / sum(r[3] for r in runs), 2),
               "front_cpu_ms_per_refusal": {"median": round(statistics.median(per_refusal_ms), 3),
                                            "least": round(min(per_refusal_ms), 3),
                                            "rounds": [round(ms, 3) for ms in per_refusal_ms]}}
    if mode == "body":
        mb = body_bytes(photo) / 1e6
        figures["front_cpu_ms_per_refused_mb"] = {"median": round(statistics.median(per_refusal_ms) / mb, 3),
                                                  "least": round(min(per_refusal_ms) / mb, 3)}
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8, help="C users resending at once (default 8)")
    parser.add_argument("--seconds", type=float, default=3, help="per round (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="per mode (default 5)")
    parser.add_argument("--modes", type=lambda v: v.split(","), default=list(MODES),
                        help="body (no Expect: bodies sent and drained), expect (Expect: 100-continue)")
    parser.add_argument("--photo", type=pathlib.Path, help="default: the photo of make overload (skimage's coffee)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child's port
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    if set(args.modes) - set(MODES):
        parser.error(f"--modes: of {', '.join(MODES)}")
    if args.photo is None:
        import skimage.data

        args.photo = pathlib.Path(skimage.data.__file__).parent / "coffee.png"
    port = free_port()
    front = subprocess.Popen([sys.executable, "-m", "tools.refusal_cost", "--serve", str(port)],
                             cwd=overload.REPO, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, front)
        with tempfile.TemporaryDirectory(prefix="refusal-cost-") as workdir:
            binary = overload.compile_c_client(workdir)
            # The modes take turns, round by round, so that the machine's other jobs weigh on both alike.
            runs = {mode: [] for mode in args.modes}
            for _ in range(args.rounds):
                for mode in args.modes:
                    runs[mode].append(one_round(binary, port, front.pid, args.photo, args.users, args.seconds, mode))
            results = [figures_of(mode, runs[mode], args.users, args.photo) for mode in args.modes]
    finally:
        front.terminate()
        front.wait(30)
    print(json.dumps({"results": results, "body_bytes": body_bytes(args.photo), "host": host.describe()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
