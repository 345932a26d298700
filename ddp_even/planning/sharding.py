"""Which rank reads which rows: the four shardings, one class each in one registry.

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

A sharding is everything that differs between them: how it cuts (``cut``), what that means for
the readers and for resuming, and its words for tables. Pure functions of the row-group sizes
and the world size: every rank computes the same shards on its own, without communicating.
The planner, the readers, resuming and the CLI loop over :data:`SHARDINGS`; adding a sharding
is one class here (and its tests).
"""

from __future__ import annotations

import itertools
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, get_args

import numpy as np
import numpy.typing as npt

from ddp_even.names import Sharding
from ddp_even.planning.balance import balanced_assignment, round_robin_assignment

__all__ = ["SHARDINGS", "RowRange", "Sharding", "ShardingPolicy", "Shards", "sharding_from"]

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


class ShardingPolicy(ABC):
    """One way of cutting a dataset's row groups into shards (see :data:`SHARDINGS`)."""

    name: ClassVar[Sharding]
    #: What it is, in a few words (tables).
    label: ClassVar[str]
    #: Petastorm's own ``cur_shard``/``shard_count`` sharding: readers may build it themselves.
    is_petastorms: ClassVar[bool] = False
    #: Some row groups are read by several ranks, each keeping a range of their rows.
    splits_row_groups: ClassVar[bool] = False
    #: Every rank reads every row group, each in its own order (seeded by the rank too).
    every_rank_reads_everything: ClassVar[bool] = False
    #: Whole row groups per rank: "at least the largest row group" bounds the rows per rank.
    keeps_row_groups_whole: ClassVar[bool] = True
    #: Why a state saved mid-epoch cannot resume on another number of ranks, or None.
    why_not_elastic: ClassVar[str | None] = None

    @abstractmethod
    def cut(self, sizes: npt.NDArray[np.int64], world_size: int) -> Shards:
        """Every rank's shard of row groups of ``sizes`` rows."""


class RoundRobin(ShardingPolicy):
    """Petastorm's: row group ``i`` to rank ``i % world_size``."""

    name = "round_robin"
    label = "round robin (i % W, as petastorm shards)"
    is_petastorms = True

    def cut(self, sizes: npt.NDArray[np.int64], world_size: int) -> Shards:
        return _whole(sizes, round_robin_assignment(len(sizes), world_size), world_size)


class BalancedRowGroups(ShardingPolicy):
    """Whole row groups, as even in rows as whole row groups allow."""

    name = "row_groups"
    label = "balanced row groups"

    def cut(self, sizes: npt.NDArray[np.int64], world_size: int) -> Shards:
        return _whole(sizes, balanced_assignment(sizes, world_size), world_size)


class EqualRows(ShardingPolicy):
    """Equal row ranges: ``floor(N / W)`` or ``ceil(N / W)`` rows per rank."""

    name = "rows"
    label = "equal row ranges"
    splits_row_groups = True
    keeps_row_groups_whole = False

    def cut(self, sizes: npt.NDArray[np.int64], world_size: int) -> Shards:
        return _row_split(sizes, world_size)


class Replicate(ShardingPolicy):
    """Every rank reads every row group, in its own seeded order."""

    name = "replicate"
    label = "replicated"
    every_rank_reads_everything = True
    keeps_row_groups_whole = False
    why_not_elastic = (
        "with sharding='replicate' every rank reads every row, each in its own order, so "
        "'the rows not yet read' is not one set"
    )

    def cut(self, sizes: npt.NDArray[np.int64], world_size: int) -> Shards:
        everything = tuple(range(len(sizes)))
        return Shards(
            row_groups=(everything,) * world_size,
            row_ranges=((),) * world_size,
            rows_per_rank=np.full(world_size, int(sizes.sum()), dtype=np.int64),
        )


#: Every sharding by name, in the order tables list them.
SHARDINGS: dict[Sharding, ShardingPolicy] = {
    policy.name: policy for policy in (RoundRobin(), BalancedRowGroups(), EqualRows(), Replicate())
}
assert tuple(SHARDINGS) == get_args(Sharding), "Sharding names every policy, in order"


def sharding_from(sharding: object, balanced: bool | None) -> Sharding:
    """The sharding asked for (a ``ValueError`` listing them for another name), taking the
    deprecated ``balanced`` flag into account: the one place that knows it (``balanced=True``
    is ``"row_groups"``, ``False`` ``"round_robin"``).

    Example:
        >>> sharding_from("rows", None)
        'rows'
    """
    # Compared, not looked up: an unhashable value is refused as any other.
    checked = next((known for known in SHARDINGS if known == sharding), None)
    if checked is None:
        raise ValueError(
            f"sharding must be one of {', '.join(map(repr, SHARDINGS))}; got {sharding!r}"
        )
    if balanced is None:
        return checked
    if not isinstance(balanced, bool):
        raise TypeError(f"balanced must be True or False, got {balanced!r}")
    warnings.warn(
        'balanced= is deprecated: pass sharding="row_groups" (balanced=True) or '
        'sharding="round_robin" (balanced=False); sharding="rows" gives equal shards',
        DeprecationWarning,
        stacklevel=3,
    )
    from_flag: Sharding = "row_groups" if balanced else "round_robin"
    if checked != "round_robin" and checked != from_flag:
        raise ValueError(
            f"balanced={balanced} contradicts sharding={checked!r}: pass only sharding"
        )
    return from_flag


def _whole(sizes: npt.NDArray[np.int64], ranks: npt.NDArray[np.int64], world_size: int) -> Shards:
    """Shards of whole row groups, row group ``i`` to rank ``ranks[i]``."""
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
