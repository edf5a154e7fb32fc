"""`make soak` in small (tools/soak.py --duration-s 40): its own fake upstream and
server, every phase (steady + hostile corpus, LLM faults and recovery, version
swap, stub SIGKILL, restart with retrying clients), then the verdict: no valid
request lost, failures only while the killed stub was down, every hostile
request answered clearly, the describe metrics there at the end, the LLM key on
every upstream request, no secret anywhere. The verdict's own checks are unit
tested in tests/unit/test_soak_checks.py."""

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(720)  # the soak's own limit is 600 s: two server starts, 40 s of phases, the verdict
def test_short_soak_with_every_fault(tmp_path):
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "tools.soak", "--duration-s", "40", "--concurrency", "6",
         "--min-phase-s", "3", "--report", str(report_path), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert report_path.exists(), run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    print(run.stdout)
    assert run.returncode == 0, (report["problems"], run.stderr[-3000:])
    valid = report["valid"]
    assert valid["lost"] == 0 and valid["sent"] == valid["answered"] + valid["failed"] and valid["answered"] > 100
    assert report["hostile"]["sent"] >= 200 and report["hostile"]["clear"] == report["hostile"]["sent"]
    faults = {f["fault"]: f for f in report["faults"]}
    assert faults["llm_recovered"]["circuit_closed_s"] is not None
    assert faults["preprocess_stub_sigkill"]["serving_again_s"] is not None
    assert faults["server_restart"]["start_to_ready_s"] > 0
    assert report["rss_start_mb"] > 0 and report["rss_end_mb"] > 0
    assert report["metrics_tail_ok"] and report["metrics_tail"]["requests_ok"] > 0
    assert report["upstream_saw_key"] and report["upstream_key"]["with_key"] == report["upstream_key"]["requests"] > 0
    assert report["secret_leaks"] == [] and report["secrets_scanned"]["client_outputs"] >= valid["answered"]
