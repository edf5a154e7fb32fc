"""The Python clients' users for `make overload` (tools/overload.py), in a
process of their own so that tools/overload.py can run it at the lowest CPU
priority (`nice -n 19`): the load generator stands for clients on other
machines, and on a shared 2-core host it should take only the CPU the server
leaves. Prints the phase's figures (JSON) on stdout.

    python -m tools.overload_users {grpc,http,openai} URL IMAGE USERS SECONDS
        [--timeout-s S] [--retries N] [--backoff-s S] [--warmup-s S] [--sdk-http aiohttp|httpx]

grpc, http: classify_describe.AsyncClient(retries=N) to Triton (URL host:port);
openai: the openai SDK (max_retries=N) to the OpenAI front (URL .../v1), on
the SDK's aiohttp client (--sdk-http; its httpx default costs 4x). One
client per process, shared by every user, as one application serving many
users holds one.
"""

import argparse
import asyncio
import base64
import collections
import contextvars
import itertools
import json
import os
import pathlib
import random
import re
import sys
import time

import httpx2

from tools.overload import ENSEMBLE, percentile_ms, summary, timeline


async def users_phase(request, users, seconds, clock=time.monotonic):
    """Closed-loop users of a Python client: each sends `request(number)` (which
    retries as that client does), waits for it and sends the next, for
    `seconds`; then every unfinished request is cancelled (neither answered
    nor lost). -> (answers, lost reasons): every answer as (its end in s since
    the start, its latency), and every loss, as the C generator counts them.
    A generator short of CPU wakes up late from its sleep: `in_window` keeps
    only the answers that ended within the window."""
    answered, lost = [], []
    numbers = itertools.count()
    start = clock()

    async def user():
        while True:
            started = clock()
            try:
                await request(next(numbers))
            except Exception as error:  # noqa: BLE001 - whatever it is, the request is lost
                lost.append(f"{type(error).__name__}: {str(error)[:160]}")
                continue
            ended = clock()
            answered.append((ended - start, ended - started))

    tasks = [asyncio.ensure_future(user()) for _ in range(users)]
    await asyncio.sleep(seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return answered, lost


def in_window(answers, warmup_s, seconds):
    """The latencies of the answers (end, latency) that ended within the
    measured window: the `seconds` after the first `warmup_s` (as
    tools/overload.py's parse_attempts for the C generator)."""
    return [latency for end, latency in answers if warmup_s < end <= warmup_s + seconds]


def python_kind_phase(make_request, users, seconds, warmup_s=0.0):
    """users_phase for `warmup_s` + `seconds` in a new event loop;
    `make_request(users)` -> (request, counts, close), counts() a dict of what
    the client saw (at least "rejected": its resends after a refusal). Figures
    as tools/overload.py's c_phase, over the measured `seconds`; latencies
    include the retries. The CPU is this process's during the phase (the
    imports and the client's construction before it are not counted: a
    running application has done them once)."""
    async def main():
        request, counts, close = make_request(users)
        cpu_before, started = time.process_time(), time.monotonic()
        at_window = {}  # the client's counts when the warm-up ends
        asyncio.get_running_loop().call_later(warmup_s, lambda: at_window.update(counts()))
        try:
            answers, lost = await users_phase(request, users, warmup_s + seconds)
        finally:
            await close()
        final = counts()
        # (end, latency) pairs, kept by their end as the answers are (in_window): a timer of a
        # generator short of CPU fires late, and the phase's end cancels late.
        attempts = final.pop("answered_attempts", None)
        at_window.pop("answered_attempts", None)
        if attempts is not None:
            attempts = in_window([(end - started, latency) for end, latency in attempts], warmup_s, seconds)
        return (answers, lost, counted_since(final, at_window), attempts, time.process_time() - cpu_before,
                time.monotonic() - started)

    answers, lost, counts, attempts_s, cpu_s, elapsed_s = asyncio.run(main())
    figures = summary(users, seconds, in_window(answers, warmup_s, seconds), [], lost)
    figures.update(warmup_s=warmup_s, answered_per_s_by_5s=timeline([end for end, _ in answers]))
    # The SDK's answered attempts alone (its retries' waits are in the answers' latencies):
    # what the target on admitted requests' latency judges.
    if attempts_s is not None:
        figures.update(answered_attempt_p50_ms=percentile_ms(attempts_s, 50),
                       answered_attempt_p99_ms=percentile_ms(attempts_s, 99))
    # Over the measured window, as the C generator's refusals: "rejected", the resends
    # seen by the client (their latency is inside the answers').
    figures.update(counts)
    # Over the phase as it lasted (a generator short of CPU ends late), as c_phase.
    figures["load_generator_cpu_share"] = round(cpu_s / elapsed_s, 3)
    # A fact read from the process, not the setting: what the scheduler gave it.
    figures["load_generator_nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    return figures


def counted_since(after, before):
    """What a client counted since `before`, key by key (nested counts too)."""
    if isinstance(after, dict):
        return {key: counted_since(value, before.get(key, {} if isinstance(value, dict) else 0))
                for key, value in after.items()}
    return after - before


def project_client(url, protocol, image, timeout_s, retries, backoff_s):
    """classify_describe.AsyncClient with its documented policy: retries with
    back-off and full jitter, and its adaptive throttle (README "Under
    overload"); one client for all users, so one throttle sees them all."""
    from classify_describe import AsyncClient

    def make(users):
        client = AsyncClient(url, protocol, concurrency=users, timeout_s=timeout_s,
                             retries=retries, retry_backoff_s=backoff_s)
        tag = f"{random.getrandbits(32):08x}"

        async def request(number):
            # A new prompt each time: the describe step's answer cache would
            # otherwise hide the LLM's latency.
            await client.infer(image, prompt=f"What is it? ({tag}-{number})")

        # "rejected": resends after the server's refusals; "throttled": attempts the
        # client's throttle refused itself, never sent.
        return request, (lambda: {"rejected": client.retried, "throttled": client.throttled}), client.close
    return make


def openai_sdk(base_url, image, timeout_s, retries, transport=None, http="aiohttp", expect=False):
    """The openai SDK against the front: its own retries, which honour
    Retry-After. One AsyncOpenAI (one connection pool, sized for the users)
    for all users, on `http`: "aiohttp", the SDK's DefaultAioHttpClient (the
    `openai[aiohttp]` extra, which its README advises for concurrency; about
    a quarter of httpx's CPU per attempt with thousands of connections, whose
    pool httpx scans on every request), or "httpx", its default. Counts every
    attempt the SDK makes (its retries are invisible to the caller):
    "attempts" (those still in flight when the phase ends included),
    "rejected" (503 answers: the front's refusals), "retry_after_s" (the
    refusals by the Retry-After they carried), "refusals_before_answer"
    (answered requests by how many times the SDK was refused first: against
    its max_retries) and "no_answer" (attempts that
    got no answer at all, e.g. a connection closed while the SDK still wrote
    its body; the SDK retries those with its own back-off, not the front's
    Retry-After), with "no_answer_reasons" (exception name -> count).
    `transport`: the one under the count, for tests (default: `http`'s own,
    pooled for the users). `expect`: every request says `Expect:
    100-continue` (the SDK's `default_headers`), the policy README gives SDK
    users of the front: on the aiohttp client the body then waits for 100
    Continue, so a refusal costs no body (httpx sends it anyway).

    Each request is the very body `chat.completions.create` would send (the
    same bytes; tests/unit/test_overload_users.py), but encoded once: create
    JSON-encodes its 622 KB data URI again on every attempt (about half of
    what an attempt costs the client), which the clients this generator
    stands for would pay on their own machines. Sent with the SDK's own
    `post`, so its retries and response parsing are create's."""
    import openai
    from openai._vendor.httpx_aiohttp import AiohttpTransport  # DefaultAioHttpClient's, for the count to wrap
    from openai.types.chat import ChatCompletion

    head, tail = chat_body_around_prompt(image)
    aio = http == "aiohttp"

    def make(users):
        limits = httpx2.Limits(max_connections=users + 8, max_keepalive_connections=users + 8)
        inner = transport or (AiohttpTransport(limits=limits) if aio else httpx2.AsyncHTTPTransport(limits=limits))
        counting = CountingTransport(inner, refusals_of_request)
        http_client = (openai.DefaultAioHttpClient if aio else openai.DefaultAsyncHttpxClient)(transport=counting)
        client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-overload-unused", max_retries=retries,
                                    timeout=timeout_s, http_client=http_client,
                                    default_headers={"Expect": "100-continue"} if expect else None)
        tag = f"{random.getrandbits(32):08x}"

        async def request(number):
            # A new prompt each time: the describe step's answer cache would
            # otherwise hide the LLM's latency.
            prompt = json.dumps(f"What is it? ({tag}-{number})", ensure_ascii=False).encode()
            refused = [0]  # the SDK's attempts run in this task: the transport counts its refusals here
            refusals_of_request.set(refused)
            await client.post("/chat/completions", cast_to=ChatCompletion, content=head + prompt + tail)
            counting.refusals_before_answer[refused[0]] += 1

        return request, counting.counts, client.close
    return make


def chat_body_around_prompt(image):
    """(head, tail): the JSON body of a chat completion asking about `image`
    (a data URI) with a prompt, encoded as the openai SDK encodes it
    (compact, UTF-8), less the prompt's JSON string between head and tail."""
    data_uri = "data:image/png;base64," + base64.b64encode(image).decode()
    marker = "\x00prompt\x00"
    body = json.dumps({"model": ENSEMBLE, "messages": [{"role": "user", "content": [
        {"type": "text", "text": marker}, {"type": "image_url", "image_url": {"url": data_uri}}]}]},
        ensure_ascii=False, separators=(",", ":")).encode()
    head, tail = body.split(json.dumps(marker, ensure_ascii=False).encode())
    return head, tail


# The refusals of the request the current task is sending ([count]), if it keeps one.
refusals_of_request = contextvars.ContextVar("refusals_of_request", default=None)


class CountingTransport(httpx2.AsyncBaseTransport):
    """Every attempt sent through `inner`, and how each ended: answered (503:
    refused, by its Retry-After) or not answered at all (by exception name).
    A refusal also counts in `refusals` (a ContextVar of [count]) where the
    caller keeps one for the request."""

    def __init__(self, inner, refusals=refusals_of_request):
        self.inner, self.refusals = inner, refusals
        self.attempts, self.rejected = 0, 0
        self.no_answer, self.retry_after = collections.Counter(), collections.Counter()
        self.refusals_before_answer = collections.Counter()  # kept by the caller
        self.refused_by = collections.Counter()  # which of the server's limits refused (refusal_reason)
        self.answered = []  # (end, latency) of each answered (200) attempt, to its answer's headers, s

    async def handle_async_request(self, request):
        self.attempts += 1
        started = time.monotonic()
        try:
            response = await self.inner.handle_async_request(request)
        except Exception as error:
            self.no_answer[type(error).__name__] += 1
            raise
        if response.status_code == 200:  # a whole answer's headers come with its body, at its end
            ended = time.monotonic()
            self.answered.append((ended, ended - started))
        if response.status_code == 503:
            self.rejected += 1
            self.retry_after[response.headers.get("retry-after", "none")] += 1
            self.refused_by[refusal_reason(await response.aread())] += 1
            if (refused := self.refusals.get()) is not None:
                refused[0] += 1
        return response

    async def aclose(self):
        await self.inner.aclose()

    def counts(self):
        return {"attempts": self.attempts, "rejected": self.rejected,
                "no_answer": sum(self.no_answer.values()), "no_answer_reasons": dict(self.no_answer),
                "retry_after_s": dict(sorted(self.retry_after.items(), key=lambda item: _number(item[0]))),
                "refusals_before_answer": dict(sorted(self.refusals_before_answer.items())),
                "refused_by": dict(self.refused_by.most_common()),
                "answered_attempts": list(self.answered)}


def refusal_reason(body):
    """Which limit refused, from a 503's OpenAI error message: its first clause with the
    numbers in it as N ("the front holds N requests already, as many as Triton takes now
    (at most ...)", "the server is overloaded (<Triton's own reason>)"), so that the
    refusals split by limit (requests in flight, bodies being read, image bytes, Triton's
    queue) without this generator knowing the front's wording."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "not an OpenAI error"
    return re.sub(r"\d+", "N", message.split(";", 1)[0]).strip()[:160]


def _number(text):
    try:
        return float(text)
    except ValueError:
        return float("inf")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("client", choices=("grpc", "http", "openai"))
    parser.add_argument("url")
    parser.add_argument("image", type=pathlib.Path)
    parser.add_argument("users", type=int)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--timeout-s", type=float, default=60)
    parser.add_argument("--retries", type=int, default=50)
    parser.add_argument("--backoff-s", type=float, default=0.5)
    parser.add_argument("--warmup-s", type=float, default=0.0, help="seconds before the measured SECONDS")
    parser.add_argument("--sdk-http", choices=("aiohttp", "httpx"), default="aiohttp")
    parser.add_argument("--expect", action="store_true", help="openai: each request with Expect: 100-continue")
    args = parser.parse_args(argv)
    image = args.image.read_bytes()  # once: every user sends the same photo
    if args.client == "openai":
        make = openai_sdk(args.url, image, args.timeout_s, args.retries, http=args.sdk_http, expect=args.expect)
    else:
        make = project_client(args.url, args.client, image, args.timeout_s, args.retries, args.backoff_s)
    print(json.dumps(python_kind_phase(make, args.users, args.seconds, args.warmup_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
