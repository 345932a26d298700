"""A plan's passes (``ddp_even.arrow.passes.make_shard_factory``) read exactly the plan's rows.

Each scenario builds every rank's factory in turn in this process (no process group needed)
and checks: the rows and batches equal the plan's, the ``id`` values are those stored in the
rank's row groups, and together the ranks read every row group exactly once. Where petastorm
is installed, round robin is also compared with petastorm's own readers
(``make_batch_reader(cur_shard=..., shard_count=...)``), an independent reference.
"""

from __future__ import annotations

import collections
import logging
import shutil
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
import torch

from ddp_even.arrow.passes import make_shard_factory
from ddp_even.errors import PlanMismatchError
from ddp_even.planning import plan_shards
from ddp_even.planning.sharding import Sharding
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.shard_reads import (
    Layouts,
    collect,
    ids_of_row_groups,
    read_shard,
)

BATCH = 4
# Skewed: round robin puts both big row groups on rank 0 of 2.
SIZES = [[40, 3], [30, 5], [1, 6, 4, 2]]
# The plan's order, each row group's rows as stored.
IN_ORDER = {"shuffle_row_groups": False}


LAYOUTS = Layouts(SIZES)
plain, partitioned = LAYOUTS.plain, LAYOUTS.partitioned
with_metadata, unischema = LAYOUTS.with_metadata, LAYOUTS.unischema


