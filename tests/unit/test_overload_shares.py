"""tools/overload.py: each kind's goodput share is against the saturations measured right before
and right after it, and the verdict judges each kind's median share over the rounds."""

import contextlib
import http.server
import threading
import time
from types import SimpleNamespace

from tools import overload, process_cpu

ARGS = SimpleNamespace(factors=[20], max_p99_ratio=3.0)


def phase(answered, lost=0, **extra):
    return dict(admitted_per_s=answered, admitted_p99_ms=3000.0, lost=lost, lost_sample=[], admitted=100,
                **extra)


def kind(answered, name="client-grpc", round_=1, before=None, after=None, lost=0):
    """A kind's phase as run() records it, its shares against the saturations around it."""
    figures = dict(phase(answered, lost=lost), kind=name, factor=20, round=round_, rejected=0, lost_by_reason={},
                   users=2560, admitted_p50_ms=1000.0, client="c", path="p")
    figures.update(overload.shares(figures, phase(50.0), before or phase(40.0), after or phase(40.0)))
    return figures


def test_the_share_is_against_the_mean_of_the_saturations_before_and_after_and_the_first_is_kept():
    shares = overload.shares(phase(36.0), phase(50.0), phase(40.0), phase(44.0))
    assert shares["goodput_share"] == 0.86 and shares["share_of_first_saturation"] == 0.72  # 36 / 42, 36 / 50
    assert shares["saturation_beside_per_s"] == 42.0
    assert shares["saturation_before"]["admitted_per_s"] == 40.0 and shares["saturation_after"]["admitted_per_s"] == 44.0


def test_with_one_saturation_beside_the_share_is_against_it_and_with_none_against_the_first():
    assert overload.shares(phase(36.0), phase(50.0), phase(40.0))["goodput_share"] == 0.9
    assert overload.shares(phase(36.0), phase(50.0), None, phase(45.0))["goodput_share"] == 0.8
    alone = overload.shares(phase(36.0), phase(50.0))
    assert alone["goodput_share"] == alone["share_of_first_saturation"] == 0.72
    assert "saturation_before" not in alone and "saturation_beside_per_s" not in alone


def test_a_loss_in_any_saturation_beside_fails_the_verdict_once():
    # The first saturation is the one before the first kind, the saturation after the first
    # kind the one before the second: each reported once.
    first_saturation, shared = phase(50.0, lost=1), phase(40.0, lost=2)
    first = kind(36.0, before=first_saturation, after=shared)
    second = kind(36.0, name="backoff-bare", before=shared, after=phase(40.0, lost=3))
    problems = overload.judge(first_saturation, [first, second], ARGS)
    assert problems == ["1 request(s) lost at saturation: []",
                        "saturation after client-grpc at 20x: 2 request(s) lost: []",
                        "saturation after backoff-bare at 20x: 3 request(s) lost: []"]


def test_the_verdict_judges_the_median_share_over_the_rounds():
    passing = [kind(answered) for answered in (30.0, 34.0, 33.0)]  # 0.75, 0.85, 0.82: median 0.82
    assert overload.judge(phase(50.0), passing, ARGS) == []
    failing = [kind(answered, round_=i + 1) for i, answered in enumerate((30.0, 31.2, 34.0))]  # 0.75, 0.78, 0.85
    assert overload.judge(phase(50.0), failing, ARGS) == [
        "client-grpc at 20x: goodput 0.78 of saturation (median of 0.75, 0.78, 0.85) (target at least 0.8)"]
    assert overload.judge(phase(50.0), [kind(31.2)], ARGS) == [
        "client-grpc at 20x: goodput 0.78 of saturation (target at least 0.8)"]


def test_by_kind_keeps_each_round_and_counts_every_loss():
    rounds = [kind(30.0, lost=1), kind(34.0, round_=2, lost=2), kind(20.0, name="resend-proxy", lost=4)]
    summary = {k["kind"]: k for k in overload.by_kind(rounds)}
    assert summary["client-grpc"]["shares"] == [0.75, 0.85] and summary["client-grpc"]["median_share"] == 0.8
    odd = overload.by_kind([kind(15.6), kind(18.4, round_=2)])[0]  # 0.39 and 0.46: 0.425, not 0.42499999999999993
    assert odd["median_share"] == 0.425
    assert summary["client-grpc"]["lost"] == 3 and summary["resend-proxy"]["lost"] == 4
    assert summary["resend-proxy"]["judged"] == 0.6


