"""tools/overload.py's Python load generator (tools/overload_users.py): what it
counts, and that it runs, as the C generator does, at the lowest CPU priority."""

import asyncio
import base64
import json
import os
import pathlib
import shutil
import time
import types

import httpx2
import pytest
from stand_in_http import StandInHandler, serving_http

from tools import overload, overload_users

ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": overload.ENSEMBLE,
          "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a cup"}}]}


def test_a_user_counts_answers_and_losses_and_not_what_the_phase_end_cancels():
    """One user: requests 0-2 answered, 3 fails (lost), 4 never ends (cancelled
    at the phase's end: neither). No request awaits anything before 4, so the
    outcome does not depend on the phase's length."""
    async def request(number):
        if number == 3:
            raise RuntimeError("refused for good")
        if number >= 4:
            await asyncio.Event().wait()

    answered, lost = asyncio.run(overload_users.users_phase(request, users=1, seconds=0.05))
    assert len(answered) == 3 and lost == ["RuntimeError: refused for good"]


def test_only_the_answers_that_end_within_the_window_count():
    """A generator short of CPU wakes from its phase's sleep late: an answer
    that ends after the window is not the window's. On a fake clock each
    request takes 0.02 s: answers end at 0.02, 0.04, 0.06 of a 0.05 s window;
    request 3 fails after it (every loss counts), 4 never ends."""
    now = [0.0]

    async def request(number):
        now[0] += 0.02
        if number == 3:
            raise RuntimeError("refused for good")
        if number >= 4:
            await asyncio.Event().wait()

    answers, lost = asyncio.run(overload_users.users_phase(request, users=1, seconds=0.05, clock=lambda: now[0]))
    assert [end for end, _ in answers] == pytest.approx([0.02, 0.04, 0.06]) and lost == ["RuntimeError: refused for good"]
    assert overload_users.in_window(answers, warmup_s=0, seconds=0.05) == pytest.approx([0.02, 0.02])


def test_with_a_warm_up_only_the_answers_after_it_count():
    """Answers ending at 1, 2, 3, 4 s; a 1.5 s warm-up and a 2 s window keep
    those ending at 2 and 3 s (the one at 3.5 s, the window's end, would count)."""
    answers = [(1.0, 0.5), (2.0, 0.6), (3.0, 0.7), (4.0, 0.8)]
    assert overload_users.in_window(answers, warmup_s=1.5, seconds=2.0) == [0.6, 0.7]
    assert overload_users.in_window(answers, warmup_s=0.0, seconds=2.0) == [0.5, 0.6]


def test_a_clients_counts_in_the_window_are_those_since_the_warm_up():
    """The SDK's counts at the warm-up's end are subtracted, key by key, as
    the C generator counts only the window's refusals."""
    before = {"attempts": 5, "retry_after_s": {"1": 4}, "refusals_before_answer": {0: 1}}
    after = {"attempts": 9, "retry_after_s": {"1": 4, "30": 2}, "refusals_before_answer": {0: 3, 2: 1}}
    assert overload_users.counted_since(after, before) == {
        "attempts": 4, "retry_after_s": {"1": 0, "30": 2}, "refusals_before_answer": {0: 2, 2: 1}}
    assert overload_users.counted_since(after, {}) == after


def test_a_python_phase_reports_the_clients_counts_from_the_warm_ups_end():
    """The first request starts before the warm-up's end can be noted (the
    loop runs a new task's first step before a timer), so the window's count
    is short of the whole phase's by at least that one."""
    sent = []

    def make(users):
        async def request(number):
            sent.append(number)
            await asyncio.sleep(0.01)

        async def close():
            pass
        return request, (lambda: {"attempts": len(sent)}), close

    figures = overload_users.python_kind_phase(make, users=1, seconds=0.1, warmup_s=0.1)
    assert 0 <= figures["attempts"] < len(sent) and figures["warmup_s"] == 0.1


