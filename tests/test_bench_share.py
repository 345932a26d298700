"""The share benchmark runs end to end on 2 and 4 ranks and reports every variant (no timings:
the structure, and what each mode trains: share every row once in ceil(B / W) steps)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from benchmarks.bench_share import EQUAL, PAD_TARGET_SHAPE, QUICK, measure_shape

pytestmark = [pytest.mark.benchmark, pytest.mark.multirank]

CONFIG = dataclasses.replace(QUICK, repeats=1)


@pytest.mark.parametrize(
    ("shape", "known_lengths"),
    [(PAD_TARGET_SHAPE, False), ((1, 2, 3, 6), False), ((1, 2, 3, 6), True)],
    ids=["22/166", "4 ranks", "4 ranks, known lengths"],
)
def test_every_variant_trains_what_its_mode_promises(
    shape: tuple[int, ...], known_lengths: bool
) -> None:
    result = measure_shape(shape, dataclasses.replace(CONFIG, known_lengths=known_lengths))

    json.dumps(result)  # what the command writes
    ranks, batches = len(shape), sum(shape)
    total = batches * CONFIG.batch_size
    assert result["world_size"] == ranks
    assert result["shard_batches"] == list(shape)
    assert result["total_rows"] == total
    assert result["share_steps"] == math.ceil(batches / ranks)
    rows = {row["variant"]: row for row in result["results"]}
    assert list(rows) == [EQUAL, "ddp_even pad", "ddp_even cycle", "ddp_even share"]
    for row in rows.values():
        assert len(row["rounds"]) == 1
        assert row["wall_s"] > 0 and row["cpu_s"] > 0
        assert len(row["rounds"][0]["cpu_per_rank_s"]) == ranks
        # Every variant trains every row at least once.
        assert row["distinct_rows"] == total, row["variant"]
    # The equal shards and share: every row once, in B / W steps on every rank.
    for name in (EQUAL, "ddp_even share"):
        assert rows[name]["steps_per_rank"] == [result["share_steps"]] * ranks, name
        assert rows[name]["rows_trained"] == total, name
    # Pad and cycle: the longest shard's steps; pad every row once, cycle repeats.
    for name in ("ddp_even pad", "ddp_even cycle"):
        assert rows[name]["steps_per_rank"] == [max(shape)] * ranks, name
    assert rows["ddp_even pad"]["rows_trained"] == total
    assert rows["ddp_even cycle"]["rows_trained"] == max(shape) * ranks * CONFIG.batch_size
    assert rows[EQUAL]["wall_vs_equal"] == rows["ddp_even pad"]["wall_vs_pad"] == 1.0
    targets = [target["target"] for target in result["targets"]]
    assert targets == [
        "share / equal shards <= 1.15x (epoch, wall)",
        *(["share / pad <= 0.6x (epoch, wall)"] if shape == PAD_TARGET_SHAPE else []),
    ]
    assert {target["passed"] for target in result["targets"]} <= {True, False}
