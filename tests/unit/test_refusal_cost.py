"""tools/refusal_cost.py's arithmetic: a process's CPU read from /proc, and a mode's
figures from its rounds (the measurement itself runs by hand: docs/reliability.md#overload)."""

import os
import pathlib

import pytest

from tools import refusal_cost


@pytest.mark.skipif(not pathlib.Path(f"/proc/{os.getpid()}/stat").exists(), reason="no /proc")
def test_cpu_seconds_of_a_process_grow_as_it_works():
    before = refusal_cost.cpu_s(os.getpid())
    for _ in range(10_000):  # bounded: a clock tick (10 ms) of work is far less than this allows
        sum(range(100_000))
        if refusal_cost.cpu_s(os.getpid()) > before:
            break
    assert refusal_cost.cpu_s(os.getpid()) > before


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