def sdk_phase(handler, retries=3):
    """overload_users.openai_sdk driven by one user through an httpx2 mock
    transport: -> (answered, lost, counts) of requests 0 and 1 only."""
    make = overload_users.openai_sdk("http://front.invalid/v1", b"photo", timeout_s=5, retries=retries,
                                     transport=httpx2.MockTransport(handler))

    async def main():
        request, counts, close = make(1)
        answered, lost = 0, []
        for number in range(2):
            try:
                await request(number)
                answered += 1
            except Exception as error:  # noqa: BLE001 - as users_phase: the request is lost
                lost.append(type(error).__name__)
        await close()
        return answered, lost, counts()
    return asyncio.run(main())


def test_the_sdks_hidden_attempts_are_counted_refusals_and_no_answers_apart():
    """Request 0: refused (503 + Retry-After), then no answer (the connection
    closed under the body), then answered; request 1 answered at once. The
    SDK retried twice without the caller seeing it: 4 attempts, 1 refusal, 1
    attempt without an answer."""
    attempts = []

    def handler(request):
        attempts.append(json.loads(request.content)["messages"][0]["content"][0]["text"])
        if len(attempts) == 1:
            return httpx2.Response(503, headers={"Retry-After": "0.01"}, json={"error": {"message": "busy"}})
        if len(attempts) == 2:
            raise httpx2.WriteError("connection closed while writing", request=request)
        return httpx2.Response(200, json=ANSWER)

    answered, lost, counts = sdk_phase(handler)
    assert (answered, lost) == (2, [])
    answered_attempts = counts.pop("answered_attempts")
    assert counts == {"attempts": 4, "rejected": 1, "no_answer": 1, "no_answer_reasons": {"WriteError": 1},
                      "retry_after_s": {"0.01": 1}, "refusals_before_answer": {0: 1, 1: 1},
                      "refused_by": {"busy": 1}}
    # Only the answered attempts are timed: the refusal's wait and resend are not in them.
    assert len(answered_attempts) == 2 and all(0 <= latency < 0.01 for _, latency in answered_attempts)
    assert attempts[0] == attempts[1] == attempts[2] != attempts[3]  # the SDK resent request 0 itself


def test_a_request_refused_past_the_sdks_retries_is_lost_and_each_refusal_counted():
    waits = iter(["0.02", "0.01", None, "0.01"])

    def handler(request):
        wait = next(waits)
        return httpx2.Response(503, headers={"Retry-After": wait} if wait else {}, json={"error": {"message": "busy"}})

    answered, lost, counts = sdk_phase(handler, retries=1)
    assert answered == 0 and lost == ["InternalServerError", "InternalServerError"]
    assert counts == {"attempts": 4, "rejected": 4, "no_answer": 0, "no_answer_reasons": {},
                      "retry_after_s": {"0.01": 2, "0.02": 1, "none": 1},  # by Retry-After, in order
                      "refusals_before_answer": {}, "refused_by": {"busy": 4}, "answered_attempts": []}


def test_each_request_is_the_body_and_headers_chat_completions_create_sends():
    """The generator encodes the photo once; the front must see the very bytes
    and headers the SDK's own create() sends for the same prompt and photo."""
    sent = []

    def handler(request):
        sent.append(request)
        return httpx2.Response(200, json=ANSWER)

    photo = bytes(range(256)) * 3  # every byte value: the base64 and JSON escaping are exercised
    make = overload_users.openai_sdk("http://front.invalid/v1", photo, timeout_s=5, retries=0,
                                     transport=httpx2.MockTransport(handler))

    async def ours():
        request, _, close = make(1)
        await request(7)
        await close()
    asyncio.run(ours())
    prompt = json.loads(sent[0].content)["messages"][0]["content"][0]["text"]
    assert prompt.startswith("What is it? (") and prompt.endswith("-7)")

    async def sdks():
        import openai
        client = openai.AsyncOpenAI(base_url="http://front.invalid/v1", api_key="sk-overload-unused", max_retries=0, timeout=5,
                                    http_client=openai.DefaultAsyncHttpxClient(transport=httpx2.MockTransport(handler)))
        await client.chat.completions.create(model=overload.ENSEMBLE, messages=[{"role": "user", "content": [
            {"type": "text", "text": prompt},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(photo).decode()}}]}])
        await client.close()
    asyncio.run(sdks())
    ours_sent, sdks_sent = sent
    assert ours_sent.content == sdks_sent.content
    assert (ours_sent.method, ours_sent.url) == (sdks_sent.method, sdks_sent.url)
    assert dict(ours_sent.headers) == dict(sdks_sent.headers)


