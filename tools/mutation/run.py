"""Mutation testing of the pure modules with mutmut; writes docs/mutation.md.

    python -m tools.mutation.run [--module NAME ...] [--max-children N] [--work DIR]
    python -m tools.mutation.run --report-only

mutmut names a mutant after its file's path (backends/classify_describe_server/describer.py
would be `backends.classify_describe_server.describer`), while the code imports the
package as `classify_describe_server`. So the run happens in a stage
(build/mutants/run/stage): a copy of the checkout in which the package sits at the top
level, where its path is its import name, and is gone from backends/, so no unmutated
copy can be imported (the stage's "." comes before the venv's editable install).
mutmut copies the stage to stage/mutants/, runs the unit tests in TESTS once to learn
which tests reach each function, then runs for each mutant only those tests, never
integration tests.

A module's score is detected / (detected + undetected): detected counts the
mutants a test failed on (killed) or that ran past mutmut's time limit or the
per-test timeout (a hang); undetected counts those no test noticed ("survived",
and "no tests" when no test reaches the function). Each run keeps its modules'
results in build/mutants/results/, and docs/mutation.md is written from all of
them, saying which run each module's figures come from. Every survivor needs a
reason in tools/mutation/explained.py (equivalent, or harmless and why); the
command fails when one has none, a module is not run or scores below TARGET.

--again reruns, in the last run's stage, only the mutants no test detected,
after bringing the stage's tests up to date: the quick way to check new tests
(tests are only added, so a mutant killed before stays killed). It sees new
tests in the test files the run started with; a new test file needs a full run
(mutmut resets every result when its test selection changes). The record
names the command, so the report says which figures came from such a rerun.
--stopped records a run cut short: the mutants it did not reach are counted
as not checked, and the module fails the target until a full run.
"""

import argparse
import ast
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

from tools import host
from tools.mutation.explained import EQUIVALENT, EXCLUDED, KILLED_AFTER, OPEN, RUN_NOTES

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORK = ROOT / "build/mutants"
RESULTS = WORK / "results"
REPORT = ROOT / "docs/mutation.md"
TARGET = 0.85
PACKAGE = "classify_describe_server"
BACKEND = f"backends/{PACKAGE}"
# Report name -> file in the checkout. A package module's report name is its name in the
# package, its mutants' names start with its import name (import_name).
MODULES = {
    "describer": f"{BACKEND}/describer.py",
    "resilience": f"{BACKEND}/resilience.py",
    "settings": f"{BACKEND}/settings.py",
    "prompting": f"{BACKEND}/prompting.py",
    "accounting": f"{BACKEND}/accounting.py",
    "openai_front.chat": "openai_front/chat.py",
    "openai_front.fetch": "openai_front/fetch.py",
    "openai_front.errors": "openai_front/errors.py",
    "classify_describe.client": "classify_describe/client.py",
}
# The unit tests that can reach each module; mutmut runs, per mutant, those
# of the run's tests that called the mutated function in its clean run.
_BACKEND_TESTS = ["tests/unit/test_describe_*.py"]
_FRONT_TESTS = ["tests/unit/test_openai_front*.py", "tests/unit/test_error_contract.py"]
TESTS = {name: _BACKEND_TESTS for name in ("describer", "resilience", "settings", "prompting", "accounting")}
TESTS.update({name: _FRONT_TESTS for name in ("openai_front.chat", "openai_front.fetch", "openai_front.errors")})
TESTS["classify_describe.client"] = ["tests/unit/test_client*.py"]
DESELECT = [
    # Tests that bound wall-clock time (1 s or less of margin, or 500 calls in 10 s).
    # mutmut's trampolines (a wrapper on every call) and a loaded machine push them
    # past their bounds: one failed the clean run, which stops mutmut, and a late one
    # would count a mutant as killed that no test noticed. Their logic is also
    # reached by the other tests; make test runs them all.
    f"tests/unit/test_describe_describer.py::{name}" for name in (
        "test_one_describer_holds_500_calls_in_flight",
        "test_waiting_for_a_local_slot_is_not_an_upstream_failure",
        "test_a_retry_after_beyond_the_limit_falls_back_at_once",
        "test_each_attempt_is_bounded_by_the_timeout",
        "test_total_timeout_bounds_all_attempts",
        "test_cancellation_stops_the_upstream_call",
    )
] + ["tests/unit/test_describe_oversized.py::test_a_whole_answer_past_the_byte_limit_is_not_read_and_falls_back"]
# fake_pb_utils builds its fake from Triton's own utils module (make build).
PB_UTILS = "build/triton/pytriton/tritonserver/backends/python/triton_python_backend_utils.py"
STATUSES = ("killed", "timeout", "survived", "no tests", "suspicious", "skipped", "segfault", "not checked",
            "caught by type check", "check was interrupted by user")
