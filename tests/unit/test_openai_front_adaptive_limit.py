"""How many requests the front passes on to Triton (openai_front/shedding.py,
AdaptiveLimit): learnt from Triton's refusals, so that it keeps Triton busy
whatever the LLM's latency, where a fixed number suits one latency only.

A simulation in fake time (no clock, no sockets) of a flood of clients, the
front, and a model of the server: two executors behind a queue that refuses
past 128 waiting and after 2 s (as model_repository's configs do), then the
LLM's latency. Then the front itself, with Triton's own refusal texts."""

import asyncio
import collections
import heapq
import json
import pathlib
import random

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from classify_describe_server import error_contract as contract
from test_openai_front import PNG, StalledPool, body, front_with
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from openai_front import app as front_app
from openai_front import keys as front_keys
from openai_front import settings, triton
from openai_front.errors import FrontError
from openai_front.shedding import AdaptiveLimit, ImageBytes
from openai_front.triton import Answer, front_error
from scripts import make_gpu_config
from tools import model_config

EXECUTORS, EXECUTION_S = 2, 0.044  # 45 answers/s: the 2-core host's saturation
QUEUE_MAX, QUEUE_TIMEOUT_S = 128, AdaptiveLimit.TRITON_QUEUE_LIMIT_S
CAPACITY = EXECUTORS / EXECUTION_S
REPOSITORY = pathlib.Path(__file__).resolve().parents[2] / "model_repository"


class FixedLimit(AdaptiveLimit):
    """The front before: one number for every LLM and host."""

    def answered(self, in_flight):
        pass

    def refused(self, passed_at, in_flight=None):
        pass


def simulate(limit, llm_s, clients=2000, seconds=120.0, resend_s=(0.05, 0.5)):
    """Clients that resend a refused request after a short random wait, each its
    next request at once after its answer. Returns, over the second half:
    answers/s, and Triton's refusals per answer (bodies the front read for nothing)."""
    rng, clock = random.Random(1), [0.0]
    limit.clock = lambda: clock[0]
    events = [(rng.uniform(0, 1), "attempt") for _ in range(clients)]
    heapq.heapify(events)
    queue, busy, in_flight = collections.deque(), 0, 0
    answers, refused_inside, half = 0, 0, seconds / 2

    def push(at, kind):
        heapq.heappush(events, (at, kind))

    def start_next(now):
        nonlocal busy, refused_inside, in_flight
        while queue and busy < EXECUTORS:
            enqueued = queue.popleft()
            if now - enqueued > QUEUE_TIMEOUT_S:  # Triton: "Request timeout expired"
                limit.refused(enqueued, in_flight)
                in_flight -= 1
                refused_inside += now > half
                push(now + rng.uniform(*resend_s), "attempt")
                continue
            busy += 1
            push(now + EXECUTION_S, "executed")

    while events:
        now, kind = heapq.heappop(events)
        if now > seconds:
            break
        clock[0] = now
        if kind == "attempt":
            if not limit.allows(in_flight):
                push(now + rng.uniform(*resend_s), "attempt")  # the front's refusal, from the headers
            elif len(queue) >= QUEUE_MAX:  # Triton: "Exceeds maximum queue size"
                limit.refused(now, in_flight + 1)  # the refused one was at Triton too
                refused_inside += now > half
                push(now + rng.uniform(*resend_s), "attempt")
            else:
                in_flight += 1
                queue.append(now)
                start_next(now)
        elif kind == "executed":
            busy -= 1
            push(now + llm_s, "answered")
            start_next(now)
        else:
            limit.answered(in_flight)
            in_flight -= 1
            answers += now > half
            push(now, "attempt")
    return answers / half, refused_inside / max(answers, 1)


@pytest.mark.parametrize("llm_s, seconds", [(0.2, 120), (1.0, 120), (5.0, 120), (10.0, 240)])
def test_the_front_keeps_the_server_busy_whatever_the_llms_latency(llm_s, seconds):
    answered, wasted = simulate(AdaptiveLimit(ceiling=1024), llm_s, seconds=seconds)
    assert answered >= 0.97 * CAPACITY, f"{answered:.1f}/s of {CAPACITY:.1f}: the front passed on too few"
    assert wasted <= 0.01, f"{wasted:.3f} of the answers again in bodies Triton refused"