def test_a_prompt_that_needs_escaping_is_still_valid_json():
    head, tail = overload_users.chat_body_around_prompt(b"photo")
    prompt = 'a "quoted" \\ prompt, \u00e9t\u00e9'
    body = json.loads(head + json.dumps(prompt, ensure_ascii=False).encode() + tail)
    assert body["messages"][0]["content"][0]["text"] == prompt and body["model"] == overload.ENSEMBLE


@pytest.mark.parametrize("nice, prefix", [(19, ["nice", "-n", "19"]), (0, [])])
def test_a_generator_runs_at_the_niceness_asked(nice, prefix):
    assert overload.generator_argv(["gen", "a"], nice) == [*prefix, "gen", "a"]


class StandInFront(StandInHandler):
    """The OpenAI front's chat completions, answering every request; records the
    niceness of the process that sent it (the test process's child)."""

    nices = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.nices.append(children_nices())
        self.answer(200, ANSWER)


def children_nices():
    """{niceness} of this process's load-generator children (Linux /proc): the C client or
    tools.overload_users; other children of a whole-suite run (a session's servers) are not theirs."""
    nices = set()
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == os.getpid() and b"overload" in command:  # fields[1]: the parent's pid
            nices.add(int(fields[16]))     # fields[16]: the niceness
    return nices


@pytest.fixture
def front():
    StandInFront.nices = []
    with serving_http(StandInFront) as address:
        yield address


def test_the_python_users_run_in_their_own_process_at_the_lowest_priority(front, tmp_path):
    (tmp_path / "photo").write_bytes(b"photo")
    args = types.SimpleNamespace(timeout_s=5, client_retries=2, backoff_s=0.5, generator_nice=19, warmup_s=0.5,
                                 sdk_http="aiohttp")
    figures = overload.python_phase_of("openai", f"http://{front}/v1", tmp_path / "photo", args)(1, 1.0)
    assert figures["load_generator_nice"] == 19 and figures["users"] == 1
    assert figures["admitted"] >= 1 and figures["lost"] == 0 and figures["rejected"] == 0
    # Counted from the warm-up's end: an attempt sent before it may be answered after it.
    assert figures["attempts"] >= figures["admitted"] - 1 and figures["no_answer"] == 0
    assert StandInFront.nices and all(nices == {19} for nices in StandInFront.nices)
    assert figures["load_generator_cpu_share"] >= 0


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_c_users_run_at_the_lowest_priority(front, tmp_path):
    (tmp_path / "photo").write_bytes(b"photo")
    figures = overload.c_phase(overload.compile_c_client(tmp_path), front, tmp_path / "photo", users=1,
                               seconds=1.0, timeout_s=5, backoff_base_s=0.01, openai=True, nice=19)
    assert figures["admitted"] >= 1 and figures["lost"] == 0
    assert StandInFront.nices and all(nices == {19} for nices in StandInFront.nices)


def test_the_project_clients_counts_split_server_refusals_from_its_own():
    # Every attempt refused by the server (503): after min_requests the client's throttle
    # refuses most of the rest itself; "rejected" counts only resends after the server's refusals.
    seen = []

    class AlwaysFull(StandInHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.path)
            self.answer(503, {"error": "Exceeds maximum queue size"})

    with serving_http(AlwaysFull) as url:
        make = overload_users.project_client(url, "http", b"photo", timeout_s=5, retries=0, backoff_s=0.0)

        async def run():
            request, counts, close = make(1)
            for number in range(60):
                with pytest.raises(Exception):  # noqa: B017 - refused, by the server or by the client
                    await request(number)
            await close()
            return counts()

        counts = asyncio.run(run())
    assert counts["throttled"] >= 20 and counts["throttled"] + len(seen) == 60
    assert counts["rejected"] == 0  # retries=0: nothing resent


