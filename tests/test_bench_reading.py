"""The reading benchmark runs end to end on 1 and 2 ranks and reports every variant (no
timings: only the structure, and that every variant read its shard's rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_reading import (
    HELD_TOGETHER,
    PER_STEP,
    PETASTORM,
    QUICK,
    READER_KINDS,
    READER_TITLES,
    SHARDINGS,
    TARGET_RATIO,
    BenchConfig,
    DatasetShape,
    measure_world,
    write_datasets,
)

pytestmark = [pytest.mark.benchmark, pytest.mark.petastorm, pytest.mark.multirank]

CONFIG = BenchConfig(
    batch_dataset=DatasetShape(files=2, rows_per_file=4_000, rows_per_row_group=1_000),
    row_dataset=DatasetShape(files=2, rows_per_file=256, rows_per_row_group=64),
    batch_size=QUICK.batch_size,
    repeats=1,
)
VARIANTS = {
    PETASTORM,
    "factory, footer lengths",
    PER_STEP,
    *(f"from_parquet {sharding}" for sharding in SHARDINGS),
}


@pytest.mark.timeout(240)
def test_one_and_two_ranks_read_every_variant(tmp_path: Path) -> None:
    urls = write_datasets(tmp_path, CONFIG)
    shapes = {"batch": CONFIG.batch_dataset, "row": CONFIG.row_dataset}
    for world_size in (1, 2):
        result = measure_world(world_size, CONFIG, urls)

        json.dumps(result)  # what the command writes
        assert (result["world_size"], result["rank"]) == (world_size, 0)
        rows = {(row["reader"], row["variant"]): row for row in result["results"]}
        # The hand-written loop that holds ranks together runs only where there are ranks.
        variants = VARIANTS | ({HELD_TOGETHER} if world_size > 1 else set())
        assert set(rows) == {(kind, variant) for kind in READER_KINDS for variant in variants}
        for (kind, variant), row in rows.items():
            # Equal row groups, an even count: every sharding gives rank 0 the same rows.
            total = shapes[kind].total_rows
            shard = total if variant == "from_parquet replicate" else total // world_size
            assert [epoch["rows"] for epoch in row["rounds"]] == [shard] * CONFIG.repeats, row
            assert row["rows_per_epoch"] == shard
            assert row["batches_per_epoch"] == -(-shard // CONFIG.batch_size)
            assert row["rows_per_s"] > 0
            assert row["vs_petastorm"] > 0
            assert row["vs_petastorm_paired"] > 0
            if variant == PETASTORM:
                assert row["vs_petastorm"] == 1
        # The target's lines: in one process every ddp_even row against petastorm's own loop;
        # on ranks, the rows of known lengths against the loop held together by hand, which
        # does the same collectives.
        judged = {(target["target"], target["variant"]) for target in result["targets"]}
        baseline = "petastorm held together by hand" if world_size > 1 else "petastorm's own loop"
        judged_variants = VARIANTS - {PETASTORM} - ({PER_STEP} if world_size > 1 else set())
        assert judged == {
            (f"{READER_TITLES[kind]}: >= {TARGET_RATIO} of {baseline}", variant)
            for kind in READER_KINDS
            for variant in judged_variants
        }
        assert {type(target["passed"]) for target in result["targets"]} == {bool}
