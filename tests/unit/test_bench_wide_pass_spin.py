"""tools/bench/wide_pass_spin.py (docs/benchmarks-method.md#where-the-cpu-goes) runs both sessions
of the served graph with the server's own code and summarises each mode; a short run here keeps it
working (its figures come from the full run, on a quiet machine)."""

import json

from tools.bench import wide_pass_spin


def test_a_short_run_measures_both_sessions_in_both_modes(tmp_path, monkeypatch):
    from classify_describe_server import classifier_runtime as runtime
    made, make_session = [], runtime._onnx_session
    monkeypatch.setattr(runtime, "_onnx_session", lambda path, threads, spin=False: made.append((threads, spin)) or
                        make_session(path, threads, spin=spin))
    results_file = tmp_path / "spin.json"
    assert wide_pass_spin.main(["--rounds", "2", "--images", "3", "--gap-ms", "1", "--seconds", "0.1",
                                "--results", str(results_file)]) == 0
    assert made == [(2, False), (2, True)]  # the server's narrow options and its wide pass's
    results = json.loads(results_file.read_text())
    assert len(results["rounds"]) == 2 and results["host"]["cpu"]["model"]
    for mode in ("lone", "back_to_back"):
        summary = results["summary"][mode]
        assert all(summary[name]["ms"] > 0 and summary[name]["cpu_ms"] > 0 for name in ("asleep", "spinning"))
        ratio = summary["spinning_over_asleep_ms"]
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and 0 <= ratio["rounds_spinning_faster"] <= 2
