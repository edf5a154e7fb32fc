"""tools/bench/harness.perf_analyzer against a stand-in executable that replays
what perf_analyzer printed in a failed CI run: a window too short for a loaded
machine is retried with a longer one, and any other failure is raised."""

import stat
import textwrap

import pytest

from tools.bench import harness

UNSTABLE = ("WARNING: Pass contained only one request, so sample latency standard deviation will be infinity\n"
            "Failed to obtain stable measurement within 3 measurement windows for concurrency 2.\n")
CSV = ("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
       "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
       "2,42.5,1,2,300,100,20000,50,1,41000,45000,46000,52000\n")


def stand_in(tmp_path, monkeypatch, failures, message):
    """An executable that fails `failures` times printing `message`, then writes the CSV.
    Each call appends its --measurement-interval to calls.txt."""
    (tmp_path / "message.txt").write_text(message)
    (tmp_path / "result.csv").write_text(CSV)
    script = tmp_path / "perf_analyzer"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        calls="{tmp_path}/calls.txt"
        interval=""; csv=""
        while [ $# -gt 0 ]; do
          case "$1" in --measurement-interval) interval="$2";; -f) csv="$2";; esac; shift
        done
        echo "$interval" >> "$calls"
        if [ "$(wc -l < "$calls")" -le {failures} ]; then cat "{tmp_path}/message.txt"; exit 2; fi
        cp "{tmp_path}/result.csv" "$csv"
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(harness, "PERF_ANALYZER", script)
    return tmp_path / "calls.txt"


def test_unstable_window_is_retried_twice_as_long(tmp_path, monkeypatch):
    calls = stand_in(tmp_path, monkeypatch, failures=2, message=UNSTABLE)
    result = harness.perf_analyzer("classify", "127.0.0.1:1", tmp_path / "in.json", 2, tmp_path, window_ms=1000)
    assert calls.read_text().split() == ["1000", "2000", "4000"]
    assert result["throughput"] == 42.5 and result["p50_ms"] == 41.0
    assert "--measurement-interval 4000" in result["command"]


def test_window_with_no_finished_request_is_retried(tmp_path, monkeypatch):
    calls = stand_in(tmp_path, monkeypatch, failures=1, message="No valid requests recorded within time interval.\n")
    harness.perf_analyzer("classify", "127.0.0.1:1", tmp_path / "in.json", 2, tmp_path, window_ms=500)
    assert calls.read_text().split() == ["500", "1000"]


def test_gives_up_after_three_short_windows(tmp_path, monkeypatch):
    calls = stand_in(tmp_path, monkeypatch, failures=5, message=UNSTABLE)
    with pytest.raises(RuntimeError, match="Failed to obtain stable measurement"):
        harness.perf_analyzer("classify", "127.0.0.1:1", tmp_path / "in.json", 2, tmp_path, window_ms=1000)
    assert calls.read_text().split() == ["1000", "2000", "4000"], "three windows, each twice as long, then no more"


def test_other_failures_are_not_retried(tmp_path, monkeypatch):
    calls = stand_in(tmp_path, monkeypatch, failures=5, message="error: failed to get model metadata\n")
    with pytest.raises(RuntimeError, match="failed to get model metadata"):
        harness.perf_analyzer("classify", "127.0.0.1:1", tmp_path / "in.json", 2, tmp_path)
    assert len(calls.read_text().split()) == 1


def test_the_streaming_runs_retry_short_windows_too(tmp_path, monkeypatch):
    """A CI run failed here: at concurrency 1 a 3 s window held one 1.2 s stream (exit 2)."""
    from types import SimpleNamespace

    from tools.bench import streaming

    calls = stand_in(tmp_path, monkeypatch, failures=1, message=UNSTABLE)
    monkeypatch.setattr(streaming, "PERF_ANALYZER", harness.PERF_ANALYZER)
    result = streaming.perf_analyzer_streaming(SimpleNamespace(grpc_url="127.0.0.1:1"), tmp_path / "in.json", 1,
                                               tmp_path, window_ms=3000)
    assert calls.read_text().split() == ["3000", "6000"]
    assert result["throughput"] == 42.5 and "--measurement-interval 6000" in result["command"]
