"""The ensemble against a BentoML service of the same job (issue 21: the
ensemble's throughput at least 1.5x BentoML's at its saturating concurrency,
with 0 failures), side by side in one run, fake LLM at 0 ms.

The BentoML side is tools/bench/bentoml_service.py in its own venv (`make
bentoml-baseline`): the same decode code, model.onnx, ONNX Runtime threads,
top 5 and LLM call. One load generator for both: this process's asyncio loop
and one aiohttp session posting pre-built bodies, the same photo bytes and a
distinct prompt per request:
  ensemble  POST /v2/models/classify_and_describe/infer, Triton's binary tensor
            extension (IMAGE and PROMPT as raw bytes), outputs as JSON
  BentoML   POST /classify_and_describe, multipart/form-data (the photo as a
            file part, the prompt as a field: BentoML's way to send a file)
A request counts as done when its answer is 200 with an LLM description; any
other answer, a connection error or a timeout is a failure.

  1. each BentoML layout of VARIANTS the mode lists is started alone and swept
     (a few concurrencies, short windows); the one with the best throughput is
     kept; the ensemble is swept the same way. A side's saturating concurrency
     is the smallest within 5 % of its best.
  2. alternating timed windows, each side at its saturating concurrency, the
     order reversed every other turn; the ratio is the ensemble's windows over
     BentoML's, summed.

  python -m tools.bench.bentoml_baseline [--mode quick|full] [--results FILE]
  (`make bench` and `make bench-quick` measure it as a section of their one
  results file: tools/bench/sections.py)
"""

import argparse
import asyncio
import collections
import datetime
import json
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from classify_describe_server import image_steps

from serving.procfs import cpu_seconds, process_tree
from tools import host, model_config
from tools.bench.clients import _drive
from tools.bench.harness import BENCH_API_KEY, FakeLLM, Triton, load_average
from tools.bench.inputs import photo_jpegs, prompts
from tools.local_stack import NotReady, free_port, log_tail, stop_process

REPO = pathlib.Path(__file__).resolve().parents[2]
VENV = REPO / "build/bentoml-venv"
MODEL = "classify_and_describe"
TARGET_RATIO = 1.5
WITHIN = 0.95  # the saturating concurrency: the smallest whose throughput is this close to the best

NAME = "bentoml"
TITLE = "The ensemble against a BentoML service of the same job"

# BentoML's own ways to spend 2 cores on the job (bentoml_service.py says what each service does).
VARIANTS = {
    "no_batching": {"service": "ClassifyDescribe", "workers": 2,
                    "label": "one service, 2 workers (one a core), no batching"},
    # max_latency_ms is BentoML's default: its dispatcher refuses (503) a request it expects to wait
    # longer, and 10 ms refused most of them on the shared 2-core VM.
    "adaptive_batching": {"service": "BatchedClassifyDescribe", "workers": 1, "classifier_workers": 1,
                          "max_batch_size": 4, "max_latency_ms": 60000,
                          "label": "1 worker (decode, LLM call) + a classifier service of 1 worker "
                                   "with adaptive batching (max batch 4, max latency 60 s)"},
}
# Per `make bench` mode. Smoke (inside `make test`, which does not build BentoML's venv) skips it.
# Quick measures the layout that full mode found best (docs/benchmarks-method.md#bentoml).
SIZES = {
    "quick": dict(variants=("no_batching",), sweep=(8, 16, 32, 64), sweep_s=3.0, warmup_s=1.0, windows=2,
                  window_s=6.0),
    "full": dict(variants=("no_batching", "adaptive_batching"), sweep=(8, 16, 32, 64), sweep_s=5.0, warmup_s=2.0,
                 windows=3, window_s=12.0),
}


def log(message):
    print(f"[bentoml bench] {message}", file=sys.stderr, flush=True)


# -- pure helpers (tests/unit/test_bench_bentoml.py) -------------------------------------------------

def saturating(sweep):
    """{concurrency: throughput} -> the smallest concurrency within WITHIN of the best."""
    best = max(sweep.values())
    return min(c for c, t in sweep.items() if t >= WITHIN * best)


