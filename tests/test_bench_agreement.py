"""The agreement benchmark runs end to end on 2 ranks and reports every variant (no timings)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_agreement import (
    EVERY_16,
    HAND_KNOWN,
    HOOKED,
    JOIN,
    LONG_ONLY,
    OVERLAPPED,
    BenchConfig,
    measure_world,
)
from tests.helpers.collectives import source_checks

pytestmark = [pytest.mark.benchmark, pytest.mark.multirank]

WORKLOADS = {"loader", "ddp model", "busy wait", "idle wait"}


def test_two_ranks_report_every_variant_and_target() -> None:
    result = measure_world(2, BenchConfig(steps=20, repeats=1, latency_samples=50))

    json.dumps(result)  # what the command writes
    assert result["world_size"] == 2
    assert result["shard_batches"] == [20, 18]
    assert result["allreduce_latency_s"] > 0
    assert set(result["allreduce_mean_by_elements_s"]) == {"1", "2", "9"}
    rows = {(row["workload"], row["variant"]): row for row in result["results"]}
    assert {workload for workload, _ in rows} == WORKLOADS
    for workload in WORKLOADS:
        assert (workload, JOIN) in rows
        assert (workload, "ddp_even truncate K=16") in rows
        assert (workload, LONG_ONLY) in rows
    for row in result["results"]:
        assert len(row["rounds"]) == 1
        assert row["per_step_s"] > 0
        # Truncate-like variants take the shortest shard's steps; Join, cycle and pad the longest.
        longest = row["variant"] == JOIN or "cycle" in row["variant"] or "pad" in row["variant"]
        assert row["steps"] == (20 if longest else 18), row
        if row["variant"].endswith("known lengths"):
            # One agreement before the first step (in both forms: it opens the epoch), the
            # checks of the sources (overlapped with the steps), one statistics gather after
            # the last step. The round timed is the loader's second epoch, whose checks start
            # at the spacing its first agreed: 16 steps where steps are slow, more where fast.
            checks = row["collectives_in_loop"]
            assert 1 <= checks <= source_checks(row["steps"], counted_from=1), row
            assert row["collectives_per_epoch"] == 3 + checks, row
        if row["variant"] == HOOKED:
            # The hook's all-reduce, one bucket a step, on the shortest shard's steps.
            assert row["workload"] == "ddp model" and row["collectives_per_epoch"] == 18, row
        if row["variant"] in ("ddp_even truncate K=1", OVERLAPPED + "K=1"):
            # One agreement per step (the first in both forms) and one that ends the epoch,
            # then the statistics: the hand-written loop does the same collectives.
            assert row["collectives_per_epoch"] == 1 + 18 + 2
        if row["variant"] in (HAND_KNOWN, f"ddp_even truncate known lengths {EVERY_16}"):
            # The opening agreement in two collectives, a check every 16 steps and after the
            # last, the statistics: by hand as by ddp_even.
            assert row["collectives_per_epoch"] == 2 + 2 + 1, row
        if row["variant"] == LONG_ONLY:
            # The long form alone: one all-reduce per agreement, the first too.
            assert row["collectives_per_epoch"] == 18 + 2
        if row["variant"] == "ddp_even pad K=1":
            # One agreement per step (the first in both forms) and one that ends the epoch,
            # each with its sum of the window's real rows, then the statistics.
            assert row["collectives_per_epoch"] == 1 + 2 * (20 + 1) + 1
    assert {target["passed"] for target in result["targets"]} <= {True, False}
    assert {target["target"].split(":")[0] for target in result["targets"]} == {
        *WORKLOADS,
        "known lengths",
    }
    for workload in WORKLOADS:
        kinds = {
            target["target"].split(": ", 1)[1]
            for target in result["targets"]
            if target["target"].startswith(f"{workload}: ")
        }
        assert kinds == {
            "K=1 CPU per step <= 1.2x the hand-written K=1's",
            "known lengths <= 10 us CPU a step, boundaries included",
        }, (workload, kinds)
