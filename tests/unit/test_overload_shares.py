"""tools/overload.py: each kind's goodput share is against the saturation measured beside it."""

from types import SimpleNamespace

from tools import overload


def phase(answered, lost=0, **extra):
    return dict(admitted_per_s=answered, admitted_p99_ms=3000.0, lost=lost, lost_sample=[], admitted=100,
                **extra)


def test_the_share_is_against_the_saturation_beside_and_the_first_is_kept():
    first, beside = phase(50.0), phase(40.0)
    shares = overload.shares(phase(36.0), first, beside)
    assert shares["goodput_share"] == 0.9 and shares["share_of_first_saturation"] == 0.72
    assert shares["saturation_beside"]["admitted_per_s"] == 40.0


def test_without_a_saturation_beside_the_share_is_against_the_first():
    shares = overload.shares(phase(36.0), phase(50.0))
    assert shares["goodput_share"] == shares["share_of_first_saturation"] == 0.72
    assert "saturation_beside" not in shares


def test_a_loss_beside_a_kind_fails_the_verdict_and_the_share_is_judged():
    args = SimpleNamespace(factors=[20], max_p99_ratio=3.0)
    kind = dict(phase(36.0), kind="client-grpc", factor=20, rejected=0, lost_by_reason={})
    kind.update(overload.shares(kind, phase(50.0), phase(40.0, lost=2)))
    problems = overload.judge(phase(50.0), [kind], args)
    assert len(problems) == 1 and "saturation beside client-grpc at 20x: 2 request(s) lost" in problems[0]
    kind.update(overload.shares(kind, phase(50.0), phase(46.0)))  # 36 / 46 = 0.78 < 0.8
    problems = overload.judge(phase(50.0), [kind], args)
    assert any("goodput 0.78 of saturation" in problem for problem in problems)


def test_the_table_shows_the_saturation_beside_and_both_shares():
    kind = dict(phase(36.0), kind="client-grpc", factor=20, users=2560, rejected=5, admitted_p50_ms=1000.0,
                client="c", path="p")
    kind.update(overload.shares(kind, phase(50.0), phase(40.0)))
    first = dict(phase(50.0), users=128, rejected=0, admitted_p50_ms=900.0)
    row = overload.table(first, [kind]).splitlines()[-1]
    assert "| 36.0 | 40.0 | 0.9 | 0.72 |" in row


def test_losses_fail_the_verdict_for_judged_kinds_but_not_the_unjudged_baseline():
    args = SimpleNamespace(factors=[20], max_p99_ratio=3.0)

    def kind(name):
        figures = dict(phase(40.0, lost=3), kind=name, factor=20, rejected=0, lost_by_reason={})
        figures.update(overload.shares(figures, phase(50.0), phase(42.0)))
        return figures

    assert overload.judge(phase(50.0), [kind("resend-bare")], args) == []
    problems = overload.judge(phase(50.0), [kind("resend-proxy")], args)
    assert problems == ["resend-proxy at 20x: 3 request(s) lost: []"]
