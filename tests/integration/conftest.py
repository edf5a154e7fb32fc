"""One real tritonserver per test session, on free ports, on the committed
model_repository/, started by the same scripts/serve.sh users run; its LLM
step points at the fake OpenAI-compatible upstream in tools/fake_openai.
The processes are tools/local_stack.py's; here they become pytest fixtures,
and a start that fails becomes pytest.fail with the log tail."""

import contextlib
import pathlib

import pytest

from tools.local_stack import FakeLLM, NotReady, TritonServer

from ..conftest import SHARED_FIXTURE_SETUP_S

REPO = pathlib.Path(__file__).resolve().parents[2]
# Scanned for in every log, output and metric: it must never show up.
TEST_API_KEY = "sk-test-DO-NOT-LEAK-7f3a9c2e51"
# The session's server is a shared fixture: the test that starts it gets this much
# more than the 300 s every test has (tests/conftest.py, pyproject.toml).
SERVER_READY_TIMEOUT_S = SHARED_FIXTURE_SETUP_S
# A test that starts a server of its own waits for it in its own time: 300 s
# (pyproject.toml) for the test, SERVER_READY_TIMEOUT_S for the start.
STARTS_ITS_OWN_SERVER = pytest.mark.timeout(300 + SERVER_READY_TIMEOUT_S)


@pytest.fixture(scope="session")
def fake_llm(tmp_path_factory):
    try:
        llm = FakeLLM(tmp_path_factory.mktemp("fake_llm") / "fake_llm.log")
    except NotReady as error:
        pytest.fail(str(error))
    try:
        yield llm
    finally:
        llm.stop()


@contextlib.contextmanager
def running_triton(workdir, fake_llm, extra_env=None, command_prefix=()):
    """Start scripts/serve.sh on free ports and a copy of the committed
    model_repository/ (built by `make build`), so tests may add a model
    version without touching the tree; stop it by its PID afterwards."""
    # The tests' own upstream model names (gpt-4o-mini-it-*, series no other test feeds) are
    # billed at gpt-4o-mini's price: unpriced, their cost would be unknown (unit-tested apart).
    server = TritonServer(workdir, {"LLM_BASE_URL": fake_llm.base_url, "LLM_API_KEY": TEST_API_KEY,
                                    "LLM_PRICE_INPUT_PER_MILLION": "0.15", "LLM_PRICE_OUTPUT_PER_MILLION": "0.60",
                                    **(extra_env or {})}, command_prefix=command_prefix)
    try:
        try:
            server.start(timeout_s=SERVER_READY_TIMEOUT_S)
        except NotReady as error:
            pytest.fail(str(error))
        yield server
    finally:
        server.stop()
        print(f"\ntritonserver log: {server.log_path}")


@pytest.fixture(scope="session")
def triton(fake_llm, tmp_path_factory):
    """The one server of the session, as `make run` starts it."""
    with running_triton(tmp_path_factory.mktemp("triton"), fake_llm) as server:
        yield server


@pytest.fixture(scope="session")
def test_api_key():
    return TEST_API_KEY


@pytest.fixture
def llm(fake_llm):
    """The fake upstream, reset to answering "ok" before and after the test."""
    fake_llm.admin("reset", {})
    yield fake_llm
    fake_llm.admin("reset", {})


@pytest.fixture(scope="session")
def photos():
    """Real photos that ship with scikit-image, as encoded bytes."""
    import skimage.data

    data_dir = pathlib.Path(skimage.data.__file__).parent
    return {name: (data_dir / f"{name}.png").read_bytes() for name in ("chelsea", "coffee")}


@pytest.fixture(scope="session")
def valid_requests(photos):
    """A valid request for every public model (tests/integration/public_models.py)."""
    import uuid

    from tools.reference import reference_pixels

    from .public_models import ValidRequests

    # The pixels of the documented preprocessing, spelled out apart from the server's (tools/reference.py):
    # an oracle for preprocess's answer, and what the classifier is fed (preprocess gives the same).
    pixels = reference_pixels(photos["coffee"])[None]
    return ValidRequests(photos["coffee"], pixels, f"What is it? ({uuid.uuid4().hex[:8]})")