def test_the_tables_show_the_round_the_saturation_beside_and_the_median():
    first = dict(phase(50.0), users=128, rejected=0, admitted_p50_ms=900.0)
    row = overload.table(first, [kind(36.0, round_=2, before=phase(40.0), after=phase(44.0))]).splitlines()[-1]
    assert "| 20x | 2 | 2560 | 36.0 | 42.0 | 0.86 | 0.72 |" in row
    assert row.count("|") == 19
    summary = overload.kinds_table(overload.by_kind([kind(30.0), kind(34.0, round_=2)])).splitlines()[-1]
    assert summary == "| client-grpc | 20x | 0.75, 0.85 | 0.8 | 0.8 | 0 |"


def test_losses_fail_the_verdict_for_judged_kinds_but_not_the_unjudged_baseline():
    assert overload.judge(phase(50.0), [kind(40.0, name="resend-bare", lost=3)], ARGS) == []
    problems = overload.judge(phase(50.0), [kind(40.0, name="resend-proxy", lost=3)], ARGS)
    assert problems == ["resend-proxy at 20x: 3 request(s) lost: []"]


def sweep_args(repeats=1):
    return SimpleNamespace(min_users=16, max_users=256, sweep_s=8, sweep_repeats=repeats)


def scripted_drive(rates):
    """A sweep step per call: answered/s from `rates[users]`, one value after the other."""
    calls = []

    def drive(users, seconds):
        calls.append(users)
        return {"users": users, "admitted_per_s": rates[users].pop(0)}
    return drive, calls


def test_a_noisy_step_past_the_knee_is_measured_again_and_the_pick_made_on_the_means():
    # One pass: 256 looks best (43.0 against 128's 39.0), as a noisy step did on one run.
    drive, calls = scripted_drive({16: [15.0], 32: [29.0], 64: [37.0, 38.0], 128: [39.0, 44.0],
                                   256: [43.0, 38.0]})
    users, sweep = overload.saturating_users(drive, sweep_args())
    assert calls == [16, 32, 64, 128, 256, 128, 256]  # the pick (256) and the step beside it, again
    assert users == 128  # means: 128 -> 41.5, 256 -> 40.5
    assert [r["users"] for r in sweep if r.get("repeat")] == [128, 256]


def test_without_repeats_the_sweep_picks_on_one_pass():
    drive, calls = scripted_drive({16: [15.0], 32: [29.0], 64: [37.0], 128: [39.0], 256: [43.0]})
    assert overload.saturating_users(drive, sweep_args(repeats=0))[0] == 256
    assert calls == [16, 32, 64, 128, 256]


def test_the_knee_is_the_fewest_users_within_5_percent_of_the_best_mean():
    sweep = [{"users": u, "admitted_per_s": r} for u, r in ((32, 30.0), (64, 41.0), (128, 42.0), (64, 40.0))]
    assert overload.knee(sweep) == 64  # 40.5 >= 0.95 * 42
    sweep.append({"users": 64, "admitted_per_s": 30.0})  # 64's mean falls to 37
    assert overload.knee(sweep) == 128


def with_cpu(figures, server_cores, generator_cores, machine_cores=2.0):
    cpu = {"server_cores": server_cores, "generator_cores": generator_cores, "machine_cores": machine_cores}
    return dict(figures, cpu=cpu, server_cpu_ms_per_answer=round(server_cores * 1000 / figures["admitted_per_s"], 1))


def test_the_cores_a_load_generator_takes_are_told_from_what_refusals_cost_the_server():
    # Saturation: 50/s on 1.9 server cores, the C generator 0.05 core. The phase: 40/s (0.8),
    # its Python generator 0.45 core, the server's 1.5 cores answering at saturation's CPU per answer.
    saturation = with_cpu(phase(50.0), 1.9, 0.05)
    shares = overload.shares(with_cpu(phase(40.0), 1.52, 0.45), saturation, saturation, saturation)
    assert shares["goodput_share"] == 0.8
    assert shares["share_of_cores_left"] == round((40 / 1.55) / (50 / 1.95), 2) == 1.01
    assert shares["server_cpu_share"] == 1.0  # 38 ms per answer in both
    # Refusals that cost the server: the same 40/s with the generator's CPU as saturation's.
    costly = overload.shares(with_cpu(phase(40.0), 1.9, 0.05), saturation, saturation, saturation)
    assert costly["share_of_cores_left"] == 0.8 and costly["server_cpu_share"] == 0.8


