"""The OpenAI front's own CPU per answered chat request, two versions side by
side: the front of git revision --base (A) and the one in this work tree (B),
each a `python -m openai_front` process, both in front of one Triton (the fake
LLM at --llm-ms), in turns A B B A A B ... of --seconds each at --concurrency.
Each turn posts the overload run's request (coffee.png as a data: URI, a 622
KB JSON body, a distinct question each) and counts the front's CPU from
/proc/<pid>/stat over the answered requests. A 503 (the front's shedding) is
waited out for 0.5 s and sent again; it is counted, and its cost is in the
turn's CPU. docs/benchmarks-method.md#the-openai-fronts-cpu.

    .venv/bin/python -m tools.bench.front_cpu_ab [--base main] [--pairs 4] [--seconds 15]
        [--concurrency 4] [--llm-ms 0] [--results FILE]

The two fronts share the cores with Triton and the load generator: compare
them within one run (the per-pair ratios), never across runs.
"""

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
import skimage

from serving.procfs import cpu_seconds, front_pid
from tools import host
from tools.bench.harness import FakeLLM, Triton, load_average
from tools.local_stack import free_port, log_tail, stop_process
from tools.overload_users import chat_body_around_prompt

REPO = pathlib.Path(__file__).resolve().parents[2]
# The front's package and the files its symbolic links point to (backends/openai_describe).
FRONT_PATHS = ("openai_front", "backends/openai_describe")
REFUSED_WAIT_S = 0.5


def log(message):
    print(f"[front cpu a/b] {message}", file=sys.stderr, flush=True)


def coffee_body_maker():
    """number -> the overload run's chat body (tools/overload_users.py: as the openai SDK
    encodes it), a distinct question each."""
    image = (pathlib.Path(skimage.data.__file__).parent / "coffee.png").read_bytes()
    head, tail = chat_body_around_prompt(image)

    def body(number):
        return head + json.dumps(f"What is it? ({number})").encode() + tail
    return body


def malloc_tunables_of(pid):
    """GLIBC_TUNABLES in process `pid`'s environment: the supervisor's own front's, so that the
    two fronts run with what serving/supervise_tritonserver.sh gives the front."""
    for entry in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = entry.partition(b"=")
        if name == b"GLIBC_TUNABLES":
            return value.decode()
    raise RuntimeError(f"the supervisor's front (pid {pid}) runs without GLIBC_TUNABLES")


async def load(url, body, concurrency, seconds):
    """Closed-loop users for `seconds` -> (answered, refused)."""
    answered, refused = 0, 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def user(number):
            nonlocal answered, refused
            while time.monotonic() < end:
                async with session.post(url, data=body(number), headers={"Content-Type": "application/json"}) as answer:
                    text = await answer.read()
                if answer.status == 503:
                    refused += 1
                    await asyncio.sleep(REFUSED_WAIT_S)
                    continue
                if answer.status != 200:
                    raise RuntimeError(f"the front answered {answer.status}: {text[:300]!r}")
                answered += 1
                number += concurrency
        await asyncio.gather(*(user(number) for number in range(concurrency)))
    return answered, refused


def front_of(revision, workdir):
    """A directory holding the front's package at `revision` (None: this work tree)."""
    if revision is None:
        return REPO
    tree = workdir / "base"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, *FRONT_PATHS],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def start_front(tree, triton, workdir, name, malloc_tunables):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{REPO}", GLIBC_TUNABLES=malloc_tunables)
    env.pop("TRITON_INFERENCE_KEY", None)  # the bench's Triton leaves inference open
    log_path = workdir / f"front-{name}.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "openai_front", "--port", str(port),
                                    "--triton-grpc-url", triton.grpc_url],
                                   env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=log_file)
    return process, f"http://127.0.0.1:{port}/v1/chat/completions", log_path


async def wait_answering(url, body, process, log_path, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await load(url, body, 1, 0.01)
        except (aiohttp.ClientError, RuntimeError):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the front did not answer:\n{log_tail(log_path)}") from None
            await asyncio.sleep(0.5)


def run(args, workdir):
    body = coffee_body_maker()
    llm = FakeLLM(workdir, latency_ms=args.llm_ms)
    triton, fronts = None, {}
    try:
        triton = Triton(workdir, llm.base_url)
        malloc_tunables = malloc_tunables_of(front_pid(triton.process.pid))
        for name, revision in (("A", args.base), ("B", None)):
            fronts[name] = start_front(front_of(revision, workdir), triton, workdir, name, malloc_tunables)
        for process, url, log_path in fronts.values():
            asyncio.run(wait_answering(url, body, process, log_path))
            asyncio.run(load(url, body, args.concurrency, args.warmup_s))
        turns = []
        for name in (["A", "B", "B", "A"] * args.pairs)[:2 * args.pairs]:
            process, url, _ = fronts[name]
            cpu_before, started = cpu_seconds(process.pid), time.monotonic()
            answered, refused = asyncio.run(load(url, body, args.concurrency, args.seconds))
            cpu_s, elapsed = cpu_seconds(process.pid) - cpu_before, time.monotonic() - started
            if not answered:
                raise RuntimeError(f"front {name} answered nothing in {args.seconds:g} s ({refused} refused)")
            turns.append({"front": name, "answered": answered, "refused": refused,
                          "answered_per_s": round(answered / elapsed, 2),
                          "front_cpu_ms_per_answer": round(cpu_s / answered * 1e3, 3)})
            log(f"{name}: {answered} answered ({answered / elapsed:.1f}/s), {refused} refused, "
                f"front CPU {cpu_s / answered * 1e3:.2f} ms per answer")
    finally:
        for process, _, _ in fronts.values():
            stop_process(process)
        if triton is not None:
            triton.stop()
        llm.stop()
    return turns


def summary(turns):
    by_front = {name: [t for t in turns if t["front"] == name] for name in ("A", "B")}
    ratios = [b["front_cpu_ms_per_answer"] / a["front_cpu_ms_per_answer"] for a, b in zip(by_front["A"], by_front["B"])]
    rates = [b["answered_per_s"] / a["answered_per_s"] for a, b in zip(by_front["A"], by_front["B"])]
    return {**{f"front_cpu_ms_per_answer_{name}": round(statistics.median(t["front_cpu_ms_per_answer"] for t in rows), 3)
               for name, rows in by_front.items()},
            "cpu_ratio_b_over_a_pairs": [round(r, 3) for r in ratios],
            "cpu_ratio_b_over_a": round(statistics.median(ratios), 3),
            "answered_ratio_b_over_a": round(statistics.median(rates), 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="the git revision of front A (B: this work tree)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--llm-ms", type=float, default=0.0)
    parser.add_argument("--results", type=pathlib.Path)
    args = parser.parse_args(argv)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="front-cpu-ab-") as workdir:
        turns = run(args, pathlib.Path(workdir))
    base_commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.base], check=True,
                                 capture_output=True, text=True).stdout.strip()
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "python -m tools.bench.front_cpu_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
               "host": host.describe(), "base": args.base, "base_commit": base_commit,
               "concurrency": args.concurrency, "llm_ms": args.llm_ms, "seconds": args.seconds,
               "load_average_before": load_before, "load_average_after": load_average(),
               **summary(turns), "turns": turns}
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
        log(f"results: {args.results}")
    print(json.dumps({key: results[key] for key in ("front_cpu_ms_per_answer_A", "front_cpu_ms_per_answer_B",
                                                    "cpu_ratio_b_over_a_pairs", "cpu_ratio_b_over_a",
                                                    "answered_ratio_b_over_a")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
