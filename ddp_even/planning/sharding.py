"""Which rank reads which rows: the four ways of sharding a dataset's row groups.

* ``"round_robin"``: petastorm's own sharding, row group ``i`` to rank ``i % world_size``.
* ``"row_groups"``: whole row groups, balanced so that rows per rank are as even as whole row
  groups allow (:func:`~ddp_even.planning.balance.balanced_assignment`).
* ``"rows"``: equal shards by construction. Rank ``r`` reads the rows
  ``[floor(r * N / W), floor((r + 1) * N / W))`` of the epoch's ``N`` rows in petastorm's order,
  so every rank gets ``floor(N / W)`` or ``ceil(N / W)`` rows. A row group that straddles a
  boundary is *split*: each rank reading part of it reads the whole row group and keeps its
  range. Each of the ``W - 1`` boundaries splits at most one row group, so an epoch costs at
  most ``W - 1`` extra row-group reads: at most one per rank.
* ``"replicate"``: every rank reads every row group, each in its own seeded order.

Pure functions of the row-group sizes and the world size: every rank computes the same shards
on its own, without communicating.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from ddp_even.planning.balance import balanced_assignment, round_robin_assignment

__all__ = ["SHARDINGS", "RowRange", "Sharding", "Shards", "check_sharding", "shard_rows"]

#: The ways a dataset can be sharded (see the module docstring).
Sharding = Literal["round_robin", "row_groups", "rows", "replicate"]
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)

#: Part of a split row group a rank reads: ``(global row-group index, start, stop)``, rows
#: counted from the row group's first row, ``stop`` excluded.
RowRange = tuple[int, int, int]


@dataclass(frozen=True)
class Shards:
    """Every rank's share of the row groups."""

    #: Global row-group indices rank ``r`` reads (whole or in part), ascending.
    row_groups: tuple[tuple[int, ...], ...]
    #: The row groups rank ``r`` reads only in part, with its range of each (``"rows"`` only).
    row_ranges: tuple[tuple[RowRange, ...], ...]
    #: Rows rank ``r`` reads in one epoch.
    rows_per_rank: npt.NDArray[np.int64]


def check_sharding(sharding: object) -> Sharding:
    """``sharding`` if it names a sharding; a ``ValueError`` listing them otherwise.

    Example:
        >>> check_sharding("rows")
        'rows'
    """
    for known in SHARDINGS:
        if sharding == known:
            return known
    raise ValueError(f"sharding must be one of {', '.join(map(repr, SHARDINGS))}; got {sharding!r}")


def shard_rows(sizes: npt.NDArray[np.int64], world_size: int, sharding: Sharding) -> Shards:
    """Shard row groups of ``sizes`` rows over ``world_size`` ranks.

    Example:
        >>> shards = shard_rows(np.array([12, 3, 7]), world_size=2, sharding="rows")
        >>> shards.row_groups, shards.row_ranges, shards.rows_per_rank.tolist()
        (((0,), (0, 1, 2)), (((0, 0, 11),), ((0, 11, 12),)), [11, 11])
    """
    if sharding == "rows":
        return _row_split(sizes, world_size)
    if sharding == "replicate":
        everything = tuple(range(len(sizes)))
        return Shards(
            row_groups=(everything,) * world_size,
            row_ranges=((),) * world_size,
            rows_per_rank=np.full(world_size, int(sizes.sum()), dtype=np.int64),
        )
    if sharding == "row_groups":
        ranks = balanced_assignment(sizes, world_size)
    else:
        ranks = round_robin_assignment(len(sizes), world_size)
    return Shards(
        row_groups=_grouped_by_rank(ranks, np.arange(len(sizes)), world_size),
        row_ranges=((),) * world_size,
        rows_per_rank=np.bincount(ranks, weights=sizes, minlength=world_size).astype(np.int64),
    )


def _grouped_by_rank(
    ranks: npt.NDArray[np.int64], row_groups: npt.NDArray[np.int64], world_size: int
) -> tuple[tuple[int, ...], ...]:
    """``row_groups`` split by their rank, each rank's in the order given."""
    by_rank = np.argsort(ranks, kind="stable")
    bounds = np.cumsum(np.bincount(ranks, minlength=world_size))[:-1]
    return tuple(tuple(row_groups[part].tolist()) for part in np.split(by_rank, bounds))


def _row_split(sizes: npt.NDArray[np.int64], world_size: int) -> Shards:
    total = int(sizes.sum())
    # Rank r reads global rows [bounds[r], bounds[r + 1]).
    bounds = (np.arange(world_size + 1, dtype=np.int64) * total) // world_size
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    ends = starts + sizes
    # The rank holding each row group's first row (the last rank starting at or before it,
    # which skips ranks with no rows).
    owner = np.clip(np.searchsorted(bounds, starts, side="right") - 1, 0, world_size - 1)
    split = ends > bounds[owner + 1]
    pieces_of: list[list[RowRange]] = [[] for _ in range(world_size)]
    extra_ranks: list[int] = []
    extra_groups: list[int] = []
    for group in np.flatnonzero(split).tolist():
        start, end = int(starts[group]), int(ends[group])
        inner = bounds[(bounds > start) & (bounds < end)].tolist()
        cuts = [start, *dict.fromkeys(inner), end]
        for piece_start, piece_end in itertools.pairwise(cuts):
            rank = int(np.searchsorted(bounds, piece_start, side="right")) - 1
            pieces_of[rank].append((group, piece_start - start, piece_end - start))
            if rank != int(owner[group]):
                extra_ranks.append(rank)
                extra_groups.append(group)
    # Every rank's row groups: those it holds the first row of, plus the split ones it
    # continues, ascending (petastorm's unshuffled order).
    all_ranks = np.concatenate((owner, np.array(extra_ranks, dtype=np.int64)))
    all_groups = np.concatenate((np.arange(len(sizes)), np.array(extra_groups, dtype=np.int64)))
    order = np.lexsort((all_groups, all_ranks))
    return Shards(
        row_groups=_grouped_by_rank(all_ranks[order], all_groups[order], world_size),
        row_ranges=tuple(tuple(pieces) for pieces in pieces_of),
        rows_per_rank=np.diff(bounds),
    )