@pytest.mark.parametrize("llm_s", [5.0, 10.0])
def test_the_fixed_limit_it_replaces_starves_the_server_behind_a_slow_llm(llm_s):
    """The baseline (and what the test above would catch): 96 at once is 96 / latency answers/s."""
    answered, wasted = simulate(FixedLimit(ceiling=96, start=96), llm_s)
    assert answered <= 96 / llm_s * 1.05 < 0.5 * CAPACITY and wasted == 0


def test_refusals_that_cut_by_a_fraction_would_cost_a_tenth_of_the_answers():
    """Why the cut is the answers of QUEUE_CUT_S and the creep slow: a tenth off
    at each refusal and one more per answer (Netflix's AIMD defaults) holds the
    queue at Triton's limit, where it refuses bodies the front already read."""
    class Fraction(AdaptiveLimit):
        def answered(self, in_flight):
            if 2 * in_flight >= self.value:
                self.value = min(self.value + 1, self.ceiling)

        def refused(self, passed_at, in_flight=None):
            if passed_at >= self.last_cut:
                self.value, self.last_cut = max(self.value * 0.9, self.floor), self.clock()

    _, wasted = simulate(Fraction(ceiling=1024), 1.0)
    assert wasted > 0.2


def test_the_limit_stays_under_its_ceiling():
    limit = AdaptiveLimit(ceiling=200)
    simulate(limit, llm_s=10.0, seconds=60.0)
    assert limit.value == 200  # 45/s x 10 s would want 450


def answers(limit, per_s, seconds, clock):
    for _ in range(int(per_s * seconds)):
        clock[0] += 1 / per_s
        limit.answered(in_flight=0)  # under half in use: no change to the limit, only the pace


def test_a_refusal_cuts_a_second_of_answers_and_a_burst_cuts_once():
    clock = [0.0]
    limit = AdaptiveLimit(ceiling=1024, start=100, clock=lambda: clock[0])
    answers(limit, per_s=20, seconds=10, clock=clock)
    passed = clock[0]
    for _ in range(50):  # all passed on before the first cut: the cut answered them all
        limit.refused(passed)
    assert limit.value == pytest.approx(80)
    cut_at = clock[0]
    answers(limit, per_s=20, seconds=AdaptiveLimit.TRITON_QUEUE_LIMIT_S + 1, clock=clock)
    # Passed on just after the cut, they waited behind the queue that refused: old news too.
    for passed in (cut_at, cut_at + 0.5, cut_at + AdaptiveLimit.TRITON_QUEUE_LIMIT_S - 0.01):
        limit.refused(passed)
    assert limit.value == pytest.approx(80)
    limit.refused(cut_at + AdaptiveLimit.TRITON_QUEUE_LIMIT_S)  # past Triton's queue limit: news
    assert limit.value == pytest.approx(60)


def test_a_refusal_cuts_from_the_requests_held_where_fewer_than_the_limit_and_at_most_halves_it():
    """RFC 5681's FlightSize, not cwnd: a limit grown while not in use (clients away for their
    Retry-Afters) says nothing of what Triton holds; cut from it, the burst coming back would
    still pass to Triton's full queue. 40 answers/s: each cut is 40."""
    clock = [0.0]
    limit = AdaptiveLimit(ceiling=1024, start=300, clock=lambda: clock[0])
    answers(limit, per_s=40, seconds=10, clock=clock)
    limit.value = 300.0
    limit.refused(clock[0], in_flight=250)
    assert limit.value == pytest.approx(250 - 40, abs=1)
    for in_flight, expected in ((400, lambda before: before - 40),  # more held than the limit: from the limit
                                (3, lambda before: before / 2)):  # few of ours held (others fill Triton)
        answers(limit, per_s=40, seconds=AdaptiveLimit.TRITON_QUEUE_LIMIT_S + 0.1, clock=clock)  # past the recovery
        before = limit.value
        limit.refused(clock[0], in_flight=in_flight)
        assert limit.value == pytest.approx(expected(before), abs=1)


