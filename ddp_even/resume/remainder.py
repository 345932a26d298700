"""The rest of an interrupted epoch, re-planned over another number of ranks.

A planned rank reading in an order known in advance (:mod:`ddp_even.planning.pass_order`: plan
order, or a seeded shuffle) has read, after ``step`` steps, the first
``min(step, batches) * batch_size`` rows of its pass. So which rows of the epoch are still
unread follows from the old plan, the pass order, the epoch and the step alone, on every new
rank alike.
The unread rows, in old-rank order, are cut into ``floor(M / W)`` / ``ceil(M / W)`` rows per new
rank, as ``sharding="rows"`` cuts a whole epoch; a new rank may read two ranges of one row group
(the tails of two old ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ddp_even.planning.pass_order import PassOrder
from ddp_even.planning.plans import ShardPlan, plan_from_shards
from ddp_even.planning.sharding import SHARDINGS, RowRange, Shards

__all__ = ["plan_own_tails", "plan_unread_rows", "unread_rows"]

_PLAN_ORDER = PassOrder()


def _tails(
    plan: ShardPlan, sizes: list[int], read: Sequence[Sequence[int]], order: PassOrder, epoch: int
) -> list[list[RowRange]]:
    """Each rank's rows not yet read, in its reading order, where rank ``r`` has read the
    batches ``read[r]`` of its pass (their indices, sorted)."""
    tails: list[list[RowRange]] = []
    for rank in range(plan.world_size):
        # The positions read, in the rank's reading order, as half-open runs.
        runs = [
            (first * plan.batch_size, end * plan.batch_size) for first, end in _runs(read[rank])
        ]
        tail: list[RowRange] = []
        position = 0
        for group, start, stop in order.rows(plan, sizes, rank, epoch):
            end = position + stop - start
            cursor = position
            for first, last in runs:
                if last <= cursor or first >= end:
                    continue
                if first > cursor:
                    tail.append((group, start + cursor - position, start + first - position))
                cursor = min(last, end)
            if cursor < end:
                tail.append((group, start + cursor - position, stop))
            position = end
        tails.append(tail)
    return tails


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices as half-open runs of consecutive ones: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def _prefixes(plan: ShardPlan, step: int) -> list[range]:
    """The batches each rank has read after ``step`` steps, reading its own only."""
    return [range(min(step, batches)) for batches in plan.batches_per_rank]


def plan_own_tails(
    plan: ShardPlan,
    sizes: list[int],
    step: int,
    order: PassOrder = _PLAN_ORDER,
    epoch: int = 0,
) -> ShardPlan:
    """``plan`` with every rank reading only its rows not yet read after ``step`` steps.

    ``order`` and ``epoch`` say in which order the ranks read (plan order by default). Every
    piece a rank reads is in its ``row_ranges``, in its reading order.

    Example:
        >>> from ddp_even.planning import plan_shards
        >>> plan = plan_shards([10, 10], world_size=2, batch_size=4, sharding="rows")
        >>> plan_own_tails(plan, [10, 10], step=2).row_ranges
        (((0, 8, 10),), ((1, 8, 10),))
    """
    return _plan_of(
        _tails(plan, sizes, _prefixes(plan, step), order, epoch), sizes, plan.batch_size
    )


def unread_rows(
    plan: ShardPlan,
    sizes: list[int],
    step: int,
    order: PassOrder = _PLAN_ORDER,
    epoch: int = 0,
    read: Sequence[Sequence[int]] | None = None,
) -> list[RowRange]:
    """The rows no rank had read after ``step`` steps of ``plan``'s epoch, in rank order.

    ``order`` and ``epoch`` say in which order the ranks read (plan order by default); a plan
    whose ranks all read every row (``"replicate"``) has no single set of unread rows.
    ``read`` gives, per rank, the batches of its pass read by then where that is not the first
    ``step`` (share hands some to other ranks: :func:`~ddp_even.share_plan.handed_out_in`).

    Example:
        >>> from ddp_even.planning import plan_shards
        >>> plan = plan_shards([10, 10], world_size=2, batch_size=4, sharding="rows")
        >>> unread_rows(plan, [10, 10], step=2)
        [(0, 8, 10), (1, 8, 10)]
    """
    if SHARDINGS[plan.sharding].every_rank_reads_everything:
        raise ValueError("with sharding='replicate' every rank reads every row")
    read = _prefixes(plan, step) if read is None else read
    return [piece for tail in _tails(plan, sizes, read, order, epoch) for piece in tail]


def plan_unread_rows(
    unread: list[RowRange], sizes: list[int], world_size: int, batch_size: int
) -> ShardPlan:
    """A plan of ``unread`` rows over ``world_size`` ranks, ⌊M/W⌋ or ⌈M/W⌉ rows each.

    Every piece a rank reads is in its ``row_ranges`` (a row group may appear twice).

    Example:
        >>> plan = plan_unread_rows([(0, 8, 10), (1, 8, 10)], [10, 10], 3, batch_size=4)
        >>> plan.rows_per_rank, plan.row_ranges
        ((1, 1, 2), (((0, 8, 9),), ((0, 9, 10),), ((1, 8, 10),)))
    """
    total = sum(stop - start for _, start, stop in unread)
    bounds = [rank * total // world_size for rank in range(world_size + 1)]
    pieces: list[list[RowRange]] = [[] for _ in range(world_size)]
    rank, position = 0, 0
    for group, start, stop in unread:
        while start < stop:
            while position >= bounds[rank + 1] and rank < world_size - 1:
                rank += 1
            take = min(stop - start, bounds[rank + 1] - position)
            pieces[rank].append((group, start, start + take))
            start += take
            position += take
    return _plan_of(pieces, sizes, batch_size)


def _plan_of(pieces: list[list[RowRange]], sizes: list[int], batch_size: int) -> ShardPlan:
    """The plan in which rank ``r`` reads ``pieces[r]``, every piece listed in its ``row_ranges``
    in reading order."""
    rows = [sum(stop - start for _, start, stop in mine) for mine in pieces]
    shards = Shards(
        # In reading order (a row group read in two pieces counts where it first appears), so
        # that a pass over this plan reads the pieces as listed.
        row_groups=tuple(tuple(dict.fromkeys(group for group, _, _ in mine)) for mine in pieces),
        row_ranges=tuple(tuple(mine) for mine in pieces),
        rows_per_rank=np.array(rows, dtype=np.int64),
    )
    return plan_from_shards(shards, sizes, batch_size, "rows")
