#!/usr/bin/env python3
"""Benchmark of the describe model against the fake OpenAI upstream.

For each upstream latency (default 0 ms and 1000 ms) it starts the fake
(`python -m tools.fake_openai`) and a tritonserver (scripts/serve.sh on a
temporary repository holding describe, plus the classifier serve.sh checks
for), then measures:

  * added latency: sequential requests through Triton's HTTP /infer of
    `describe`, against the same chat-completions call made straight to the
    fake, both with the openai SDK (what a client pays without the describe
    step) and as a raw HTTP POST (the floor); "added" = difference of p50s;
  * throughput with N requests in flight (default 512), through Triton and direct.

Every request has its own PROMPT and the in-model cache is off
(LLM_CACHE_ENABLED=false), so each one reaches the upstream.

usage: .venv/bin/python -m tools.bench_describe [--latencies 0 1000] [--concurrency 512]
"""

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time

import aiohttp

from tools.local_stack import FakeLLM, NotReady, TritonServer

REPO = pathlib.Path(__file__).resolve().parents[1]

LABELS = ["tabby, tabby cat", "tiger cat", "Egyptian cat", "lynx", "Persian cat"]
SCORES = [0.62, 0.21, 0.09, 0.03, 0.01]


def percentiles(samples_s):
    ordered = sorted(samples_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": statistics.mean(ordered) * 1000.0}


def triton_payload(prompt):
    return {"inputs": [
        {"name": "LABELS", "shape": [1, len(LABELS)], "datatype": "BYTES", "data": LABELS},
        {"name": "SCORES", "shape": [1, len(SCORES)], "datatype": "FP32", "data": SCORES},
        {"name": "PROMPT", "shape": [1, 1], "datatype": "BYTES", "data": [prompt]}]}


def direct_payload(prompt):
    # What the describe model sends upstream, near enough in size.
    labels = "\n".join(f"- {label} ({score:.1%})" for label, score in zip(LABELS, SCORES))
    return {"model": "gpt-4o-mini", "max_tokens": 256, "temperature": 0.2, "messages": [
        {"role": "system", "content": "You describe objects recognised in a photo by an image classifier."},
        {"role": "user", "content": f"{prompt}\n\nThe image classifier's top labels, with confidence:\n{labels}"}]}


async def one(session, url, payload, check):
    started = time.perf_counter()
    async with session.post(url, json=payload) as response:
        body = await response.json()
    elapsed = time.perf_counter() - started
    if response.status != 200 or not check(body):
        raise RuntimeError(f"bad answer {response.status}: {json.dumps(body)[:300]}")
    return elapsed


def triton_ok(body):
    return next(o["data"][0] for o in body["outputs"] if o["name"] == "DESCRIPTION_SOURCE") == "llm"


def direct_ok(body):
    return bool(body["choices"][0]["message"]["content"])


async def sequential(url, make_payload, check, count, tag):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for i in range(5):  # warm-up: connections, first-call imports
            await one(session, url, make_payload(f"warm {tag} {i}"), check)
        return [await one(session, url, make_payload(f"seq {tag} {i}"), check) for i in range(count)]


async def concurrent(url, make_payload, check, count, in_flight, tag):
    """`in_flight` workers, each sending its share back to back: exactly
    `in_flight` requests outstanding, and latencies without client-side queueing."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=in_flight), timeout=timeout) as session:
        await asyncio.gather(*(one(session, url, make_payload(f"warm {tag} {i}"), check) for i in range(in_flight)))

        async def worker(w):
            return [await one(session, url, make_payload(f"conc {tag} {w} {i}"), check)
                    for i in range(count // in_flight)]

        started = time.perf_counter()
        shares = await asyncio.gather(*(worker(w) for w in range(in_flight)))
        latencies = [x for share in shares for x in share]
        return len(latencies) / (time.perf_counter() - started), latencies


async def sequential_sdk(base_url, count, tag):
    """The same call made straight to the upstream with the openai SDK: what a
    client would pay without the describe step."""
    import openai

    client = openai.AsyncOpenAI(api_key="sk-bench", base_url=base_url, max_retries=0,
                                http_client=openai.DefaultAioHttpClient())
    try:
        async def call(prompt):
            payload = direct_payload(prompt)
            started = time.perf_counter()
            response = await client.chat.completions.create(**payload)
            assert response.choices[0].message.content
            return time.perf_counter() - started
        for i in range(5):
            await call(f"warm {tag} {i}")
        return [await call(f"seq {tag} {i}") for i in range(count)]
    finally:
        await client.close()


def run_one_latency(latency_ms, args, workdir):
    repo = workdir / f"repo_{latency_ms}"
    repo.mkdir()
    for name in ("describe", "classifier"):
        (repo / name).symlink_to(REPO / "model_repository" / name)
    fake = server = None
    try:
        try:
            fake = FakeLLM(workdir / f"fake_{latency_ms}.log", latency_ms)
            server = TritonServer(workdir, {"LLM_BASE_URL": fake.base_url, "LLM_API_KEY": "sk-bench",
                                            "LLM_CACHE_ENABLED": "false"},
                                  repository=repo, log_path=workdir / f"triton_{latency_ms}.log")
            server.start()
        except NotReady as error:
            sys.exit(f"bench: {error}")
        via = f"http://{server.http_url}/v2/models/describe/infer"
        direct = f"{fake.base_url}/chat/completions"
        sequential_count = args.sequential if latency_ms < 100 else max(20, args.sequential // 10)
        result = {"latency_ms": latency_ms}
        d = asyncio.run(sequential(direct, direct_payload, direct_ok, sequential_count, f"d{latency_ms}"))
        sdk = asyncio.run(sequential_sdk(fake.base_url, sequential_count, f"s{latency_ms}"))
        t = asyncio.run(sequential(via, triton_payload, triton_ok, sequential_count, f"t{latency_ms}"))
        result["direct"], result["direct_sdk"], result["triton"] = percentiles(d), percentiles(sdk), percentiles(t)
        for base in ("direct", "direct_sdk"):
            result[f"added_over_{base}"] = {k: result["triton"][k] - result[base][k] for k in ("p50", "p90", "p99")}
        count = args.concurrency * (args.rounds if latency_ms >= 100 else args.rounds * 4)
        direct_rps, _ = asyncio.run(concurrent(direct, direct_payload, direct_ok, count, args.concurrency,
                                               f"d{latency_ms}"))
        triton_rps, lat = asyncio.run(concurrent(via, triton_payload, triton_ok, count, args.concurrency,
                                                 f"t{latency_ms}"))
        result["throughput"] = {"in_flight": args.concurrency, "requests": count, "direct_rps": direct_rps,
                                "triton_rps": triton_rps, "triton_latency": percentiles(lat)}
        return result
    finally:
        for handle in (server, fake):
            if handle is not None:
                handle.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latencies", type=float, nargs="+", default=[0, 1000])
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--sequential", type=int, default=300, help="sequential requests at 0 ms (1/10 at 1 s)")
    parser.add_argument("--rounds", type=int, default=3, help="requests per run = concurrency x rounds (x4 at 0 ms)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_describe_") as tmp:
        results = [run_one_latency(latency, args, pathlib.Path(tmp)) for latency in args.latencies]
    print("| upstream latency | direct HTTP p50 / p99 (ms) | direct openai SDK p50 / p99 | via describe p50 / p99 "
          "| added over SDK call p50 | added over raw HTTP p50 "
          f"| {args.concurrency} in flight: via describe / direct (req/s) | via describe p50 / p99 at {args.concurrency} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        d, sdk, t, th = r["direct"], r["direct_sdk"], r["triton"], r["throughput"]
        tl = th["triton_latency"]
        print(f"| {r['latency_ms']:.0f} ms | {d['p50']:.2f} / {d['p99']:.2f} | {sdk['p50']:.2f} / {sdk['p99']:.2f} "
              f"| {t['p50']:.2f} / {t['p99']:.2f} | {r['added_over_direct_sdk']['p50']:.2f} "
              f"| {r['added_over_direct']['p50']:.2f} | {th['triton_rps']:.0f} / {th['direct_rps']:.0f} "
              f"| {tl['p50']:.0f} / {tl['p99']:.0f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