def test_it_ramps_until_a_refusal_then_creeps_then_ramps_again_after_a_quiet_while():
    clock = [0.0]
    limit = AdaptiveLimit(ceiling=1024, start=100, clock=lambda: clock[0])
    limit.answered(in_flight=49)
    assert limit.value == 100  # under half in use: no evidence that more would be taken
    limit.answered(in_flight=50)
    assert limit.value == 101
    limit.refused(clock[0])
    limit.answered(in_flight=100)
    assert limit.value == pytest.approx(100 + AdaptiveLimit.CREEP_PER_ANSWER)
    clock[0] += AdaptiveLimit.PROBE_AFTER_S + 1
    limit.answered(in_flight=100)
    assert limit.value == pytest.approx(101 + AdaptiveLimit.CREEP_PER_ANSWER)


def test_the_floor_and_a_ceiling_under_it():
    clock = [0.0]
    limit = AdaptiveLimit(ceiling=1024, start=10, floor=8, clock=lambda: clock[0])
    for _ in range(20):
        clock[0] += AdaptiveLimit.TRITON_QUEUE_LIMIT_S
        limit.refused(clock[0])
    assert limit.value == 8 and limit.allows(7) and not limit.allows(8)
    small = AdaptiveLimit(ceiling=1)  # OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT=1: exactly one, always
    small.refused(0.0)
    assert small.allows(0) and not small.allows(1)


@pytest.mark.parametrize("message, overload", [
    ("in ensemble 'classify_and_describe', [request id: 6192] Exceeds maximum queue size", True),
    ("in ensemble 'classify_and_describe', Request timeout expired", True),
    (contract.tagged(contract.OVERLOADED, "the describe step's LLM queue is full"), True),
    # not for load: fewer requests passed on would not help
    ("Server is stopping, scheduler for model has stopped accepting new inference requests", False),
    (contract.tagged(contract.MODEL_UNLOADING, "the model is unloading"), False),
    (contract.tagged(contract.UPSTREAM_UNAVAILABLE, "the LLM upstream could not answer (timeout)"), False),
    ("Request for unknown model: 'classify_and_describe' is not found", False),
    (contract.tagged(contract.INVALID_INPUT, "IMAGE format GIF is not supported (use one of JPEG, PNG)", "IMAGE"),
     False),
])
def test_only_refusals_for_load_count(message, overload):
    assert front_error(InferenceServerException(message)).overload is overload


class RefusingPool(StalledPool):
    """Answers every request with one of Triton's refusals, or with an answer once `answer` is set."""

    def __init__(self, message):
        super().__init__()
        self.message, self.answer = message, None

    async def infer(self, *args, **kwargs):
        if self.answer is not None:
            return self.answer
        raise front_error(InferenceServerException(self.message))


@pytest.mark.parametrize("message, cut", [("in ensemble 'classify_and_describe', Request timeout expired", True),
                                          ("Server is stopping, scheduler for model has stopped accepting", False)])
def test_the_front_cuts_on_tritons_refusals_for_load(message, cut):
    pool = RefusingPool(message)
    app = front_with(pool, max_requests_in_flight=100)

    async def main():
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                    data=json.dumps(body())) as answer:
                return answer.status, app[front_keys.ADMISSION].limit

    status, limit = asyncio.run(main())
    assert status == 503
    assert (limit.value, limit.cuts) == ((32, 1) if cut else (64, 0))  # from the one held: at most half


class RecordingLimit(AdaptiveLimit):
    def __init__(self):
        super().__init__(ceiling=1024)
        self.seen = []

    def answered(self, in_flight):
        self.seen.append(("answered", in_flight))

    def refused(self, passed_at, in_flight=None):
        self.seen.append(("refused", in_flight))


def test_only_successful_answers_and_refusals_for_load_reach_the_limit():
    """A 4xx answered at once (a flood of bad requests) says nothing of what Triton takes."""
    pool = RefusingPool("in ensemble 'classify_and_describe', Request timeout expired")
    pool.answer = Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}, description="A cup")
    app = front_with(pool, max_requests_in_flight=100)
    limit = RecordingLimit()

    async def main():
        app[front_keys.ADMISSION].limit = limit
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
            statuses = []
            for data in (json.dumps(body()), "{not json", json.dumps({**body(), "model": "no-such-model"})):
                async with session.post(url, data=data) as answer:
                    statuses.append(answer.status)
            return statuses

    assert asyncio.run(main()) == [200, 400, 404]
    assert limit.seen == [("answered", 1)]