def summarize(windows):
    """Alternating windows -> per side the mean throughput, the summed failures and the mean server CPU
    per request (steadier than throughput on a shared machine: other load slows a window, it adds
    little CPU to its requests), and the ratio of the throughputs' sums."""
    out = {"throughput": {}, "failures": {}, "server_cpu_ms_per_request": {}}
    for side in ("ensemble", "bentoml"):
        mine = [w for w in windows if w["side"] == side]
        out["throughput"][side] = _mean(w["throughput"] for w in mine)
        out["server_cpu_ms_per_request"][side] = _mean(w["server_cpu_ms_per_request"] for w in mine)
        out["failures"][side] = sum(w["failures"] for w in mine)
    bento = sum(w["throughput"] for w in windows if w["side"] == "bentoml")
    ensemble = sum(w["throughput"] for w in windows if w["side"] == "ensemble")
    out["ratio"] = ensemble / bento if bento else float("nan")
    return out


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def window_cores(window):
    """The cores a window's server kept busy; for results files from before it was recorded, its CPU
    per request times its throughput (a little low: the CPU includes the warm-up's requests)."""
    if "server_cores" in window:
        return window["server_cores"]
    return window["server_cpu_ms_per_request"] * window["throughput"] / 1e3


def underused_windows(windows, candidates=None, workers=2):
    """The cores of BentoML's answering `candidates` (default: its `windows`) that kept under 3/4 of
    the cores the ensemble's windows kept busy (the median of theirs), or of its `workers`, whichever
    is less: a kept-alive pool on one worker, the other idle (BENTOML_RECONNECT_EVERY)."""
    ensemble = [window_cores(w) for w in windows if w["side"] == "ensemble"]
    if not ensemble:
        return []
    floor = 0.75 * min(statistics.median(ensemble), workers)
    candidates = windows if candidates is None else candidates
    return [cores for cores in (window_cores(w) for w in candidates if w["side"] == "bentoml" and w["throughput"])
            if cores < floor]


def target_row(section):
    """The targets table's row (report.Target) from this section's results: the ratio, met only at
    TARGET_RATIO or more with no failed ensemble request; None for a run without the section."""
    from tools.bench.report import Target  # report imports the sections: import it when called

    name = "ensemble / a BentoML service of the same job, throughput at its saturating concurrency"
    if section is None:
        return Target(name, None, TARGET_RATIO,
                      detail="not measured: tools/bench has no BentoML service of the job yet")
    if "skipped" in section or "error" in section:
        return Target(name, None, TARGET_RATIO, detail=f"not measured: {section.get('skipped') or section['error']}")
    s = section["saturating"]
    failures = section["failures"]
    cpu = (section.get("host") or {}).get("cpu") or {}
    detail = (f"{section['throughput']['ensemble']:.1f} req/s at c={s['ensemble']} vs BentoML "
              f"{section['bentoml_version']} {section['throughput']['bentoml']:.1f} req/s at c={s['bentoml']} "
              f"({section['variant']}); failed requests {failures['ensemble']} vs {failures['bentoml']}; server CPU "
              f"{section['server_cpu_ms_per_request']['ensemble']:.1f} vs "
              f"{section['server_cpu_ms_per_request']['bentoml']:.1f} ms per request; "
              f"{host.cpu_name(section.get('host')) or 'CPU not recorded'} ({'VNNI' if cpu.get('vnni') else 'no VNNI'})")
    # "with 0 failures": the ensemble's; BentoML's own failures are reported, its throughput counts answers only.
    unmet = f"{failures['ensemble']} ensemble request(s) failed" if failures["ensemble"] else ""
    # Only the layout whose workers share one listening socket; the batching one runs a front and a
    # classifier process by design, 1.4-1.6 cores here.
    judged = section["variant"] == "no_batching"
    idle = underused_windows(section["windows"]) if judged else []
    if idle and not unmet:
        unmet = (f"BentoML kept {', '.join(f'{c:.2f}' for c in idle)} cores busy in {len(idle)} window(s) "
                 "against the ensemble's, one worker idle: not at its limit, so the ratio flatters")
    # A sweep point on one worker does not void the windows, but it may have picked their concurrency.
    sweep = section.get("sweep_bentoml", {}).get("no_batching", {}) if judged else {}
    pinned = [c for c, point in sweep.items() if underused_windows(section["windows"], [point])]
    if pinned:
        detail += f"; BentoML sweep points with a worker idle (c={', '.join(map(str, pinned))}): its concurrency may be mis-picked"
    return Target(name, section["ratio"], section["target_ratio"], unmet_reason=unmet,
                  detail=f"not met whatever the ratio: {unmet}; {detail}" if unmet else detail)


