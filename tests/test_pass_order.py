"""The order of a planned reader's pass, computed by ddp_even and followed by real readers.

Pure tests of :mod:`ddp_even.planning.pass_order` and of the remainder of a seeded pass, then
the pyarrow reader's passes over real Parquet: seeded shuffles read by several threads give the
same batches in the same order on every pass of an epoch, in the order ddp_even computes;
unseeded shuffles a fresh order each pass, and say that no order can be computed.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_even.arrow.passes import make_shard_factory
from ddp_even.planning import plan_shards
from ddp_even.planning.pass_order import PassOrder
from ddp_even.planning.plans import plan_rows
from ddp_even.planning.sharding import RowRange
from tests.helpers.datasets import flat_sizes, write_plain_dataset
from tests.helpers.shard_reads import ShardRead, collect

# Many small row groups of uneven sizes, so that four threads finish them out of order.
SIZES = [[3, 40, 5, 9, 1, 60, 7], [2, 30, 4, 8, 50, 6, 3, 11]]
FLAT = flat_sizes(SIZES)
TOTAL = sum(FLAT)
BATCH = 8
SEEDED = {"seed": 11}
FOUR_THREADS = {"threads": 4, "prefetch": 6}


def _ids(pieces: list[RowRange], sizes: list[int]) -> list[int]:
    """The global row ids of ``pieces``, in order (rows unshuffled inside row groups)."""
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    return [starts[group] + row for group, start, stop in pieces for row in range(start, stop)]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=20),
    world_size=st.integers(1, 6),
    sharding=st.sampled_from(["round_robin", "row_groups", "rows", "replicate"]),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 5),
)
def test_a_seeded_pass_reads_the_shard_once_in_an_order_of_the_seed_and_epoch(
    sizes: list[int], world_size: int, sharding: Any, seed: int, epoch: int
) -> None:
    plan = plan_shards(sizes, world_size, batch_size=3, sharding=sharding)
    seeded, unshuffled = PassOrder(seed, shuffle_row_groups=True), PassOrder(seed)
    for rank in range(world_size):
        rows = seeded.rows(plan, sizes, rank, epoch)
        assert rows == seeded.rows(plan, sizes, rank, epoch), "a pure function"
        assert Counter(rows) == Counter(unshuffled.rows(plan, sizes, rank, epoch))
        assert sum(stop - start for _, start, stop in rows) == plan.rows_per_rank[rank]
        assert [group for group, _, _ in unshuffled.rows(plan, sizes, rank, epoch)] == list(
            plan.shards[rank]
        ), "without a shuffle: plan order"


def test_an_unseeded_shuffle_has_no_order_to_compute() -> None:
    plan = plan_shards([3, 3], world_size=1, batch_size=2)
    with pytest.raises(ValueError, match="without a seed"):
        PassOrder(None, shuffle_row_groups=True).rows(plan, [3, 3], 0, epoch=0)
    replicated = plan_shards([3, 3], world_size=2, batch_size=2, sharding="replicate")
    for rank in range(2):
        rows = PassOrder(None, shuffle_row_groups=True).rows(replicated, [3, 3], rank, epoch=0)
        assert sorted(rows) == [(0, 0, 3), (1, 0, 3)], "replicate always has a seed"


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=20),
    old_world=st.integers(1, 6),
    new_world=st.integers(1, 6),
    batch=st.integers(1, 7),
    step=st.integers(0, 25),
    sharding=st.sampled_from(["round_robin", "row_groups", "rows"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_after_step_steps_of_a_seeded_pass_the_rest_is_read_once(
    sizes: list[int],
    old_world: int,
    new_world: int,
    batch: int,
    step: int,
    sharding: Any,
    seed: int,
) -> None:
    order, epoch = PassOrder(seed, shuffle_row_groups=True), 3
    old = plan_shards(sizes, old_world, batch, sharding=sharding)
    tails = old.own_tails(sizes, step, order, epoch)
    read: Counter[int] = Counter()
    for rank in range(old_world):
        # Independently: a rank's pass, row by row; the first consumed rows were read.
        ids = _ids(order.rows(old, sizes, rank, epoch), sizes)
        consumed = min(step, old.batches_per_rank[rank]) * batch
        read.update(ids[:consumed])
        # On as many ranks, a rank's own tail is the rest of its pass, in the same order.
        assert _ids(list(tails.row_ranges_of(rank)), sizes) == ids[consumed:]
        assert set(tails.shards[rank]) == {group for group, _, _ in tails.row_ranges_of(rank)}
    rest = plan_rows(old.unread_rows(sizes, step, order, epoch), sizes, new_world, batch)
    replanned = Counter(
        row for rank in range(new_world) for row in _ids(list(rest.row_ranges_of(rank)), sizes)
    )
    assert read + replanned == Counter(range(sum(sizes))), "every row once, read or re-planned"


def test_which_rows_remain_after_two_steps_of_a_seeded_pass() -> None:
    sizes = [4, 4, 4]
    plan = plan_shards(sizes, world_size=1, batch_size=3)
    order = PassOrder(seed=2, shuffle_row_groups=True)
    _, second, third = order.rows(plan, sizes, 0, epoch=0)
    # Six rows read: the pass's first row group, and two rows of its second.
    assert plan.unread_rows(sizes, 2, order, epoch=0) == [(second[0], 2, 4), third]
    assert plan.own_tails(sizes, 2, order, epoch=0).row_ranges == (((second[0], 2, 4), third),)
    with pytest.raises(ValueError, match="replicate"):
        plan_shards(sizes, 2, 3, sharding="replicate").unread_rows(sizes, 1, order, epoch=0)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_plain_dataset(tmp_path_factory.mktemp("pass-order") / "data", SIZES)


def _read(
    url: str,
    rank: int,
    world_size: int,
    epoch: int,
    loader_kwargs: dict[str, Any] | None = None,
    **reader_kwargs: Any,
) -> ShardRead:
    _, passes = make_shard_factory(
        url,
        rank,
        world_size,
        BATCH,
        sharding="rows",
        reader_kwargs=reader_kwargs,
        loader_kwargs=loader_kwargs,
    )
    with passes(epoch=epoch) as shard_pass:
        return collect(shard_pass)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "loader_kwargs"),
    [
        (SEEDED, FOUR_THREADS),
        ({**SEEDED, "shuffle_row_groups": False}, FOUR_THREADS),
        (SEEDED, {"threads": 1, "prefetch": 1}),
    ],
    ids=["seeded-shuffle", "unshuffled", "one-thread"],
)
def test_threaded_and_seeded_passes_read_in_the_computed_order(
    url: str, options: dict[str, Any], loader_kwargs: dict[str, Any]
) -> None:
    plan, passes = make_shard_factory(url, 0, 2, BATCH, sharding="rows", reader_kwargs=options)
    assert passes.why_not_in_plan_order is None
    expected = _ids(passes.order.rows(plan, FLAT, 0, epoch=0), FLAT)
    for _ in range(3):
        read = _read(url, 0, 2, 0, loader_kwargs, **options)
        assert read.ids == expected, "the same order on every pass: the computed one"
        assert len(read.batch_sizes) == plan.batches_per_rank[0]
    if options.get("shuffle_row_groups", True):
        assert expected != sorted(expected), "the row groups are shuffled"
        assert _read(url, 0, 2, 1, loader_kwargs, **options).ids != expected, (
            "another order the next epoch"
        )


@pytest.mark.timeout(120)
def test_a_seeded_row_shuffle_is_the_same_on_every_pass_and_every_rank_keeps_its_part(
    url: str,
) -> None:
    options = {**SEEDED, "shuffle_rows": True}
    passes = {
        (rank, epoch): _read(url, rank, 3, epoch, FOUR_THREADS, **options)
        for rank in range(3)
        for epoch in (0, 1)
    }
    again = _read(url, 1, 3, 0, FOUR_THREADS, **options)
    assert again == passes[1, 0], "the same batches in the same order"
    for epoch in (0, 1):
        everything = Counter(row for rank in range(3) for row in passes[rank, epoch].ids)
        assert everything == Counter(range(TOTAL)), "split row groups: disjoint parts"
    assert passes[0, 0].ids != passes[0, 1].ids
    plan, _ = make_shard_factory(url, 0, 3, BATCH, sharding="rows")
    assert plan.split_row_groups >= 1, "the test must split row groups"
    computed = _ids(PassOrder(11, True).rows(plan, FLAT, 0, epoch=0), FLAT)
    # The row groups come in the computed order, each one's rows shuffled.
    group_of = np.repeat(np.arange(len(FLAT)), FLAT)
    assert group_of[passes[0, 0].ids].tolist() == group_of[computed].tolist()
    assert passes[0, 0].ids != computed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "options",
    [{}, {"shuffle_row_groups": False, "shuffle_rows": True}],
    ids=["row-groups", "rows"],
)
def test_an_unseeded_shuffle_reads_the_shard_in_a_fresh_order_each_pass(
    url: str, options: dict[str, Any]
) -> None:
    plan, passes = make_shard_factory(url, 0, 1, BATCH, reader_kwargs=options)
    reads = []
    for _ in range(3):
        with passes(epoch=0) as shard_pass:
            reads.append(collect(shard_pass))
    for read in reads:
        assert sorted(read.ids) == list(range(TOTAL)), "the whole shard once"
        assert read.batches == plan.batches_per_rank[0]
    assert len({tuple(read.ids) for read in reads}) == 3, "a fresh order each pass"
    if not options:
        group_of = np.repeat(np.arange(len(FLAT)), FLAT)
        for read in reads:
            groups = group_of[read.ids].tolist()
            assert groups == sorted(groups, key=groups.index), "each row group whole, in turn"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("reader_kwargs", "words"),
    [
        ({}, r"row groups are shuffled without a seed \(pass seed="),
        (
            {"shuffle_row_groups": False, "shuffle_rows": True},
            r"rows are shuffled without a seed \(pass seed=",
        ),
        ({"seed": 1, "shuffle_rows": True}, None),
        ({"shuffle_row_groups": False}, None),
    ],
)
def test_what_reads_out_of_the_computed_order_says_why(
    url: str, reader_kwargs: dict[str, Any], words: str | None
) -> None:
    _, passes = make_shard_factory(
        url,
        0,
        2,
        BATCH,
        sharding="row_groups",
        reader_kwargs=reader_kwargs,
        loader_kwargs={"threads": 3},
    )
    if words is None:
        assert passes.why_not_in_plan_order is None
    else:
        assert re.search(words, passes.why_not_in_plan_order or ""), passes.why_not_in_plan_order


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("reader_kwargs", "loader_kwargs", "instead"),
    [
        ({"seed": 1, "reader_pool_type": "process"}, {}, r"loader_kwargs=\{'threads': N\}"),
        ({"seed": 1, "shuffle_row_drop_partitions": 2}, {}, "shuffle_rows=True"),
        ({"seed": 1}, {"shuffling_queue_capacity": 8}, "shuffle_rows=True"),
    ],
    ids=["process-pool", "row-drop-partitions", "shuffling-queue"],
)
def test_what_read_out_of_the_computed_order_in_petastorm_is_refused(
    url: str, reader_kwargs: dict[str, Any], loader_kwargs: dict[str, Any], instead: str
) -> None:
    # petastorm's process pool, row-drop partitions and shuffling queue read out of any order
    # ddp_even can compute; the pyarrow reader has none of them and names what to use instead.
    with pytest.raises(ValueError, match=f"option of petastorm's own reader.*{instead}"):
        make_shard_factory(
            url,
            0,
            2,
            BATCH,
            sharding="row_groups",
            reader_kwargs=reader_kwargs,
            loader_kwargs=loader_kwargs,
        )