def test_without_cpu_windows_no_cpu_share_is_made_up():
    shares = overload.shares(phase(40.0), phase(50.0), phase(50.0), with_cpu(phase(50.0), 1.9, 0.05))
    assert "share_of_cores_left" not in shares and "server_cpu_share" not in shares


def test_a_window_splits_the_cores_into_server_generator_and_idle():
    before = {("tritonserver", "1"): 10.0, ("stub:describe", "2"): 5.0, ("openai_front", "3"): 1.0,
              ("overload_users", "4"): 0.0, ("fake_openai", "5"): 2.0}
    after = {("tritonserver", "1"): 12.0, ("stub:describe", "2"): 9.0, ("openai_front", "3"): 2.0,
             ("overload_users", "4"): 1.5, ("fake_openai", "5"): 2.5, ("stub:classify_with_view", "6"): 3.0}
    machine_before, machine_after = {"idle": 100.0, "steal": 1.0, "all": 200.0}, {"idle": 100.5, "steal": 1.5, "all": 220.0}
    figures = process_cpu.window_figures(before, after, machine_before, machine_after, 10.0)
    assert figures["server_cores"] == 1.0  # (2 + 4 + 1 + 3) / 10: a stub that started in the window counts from 0
    assert figures["generator_cores"] == 0.15 and figures["cores"]["fake_openai"] == 0.05
    assert figures["idle_cores"] == 0.05 and figures["steal_cores"] == 0.05 and figures["machine_cores"] == 2.0


@contextlib.contextmanager
def serving_metrics(text_of_scrape):
    """The port of a local HTTP server that answers every GET with text_of_scrape() (the text of
    a /metrics scrape)."""
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = text_of_scrape().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def test_tritons_queues_and_the_fronts_admission_limit_are_sampled_while_a_phase_runs():
    limits = iter(range(40, 10, -1))

    def front_scrape():
        return (f"# HELP openai_front_admission_limit x\nopenai_front_admission_limit {next(limits)}.0\n"
                "openai_front_in_flight 12.0\nopenai_front_requests_total 3.0\n")

    with serving_metrics(front_scrape) as front, serving_metrics(lambda: TRITON_SCRAPE) as triton:
        stack = SimpleNamespace(openai_base_url=f"http://127.0.0.1:{front}/v1", metrics_url=f"127.0.0.1:{triton}")
        with overload.phase_gauges(stack, "backoff-bare", interval_s=0.02) as bare:
            time.sleep(0.2)
        with overload.phase_gauges(stack, "openai-front", interval_s=0.02) as gauges:
            time.sleep(0.3)
    assert bare.by_5s() == [{"t_s": 0, "queued describe": 9.0}]  # no front on its path
    steps = gauges.by_5s()
    assert len(steps) == 1 and steps[0]["t_s"] == 0 and steps[0]["openai_front_in_flight"] == 12.0
    assert steps[0]["queued describe"] == 9.0
    assert 10 < steps[0]["openai_front_admission_limit"] < 40  # the mean of falling values
    assert all("openai_front_requests_total" not in values for _, values in gauges.samples)


def test_the_answered_attempts_p99_is_judged_for_every_judged_kind_that_has_it():
    """Saturation's p99 is 3,000 ms: 3.2x fails a judged kind (the openai SDK's attempts, as a C
    kind's), never an unjudged one; a kind whose latencies hold its retries has none to judge."""
    slow = dict(answered_attempt_p99_ms=9600.0)
    for name in ("openai-front", "backoff-front", "resend-proxy"):
        figures = dict(kind(45.0, name=name), **slow)
        assert overload.judge(phase(50.0), [figures], ARGS) == [
            f"{name} at 20x: answered attempts' p99 3.20x saturation's (limit 3.0x)"]
    assert overload.judge(phase(50.0), [dict(kind(45.0, name="openai-front-expect"), **slow)], ARGS) == []
    assert overload.judge(phase(50.0), [dict(kind(45.0), answered_attempt_p99_ms=None)], ARGS) == []
    assert overload.judge(phase(50.0), [dict(kind(45.0, name="openai-front"), answered_attempt_p99_ms=8900.0)],
                          ARGS) == []