DETECTED = {"killed", "timeout", "caught by type check"}
UNDETECTED = {"survived", "no tests"}


def import_name(name):
    return f"{PACKAGE}.{name}" if "." not in name else name


def staged_path(name):
    return f"{PACKAGE}/{name}.py" if "." not in name else MODULES[name]


def checkout_files():
    # Tracked files and new ones not yet committed (a new test), never ignored ones.
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True).stdout
    return [name for name in out.decode().split("\0") if name and (ROOT / name).exists()]


def build_stage(stage, modules):
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for name in checkout_files():
        source, target = ROOT / name, stage / name
        if name.startswith(f"{BACKEND}/"):
            target = stage / PACKAGE / pathlib.Path(name).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    (stage / PB_UTILS).parent.mkdir(parents=True)
    shutil.copy2(ROOT / PB_UTILS, stage / PB_UTILS)
    sources = [staged_path(name) for name in modules]
    # mutmut copies source_paths and also_copy into mutants/; a folder in
    # also_copy would overwrite the mutated file it holds, so such folders are
    # listed file by file.
    keep = set()
    for entry in sorted(stage.iterdir()):
        if entry.name == "pyproject.toml":
            continue
        rel = entry.relative_to(stage).as_posix()
        if any(source.startswith(f"{rel}/") for source in sources):
            keep.update(p.relative_to(stage).as_posix() for p in entry.rglob("*")
                        if p.is_file() and p.relative_to(stage).as_posix() not in sources)
        elif rel not in sources:
            keep.add(rel)
    patterns = {pattern for name in modules for pattern in TESTS[name]}
    tests = sorted({p.relative_to(stage).as_posix() for pattern in patterns for p in stage.glob(pattern)})
    selection = tests + [f"--deselect={test}" for test in DESELECT]
    (stage / "pyproject.toml").write_text(pyproject(sources, sorted(keep), selection))
    return sources


def refresh_tests(stage, modules):
    """For --again: the stage's tests brought up to date (the modules must not have changed)."""
    for name in modules:
        if (stage / staged_path(name)).read_bytes() != (ROOT / MODULES[name]).read_bytes():
            raise SystemExit(f"{MODULES[name]} changed since the last run in {stage}: run without --again")
    for name in checkout_files():
        if name.startswith("tests/"):
            for root in (stage, stage / "mutants"):
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, root / name)


def toml_list(items):
    return "[\n" + "".join(f"    {item!r},\n".replace("'", '"') for item in items) + "]"


def pyproject(sources, also_copy, selection):
    return f"""# Written by tools/mutation/run.py for the stage; not the project's pyproject.toml.
[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "-ra --strict-markers -p no:cacheprovider"
# A mutant that makes a test hang fails that test (pytest-timeout) rather than
# waiting for mutmut's own limit, many times longer; the slowest test takes 2 s.
timeout = 60
markers = ["slow: longer integration tests (still part of `make test`)"]
pythonpath = [".", "tests/unit"]

[tool.mutmut]
source_paths = {toml_list(sources)}
also_copy = {toml_list(also_copy)}
pytest_add_cli_args_test_selection = {toml_list(selection)}
use_setproctitle = false
"""


def function_globs(stage, name, path):
    """One mutmut name pattern per function and method of the module, those in EXCLUDED left out."""
    tree = ast.parse((stage / path).read_text())
    functions = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(f"{import_name(name)}.x_{node.name}")
        elif isinstance(node, ast.ClassDef):
            functions += [f"{import_name(name)}.x\u01c1{node.name}\u01c1{item.name}" for item in node.body
                          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f"{function}__mutmut_*" for function in functions if function not in EXCLUDED]


