"""The suite's own rules (tests/conftest.py, pyproject.toml) hold: pytest runs
small suites laid out like tests/, under this repository's pytest configuration
and conftest, in a fresh process; a hang, a module skipped at collection or a
level that did not run must fail them."""

import pathlib
import subprocess
import sys
import time

import pytest
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PASSING = "def test_passes():\n    assert True\n"


@pytest.fixture
def suite(pytester):
    """A suite with one passing test in each level, the project's configuration and tests/conftest.py."""
    pytester.makepyprojecttoml((REPO / "pyproject.toml").read_text())
    add(pytester, "conftest.py", (REPO / "tests/conftest.py").read_text())
    for level in ("unit", "integration", "long"):
        add(pytester, f"{level}/test_{level}_level.py", PASSING)
    add(pytester, "test_scripts_level.py", PASSING)
    return pytester


def add(pytester, path, text):
    file = pytester.path / "tests" / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def test_the_full_suite_passes_when_every_level_ran(suite):
    result = suite.runpytest_subprocess("--every-level")
    result.assert_outcomes(passed=4)
    assert result.ret == 0


@pytest.mark.parametrize("skip", ['pytest.importorskip("a_module_that_is_not_installed")',
                                  'pytest.skip("no photo", allow_module_level=True)'])
def test_a_module_skipped_at_collection_fails_the_run(suite, skip):
    add(suite, "integration/test_skipped_module.py", f"import pytest\n\n{skip}\n\n\n{PASSING}")
    result = suite.runpytest_subprocess()  # a per-file run's rule as much as make test's
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["FAILED: 1 test(s) were skipped; every test must run:",
                                 "*tests/integration/test_skipped_module.py (at collection: *"])


@pytest.mark.parametrize("how, args, says", [
    ("removed", [], "tests/integration: no test collected"),
    ("deselected", ["-k", "not integration"], "integration: 0 of 1 collected tests passed"),
    ("cut short", ["--deselect", "tests/long/test_long_level.py::test_more"], "long: 1 of 2 collected tests passed"),
])
def test_a_level_that_did_not_run_every_test_fails_make_tests_run(suite, how, args, says):
    if how == "removed":
        (suite.path / "tests/integration/test_integration_level.py").unlink()
    add(suite, "long/test_long_level.py", PASSING + "\n\n" + PASSING.replace("passes", "more"))
    assert suite.runpytest_subprocess(*args).ret == 0  # a developer's partial run is fine
    result = suite.runpytest_subprocess("--every-level", *args)  # scripts/run_tests.sh's is not
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["FAILED: every level must run every test it has:", f"*{says}"])


def test_the_runner_asks_for_every_level():
    """Every level of tests/, and only tests/upstreams left to its own target (make test-upstreams)."""
    runner = (REPO / "scripts/run_tests.sh").read_text()
    assert ".venv/bin/python -m pytest tests --ignore=tests/upstreams --every-level" in runner
    assert "test-upstreams:" in (REPO / "Makefile").read_text() and "pytest -q tests/upstreams" in (REPO / "Makefile").read_text()


def test_every_test_has_a_time_limit_and_a_hang_fails_it(suite):
    configured = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < configured["timeout"] <= 300 and configured.get("timeout_func_only", False) is False
    add(suite, "unit/test_hangs.py", (
        "import time\n\nimport pytest\n\n\n"
        "@pytest.fixture\ndef hanging_fixture():\n    time.sleep(600)\n\n\n"
        "def test_hangs():\n    time.sleep(600)\n\n\n"
        "def test_its_fixture_hangs(hanging_fixture):\n    pass\n"))
    started = time.monotonic()
    result = suite.runpytest_subprocess("-o", "timeout=3", "tests/unit")  # the project's limit, made short
    assert time.monotonic() - started < 300  # not the 20 minutes the two hangs would take
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*Timeout (>3.0s) from pytest-timeout.*"])


def test_the_test_that_starts_a_shared_fixture_has_time_for_it_once(suite):
    add(suite, "integration/test_slow_server.py", (
        "import time\n\nimport pytest\n\n\n"
        "@pytest.fixture(scope='session')\ndef server():\n    time.sleep(4)  # a start longer than the limit\n\n\n"
        "def test_first(server):\n    pass\n\n\n"
        "def test_second(server):\n    time.sleep(4)\n"))
    result = suite.runpytest_subprocess("-o", "timeout=2", "tests/integration/test_slow_server.py")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED tests/integration/test_slow_server.py::test_second - Failed: Timeout*"])


def test_the_open_file_limit_is_raised_to_the_hard_limit(suite):
    add(suite, "unit/test_limit.py", (
        "import resource\n\n\ndef test_limit():\n"
        "    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "    assert soft == hard, (soft, hard)\n"))
    hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True, check=True).stdout.strip()
    if hard != "unlimited" and int(hard) <= 256:
        pytest.fail(f"the hard limit on open files is {hard}: this check needs room to lower the soft one")
    run = subprocess.run(["bash", "-c", f"ulimit -Sn 256 && exec {sys.executable} -m pytest -p no:cacheprovider "
                                        "tests/unit/test_limit.py"],
                         cwd=suite.path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]
