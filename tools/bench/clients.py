"""Load that perf_analyzer cannot generate, from a Python asyncio client:

1. The one-request ensemble against the two-step client pattern, with the same
   client code, images, distinct prompts, concurrency and fake upstream latency:
     ensemble:  tritonclient.http.aio -> classify_and_describe (IMAGE, PROMPT)
     two-step:  tritonclient.http.aio -> classify (IMAGE), then the client calls the
                LLM itself with the openai SDK (AsyncOpenAI), sending the chat messages
                the describe model would send (backends/classify_describe_server/prompting.py).
   Both keep `concurrency` requests in flight for `duration_s` after a warm-up.
2. The describe model's overhead over calling the upstream directly.
"""

import asyncio
import pathlib
import statistics
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]


def _percentile(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _summary(latencies_s, elapsed_s, errors):
    ms = [v * 1e3 for v in latencies_s]
    return {"throughput": len(ms) / elapsed_s if elapsed_s else 0.0, "count": len(ms), "errors": errors,
            "p50_ms": _percentile(ms, 50), "p99_ms": _percentile(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else float("nan")}


async def _drive(one_request, concurrency, duration_s, warmup_s):
    latencies, errors = [], [0]
    counter = [0]
    finished = [0]  # every request that ended, warm-up included: what CPU totals are divided by
    measuring = [False]
    stop_at = [float("inf")]

    async def worker():
        while time.perf_counter() < stop_at[0]:
            index = counter[0]
            counter[0] += 1
            started = time.perf_counter()
            try:
                await one_request(index)
            except Exception:  # noqa: BLE001 - counted, reported, and the run goes on
                errors[0] += measuring[0]
                continue
            finally:
                finished[0] += 1
            if measuring[0] and time.perf_counter() <= stop_at[0]:
                latencies.append(time.perf_counter() - started)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(warmup_s)
    measuring[0] = True
    begun = time.perf_counter()
    stop_at[0] = begun + duration_s
    await asyncio.gather(*tasks)
    return {**_summary(latencies, duration_s, errors[0]), "finished_all": finished[0]}


def _inputs(module, image, prompt=None):
    tensors = [("IMAGE", image)] + ([("PROMPT", prompt.encode())] if prompt is not None else [])
    inputs = []
    for name, value in tensors:
        tensor = module.InferInput(name, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.object_))
        inputs.append(tensor)
    return inputs


async def run_pattern(pattern, triton_url, llm_base_url, images, prompts, concurrency, duration_s, warmup_s=2.0):
    """pattern: "ensemble" or "two_step"; returns throughput (req/s) and p50/p99 (ms)."""
    import tritonclient.http.aio as httpclient
    from classify_describe_server.prompting import build_messages
    from classify_describe_server.settings import Settings
    from openai import AsyncOpenAI

    settings = Settings()
    triton = httpclient.InferenceServerClient(triton_url, conn_limit=max(100, concurrency * 2),
                                              conn_timeout=120.0)
    llm = AsyncOpenAI(base_url=llm_base_url, api_key="sk-bench-not-a-real-key", timeout=60.0, max_retries=0)

    async def ensemble(index):
        result = await triton.infer("classify_and_describe",
                                    _inputs(httpclient, images[index % len(images)], prompts[index % len(prompts)]))
        if result.as_numpy("DESCRIPTION_SOURCE")[0][0] != b"llm":
            raise RuntimeError("the describe step fell back")

    async def two_step(index):
        result = await triton.infer("classify", _inputs(httpclient, images[index % len(images)]))
        labels = [label.decode() for label in result.as_numpy("LABELS")[0]]
        scores = [float(score) for score in result.as_numpy("SCORES")[0]]
        messages = build_messages(settings, labels, scores, prompts[index % len(prompts)])
        answer = await llm.chat.completions.create(model=settings.model, messages=messages,
                                                   max_tokens=settings.max_tokens,
                                                   temperature=settings.temperature)
        if not answer.choices[0].message.content:
            raise RuntimeError("empty LLM answer")

    try:
        return await _drive(ensemble if pattern == "ensemble" else two_step, concurrency, duration_s, warmup_s)
    finally:
        await triton.close()
        await llm.close()


def measure(pattern, *args, **kwargs):
    return asyncio.run(run_pattern(pattern, *args, **kwargs))


async def run_describe_overhead(triton_url, llm_base_url, prompts, count, warmup=10):
    """One request at a time: the describe model (LABELS, SCORES, PROMPT in) against the
    same chat call made straight to the upstream with the openai SDK. The fake answers
    at once, so the difference is what the Triton step adds."""
    import tritonclient.http.aio as httpclient
    from classify_describe_server.prompting import build_messages
    from classify_describe_server.settings import Settings
    from openai import AsyncOpenAI

    settings = Settings()
    labels = ["Egyptian cat", "tabby, tabby cat", "tiger cat", "lynx, catamount", "window screen"]
    scores = [0.53, 0.21, 0.12, 0.02, 0.01]
    triton = httpclient.InferenceServerClient(triton_url, conn_timeout=60.0)
    llm = AsyncOpenAI(base_url=llm_base_url, api_key="sk-bench-not-a-real-key", timeout=60.0, max_retries=0)

    async def via_triton(index):
        tensors = []
        for name, value, dtype in (("LABELS", np.array([[s.encode() for s in labels]], dtype=np.object_), "BYTES"),
                                   ("SCORES", np.array([scores], dtype=np.float32), "FP32"),
                                   ("PROMPT", np.array([[prompts[index % len(prompts)].encode()]], dtype=np.object_),
                                    "BYTES")):
            tensor = httpclient.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        result = await triton.infer("describe", tensors)
        if result.as_numpy("DESCRIPTION_SOURCE")[0][0] != b"llm":
            raise RuntimeError("the describe step fell back")

    async def direct(index):
        messages = build_messages(settings, labels, scores, prompts[index % len(prompts)])
        await llm.chat.completions.create(model=settings.model, messages=messages,
                                          max_tokens=settings.max_tokens, temperature=settings.temperature)

    timings = {"triton": [], "direct": []}
    try:
        for index in range(warmup):
            await via_triton(10_000_000 + index)
            await direct(index)
        for index in range(count):  # interleaved, so both see the same machine load
            for name, call in (("triton", via_triton), ("direct", direct)):
                started = time.perf_counter()
                await call(index)
                timings[name].append((time.perf_counter() - started) * 1e3)
    finally:
        await triton.close()
        await llm.close()
    out = {name: {"p50_ms": _percentile(v, 50), "p99_ms": _percentile(v, 99), "count": len(v)}
           for name, v in timings.items()}
    out["overhead_p50_ms"] = out["triton"]["p50_ms"] - out["direct"]["p50_ms"]
    out["overhead_p99_ms"] = out["triton"]["p99_ms"] - out["direct"]["p99_ms"]
    return out


def describe_overhead(*args, **kwargs):
    return asyncio.run(run_describe_overhead(*args, **kwargs))