class ScriptedPool(StalledPool):
    """Each call waits for `go`, then answers, refuses for load, or (streams) sends
    the labels and then fails or ends, as `script` says."""

    REFUSAL = "in ensemble 'classify_and_describe', Request timeout expired"

    def __init__(self, script):
        super().__init__()
        self.script, self.go, self.calls = script, asyncio.Event(), 0

    async def _turn(self):
        self.calls += 1
        await self.go.wait()
        if self.script == "refuse":
            raise front_error(InferenceServerException(self.REFUSAL))

    async def infer(self, *args, **kwargs):
        await self._turn()
        return Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}, description="A cup")

    async def stream(self, *args, **kwargs):
        await self._turn()
        yield Answer(labels=["espresso"], scores=[0.9], source="llm", usage={}), "A cup"
        if self.script == "fail after the labels":
            raise front_error(InferenceServerException("the LLM upstream could not answer"))


def exchange(pool, requests, stream=False, limit=None, **changes):
    """`requests` chat requests at once through the front; when all reached the pool, they go on.
    Returns (statuses, the front's limit, its Admission)."""
    app = front_with(pool, **changes)

    async def main():
        if limit is not None:
            app[front_keys.ADMISSION].limit = limit
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            async def one():
                async with session.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                        data=json.dumps(body(stream=stream))) as answer:
                    await answer.read()
                    return answer.status

            sent = [asyncio.create_task(one()) for _ in range(requests)]
            while pool.calls < requests:
                await asyncio.sleep(0.01)
            pool.go.set()
            return await asyncio.gather(*sent), app[front_keys.ADMISSION]

    statuses, admission = asyncio.run(main())
    return statuses, admission.limit, admission


@pytest.mark.parametrize("stream", [False, True])
def test_a_burst_of_refusals_through_the_front_cuts_once(stream):
    statuses, limit, admission = exchange(ScriptedPool("refuse"), 6, stream=stream)
    assert statuses == [503] * 6
    assert (limit.cuts, limit.value) == (1, 32)  # from the 6 held, not the limit's 64, but at most half, once
    assert (admission.now, admission.at_triton) == (0, 0)


@pytest.mark.parametrize("script, seen", [("answer", [("answered", 1)]), ("fail after the labels", [])])
def test_only_a_stream_that_ends_well_is_an_answer(script, seen):
    """A failed stream (an error event after its 200 headers) says nothing of what Triton takes."""
    limit = RecordingLimit()
    statuses, _, _ = exchange(ScriptedPool(script), 1, stream=True, limit=limit)
    assert statuses == [200] and limit.seen == seen


@pytest.mark.parametrize("script, seen", [("answer", [("answered", 1)]), ("refuse", [("refused", 4)])])
def test_a_request_still_sending_its_body_is_not_at_triton(script, seen):
    """The ramp counts the requests at Triton: slow senders holding admitted slots are not evidence.
    A refusal's cut is from what the limit bounds, the requests admitted, those slow senders too:
    from the requests at Triton alone the limit would refuse while Triton holds fewer."""
    pool = ScriptedPool(script)
    app = front_with(pool)
    limit = RecordingLimit()
    payload = json.dumps(body()).encode()

    async def main():
        app[front_keys.ADMISSION].limit = limit
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            slow = []
            for _ in range(3):  # admitted, their bodies half sent
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(payload) + payload[:100])
                await writer.drain()
                slow.append(writer)
            while app[front_keys.ADMISSION].now < 3:
                await asyncio.sleep(0.01)
            pool.go.set()
            async with session.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", data=payload) as answer:
                status = answer.status
            for writer in slow:
                writer.close()
            return status

    assert asyncio.run(main()) == (200 if script == "answer" else 503)
    assert limit.seen == seen  # answered: 1, not 4 (three were admitted, none at Triton); refused: the 4 admitted


