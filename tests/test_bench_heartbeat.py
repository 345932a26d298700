"""The heartbeat benchmark runs end to end against a real TCPStore (no timings asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_heartbeat import BenchConfig, run


@pytest.mark.timeout(60)
def test_two_writers_beat_once_a_second_into_one_store() -> None:
    (row,) = run(BenchConfig(writers=(2,), seconds=2.0))
    json.dumps(row)  # what the command writes
    assert row["writers"] == 2 and row["beat_interval_s"] == 1.0
    # Each writer beats at once, then once a second: 2 or 3 beats each in 2 s.
    assert 1.5 <= row["beats_per_s"] <= 3.5, row
    assert 40 < row["bytes_per_beat"] < 200, row
    assert row["set_median_s"] > 0 and row["look_median_s"] > 0
