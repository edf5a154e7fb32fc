"""tools/refusal_cost.py's arithmetic: a mode's figures from its rounds (the
measurement itself runs by hand: docs/reliability.md#overload; the front's CPU is
read by serving/procfs.py, tested in test_procfs.py)."""

from tools import refusal_cost


def test_a_modes_figures_per_refusal_and_per_refused_mb(tmp_path):
    photo = tmp_path / "photo"
    photo.write_bytes(b"p" * 749_850)  # base64 999,800 + 200 bytes of JSON: a body of 1 MB
    assert refusal_cost.body_bytes(photo) == 1_000_000
    runs = [(1000, 0, 0.5, 3.0), (2000, 1, 0.6, 3.0), (500, 0, 0.5, 3.0)]  # refused, others, CPU s, wall s
    body = refusal_cost.figures_of("body", runs, 8, photo)
    assert body["refused"] == 3500 and body["not_refused"] == 1 and body["front_cpu_share"] == 0.18
    assert body["front_cpu_ms_per_refusal"] == {"median": 0.5, "least": 0.3, "rounds": [0.5, 0.3, 1.0]}
    assert body["front_cpu_ms_per_refused_mb"] == {"median": 0.5, "least": 0.3}
    assert "front_cpu_ms_per_refused_mb" not in refusal_cost.figures_of("expect", runs, 8, photo)