def test_the_images_in_flight_are_bounded_in_bytes_whatever_their_number():
    pool = ScriptedPool("answer")
    image_bytes = len(PNG)
    app = front_with(pool, max_image_bytes_in_flight=2 * image_bytes)

    async def main():
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"

            async def one():
                async with session.post(url, data=json.dumps(body())) as answer:
                    return answer.status, answer.headers.get("Retry-After"), await answer.json()

            held = [asyncio.create_task(one()) for _ in range(2)]
            while pool.calls < 2:
                await asyncio.sleep(0.01)
            refused = await asyncio.wait_for(one(), 10)  # a third image would pass the bytes allowed
            pool.go.set()
            return [status for status, _, _ in await asyncio.gather(*held)], refused, app[front_keys.IMAGES].now

    answered, (status, retry_after, error), left = asyncio.run(main())
    assert answered == [200, 200] and left == 0
    assert status == 503 and retry_after == "1"
    assert "OPENAI_FRONT_MAX_IMAGE_BYTES_IN_FLIGHT" in error["error"]["message"]


def test_one_image_always_fits():
    images = ImageBytes(limit=10)
    with images.hold(25):  # the largest allowed image is refused by its own limit, not this one
        with pytest.raises(FrontError), images.hold(1):
            pass
    assert images.now == 0


def test_the_image_bytes_setting():
    assert settings.from_environ({}).max_image_bytes_in_flight == 512 * 1024 * 1024
    assert settings.from_environ({"OPENAI_FRONT_MAX_IMAGE_BYTES_IN_FLIGHT": "7"}).max_image_bytes_in_flight == 7


@pytest.mark.parametrize("queue_limit_s", [0.5, AdaptiveLimit.TRITON_QUEUE_LIMIT_S, 5.0])
def test_refusals_are_old_news_for_the_queue_time_limit_it_was_given(queue_limit_s):
    clock = [0.0]
    limit = AdaptiveLimit(ceiling=1024, start=100, clock=lambda: clock[0])
    limit.queue_limit_s = queue_limit_s
    answers(limit, per_s=20, seconds=10, clock=clock)
    limit.refused(clock[0])
    cut_at, value = clock[0], limit.value
    clock[0] += queue_limit_s + 1
    limit.refused(cut_at + queue_limit_s - 0.01)  # waited behind the queue that refused
    assert limit.value == value
    limit.refused(cut_at + queue_limit_s)
    assert limit.value < value


class ConfigClient:
    """tritonclient.grpc.aio's get_model_config over the repository's configs, changed as told."""

    def __init__(self, change=None, missing=(), gpu=False):
        self.change, self.missing, self.asked = change or (lambda name, config: None), missing, []
        self.gpu = gpu  # the GPU layout: classify_with_view an ensemble of preprocess and the classifier

    async def get_model_config(self, name, client_timeout=None):
        self.asked.append(name)
        if name in self.missing:
            raise InferenceServerException(f"Request for unknown model: '{name}' is not found")
        config = model_config.read(REPOSITORY / name / "config.pbtxt")
        if self.gpu and name == "classify_with_view":
            config = model_config.read(REPOSITORY / name / "configs" / "gpu.pbtxt")
        elif self.gpu and name == "classifier":  # generated by the build, as in the image
            config = make_gpu_config.gpu_config((REPOSITORY / name / "config.pbtxt").read_text())
        self.change(name, config)
        return service_pb2.ModelConfigResponse(config=config)


def pool_asking(client):
    pool = triton.TritonPool.__new__(triton.TritonPool)
    pool._configs = client
    return pool


def timeout_of(name, seconds, priority=False, action=model_config_pb2.ModelQueuePolicy.REJECT):
    def change(model, config):
        if model == name:
            policy = (config.dynamic_batching.priority_queue_policy[1] if priority
                      else config.dynamic_batching.default_queue_policy)
            policy.default_timeout_microseconds, policy.timeout_action = int(seconds * 1e6), action
    return change


def no_time_limits(model, config):
    if config.HasField("dynamic_batching"):  # one of the scheduling choices: an ensemble has none
        config.dynamic_batching.default_queue_policy.default_timeout_microseconds = 0


def both(*changes):
    def change(model, config):
        for one in changes:
            one(model, config)
    return change


def calling_itself(model, config):
    if model == "classify_and_describe_stream":
        config.parameters[triton.BLS_CALLEE].string_value = model


