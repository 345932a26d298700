"""The heartbeat benchmark runs end to end against a real TCPStore (no timings asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_heartbeat import BenchConfig, run

pytestmark = pytest.mark.benchmark


@pytest.mark.timeout(60)
def test_two_writers_beat_twice_a_second_into_one_store() -> None:
    # A loader timeout of 2 s paces the beats every 0.5 s (the command's 30 s: every 1 s).
    (row,) = run(BenchConfig(writers=(2,), seconds=1.0, timeout=2.0))
    json.dumps(row)  # what the command writes
    assert row["writers"] == 2 and row["beat_interval_s"] == 0.5
    # Each writer beats at once, then every 0.5 s: 2 or 3 beats each in 1 s.
    assert 3.0 <= row["beats_per_s"] <= 7.0, row
    assert 40 < row["bytes_per_beat"] < 200, row
    assert row["set_median_s"] > 0 and row["look_median_s"] > 0
