"""Balanced assignments: every row group on exactly one rank, rows per rank as even as can be."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_even.planning import plan_shards
from ddp_even.planning.sharding import balanced_assignment, round_robin_assignment

row_group_sizes = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=300)
world_sizes = st.integers(min_value=1, max_value=40)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(sizes=row_group_sizes, world_size=world_sizes)
def test_every_row_group_once_and_spread_at_most_the_largest(
    sizes: list[int], world_size: int
) -> None:
    ranks = balanced_assignment(sizes, world_size)
    assert ranks.shape == (len(sizes),)
    assert ((ranks >= 0) & (ranks < world_size)).all()
    loads = np.bincount(ranks, weights=sizes, minlength=world_size)
    assert loads.sum() == sum(sizes)
    assert loads.max() - loads.min() <= max(sizes)


@pytest.mark.timeout(120)
@settings(max_examples=100, deadline=None)
@given(sizes=row_group_sizes, world_size=world_sizes)
def test_plan_shards_partition_the_row_groups(sizes: list[int], world_size: int) -> None:
    plan = plan_shards(sizes, world_size, batch_size=16, sharding="row_groups")
    every = sorted(index for shard in plan.shards for index in shard)
    assert every == list(range(len(sizes)))
    assert all(list(shard) == sorted(shard) for shard in plan.shards)
    assert plan.spread_rows <= plan.largest_row_group
    assert max(plan.rows_per_rank) >= plan.lower_bound_rows


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(sizes=row_group_sizes, world_size=world_sizes)
def test_deterministic(sizes: list[int], world_size: int) -> None:
    # Every rank computes the assignment on its own: it must come out the same every time.
    first = balanced_assignment(sizes, world_size)
    second = balanced_assignment(list(sizes), world_size)
    assert first.tolist() == second.tolist()


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(sizes=row_group_sizes, world_size=world_sizes)
def test_never_more_uneven_than_round_robin(sizes: list[int], world_size: int) -> None:
    balanced = plan_shards(sizes, world_size, batch_size=8, sharding="row_groups")
    round_robin = plan_shards(sizes, world_size, batch_size=8)
    assert balanced.spread_rows <= round_robin.spread_rows


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("sizes", "world_size", "expected_loads"),
    [
        ([90, 10, 50, 50], 2, [100, 100]),
        ([400, 100, 30, 70, 250, 10, 10, 5, 90], 3, [400, 280, 285]),
        ([6, 5, 4, 3, 2, 1], 3, [7, 7, 7]),
        ([8, 1, 1], 4, [8, 1, 1, 0]),
    ],
)
def test_reaches_the_best_split_on_small_cases(
    sizes: list[int], world_size: int, expected_loads: list[int]
) -> None:
    ranks = balanced_assignment(sizes, world_size)
    loads = np.bincount(ranks, weights=sizes, minlength=world_size).astype(int).tolist()
    assert sorted(loads) == sorted(expected_loads)


@pytest.mark.timeout(30)
def test_skewed_sizes_land_on_the_lower_bound() -> None:
    rng = np.random.default_rng(0)
    sizes = np.clip(np.rint(rng.lognormal(np.log(2000), 1.0, 4096)), 1, 50_000).astype(np.int64)
    plan = plan_shards(sizes, world_size=64, batch_size=256, sharding="row_groups")
    assert max(plan.rows_per_rank) - plan.lower_bound_rows <= 1
    assert max(plan.batches_per_rank) - min(plan.batches_per_rank) <= 1


@pytest.mark.timeout(30)
def test_round_robin_is_petastorms_modulo() -> None:
    assert round_robin_assignment(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