FRONT_MODELS = ["classify_and_describe", "classify_and_describe_stream"]
BEHIND_THE_FRONT = sorted(FRONT_MODELS + ["classify_with_view", "describe"])
DELAY = model_config_pb2.ModelQueuePolicy.DELAY


@pytest.mark.parametrize("client, models, expected", [
    (ConfigClient(), FRONT_MODELS, AdaptiveLimit.TRITON_QUEUE_LIMIT_S),  # the shipped configs: the default agrees
    (ConfigClient(timeout_of("classify_with_view", 5.0)), FRONT_MODELS, 5.0),  # a step of the ensemble
    (ConfigClient(timeout_of("classify_with_view", 7.5, priority=True)), FRONT_MODELS, 7.5),  # a priority level's
    (ConfigClient(timeout_of("classify_with_view", 9.0, priority=True, action=DELAY)), FRONT_MODELS, 2.0),  # never refused
    (ConfigClient(timeout_of("describe", 1.5)), FRONT_MODELS, 3.5),  # queues one after the other add up
    (ConfigClient(timeout_of("classify_with_view", 5.0)), ["classify_and_describe_stream"], 5.0),  # its BLS callee
    (ConfigClient(both(calling_itself, timeout_of("classify_and_describe_stream", 1.0))),
     ["classify_and_describe_stream"], 1.0),  # a callee naming its caller: no loop
    (ConfigClient(no_time_limits), FRONT_MODELS, 0.0),
    (ConfigClient(gpu=True), ["classify_and_describe"], 4.0),  # preprocess's queue, then the classifier's
], ids=["shipped", "a step's", "a priority level's", "DELAY", "a chain", "a BLS callee", "a loop", "none", "GPU"])
def test_the_queue_time_limit_is_read_along_the_paths_behind_the_served_models(client, models, expected):
    assert asyncio.run(pool_asking(client).longest_queue_time_s(models)) == pytest.approx(expected)
    if models == FRONT_MODELS:  # every model behind the front asked once, none twice
        assert sorted(client.asked) == BEHIND_THE_FRONT


def test_a_model_triton_does_not_know_yet_leaves_the_limit_unknown():
    with pytest.raises(InferenceServerException):
        asyncio.run(pool_asking(ConfigClient(missing={"describe"})).longest_queue_time_s(FRONT_MODELS))


def test_the_front_takes_the_queue_time_limit_once_triton_says_it(monkeypatch, caplog):
    monkeypatch.setattr(front_app, "QUEUE_LIMIT_RETRY_S", 0.01)
    monkeypatch.setattr(front_app, "QUEUE_LIMIT_REREAD_S", 0.01)
    # Triton not up (twice), a bug in the reading, no time limit (the default stays), then 5 s
    said = [InferenceServerException("connection refused"), InferenceServerException("connection refused"),
            AttributeError("a bug"), 0.0, 5.0]

    class SayingPool(StalledPool):
        seen = []  # the front's queue time limit each time it asked

        async def longest_queue_time_s(self, models):
            self.models = models
            self.seen.append(app[front_keys.ADMISSION].limit.queue_limit_s)
            answer = said.pop(0) if len(said) > 1 else said[0]
            if isinstance(answer, Exception):
                raise answer
            return answer

    pool = SayingPool()
    app = front_with(pool, triton_grpc_url="127.0.0.1:9")

    async def main():
        async with TestServer(app, host="127.0.0.1"):
            limit = app[front_keys.ADMISSION].limit
            for _ in range(500):
                if limit.queue_limit_s == 5.0:
                    break
                await asyncio.sleep(0.01)
            return limit.queue_limit_s, pool.models

    with caplog.at_level("INFO", logger="openai_front"):
        assert asyncio.run(main()) == (5.0, FRONT_MODELS)
    assert pool.seen[:5] == [AdaptiveLimit.TRITON_QUEUE_LIMIT_S] * 5  # "no time limit" kept the default
    lines = [record.getMessage() for record in caplog.records if "queue time limit" in record.getMessage()
             or "Triton queues" in record.getMessage()]
    assert len([line for line in lines if "connection refused" in line]) == 1  # each outcome logged once
    assert any("AttributeError: a bug" in line for line in lines)
    assert any(line.startswith("no queue time limit") for line in lines)
    assert any(line.startswith("Triton queues a request of ours at most 5 s") for line in lines)