def triton_body(image, prompt):
    """(header, body) of a Triton infer request in the binary tensor extension: the JSON header, then
    each BYTES tensor as a 4-byte little-endian length and its bytes. No output is asked for in
    binary, so all come back as JSON."""
    tensors = [len(image).to_bytes(4, "little") + image, len(prompt).to_bytes(4, "little") + prompt]
    header = json.dumps({"inputs": [
        {"name": name, "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(data)}}
        for name, data in zip(("IMAGE", "PROMPT"), tensors)]}).encode()
    return header, b"".join([header, *tensors])


BOUNDARY = "bench-bentoml-3f9c2a"


def multipart_body(image, prompt):
    """multipart/form-data (boundary BOUNDARY): the photo as the file part `image`, the prompt as the field `prompt`."""
    b = BOUNDARY.encode()
    return b"".join([
        b"--", b, b'\r\nContent-Disposition: form-data; name="image"; filename="photo.jpg"\r\n'
        b"Content-Type: image/jpeg\r\n\r\n", image,
        b"\r\n--", b, b'\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n', prompt,
        b"\r\n--", b, b"--\r\n"])


# -- the BentoML server ----------------------------------------------------------------------------

def job(repository, variant):
    """What bentoml_service.py serves (its BENTOML_JOB): the model file and every setting of the
    run's model repository that the ensemble's steps use, and the variant's layout."""
    repository = pathlib.Path(repository)

    def parameters(model):
        config = model_config.read(repository / model / "config.pbtxt")
        return {key: value.string_value for key, value in config.parameters.items()}

    classifier = parameters("classifier")
    if classifier.get("runtime") != "onnxruntime":
        raise ValueError(f"the classifier serves runtime {classifier.get('runtime')!r}; the BentoML service "
                         "runs the ONNX graph")
    settings = {key: value for key, value in VARIANTS[variant].items() if key not in ("service", "label")}
    return {"model_file": str(repository / "classifier/1" / classifier.get("model_file", "model.onnx")),
            "intra_op_threads": int(classifier.get("intra_op_threads", "1")),
            "preprocess": image_steps.split_parameters(parameters("preprocess"))[1], "describe": parameters("describe"), **settings}


class BentoServer:
    """`bentoml serve tools.bench.bentoml_service:<service>` on a free loopback port, stopped by its PID
    (the workers are its children, which it stops on SIGTERM)."""

    def __init__(self, workdir, repository, variant, llm_base_url, ready_timeout_s=240):
        self.port = free_port()
        self.log_path = pathlib.Path(workdir) / f"bentoml_{variant}_{self.port}.log"
        env = {**os.environ, "BENTOML_JOB": json.dumps(job(repository, variant)), "LLM_BASE_URL": llm_base_url,
               "LLM_API_KEY": BENCH_API_KEY, "BENTOML_HOME": str(pathlib.Path(workdir) / "bentoml_home"),
               "BENTOML_DO_NOT_TRACK": "True", "PYTHONDONTWRITEBYTECODE": "1"}
        with open(self.log_path, "w") as log_file:
            self.process = subprocess.Popen(
                [str(VENV / "bin/bentoml"), "serve", f"tools.bench.bentoml_service:{VARIANTS[variant]['service']}",
                 "--host", "127.0.0.1", "--port", str(self.port), "--working-dir", str(REPO)],
                cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_ready(ready_timeout_s)
        except NotReady:
            self.stop()
            raise

    def _wait_ready(self, timeout_s):
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise NotReady(f"bentoml serve exited with {self.process.returncode}:\n{log_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise NotReady(f"bentoml serve not ready after {timeout_s}s:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def pids(self):
        return process_tree(self.process.pid)

    def stop(self):
        tree = self.pids()
        stop_process(self.process, grace_s=30)
        for pid in tree[1:]:  # a worker its arbiter left behind: by its PID, as every process here
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def tree_cpu_s(pids):
    return sum(filter(None, map(cpu_seconds, pids)))  # a worker gone since counts nothing


# -- the load generator ------------------------------------------------------------------------------

# BentoML's workers accept from one shared listening socket, and a kept-alive connection stays with
# the worker that accepted it: a pool's connections can all sit on one worker, which then serves every
# request while the other idles (64 req/s on one core against 124 on two at the same concurrency, in
# one run; docs/benchmarks-method.md#bentoml). So one request in BENTOML_RECONNECT_EVERY, drawn at
# random (a fixed index would fall to the same task at a concurrency that divides it), closes its
# connection (uvicorn answers `Connection: close` and closes; aiohttp then drops it from its pool),
# and the next is accepted by a worker waiting in accept: an idle one. A new connection for every
# request cost BentoML about 1.7 ms more CPU a request, so not every request. Triton is one
# process: its side keeps its connections.
BENTOML_RECONNECT_EVERY = 16


class Sides:
    """One request to either side; `index` picks the photo and the prompt. Failures are counted by
    reason (a few words, never a body) while `counting` is set."""

    def __init__(self, triton_url, images, questions):
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=120))
        self.triton = f"http://{triton_url}/v2/models/{MODEL}/infer"
        self.bento = None
        self.images, self.questions = images, questions
        self.reasons = collections.Counter()
        self.reconnect = random.Random(0)  # which BentoML requests close their connection

    def photo_and_prompt(self, index):
        return self.images[index % len(self.images)], self.questions[index % len(self.questions)].encode()

    async def ensemble(self, index):
        header, body = triton_body(*self.photo_and_prompt(index))
        async with self.session.post(self.triton, data=body, headers={
                "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}) as r:
            answer = await r.read()
        if r.status != 200:
            raise Failure(f"HTTP {r.status}")
        outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
        if outputs["DESCRIPTION_SOURCE"] != ["llm"]:
            raise Failure(f"description_source {outputs['DESCRIPTION_SOURCE']}")

    async def bentoml(self, index):
        headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        if self.reconnect.random() < 1 / BENTOML_RECONNECT_EVERY:
            headers["Connection"] = "close"
        async with self.session.post(f"{self.bento}/{MODEL}", data=multipart_body(*self.photo_and_prompt(index)),
                                     headers=headers) as r:
            answer = await r.read()
        if r.status != 200:
            raise Failure(f"HTTP {r.status}")
        if json.loads(answer)["description_source"] != "llm":
            raise Failure("description_source not llm")

    async def close(self):
        await self.session.close()


class Failure(RuntimeError):
    pass


async def run_window(sides, side, concurrency, seconds, warmup_s, server_pids):
    """One timed window of `side` at `concurrency`: throughput, latencies, failures (by reason) and the
    CPU per request of the side's server processes and of this load generator."""
    reasons = collections.Counter()
    call = sides.ensemble if side == "ensemble" else sides.bentoml

    async def counted(index):
        try:
            await call(index)
        except Exception as exc:
            reasons[str(exc)[:80] if isinstance(exc, Failure) else type(exc).__name__] += 1
            raise

    cpu_before, generator_before = tree_cpu_s(server_pids()), time.process_time()
    started = time.monotonic()
    run = await _drive(counted, concurrency, seconds, warmup_s)
    requests, server_cpu_s = max(1, run["finished_all"]), tree_cpu_s(server_pids()) - cpu_before
    return {"side": side, "concurrency": concurrency, "throughput": run["throughput"], "count": run["count"],
            "p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"], "failures": run["errors"],
            "failure_reasons": dict(reasons),
            # How many cores the server kept busy: a side on one core of two is not at its limit.
            "server_cores": server_cpu_s / (time.monotonic() - started),
            "server_cpu_ms_per_request": server_cpu_s * 1e3 / requests,
            "generator_cpu_ms_per_request": (time.process_time() - generator_before) * 1e3 / requests}


async def sweep(sides, side, size, server_pids):
    points = {}
    for concurrency in size["sweep"]:
        points[concurrency] = await run_window(sides, side, concurrency, size["sweep_s"], size["warmup_s"],
                                               server_pids)
        log(f"  sweep {side} c={concurrency}: {points[concurrency]['throughput']:.1f} req/s, "
            f"failures {points[concurrency]['failures']}")
    return points


async def bench(triton, llm, workdir, size):
    images = list(photo_jpegs().values())
    sides = Sides(triton.http_url, images, prompts(1_000_000))
    triton_pids = lambda: process_tree(triton.process.pid)  # noqa: E731 - tritonserver, its stubs, the front
    results = {"target_ratio": TARGET_RATIO, "host": host.describe(), "bentoml_version": _version(),
               "variants": {name: VARIANTS[name]["label"] for name in size["variants"]}, "size": size}
    try:
        for index in range(20):  # the ensemble's first requests (connection pool, the stubs' first calls)
            await sides.ensemble(index)
        results["sweep_ensemble"] = await sweep(sides, "ensemble", size, triton_pids)
        variant_sweeps = {}
        for name in size["variants"]:
            server = BentoServer(workdir, triton.repository, name, llm.base_url)
            try:
                sides.bento = server.url
                for index in range(20):
                    await sides.bentoml(index)
                log(f"BentoML {name}: {VARIANTS[name]['label']}")
                variant_sweeps[name] = await sweep(sides, "bentoml", size, server.pids)
            finally:
                server.stop()
        results["sweep_bentoml"] = variant_sweeps
        best = {name: max(p["throughput"] for p in points.values()) for name, points in variant_sweeps.items()}
        results["variant"] = max(best, key=best.get)
        results["saturating"] = {
            "ensemble": saturating({c: p["throughput"] for c, p in results["sweep_ensemble"].items()}),
            "bentoml": saturating({c: p["throughput"] for c, p in variant_sweeps[results["variant"]].items()})}
        log(f"kept {results['variant']}; saturating concurrency: ensemble {results['saturating']['ensemble']}, "
            f"BentoML {results['saturating']['bentoml']}")
        server = BentoServer(workdir, triton.repository, results["variant"], llm.base_url)
        try:
            sides.bento = server.url
            for index in range(20):
                await sides.bentoml(index)
            windows = []
            for turn in range(size["windows"]):
                for side in (("ensemble", "bentoml") if turn % 2 == 0 else ("bentoml", "ensemble")):
                    window = await run_window(sides, side, results["saturating"][side], size["window_s"],
                                              size["warmup_s"], triton_pids if side == "ensemble" else server.pids)
                    windows.append(window)
                    log(f"  {side} c={window['concurrency']}: {window['throughput']:.1f} req/s, p50 "
                        f"{window['p50_ms']:.0f} ms, failures {window['failures']} {window['failure_reasons'] or ''}")
        finally:
            server.stop()
        results["windows"] = windows
        results.update(summarize(windows))
    finally:
        await sides.close()
    log(f"ratio {results['ratio']:.2f}: ensemble {results['throughput']['ensemble']:.1f} vs BentoML "
        f"{results['throughput']['bentoml']:.1f} req/s; failures {results['failures']}")
    return results


def _version():
    found = list((VENV / "lib").glob("python3*/site-packages/bentoml-*.dist-info"))
    return found[0].name.split("-")[1].removesuffix(".dist") if found else "?"


# -- as a section of `make bench` (tools/bench/sections.py) --------------------------------------

def measure(ctx):
    size = SIZES.get(ctx.mode)
    if size is None:
        return {"skipped": f"mode {ctx.mode} does not measure it (make bench, make bench-quick do)"}
    if not (VENV / "bin/bentoml").exists():
        return {"skipped": f"no BentoML venv at {VENV.relative_to(REPO)}: run `make bentoml-baseline`"}
    load_before = load_average()
    results = asyncio.run(bench(ctx.triton, ctx.llm, ctx.workdir, size))
    results.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   load_average_before=load_before, load_average_after=load_average())
    return results


def render(section):
    lines = [f"## {TITLE}", ""]
    if "skipped" in section:
        return lines + [f"Not measured: {section['skipped']}."]
    s, t = section["saturating"], section["throughput"]
    lines += [
        f"`classify_and_describe` through Triton's HTTP endpoint and BentoML {section['bentoml_version']} serving "
        "the same job with the same code and model file (tools/bench/bentoml_service.py; "
        "[method](benchmarks-method.md#bentoml)), fake LLM at 0 ms, one aiohttp load generator for both. "
        f"BentoML layouts swept: {'; '.join(f'`{n}` ({label})' for n, label in section['variants'].items())}; "
        f"kept: `{section['variant']}`. CPU: {host.summary(section['host'])} ({host.isa_text(section['host'])}).",
        "", "Sweeps (req/s, failed requests):", "",
        "| concurrency | ensemble | " + " | ".join(f"BentoML `{n}`" for n in section["sweep_bentoml"]) + " |",
        "| --- | --- |" + " --- |" * len(section["sweep_bentoml"])]
    for c, point in section["sweep_ensemble"].items():
        cells = [section["sweep_bentoml"][n].get(c) for n in section["sweep_bentoml"]]
        lines.append(f"| {c} | {point['throughput']:.1f} ({point['failures']}) | " + " | ".join(
            f"{p['throughput']:.1f} ({p['failures']})" if p else "" for p in cells) + " |")
    lines += ["", f"Alternating windows at each side's saturating concurrency (ensemble {s['ensemble']}, BentoML "
              f"{s['bentoml']}):", "",
              "| turn | side | c | req/s | p50 ms | p99 ms | failed | server CPU ms/req | server cores busy "
              "| generator CPU ms/req |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for number, w in enumerate(section["windows"], 1):
        # Files from before it recorded none: ~ its CPU per request times its throughput.
        cores = f"{w['server_cores']:.2f}" if "server_cores" in w else f"~{window_cores(w):.2f}"
        lines.append(f"| {number} | {w['side']} | {w['concurrency']} | {w['throughput']:.1f} | {w['p50_ms']:.0f} | "
                     f"{w['p99_ms']:.0f} | {w['failures']} | {w['server_cpu_ms_per_request']:.1f} | {cores} | "
                     f"{w['generator_cpu_ms_per_request']:.1f} |")
    lines += ["", f"Ratio: **{section['ratio']:.2f}** (ensemble {t['ensemble']:.1f} vs BentoML {t['bentoml']:.1f} "
              f"req/s, means over the windows); failed requests {section['failures']['ensemble']} vs "
              f"{section['failures']['bentoml']}; server CPU per request {section['server_cpu_ms_per_request']['ensemble']:.1f}"
              f" vs {section['server_cpu_ms_per_request']['bentoml']:.1f} ms (each side's whole process tree); load "
              f"average {section['load_average_before'][0]:.1f} before, "
              f"{section['load_average_after'][0]:.1f} after."]
    return lines


# The row sits in the targets table with issue 21's other rows (report.serving_overhead_targets).


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(SIZES), default="quick")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="the BentoML layouts to sweep")
    parser.add_argument("--results", type=pathlib.Path, default=REPO / "build/bench/bentoml/results.json")
    args = parser.parse_args(argv)
    size = dict(SIZES[args.mode], **({"variants": tuple(args.variants)} if args.variants else {}))
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-bentoml-"))
    llm = FakeLLM(workdir, latency_ms=0.0)
    triton = None
    try:
        triton = Triton(workdir, llm.base_url, extra_env={"LLM_CACHE_ENABLED": "false"})
        load_before = load_average()
        results = asyncio.run(bench(triton, llm, workdir, size))
    finally:
        if triton is not None:
            triton.stop()
        llm.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    results.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="python -m tools.bench.bentoml_baseline " + " ".join(sys.argv[1:] if argv is None else argv),
                   load_average_before=load_before, load_average_after=load_average())
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1, default=float) + "\n")
    print("\n".join(render(json.loads(json.dumps(results)))))
    log(f"results: {args.results}")


if __name__ == "__main__":
    sys.exit(main())