def test_what_triton_did_per_model_in_a_window_answers_failures_by_reason_and_the_mean_batch():
    counted = {"nv_inference_request_success classify_with_view": 600.0,
               "nv_inference_request_failure classify_with_view REJECTED": 30.0,
               "nv_inference_request_failure classify_with_view BACKEND": 0.0,
               "nv_inference_count classify_with_view": 630.0, "nv_inference_exec_count classify_with_view": 90.0,
               "nv_inference_request_success describe": 570.0, "nv_inference_request_failure describe OTHER": 3.0,
               "nv_inference_count describe": 570.0, "nv_inference_exec_count describe": 570.0,
               "nv_inference_request_success unused": 0.0, "nv_inference_count unused": 0.0}
    assert overload.triton_per_model(counted, 30.0) == {
        "classify_with_view": {"answered_per_s": 20.0, "failed_rejected_per_s": 1.0, "mean_batch": 7.0},
        "describe": {"answered_per_s": 19.0, "failed_other_per_s": 0.1, "mean_batch": 1.0}}


def test_the_fronts_refusals_in_a_window_tell_those_shed_from_the_headers_from_those_admitted_first():
    counted = {"openai_front_requests_total 200": 600.0, "openai_front_requests_total 503": 30.0,
               "openai_front_errors_total 503 service_unavailable": 330.0,
               "openai_front_errors_total 400 invalid_request": 3.0,
               "nv_inference_request_success describe": 600.0}
    figures = overload.served_figures(counted, 30.0)
    assert figures["front"] == {"answered_per_s": 20.0, "shed_per_s": 10.0, "refused_admitted_per_s": 1.0}
    assert figures["triton"] == {"describe": {"answered_per_s": 20.0}}
    assert "front" not in overload.served_figures({"nv_inference_request_success describe": 3.0}, 30.0)


TRITON_SCRAPE = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="describe",version="1"} 570
nv_inference_request_success{model="describe",version="2"} 30
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="describe",reason="REJECTED",version="1"} 4
nv_inference_request_failure{model="describe",reason="BACKEND",version="1"} 0
# TYPE nv_inference_count counter
nv_inference_count{model="describe",version="1"} 570
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="describe",version="1"} 285
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="describe",version="1"} 9
"""
FRONT_SCRAPE = """# TYPE openai_front_requests_total counter
openai_front_requests_total{model="m",status="200",stream="false"} 10.0
openai_front_requests_total{model="m",status="200",stream="true"} 5.0
openai_front_requests_total{model="m",status="503",stream="false"} 1.0
# TYPE openai_front_errors_total counter
openai_front_errors_total{code="service_unavailable",status="503"} 7.0
# TYPE openai_front_in_flight gauge
openai_front_in_flight 3.0
"""


def test_the_served_counters_are_read_from_the_scrapes_each_key_summing_the_series_it_stands_for():
    with serving_metrics(lambda: TRITON_SCRAPE) as triton, serving_metrics(lambda: FRONT_SCRAPE) as front:
        counted = overload.served_counters(f"127.0.0.1:{triton}", f"http://127.0.0.1:{front}/metrics")
        assert "openai_front_requests_total 200" not in overload.served_counters(f"127.0.0.1:{triton}")
        assert overload.pending_requests(f"127.0.0.1:{triton}") == 9.0  # what settle() waits on
    assert counted == {"nv_inference_request_success describe": 600.0,
                       "nv_inference_request_failure describe REJECTED": 4.0,
                       "nv_inference_request_failure describe BACKEND": 0.0,
                       "nv_inference_count describe": 570.0, "nv_inference_exec_count describe": 285.0,
                       "openai_front_requests_total 200": 15.0, "openai_front_requests_total 503": 1.0,
                       "openai_front_errors_total 503 service_unavailable": 7.0}