@pytest.mark.parametrize("expect", [False, True])
def test_the_expect_kind_says_expect_100_continue_and_sends_the_same_body(expect):
    """openai-front-expect's users: the same request as openai-front's, with the header."""
    sent = []

    def handler(request):
        sent.append(request)
        return httpx2.Response(200, json=ANSWER)

    make = overload_users.openai_sdk("http://front.invalid/v1", b"photo", timeout_s=5, retries=0,
                                     transport=httpx2.MockTransport(handler), expect=expect)

    async def main():
        request, _, close = make(1)
        await request(3)
        await close()
    asyncio.run(main())
    assert sent[0].headers.get("Expect") == ("100-continue" if expect else None)
    assert json.loads(sent[0].content)["messages"][0]["content"][1]["image_url"]["url"].endswith(
        base64.b64encode(b"photo").decode())


def test_refusals_are_split_by_the_limit_that_gave_them():
    """The front's own messages, numbers as N; a 503 that is not an OpenAI error is named so."""
    bodies = [
        {"error": {"message": "the front holds 64 requests already, as many as Triton takes now (at most "
                              "OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT); retry after Retry-After seconds"}},
        {"error": {"message": "the front holds 12 requests already, as many as Triton takes now (at most X)"}},
        {"error": {"message": "the front is reading 16 request bodies already (OPENAI_FRONT_MAX_BODIES_IN_FLIGHT); "
                              "retry after Retry-After seconds"}},
        None,
    ]
    sent = iter(bodies)

    def handler(request):
        body = next(sent, "answer")
        if body == "answer":
            return httpx2.Response(200, json=ANSWER)
        if body is None:
            return httpx2.Response(503, headers={"Retry-After": "0.01"}, text="<html>Service Unavailable</html>")
        return httpx2.Response(503, headers={"Retry-After": "0.01"}, json=body)

    answered, lost, counts = sdk_phase(handler, retries=5)
    assert (answered, lost) == (2, [])
    assert counts["refused_by"] == {
        "the front holds N requests already, as many as Triton takes now (at most OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT)": 1,
        "the front holds N requests already, as many as Triton takes now (at most X)": 1,
        "the front is reading N request bodies already (OPENAI_FRONT_MAX_BODIES_IN_FLIGHT)": 1,
        "not an OpenAI error": 1}


def test_a_python_phase_reports_the_answered_attempts_of_the_window_apart_from_the_answers():
    """The answers' latencies include the client's retries (a Retry-After's wait); the
    answered attempts' alone are what the target on admitted requests' latency judges.
    Only the attempts that ended in the measured window count, by their end, as the answers."""
    attempts, start = [], []

    def make(users):
        async def request(number):
            await asyncio.sleep(0.02)  # a retry's wait, hidden in the answer's latency
            now = time.monotonic()
            start[:] = start or [now]
            if now - start[0] < 0.1:
                attempts.append((now, 0.5))  # in the warm-up: slow, left out
            elif now - start[0] > 0.5:
                attempts.append((now, 0.004))  # well inside the window
            await asyncio.sleep(0.005)

        async def close():
            pass
        return request, (lambda: {"rejected": 0, "answered_attempts": list(attempts)}), close

    figures = overload_users.python_kind_phase(make, users=1, seconds=0.6, warmup_s=0.3)
    assert attempts[0][1] == 0.5 and figures["answered_attempt_p99_ms"] == 4.0
    assert figures["answered_attempt_p50_ms"] == 4.0
    assert figures["admitted_p50_ms"] >= 20  # the answers: the wait included
    assert "answered_attempts" not in figures
