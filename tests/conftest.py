"""Suite-wide rules: a run passes only if what it promises was checked.

- A test that was skipped fails the run, and so does a module skipped at
  collection (`pytest.importorskip`, `pytest.skip(allow_module_level=True)`).
  Triton's own QA counts the tests that actually ran for the same reason: a
  missing server or photo must not turn into a green run with nothing checked.
- With --every-level (scripts/run_tests.sh, so `make test`), each level of the
  suite (LEVELS) must have collected tests and passed every one it collected:
  a level lost, deselected or cut short fails the run.
- Every test has a time limit (pyproject.toml, pytest-timeout), so a hang fails
  one test instead of stalling the run; the test that first sets up a shared
  fixture (the session's tritonserver) gets SHARED_FIXTURE_SETUP_S more.
- Tests that hold many connections need more open files than the usual soft
  limit of 1,024: it is raised to the hard limit here, once for the run and the
  servers it starts.
"""

import collections
import pathlib
import resource

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
# "scripts": the files directly in tests/ (the repository's scripts and manifests).
LEVELS = ("scripts", "unit", "integration", "long")
# The longest a shared fixture may take to set up: tests/integration/conftest.py
# waits this long for the session's tritonserver to become ready.
SHARED_FIXTURE_SETUP_S = 300

_skipped = []
_collected = collections.Counter()
_passed = collections.Counter()
_level_of = {}


def pytest_addoption(parser):
    parser.addoption("--every-level", action="store_true",
                     help=f"fail unless each level of tests/ ({', '.join(LEVELS)}) collected tests and passed "
                          "every one (scripts/run_tests.sh sets it)")


def pytest_configure(config):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # an unlimited hard limit is above the kernel's cap (fs.nr_open): keep the soft one


def level(path):
    """The level of a test file: its folder under tests/, "scripts" for tests/*.py, None outside tests/."""
    try:
        parts = pathlib.Path(path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else "scripts"


def pytest_itemcollected(item):
    _level_of[item.nodeid] = level(item.path)
    _collected[_level_of[item.nodeid]] += 1


def pytest_collectreport(report):
    if report.skipped:
        _skipped.append(f"{report.nodeid} (at collection: {report.longrepr[-1]})")


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.append(report.nodeid)
    elif report.when == "call" and report.passed:
        _passed[_level_of.get(report.nodeid)] += 1


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    # pytest-timeout times setup, call and teardown together; the first test to use
    # a session- or module-scoped fixture also waits for its setup.
    if item.config.pluginmanager.hasplugin("timeout") and sets_up_a_shared_fixture(item):
        timeout = timeout_of(item)
        if timeout:
            item.add_marker(pytest.mark.timeout(timeout + SHARED_FIXTURE_SETUP_S), append=False)
    yield


def sets_up_a_shared_fixture(item):
    return any(defs[-1].scope != "function" and defs[-1].cached_result is None
               for defs in item._fixtureinfo.name2fixturedefs.values() if defs)


def timeout_of(item):
    from pytest_timeout import get_env_settings

    marker = item.get_closest_marker("timeout")
    if marker is not None:
        return marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    return get_env_settings(item.config).timeout


def missing_levels(config):
    """What --every-level finds wrong, one line per level."""
    if not config.getoption("every_level"):
        return []
    problems = []
    for name in LEVELS:
        if not _collected[name]:
            problems.append(f"tests/{'*.py' if name == 'scripts' else name}: no test collected")
        elif _passed[name] < _collected[name]:
            problems.append(f"{name}: {_passed[name]} of {_collected[name]} collected tests passed")
    return problems


def pytest_sessionfinish(session, exitstatus):
    problems = missing_levels(session.config)
    if problems:
        print("\nFAILED: every level must run every test it has:")
        for problem in problems:
            print("  ", problem)
    if _skipped:
        print(f"\nFAILED: {len(_skipped)} test(s) were skipped; every test must run:")
        for nodeid in _skipped:
            print("  ", nodeid)
    if (problems or _skipped) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
