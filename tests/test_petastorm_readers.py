"""Readers built from a plan read exactly the plan's row groups, through petastorm.

Each scenario builds every rank's reader in turn in this process (no process group needed)
and checks: the rows and batches equal the plan's, the ``id`` values are those stored in the
rank's row groups, and together the ranks read every row group exactly once.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

from ddp_even.errors import PlanMismatchError
from ddp_even.petastorm.readers import make_shard_factory, petastorm_url
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.shard_reads import (
    Layouts,
    collect,
    ids_of_row_groups,
    read_shard,
)

pytestmark = pytest.mark.petastorm

BATCH = 4
# Skewed: round robin puts both big row groups on rank 0 of 2.
SIZES = [[40, 3], [30, 5], [1, 6, 4, 2]]
DUMMY = {"reader_pool_type": "dummy", "shuffle_row_groups": False}


LAYOUTS = Layouts(SIZES)
plain, partitioned = LAYOUTS.plain, LAYOUTS.partitioned
with_metadata, unischema = LAYOUTS.with_metadata, LAYOUTS.unischema


def read_all_ranks(
    url: str, world_size: int, *, sharding: str = "row_groups", **options: Any
) -> tuple[Any, list[list[int]], list[int]]:
    """(plan, ids per rank, batches per rank), reading each rank's shard in turn."""
    ids_per_rank: list[list[int]] = []
    batches_per_rank: list[int] = []
    plan = None
    for rank in range(world_size):
        plan, factory = make_shard_factory(
            url, rank, world_size, BATCH, sharding=sharding, **options
        )
        with factory() as shard_pass:
            got = collect(shard_pass)
        ids_per_rank.append(got.ids)
        batches_per_rank.append(got.batches)
    return plan, ids_per_rank, batches_per_rank


SCENARIOS = [
    (plain, {"reader": "batch", "loader": "batched_dataloader"}),
    (plain, {"reader": "batch", "loader": "dataloader"}),
    (plain, {"reader": "batch", "loader": "reader"}),
    (partitioned, {"reader": "batch", "loader": "batched_dataloader"}),
    (with_metadata, {"reader": "batch", "loader": "batched_dataloader"}),
    (unischema, {"reader": "row", "loader": "dataloader"}),
    (unischema, {"reader": "row", "loader": "batched_dataloader"}),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("make_dataset", "options"),
    SCENARIOS,
    ids=[f"{make.__name__}-{o['reader']}-{o['loader']}" for make, o in SCENARIOS],
)
def test_balanced_readers_read_exactly_their_row_groups(
    tmp_path: Path, make_dataset: Any, options: dict[str, Any]
) -> None:
    url = make_dataset(tmp_path / "ds")
    from ddp_even.parquet.metadata import read_row_groups

    groups = read_row_groups(url)
    all_ids = ids_of_row_groups(
        groups.files, groups.file_of, groups.index_in_file, range(len(groups))
    )
    for world_size in (1, 2, 3, 5):  # 5: more ranks than files
        plan, ids_per_rank, batches_per_rank = read_all_ranks(
            url, world_size, reader_kwargs=DUMMY, **options
        )
        for rank in range(world_size):
            expected = ids_of_row_groups(
                groups.files, groups.file_of, groups.index_in_file, plan.row_groups_of(rank)
            )
            where = f"world {world_size} rank {rank}"
            assert ids_per_rank[rank] == expected, where
            assert len(ids_per_rank[rank]) == plan.rows_per_rank[rank], where
            if options["loader"] != "reader":
                assert batches_per_rank[rank] == plan.batches_per_rank[rank], where
        counts = collections.Counter(i for ids in ids_per_rank for i in ids)
        assert sorted(counts) == sorted(all_ids)
        assert set(counts.values()) == {1}, f"world {world_size}: some rows read twice"