def mutmut(stage, *args, capture=False):
    command = [str(pathlib.Path(sys.executable).parent / "mutmut"), *args]
    return subprocess.run(command, cwd=stage, text=True, capture_output=capture,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def function_of(mutant):
    return mutant.split("__mutmut_")[0]


def module_of(mutant):
    return mutant.split(".x_")[0].split(".x\u01c1")[0]


def results(stage):
    out = mutmut(stage, "results", "--all", "true", capture=True).stdout
    found = {}
    for line in out.splitlines():
        match = re.match(r"\s+(\S+__mutmut_\d+): (.+)$", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def cpu():
    machine = host.describe()
    return f"{host.cpu_name(machine)}, {machine['cores']} CPUs"


# What `mutmut show NAME` prints, for many mutants in one process (one `mutmut
# show` each costs seconds on a loaded machine, with hundreds of survivors).
_SHOW = """
import json, sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
print(json.dumps({name: get_diff_for_mutant(name, path=find_mutant(name).path) for name in sys.argv[1:]}))
"""


def diffs_of(stage, mutants):
    if not mutants:
        return {}
    shown = subprocess.run([sys.executable, "-c", _SHOW, *mutants], cwd=stage, text=True, capture_output=True,
                           check=True).stdout
    return {name: "\n".join(line for line in diff.splitlines() if line.startswith(("+", "-"))
                            and not line.startswith(("+++", "---")))
            for name, diff in json.loads(shown.splitlines()[-1]).items()}


def record(stage, modules, status, run):
    """One results file per module (build/mutants/results/NAME.json), so runs of
    some modules each update theirs and the report gathers them all."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in modules:
        mine = {m: s for m, s in status.items() if module_of(m) == import_name(name) and function_of(m) not in EXCLUDED}
        undetected = sorted(m for m, s in mine.items() if s in UNDETECTED)
        survivors = {m: {"status": mine[m], "diff": diff} for m, diff in diffs_of(stage, undetected).items()}
        counts = {s: sum(1 for v in mine.values() if v == s) for s in sorted(set(mine.values()))}
        path = RESULTS / f"{name}.json"
        # An --again run adds to the full run it continues: the report names both.
        history = json.loads(path.read_text())["runs"] if "--again" in run["command"] and path.exists() else []
        path.write_text(json.dumps({"module": name, "runs": history + [run], "counts": counts,
                                    "survivors": survivors}, indent=1))


def score(counts):
    detected = sum(counts.get(s, 0) for s in DETECTED)
    undetected = sum(counts.get(s, 0) for s in UNDETECTED)
    return detected / (detected + undetected) if detected + undetected else 1.0


def report():
    """docs/mutation.md from every module's latest results, and what fails the target."""
    lines = [
        "# Mutation testing",
        "",
        "Written by `make mutants` (tools/mutation/run.py): mutmut over the pure modules, each",
        "mutant running only the unit tests that reach the function it changes; `make test` does",
        "not run it. How the run is staged and the score counted: tools/mutation/run.py's docstring.",
        f"Target: every module >= {TARGET:.0%}. Score = (killed + timeout) / (killed + timeout + survived + no tests), "
        "over the mutants checked.",
        "",
        "| module | mutants | killed | timeout | survived | no tests | not checked | score | run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    failures, runs, survivors = [], {}, {}
    for name in MODULES:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | not run | | | | | | | |")
            failures.append(f"{name} has not been run")
            continue
        result = json.loads(path.read_text())
        counts = result["counts"]
        key = tuple((r["command"], r["started"]) for r in result["runs"])
        run, _ = runs.setdefault(key, (len(runs) + 1, result["runs"]))
        lines.append(f"| {name} | {sum(counts.values())} | {counts.get('killed', 0)} | {counts.get('timeout', 0)} "
                     f"| {counts.get('survived', 0)} | {counts.get('no tests', 0)} | {counts.get('not checked', 0)} "
                     f"| {score(counts):.1%} | {run} |")
        if score(counts) < TARGET:
            failures.append(f"{name} scores {score(counts):.1%} < {TARGET:.0%}")
        other = sum(counts.values()) - sum(counts.get(s, 0) for s in DETECTED | UNDETECTED)
        if other:
            failures.append(f"{name}: {other} mutants not checked ({counts})")
        survivors.update(result["survivors"])
    lines += ["", "Runs:", ""]
    for run, history in runs.values():
        lines.append(f"{run}. " + ", then ".join(
            f"`{info['command']}` on {info['started']} UTC, {info['elapsed_s'] / 60:.0f} minutes"
            + (f", load average {info['load']:.1f} at the start" if info["load"] is not None else "")
            for info in history)
            + f" ({history[0]['cpu']}, shared with other work; mutmut {history[0]['mutmut']}, "
              f"Python {history[0]['python']})")
    lines += [""] + [f"Note: {note}" for note in RUN_NOTES]
    groups = {}
    for name, patterns in TESTS.items():
        groups.setdefault(tuple(patterns), []).append(name)
    lines += ["", "The tests each module's mutants may run (those that reach the mutated function):", ""]
    lines += [f"- {', '.join(names)}: {', '.join(f'`{p}`' for p in patterns)}" for patterns, names in groups.items()]
    lines += ["", "Left out (see DESELECT in tools/mutation/run.py for why):", ""]
    lines += [f"- `{test}`" for test in DESELECT]
    lines += ["", "## Tests written to kill survivors", "",
              "Survivors of the first runs that a plausible bug could look like were killed by new",
              "tests (tests/unit/*_edges.py); each asserts behaviour a caller sees:", ""]
    for path in sorted((ROOT / "tests/unit").glob("*_edges.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines.append(f"- `{path.relative_to(ROOT)}`: {' '.join(doc.split()).split(' (found by')[0]}")
    lines += ["", "## Not mutated", "", "Left out of the run on purpose:", ""]
    lines += [f"- `{function}`: {reason}" for function, reason in EXCLUDED.items()]
    lines += ["", "## Surviving mutants", "",
              "Each with the reason it is equivalent or harmless (tools/mutation/explained.py).", ""]
    for mutant, found in sorted(survivors.items()):
        reason = EQUIVALENT.get(mutant) or KILLED_AFTER.get(mutant) or OPEN.get(mutant)
        if mutant in OPEN:
            failures.append(f"{mutant} is open (tools/mutation/explained.py)")
        elif reason is None:
            failures.append(f"{mutant} survived without a reason in tools/mutation/explained.py")
            reason = "**Not explained.**"
        lines += [f"### `{mutant}` ({found['status']})", "", reason, "", "```diff", found["diff"], "```", ""]
    if not survivors:
        lines += ["None.", ""]
    reasons = {**EQUIVALENT, **KILLED_AFTER, **OPEN}
    stale = sorted(m for m in reasons if m not in survivors and (RESULTS / f"{module_of(m)}.json").exists())
    if stale:
        lines += ["## Reasons no longer needed", "", "Killed now, or gone; their entries in explained.py can go:", ""]
        lines += [f"- `{mutant}`" for mutant in stale] + [""]
    lines += ["## Result", ""]
    lines += [f"- FAIL: {f}" for f in failures] if failures else ["Every module meets the target."]
    return "\n".join(lines) + "\n", failures


def mutmut_version():
    from importlib.metadata import version
    return version("mutmut")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", choices=list(MODULES),
                        help="only this module (repeatable); the others keep their last results")
    parser.add_argument("--max-children", type=int, default=os.cpu_count())
    parser.add_argument("--work", type=pathlib.Path, default=WORK / "run",
                        help="where the stage and mutmut's files go (runs at the same time need their own)")
    parser.add_argument("--again", action="store_true",
                        help="in the last run's stage: bring the tests up to date and run again only the mutants "
                             "no test detected (mutmut runs its stats for the new tests first)")
    parser.add_argument("--report-only", action="store_true", help="rewrite docs/mutation.md from the results kept")
    parser.add_argument("--stopped", metavar="COMMAND",
                        help="record what a run of COMMAND stopped before its end left in --work (mutants it did not "
                             "reach count as not checked), then rewrite docs/mutation.md")
    args = parser.parse_args()
    if args.stopped:
        stage = args.work.resolve() / "stage"
        started = datetime.datetime.fromtimestamp((stage / "pyproject.toml").stat().st_mtime, datetime.timezone.utc)
        elapsed_s = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
        record(stage, args.module or list(MODULES), results(stage), {
            "command": f"{args.stopped} (stopped before its end)", "started": f"{started:%Y-%m-%d %H:%M}",
            "elapsed_s": elapsed_s, "load": None, "cpu": cpu(), "mutmut": mutmut_version(),
            "python": platform.python_version()})
    elif not args.report_only:
        stage = args.work.resolve() / "stage"
        modules = args.module or list(MODULES)
        options = [f"--module {m}" for m in args.module or []] + (["--again"] if args.again else [])
        command = "make mutants" + (f' MUTANTS_ARGS="{" ".join(options)}"' if options else "")
        started, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]
        if args.again:
            refresh_tests(stage, modules)
            names = [m for m, s in results(stage).items() if s in UNDETECTED and module_of(m) in modules]
        else:
            sources = build_stage(stage, modules)
            names = [g for name, path in zip(modules, sources) for g in function_globs(stage, name, path)]
        if names and mutmut(stage, "run", "--max-children", str(args.max_children), *names).returncode:
            raise SystemExit("mutmut run failed; its output is above")
        elapsed_s = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
        record(stage, modules, results(stage), {
            "command": command, "started": f"{started:%Y-%m-%d %H:%M}", "elapsed_s": elapsed_s, "load": load,
            "cpu": cpu(), "mutmut": mutmut_version(), "python": platform.python_version()})
    text, failures = report()
    REPORT.write_text(text)
    print(f"wrote {REPORT.relative_to(ROOT)}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
