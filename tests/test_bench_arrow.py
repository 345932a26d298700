"""The pyarrow reader's benchmark runs end to end on 1 and 2 ranks and reports every variant
(the rows each read, no timings judged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_arrow import (
    ARROW_ALONE,
    DECODING_ALONE,
    FROM_PARQUET,
    PETASTORM,
    BenchConfig,
    evaluate_target,
    measure_on_rank,
)
from benchmarks.bench_reading import DatasetShape, write_dataset
from benchmarks.ranks import run_on_ranks

pytestmark = [pytest.mark.benchmark, pytest.mark.petastorm, pytest.mark.multirank]

CONFIG = BenchConfig(dataset=DatasetShape(2, 4_000, 1_000), batch_size=256, repeats=1)
VARIANTS = {PETASTORM, FROM_PARQUET, ARROW_ALONE, DECODING_ALONE}


@pytest.mark.timeout(240)
def test_one_and_two_ranks_read_every_variant(tmp_path: Path) -> None:
    url = write_dataset(tmp_path / "batch", CONFIG.dataset, unischema=False)
    for world_size in (1, 2):
        result = run_on_ranks(measure_on_rank, world_size, CONFIG, url)
        json.dumps(result)  # what the command writes
        rows = {row["variant"]: row for row in result["results"]}
        assert set(rows) == VARIANTS
        shard = CONFIG.dataset.total_rows // world_size
        for variant, row in rows.items():
            # Equal row groups, an even count: every variant reads rank 0's half (or all).
            assert row["rows_per_epoch"] == shard, (variant, row)
            assert row["batches_per_epoch"] == -(-shard // CONFIG.batch_size)
            assert row["rows_per_s"] > 0 and row["process_cpu_per_batch_s"] > 0
            assert row["peak_rss_bytes"] >= 0
        assert rows[PETASTORM]["vs_petastorm"] == 1
        target = evaluate_target(result)
        # The target is judged in one process only.
        assert (target is None) == (world_size > 1)
        if target is not None:
            assert isinstance(target["passed"], bool) and FROM_PARQUET in target["target"]
