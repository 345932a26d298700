"""The scale benchmark runs end to end on 4 ranks: every mode as defined (in memory, and over
Parquet round robin and by rows, with a resume), the agreement's costs and collectives, the
store's load, and a SIGKILL and a SIGSTOP named on every survivor within their bound, and a
SIGKILL in a fresh job per Parquet reader, beside CPU hogs."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_scale import AGREEMENT_STEPS, KILL_TIMEOUT_S, available_readers, run_world

# One at a time with the other test that loads the machine (tests/test_busy_at_scale.py):
# this one bounds how soon a fault is named.
pytestmark = [pytest.mark.benchmark, pytest.mark.multirank, pytest.mark.xdist_group("load")]


@pytest.mark.timeout(420)
def test_four_ranks_measure_everything_and_name_the_killed_rank() -> None:
    run = run_world(4)
    json.dumps(run)  # what the command writes
    assert run["errors"] == {} and run["hung"] == [], run
    assert run["ranks_reported"] == 4, run
    assert run["modes_as_defined"], run
    assert run["parquet_wrong"] == [], run
    assert run["kill"]["named"], run
    assert run["kill"]["to_last_error_s"] <= KILL_TIMEOUT_S + 5, run
    assert run["stop"]["named"], run
    assert run["stop"]["to_last_error_s"] <= KILL_TIMEOUT_S + 5, run
    # A fresh job per Parquet reader, beside CPU hogs: only the killed rank is named.
    for reader in available_readers():
        assert run[f"kill_{reader}"]["named"], run
        assert run[f"kill_{reader}"]["to_last_error_s"] <= KILL_TIMEOUT_S + 5, run
    assert run["control_group_s"] > 0, run
    # Agreeing every step: one agreement per step (the first in two forms), one to end the
    # epoch, the statistics; known lengths: the opening agreement's two, one check after the
    # last step (short steps space the checks out), the statistics.
    assert run["every_step"]["collectives"] == AGREEMENT_STEPS + 3, run
    assert run["known"]["collectives"] == 4, run
    assert run["store_requests_per_s"]["training"] > 0, run
    assert run["peak_rss_mib"] > 0
