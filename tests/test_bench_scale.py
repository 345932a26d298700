"""The scale benchmark runs end to end on 4 ranks: every mode as defined, the agreement's costs
and collectives, the store's load, and a SIGKILL named on every survivor within its bound."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_scale import AGREEMENT_STEPS, KILL_TIMEOUT_S, run_world

pytestmark = [pytest.mark.multirank, pytest.mark.timing]


@pytest.mark.timeout(300)
def test_four_ranks_measure_everything_and_name_the_killed_rank() -> None:
    run = run_world(4)
    json.dumps(run)  # what the command writes
    assert run["errors"] == {} and run["hung"] == [], run
    assert run["ranks_reported"] == 3, "the killed rank reports nothing"
    assert run["modes_as_defined"], run
    assert run["fault_named"], run
    assert run["kill_to_last_error_s"] <= KILL_TIMEOUT_S + 5, run
    # Agreeing every step: one agreement per step (the first in two forms), one to end the
    # epoch, the statistics; known lengths: the opening agreement's two, one check after the
    # last step (short steps space the checks out), the statistics.
    assert run["every_step"]["collectives"] == AGREEMENT_STEPS + 3, run
    assert run["known"]["collectives"] == 4, run
    assert run["store_requests_per_s"]["training"] > 0, run
    assert run["peak_rss_mib"] > 0