def read_all_ranks(
    url: str, world_size: int, *, sharding: Sharding = "row_groups", **options: Any
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


PETASTORM = pytest.mark.petastorm
SCENARIOS = [
    pytest.param(plain, {"reader": "batch"}, id="plain-batch"),
    pytest.param(partitioned, {"reader": "batch"}, id="hive"),
    pytest.param(with_metadata, {"reader": "batch"}, id="metadata"),
    pytest.param(unischema, {"reader": "row"}, id="unischema-row", marks=PETASTORM),
    pytest.param(unischema, {"reader": "batch"}, id="unischema-batch", marks=PETASTORM),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("make_dataset", "options"), SCENARIOS)
def test_balanced_passes_read_exactly_their_row_groups(
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
            url, world_size, reader_kwargs=IN_ORDER, **options
        )
        for rank in range(world_size):
            expected = ids_of_row_groups(
                groups.files, groups.file_of, groups.index_in_file, plan.row_groups_of(rank)
            )
            where = f"world {world_size} rank {rank}"
            assert ids_per_rank[rank] == expected, where
            assert len(ids_per_rank[rank]) == plan.rows_per_rank[rank], where
            assert batches_per_rank[rank] == plan.batches_per_rank[rank], where
        counts = collections.Counter(i for ids in ids_per_rank for i in ids)
        assert sorted(counts) == sorted(all_ids)
        assert set(counts.values()) == {1}, f"world {world_size}: some rows read twice"


@pytest.mark.timeout(60)
def test_hive_partition_keys_are_columns_of_every_batch(tmp_path: Path) -> None:
    url = partitioned(tmp_path / "ds")
    plan, factory = make_shard_factory(url, 0, 1, BATCH, reader_kwargs=IN_ORDER)
    with factory() as shard_pass:
        batches = list(shard_pass)
    assert all(batch["part"].dtype == torch.int32 for batch in batches), "typed as pyarrow infers"
    # One file per partition directory: part=i holds file i's rows.
    starts = [0, 43, 78]
    for batch in batches:
        for row, part in zip(batch["id"].tolist(), batch["part"].tolist(), strict=True):
            assert starts[part] <= row < [*starts, 91][part + 1]
    assert sum(len(batch["id"]) for batch in batches) == plan.total_rows


@pytest.mark.timeout(60)
def test_balanced_evens_out_the_skewed_dataset(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    round_robin, rr_ids, _ = read_all_ranks(url, 2, sharding="round_robin", reader_kwargs=IN_ORDER)
    balanced, balanced_ids, _ = read_all_ranks(url, 2, reader_kwargs=IN_ORDER)
    # Global order 40, 3, 30, 5, 1, 6, 4, 2: rank 0 gets 40+30+1+4, rank 1 gets 3+5+6+2.
    assert [len(ids) for ids in rr_ids] == [75, 16] == list(round_robin.rows_per_rank)
    # Best split of 91 rows: 46 / 45 (40+6 and 30+5+4+3+2+1).
    assert sorted(len(ids) for ids in balanced_ids) == [45, 46]
    assert balanced.spread_rows < round_robin.spread_rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "loader_kwargs",
    [{"threads": 3, "prefetch": 1}, {"threads": 1, "prefetch": 8}],
    ids=["3-threads", "1-thread"],
)
def test_shuffled_threaded_reads_keep_the_same_row_groups(
    tmp_path: Path, loader_kwargs: dict[str, Any]
) -> None:
    url = plain(tmp_path / "ds")
    shuffled = {"seed": 3, "shuffle_row_groups": True}
    plan, ids_per_rank, batches = read_all_ranks(
        url, 3, reader_kwargs=shuffled, loader_kwargs=loader_kwargs
    )
    _, in_order, _ = read_all_ranks(url, 3, reader_kwargs=IN_ORDER)
    assert [sorted(ids) for ids in ids_per_rank] == [sorted(ids) for ids in in_order]
    assert ids_per_rank != in_order, "the seed shuffles the row groups"
    assert batches == list(plan.batches_per_rank)


@pytest.mark.petastorm
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_round_robin_factory_reads_what_petastorm_reads(tmp_path: Path, world_size: int) -> None:
    url = plain(tmp_path / "ds")
    _, ids_per_rank, batches = read_all_ranks(
        url, world_size, sharding="round_robin", reader_kwargs=IN_ORDER
    )
    for rank in range(world_size):
        petastorm = read_shard(url, rank, world_size, batch_size=BATCH)
        assert ids_per_rank[rank] == petastorm.ids
        assert batches[rank] == petastorm.batches


@pytest.mark.petastorm
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_round_robin_row_factory_reads_what_petastorms_make_reader_reads(
    tmp_path: Path, world_size: int
) -> None:
    url = unischema(tmp_path / "ds")
    for rank in range(world_size):
        _, factory = make_shard_factory(
            url,
            rank,
            world_size,
            BATCH,
            sharding="round_robin",
            reader="row",
            reader_kwargs=IN_ORDER,
        )
        with factory() as shard_pass:
            ours = collect(shard_pass)
        petastorm = read_shard(
            url, rank, world_size, reader="row", loader="dataloader", batch_size=BATCH
        )
        assert ours == petastorm, f"world {world_size} rank {rank}"


@pytest.mark.timeout(60)
def test_each_factory_call_is_a_fresh_pass(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    # A pass's short last batch must not be carried over into the next pass.
    plan, factory = make_shard_factory(url, 0, 2, BATCH, reader_kwargs=IN_ORDER)
    passes = []
    for _ in range(2):
        with factory() as shard_pass:
            passes.append(collect(shard_pass))
    assert passes[0] == passes[1]
    assert passes[0].batches == plan.batches_per_rank[0]


@pytest.mark.timeout(60)
def test_balanced_rank_without_row_groups_reads_nothing(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "ds", [[5, 5], [5]])
    plan, ids_per_rank, batches = read_all_ranks(url, 4, reader_kwargs=IN_ORDER)
    assert plan.empty_ranks == (3,)
    assert [len(ids) for ids in ids_per_rank] == [5, 5, 5, 0]
    assert batches == [2, 2, 2, 0]


def _round_robin_over_too_few_row_groups(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> tuple[Any, list[list[int]], list[int], list[list[str]]]:
    """Round robin of 3 row groups over 4 ranks: (plan, ids and batches per rank, what each
    rank logged)."""
    url = write_plain_dataset(tmp_path / "ds", [[5, 5], [5]])
    caplog.set_level(logging.WARNING, logger="ddp_even")
    ids_per_rank, batches, said = [], [], []
    plan = None
    for rank in range(4):
        caplog.clear()
        plan, factory = make_shard_factory(
            url, rank, 4, BATCH, sharding="round_robin", reader_kwargs=IN_ORDER
        )
        said.append([record.getMessage() for record in caplog.records])
        with factory() as shard_pass:
            got = collect(shard_pass)
        ids_per_rank.append(got.ids)
        batches.append(got.batches)
    return plan, ids_per_rank, batches, said


@pytest.mark.timeout(60)
def test_round_robin_with_more_ranks_than_row_groups_plans_an_empty_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Petastorm's own reader raises NoDataAvailableError here; the planned passes do not.
    plan, ids_per_rank, batches, said = _round_robin_over_too_few_row_groups(tmp_path, caplog)
    assert plan.empty_ranks == (3,)
    assert ids_per_rank == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], []]
    assert batches == [2, 2, 2, 0] == list(plan.batches_per_rank)
    assert len(said[0]) == 1 and "rank(s) 3 get no batch" in said[0][0], said[0]
    assert said[1:] == [[], [], []], "the warning is logged once, by rank 0"


@pytest.mark.timeout(60)
def test_the_empty_shard_warning_says_what_each_mode_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan, _, _, said = _round_robin_over_too_few_row_groups(tmp_path, caplog)
    assert "NoDataAvailableError" not in said[0][0], said[0][0]
    # As for whole balanced row groups leaving the same rank empty: truncate, pad and join run.
    balanced = plan_shards([5, 5, 5], world_size=4, batch_size=BATCH, sharding="row_groups")
    assert balanced.empty_ranks == plan.empty_ranks
    for mode in ("truncate", "cycle", "pad", "join"):
        assert plan.stats(mode) == balanced.stats(mode), mode


@pytest.mark.timeout(60)
def test_a_file_rewritten_after_planning_is_caught_before_the_pass_reads(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    _, factory = make_shard_factory(url, 0, 2, BATCH, sharding="row_groups", reader_kwargs=IN_ORDER)
    shutil.rmtree(tmp_path / "ds")
    write_plain_dataset(tmp_path / "ds", [[40, 3], [31, 5], [1, 6, 4, 2]])
    with pytest.raises(
        PlanMismatchError, match=r"part-00001.parquet was rewritten since it was planned"
    ):
        factory()


@pytest.mark.timeout(60)
def test_plain_paths_work(tmp_path: Path) -> None:
    plain(tmp_path / "ds")
    plan, factory = make_shard_factory(tmp_path / "ds", 1, 2, BATCH, reader_kwargs=IN_ORDER)
    with factory() as shard_pass:
        assert collect(shard_pass).rows == plan.rows_per_rank[1]


@pytest.mark.timeout(60)
def test_loader_options_shape_the_pass_not_its_batches(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    reads = []
    for loader_kwargs in ({}, {"threads": 1, "prefetch": 1}, {"threads": 4, "prefetch": 16}):
        plan, factory = make_shard_factory(
            url, 0, 1, BATCH, reader_kwargs=IN_ORDER, loader_kwargs=loader_kwargs
        )
        with factory() as shard_pass:
            assert shard_pass._prefetch == loader_kwargs.get("prefetch", 4)
            assert shard_pass._threads == loader_kwargs.get("threads", 2)
            reads.append(collect(shard_pass))
    assert reads[0] == reads[1] == reads[2]
    assert reads[0].rows == plan.total_rows and reads[0].batches == plan.batches_per_rank[0]


# Each option of petastorm's own reader or loaders, and what its refusal points to instead.
PETASTORM_ONLY = [
    ("reader_kwargs", "reader_pool_type", "thread", r"loader_kwargs=\{'threads': N\}"),
    ("reader_kwargs", "workers_count", 2, r"loader_kwargs=\{'threads': N\}"),
    ("reader_kwargs", "results_queue_size", 8, r"loader_kwargs=\{'prefetch': N\}"),
    ("reader_kwargs", "shuffle_row_drop_partitions", 2, "shuffle_rows=True"),
    ("reader_kwargs", "cache_type", "local-disk", "local copy"),
    ("reader_kwargs", "cache_location", "/tmp", "local copy"),
    ("reader_kwargs", "cache_size_limit", 1, "local copy"),
    ("reader_kwargs", "cache_row_size_estimate", 1, "local copy"),
    ("reader_kwargs", "cache_extra_settings", {}, "local copy"),
    ("reader_kwargs", "hdfs_driver", "libhdfs", "filesystem= or storage_options="),
    ("reader_kwargs", "zmq_copy_buffers", False, r"'threads': N"),
    ("reader_kwargs", "cur_shard", 0, r"sharding follows the plan \(sharding=\)"),
    ("reader_kwargs", "shard_count", 2, r"sharding follows the plan \(sharding=\)"),
    ("reader_kwargs", "shard_seed", 1, "seed= shuffles the reading order"),
    ("reader_kwargs", "num_epochs", 2, "EvenLoader runs the epochs"),
    ("reader_kwargs", "rowgroup_selector", object(), "which row groups exist"),
    ("reader_kwargs", "filters", [("id", ">", 3)], "predicate= "),
    ("loader_kwargs", "shuffling_queue_capacity", 16, "shuffle_rows=True"),
    ("loader_kwargs", "collate_fn", None, "dicts of tensors"),
    ("loader_kwargs", "transform_fn", None, "dicts of tensors"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("where", "name", "value", "instead"),
    PETASTORM_ONLY,
    ids=[f"{where}-{name}" for where, name, _, _ in PETASTORM_ONLY],
)
def test_petastorms_own_options_are_refused_with_the_way_to_the_same(
    tmp_path: Path, where: str, name: str, value: Any, instead: str
) -> None:
    url = plain(tmp_path / "ds")
    said = (
        rf"{where}\['{name}'\] is an option of petastorm's own reader, which from_parquet "
        rf"does not use: .*{instead}.*EvenLoader\(lambda: DataLoader\(make_reader"
    )
    with pytest.raises(ValueError, match=said):
        options: dict[str, Any] = {where: {name: value}}
        make_shard_factory(url, 0, 2, BATCH, **options)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"sharding": "halves"}, "sharding must be one of"),
        (
            {"reader_kwargs": {"storage_options": {}}, "storage_options": {"anon": True}},
            "given twice",
        ),
        (
            {"reader_kwargs": {"predicate": pc.field("id") > 1}, "predicate": pc.field("id") > 2},
            "predicate is given twice",
        ),
        (
            {"reader_kwargs": {"shuffle": True}},
            r"reader_kwargs\['shuffle'\] is not an option of from_parquet's reader "
            r"\(did you mean 'shuffle_rows'\?\)",
        ),
        ({"loader_kwargs": {"collate": None}}, r"loader_kwargs\['collate'\] is not an option"),
        (
            {"loader_kwargs": {"batch_size": 8}},
            "it takes pin_memory, prefetch, threads",
        ),
        ({"loader_kwargs": {"threads": 0}}, "threads must be at least 1"),
        ({"loader_kwargs": {"prefetch": 0}}, "prefetch must be at least 1"),
        ({"reader_kwargs": {"schema_fields": []}}, r"schema_fields=\[\] reads no column"),
        (
            {"reader_kwargs": {"schema_fields": ["idd"]}},
            r"names 'idd', which the dataset does not have \(did you mean 'id'",
        ),
        (
            {"reader_kwargs": {"schema_fields": ["i.*"]}},
            "Regular expressions need reader='row'",
        ),
        ({"reader": "rows"}, "reader must be 'batch'"),
        ({"rank": 2}, r"rank must be in \[0, 2\)"),
    ],
)
def test_refused_options_say_why(tmp_path: Path, kwargs: dict[str, Any], words: str) -> None:
    url = plain(tmp_path / "ds")
    arguments: dict[str, Any] = {"rank": 0, "world_size": 2, "batch_size": BATCH}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=words):
        make_shard_factory(url, **arguments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins memory where CUDA is available")
@pytest.mark.timeout(30)
def test_pinned_memory_without_cuda_is_refused(tmp_path: Path) -> None:
    url = plain(tmp_path / "ds")
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
        make_shard_factory(url, 0, 1, BATCH, loader_kwargs={"pin_memory": True})


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_ngram_is_refused(tmp_path: Path) -> None:
    from petastorm.ngram import NGram

    url = unischema(tmp_path / "ds")
    ngram = NGram({0: ["id"], 1: ["id"]}, delta_threshold=1, timestamp_field="id")
    with pytest.raises(TypeError, match="schema_fields must be a list of column names, got NGram"):
        make_shard_factory(url, 0, 1, BATCH, reader="row", reader_kwargs={"schema_fields": ngram})


@pytest.mark.timeout(60)
def test_pyarrow_is_the_one_engine(tmp_path: Path) -> None:
    from ddp_even import EvenLoader

    url = plain(tmp_path / "ds")
    loader = EvenLoader.from_parquet(url, BATCH)
    assert sum(len(batch["id"]) for batch in loader) == 91