@pytest.mark.timeout(60)
def test_balanced_evens_out_the_skewed_dataset(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    round_robin, rr_ids, _ = read_all_ranks(url, 2, sharding="round_robin", reader_kwargs=DUMMY)
    balanced, balanced_ids, _ = read_all_ranks(url, 2, reader_kwargs=DUMMY)
    # Global order 40, 3, 30, 5, 1, 6, 4, 2: rank 0 gets 40+30+1+4, rank 1 gets 3+5+6+2.
    assert [len(ids) for ids in rr_ids] == [75, 16] == list(round_robin.rows_per_rank)
    # Best split of 91 rows: 46 / 45 (40+6 and 30+5+4+3+2+1).
    assert sorted(len(ids) for ids in balanced_ids) == [45, 46]
    assert balanced.spread_rows < round_robin.spread_rows


@pytest.mark.timeout(60)
def test_shuffled_threaded_reads_keep_the_same_row_groups(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    shuffled = {
        "reader_pool_type": "thread",
        "workers_count": 2,
        "seed": 3,
        "shuffle_row_groups": True,
    }
    plan, ids_per_rank, batches = read_all_ranks(url, 3, reader_kwargs=shuffled)
    _, in_order, _ = read_all_ranks(url, 3, reader_kwargs=DUMMY)
    assert [sorted(ids) for ids in ids_per_rank] == [sorted(ids) for ids in in_order]
    assert batches == list(plan.batches_per_rank)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_round_robin_factory_reads_what_petastorm_reads(tmp_path: Path, world_size: int) -> None:
    url = plain(tmp_path / "ds")
    _, ids_per_rank, batches = read_all_ranks(
        url, world_size, sharding="round_robin", reader_kwargs=DUMMY
    )
    for rank in range(world_size):
        petastorm = read_shard(url, rank, world_size, batch_size=BATCH)
        assert ids_per_rank[rank] == petastorm.ids
        assert batches[rank] == petastorm.batches


@pytest.mark.timeout(60)
def test_each_factory_call_is_a_fresh_pass(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    # DataLoader carries a short last batch over into a second pass of the same loader;
    # a fresh reader and loader per pass must not.
    plan, factory = make_shard_factory(url, 0, 2, BATCH, loader="dataloader", reader_kwargs=DUMMY)
    passes = []
    for _ in range(2):
        with factory() as shard_pass:
            passes.append(collect(shard_pass))
    assert passes[0] == passes[1]
    assert passes[0].batches == plan.batches_per_rank[0]


@pytest.mark.timeout(60)
def test_balanced_rank_without_row_groups_reads_nothing(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "ds", [[5, 5], [5]])
    plan, ids_per_rank, batches = read_all_ranks(url, 4, reader_kwargs=DUMMY)
    assert plan.empty_ranks == (3,)
    assert [len(ids) for ids in ids_per_rank] == [5, 5, 5, 0]
    assert batches == [2, 2, 2, 0]


@pytest.mark.timeout(60)
def test_round_robin_with_more_ranks_than_row_groups_is_refused(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "ds", [[5, 5], [5]])
    with pytest.raises(ValueError, match=r"NoDataAvailableError.*sharding='rows'"):
        make_shard_factory(url, 0, 4, BATCH)


@pytest.mark.timeout(60)
def test_dataset_changed_after_planning_is_caught(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    _, factory = make_shard_factory(url, 0, 2, BATCH, sharding="row_groups", reader_kwargs=DUMMY)
    write_plain_dataset(tmp_path / "ds2", [[7]])
    (tmp_path / "ds2" / "part-00000.parquet").rename(tmp_path / "ds" / "part-00003.parquet")
    with pytest.raises(PlanMismatchError, match="petastorm lists 9 row groups, the plan 8"):
        factory()


@pytest.mark.timeout(60)
def test_plain_paths_work(tmp_path: Path) -> None:
    plain(tmp_path / "ds")
    plan, factory = make_shard_factory(tmp_path / "ds", 1, 2, BATCH, reader_kwargs=DUMMY)
    with factory() as shard_pass:
        assert collect(shard_pass).rows == plan.rows_per_rank[1]


@pytest.mark.timeout(60)
def test_loader_options_reach_the_loader(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    plan, factory = make_shard_factory(
        url, 0, 1, BATCH, reader_kwargs=DUMMY, loader_kwargs={"shuffling_queue_capacity": 16}
    )
    with factory() as loader:
        assert loader.shuffling_queue_capacity == 16
        got = collect(loader)
    assert got.rows == plan.total_rows and got.batches == plan.batches_per_rank[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"sharding": "halves"}, "sharding must be one of"),
        (
            {"sharding": "rows", "reader_kwargs": {"shuffle_row_drop_partitions": 2}},
            "already splits row groups",
        ),
        ({"reader_kwargs": {"cur_shard": 0}}, "pass rank and world_size"),
        ({"reader_kwargs": {"num_epochs": 2}}, "one pass"),
        ({"reader_kwargs": {"filters": [("id", ">", 3)]}}, "partition directories"),
        ({"reader_kwargs": {"rowgroup_selector": object()}}, "which row groups exist"),
        (
            {"reader_kwargs": {"storage_options": {}}, "storage_options": {"anon": True}},
            "given twice",
        ),
        ({"reader_kwargs": {"shuffle": True}}, "unknown reader option 'shuffle'"),
        ({"loader_kwargs": {"collate": None}}, "unknown option 'collate'"),
        ({"loader_kwargs": {"batch_size": 8}}, "pass batch_size to make_shard_factory"),
        ({"loader": "reader", "loader_kwargs": {"shuffling_queue_capacity": 4}}, "need a loader"),
        ({"loader": "torch"}, "loader must be one of"),
        ({"reader": "rows"}, "reader must be one of"),
        ({"rank": 2}, r"rank must be in \[0, 2\)"),
    ],
)
def test_refused_options_say_why(tmp_path: Path, kwargs: dict[str, Any], words: str) -> None:
    url = plain(tmp_path / "ds")
    arguments: dict[str, Any] = {"rank": 0, "world_size": 2, "batch_size": BATCH}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=words):
        make_shard_factory(url, **arguments)


@pytest.mark.timeout(30)
def test_ngram_is_refused(tmp_path: Path) -> None:
    from petastorm.ngram import NGram

    url = unischema(tmp_path / "ds")
    ngram = NGram({0: ["id"], 1: ["id"]}, delta_threshold=1, timestamp_field="id")
    with pytest.raises(ValueError, match="NGram"):
        make_shard_factory(url, 0, 1, BATCH, reader="row", reader_kwargs={"schema_fields": ngram})


@pytest.mark.timeout(30)
def test_petastorm_url_does_not_percent_encode() -> None:
    assert petastorm_url("/data/a b=1") == "file:///data/a b=1"
    assert petastorm_url("file:///x") == "file:///x"
