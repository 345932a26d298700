"""The hand-over benchmark runs end to end on 2 ranks and reports every row (no timings)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_handover import BenchConfig, run, tables

pytestmark = [pytest.mark.benchmark, pytest.mark.multirank]


@pytest.mark.timeout(120)
def test_two_ranks_time_every_size_and_both_groups() -> None:
    config = BenchConfig(sizes_mb=(0.0, 0.5), round_trips=2, busy_mb=(0.5,), busy_repeats=2)
    result = run(config)
    json.dumps(result)  # what the command writes
    assert [row["batch_mb"] for row in result["handovers"]] == [0.0, 0.5]
    assert all(row["median_s"] > 0 for row in result["handovers"])
    assert [row["batch_on"] for row in result["busy"]] == ["control group", "group of its own"]
    assert all(row["slowest_during_s"] >= row["first_during_s"] > 0 for row in result["busy"])
    assert len(tables(result, config)) == 2
