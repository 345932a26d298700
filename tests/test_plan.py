"""The plan predicts, from metadata alone, what petastorm's own readers then deliver.

Each scenario: a dataset, a world size, a reader and a loader. Every shard is read once with
petastorm's public API (``cur_shard``/``shard_count``), one after another in this process,
and its rows, batches and the row groups they came from must equal the plan's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ddp_even.modes import MODES
from ddp_even.parquet import plan_for_dataset
from ddp_even.planning import plan_shards
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.shard_reads import Layouts, ids_of_row_groups, read_shard, write_summary_metadata

BATCH = 4
# Uneven on purpose: short last batches, row groups smaller and larger than a batch.
SIZES = [[7, 3, 12], [5], [1, 9, 4, 6], [2, 10]]
# One rank, two, row groups not a multiple of the ranks (3), more ranks than files (5).
WORLD_SIZES = [1, 2, 3, 5]


LAYOUTS = Layouts(SIZES)
plain, partitioned = LAYOUTS.plain, LAYOUTS.partitioned
with_metadata, unischema = LAYOUTS.with_metadata, LAYOUTS.unischema


def metadata_skipping_a_file(root: Path) -> str:
    url = write_plain_dataset(root, SIZES)
    write_summary_metadata(root, skip=("part-00002.parquet",))
    return url


# (dataset, petastorm reader kind, loader): plain Parquet through make_batch_reader, the
# Unischema dataset through make_reader (rows) and make_batch_reader (raw: its binary
# ndarray column cannot go through the pytorch loaders undecoded).
SCENARIOS = [
    (plain, "batch", "raw"),
    (plain, "batch", "batched_dataloader"),
    (plain, "batch", "dataloader"),
    (partitioned, "batch", "batched_dataloader"),
    (with_metadata, "batch", "batched_dataloader"),
    (metadata_skipping_a_file, "batch", "dataloader"),
    (unischema, "row", "raw"),
    (unischema, "row", "dataloader"),
    (unischema, "row", "batched_dataloader"),
    (unischema, "batch", "raw"),
]


@pytest.mark.timeout(120)
@pytest.mark.petastorm
@pytest.mark.parametrize(
    ("make_dataset", "reader", "loader"),
    SCENARIOS,
    ids=[f"{make.__name__}-{reader}-{loader}" for make, reader, loader in SCENARIOS],
)
def test_plan_equals_petastorm_reads(
    tmp_path: Path, make_dataset: Any, reader: Any, loader: Any
) -> None:
    url = make_dataset(tmp_path / "ds")
    for world_size in WORLD_SIZES:
        row_groups, plan = plan_for_dataset(url, world_size, BATCH)
        for rank in range(world_size):
            got = read_shard(url, rank, world_size, reader=reader, loader=loader, batch_size=BATCH)
            shard = plan.row_groups_of(rank)
            expected_ids = ids_of_row_groups(
                row_groups.files, row_groups.file_of, row_groups.index_in_file, shard
            )
            where = f"world {world_size} rank {rank}"
            assert got.rows == plan.rows_per_rank[rank], where
            assert sorted(got.ids) == sorted(expected_ids), where
            if loader != "raw":
                assert got.batches == plan.batches_per_rank[rank], where
                assert all(size == BATCH for size in got.batch_sizes[:-1]), where


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_too_many_ranks_petastorm_refuses_and_the_plan_says_so(tmp_path: Path) -> None:
    from petastorm import make_batch_reader
    from petastorm.errors import NoDataAvailableError

    url = write_plain_dataset(tmp_path / "ds", [[5, 5], [5]])
    _, plan = plan_for_dataset(url, world_size=4, batch_size=2)
    with pytest.raises(NoDataAvailableError):
        make_batch_reader(url, cur_shard=0, shard_count=4, reader_pool_type="dummy")
    assert plan.petastorm_error is not None and "NoDataAvailableError" in plan.petastorm_error
    # The shards themselves run as a balanced plan's with the same empty rank (from_parquet).
    assert [plan.stats(mode).runnable for mode in MODES] == [True, False, True, True, True]
    message = plan.describe_too_many_ranks()
    assert message is not None
    for words in (
        "petastorm's own readers (cur_shard/shard_count) raise NoDataAvailableError",
        "from_parquet reads the same shards with empty ranks: rank(s) 3 get no rows",
        "truncate runs 0 steps",
        "cycle cannot run",
        "join trains on 3 rank(s)",
    ):
        assert words in message
    assert "every mode fails" not in message  # from_parquet runs three of them
    _, balanced = plan_for_dataset(url, world_size=4, batch_size=2, sharding="row_groups")
    assert balanced.petastorm_error is None
    assert balanced.empty_ranks == (3,)
    assert balanced.steps("truncate") == 0
    assert not balanced.stats("cycle").runnable
    assert balanced.stats("join").runnable
    # Exactly as many ranks as row groups is fine for petastorm.
    assert plan_for_dataset(url, world_size=3, batch_size=2)[1].petastorm_error is None


# --- Mode arithmetic, against counts worked out by hand. ---


@pytest.mark.timeout(30)
def test_modes_on_a_worked_example() -> None:
    # Round robin over [25, 4, 10, 3, 1] with 2 ranks: rank 0 gets 25+10+1 = 36 rows,
    # rank 1 gets 4+3 = 7 rows. Batch 5: 8 and 2 batches.
    plan = plan_shards([25, 4, 10, 3, 1], world_size=2, batch_size=5)
    assert plan.shards == ((0, 2, 4), (1, 3))
    assert plan.rows_per_rank == (36, 7)
    assert plan.batches_per_rank == (8, 2)

    truncate = plan.stats("truncate")
    assert truncate.steps == 2
    assert truncate.dropped_batches == (6, 0)
    assert truncate.dropped_rows == (36 - 10, 0)
    assert truncate.waste_percent == pytest.approx(100 * 26 / 43, abs=1e-3)

    cycle = plan.stats("cycle")
    assert cycle.steps == 8
    # Rank 1 repeats 6 batches: 3 whole passes of its 7 rows (2 batches each).
    assert cycle.repeated_batches == (0, 6)
    assert cycle.repeated_rows == (0, 21)

    join = plan.stats("join")
    assert join.steps == 8
    assert join.idle_steps == (0, 6)
    assert join.waste_percent == pytest.approx(100 * 6 / 16, abs=1e-3)
    assert sum(join.dropped_rows) == sum(join.repeated_rows) == 0


@pytest.mark.timeout(30)
def test_cycle_repeats_a_partial_pass_with_full_batches() -> None:
    # Rank 1: 11 rows = batches of 4, 4, 3. It must repeat 4 batches: one whole pass
    # (11 rows) and the first, full batch of another (4 rows).
    plan = plan_shards([28, 11], world_size=2, batch_size=4)
    assert plan.batches_per_rank == (7, 3)
    assert plan.stats("cycle").repeated_rows == (0, 15)


@pytest.mark.timeout(30)
def test_batches_are_ceil_of_rows() -> None:
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 50, 200)
    for world_size, batch_size in ((1, 1), (3, 7), (16, 32)):
        plan = plan_shards(sizes, world_size, batch_size)
        for rank in range(world_size):
            rows = int(sizes[rank::world_size].sum())
            assert plan.rows_per_rank[rank] == rows
            assert plan.batches_per_rank[rank] == math.ceil(rows / batch_size)
            assert plan.row_groups_of(rank) == tuple(range(rank, len(sizes), world_size))


@pytest.mark.timeout(30)
def test_to_dict_is_json_ready() -> None:
    import json

    document = plan_shards([3, 5, 2], world_size=2, batch_size=2, sharding="row_groups").to_dict()
    assert json.loads(json.dumps(document)) == document
    assert set(document["modes"]) == set(MODES)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"world_size": 0}, ValueError, "world_size must be at least 1"),
        ({"world_size": 2.0}, TypeError, "world_size must be a positive int"),
        ({"world_size": True}, TypeError, "world_size must be a positive int"),
        ({"batch_size": 0}, ValueError, "batch_size must be at least 1"),
        ({"balanced": "yes"}, TypeError, "balanced must be True or False"),
        ({"row_groups": []}, ValueError, "no row groups"),
        ({"row_groups": [1.5, 2.0]}, TypeError, "row counts"),
        ({"row_groups": [3, -1]}, ValueError, ">= 0"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs: dict[str, Any], error: type, words: str) -> None:
    arguments: dict[str, Any] = {"row_groups": [1, 2, 3], "world_size": 2, "batch_size": 2}
    arguments.update(kwargs)
    with pytest.raises(error, match=words):
        plan_shards(**arguments)


@pytest.mark.timeout(30)
def test_bad_mode_and_rank() -> None:
    plan = plan_shards([1, 2, 3], world_size=2, batch_size=2)
    with pytest.raises(
        ValueError, match="unknown mode 'drop': choose one of 'truncate', 'cycle', 'pad', 'join'"
    ):
        plan.steps("drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        plan.row_groups_of(2)
