"""Which rank reads which rows: the four shardings, one class each in one registry.

* ``"round_robin"``: petastorm's own sharding, row group ``i`` to rank ``i % world_size``.
* ``"row_groups"``: whole row groups, balanced so that rows per rank are as even as whole row
  groups allow (:func:`balanced_assignment`).
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

__all__ = [
    "SHARDINGS",
    "RowRange",
    "Sharding",
    "ShardingPolicy",
    "Shards",
    "balanced_assignment",
    "round_robin_assignment",
    "sharding_from",
]

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


# Refinement rounds per rank. Each round fixes the current extreme pair; in practice it
# converges long before this on realistic size distributions.
_REFINE_ROUNDS_PER_RANK = 4
# When the heaviest and lightest rank cannot trade, how many other partners each one tries.
_PARTNERS_PER_EXTREME = 8


def round_robin_assignment(num_row_groups: int, world_size: int) -> npt.NDArray[np.int64]:
    """Petastorm's sharding: row group ``i`` goes to rank ``i % world_size``.

    Example:
        >>> round_robin_assignment(5, 2).tolist()
        [0, 1, 0, 1, 0]
    """
    return np.arange(num_row_groups, dtype=np.int64) % world_size


def balanced_assignment(num_rows: npt.ArrayLike, world_size: int) -> npt.NDArray[np.int64]:
    """Assign whole row groups to ranks so that rows per rank come out as even as possible.

    Returns the rank of each row group. Every row group gets exactly one rank, the result is
    deterministic, and max minus min rows per rank is at most the largest row group (with
    more row groups than ranks it is usually far smaller) and never more than with
    petastorm's round robin. The lower bound on the most rows a
    rank must get is ``max(ceil(total_rows / world_size), largest row group)``.

    Row groups stay whole (petastorm reads whole row groups), in two steps:

    1. *Greedy, largest first*, one round of ``world_size`` row groups at a time: each round
       hands its largest row group to the least-loaded rank, its second largest to the
       second least-loaded, and so on. Rank loads after a round never differ by more than the
       larger of (the spread before the round, the size range within the round), so the final
       spread is at most the largest row group. Rounds keep it vectorised: 100,000 row groups
       over 1,024 ranks take about 100 sorts of 1,024 numbers.
    2. *Refinement*: repeatedly take the most- and the least-loaded rank and make the one move
       of a row group, or swap of two, between them that brings them closest together (if they
       cannot trade, each tries a few next partners). Every accepted change lands both loads
       strictly inside the pair's old range, so the spread never grows; it stops when no change
       helps or after a bounded number of rounds.

    Example:
        >>> ranks = balanced_assignment([90, 10, 50, 50], world_size=2)
        >>> [int(np.asarray([90, 10, 50, 50])[ranks == r].sum()) for r in range(2)]
        [100, 100]
    """
    sizes = np.asarray(num_rows, dtype=np.int64).reshape(-1)
    ranks = _greedy_rounds(sizes, world_size)
    if len(sizes) > world_size:
        _refine(sizes, ranks, world_size)
    # The heuristic is not optimal; never hand back something more uneven than petastorm's.
    round_robin = round_robin_assignment(len(sizes), world_size)
    if _spread(sizes, round_robin, world_size) < _spread(sizes, ranks, world_size):
        return round_robin
    return ranks


def _spread(sizes: npt.NDArray[np.int64], ranks: npt.NDArray[np.int64], world_size: int) -> int:
    loads = np.bincount(ranks, weights=sizes, minlength=world_size)
    return int(loads.max() - loads.min())


def _greedy_rounds(sizes: npt.NDArray[np.int64], world_size: int) -> npt.NDArray[np.int64]:
    # Stable sorts with explicit tie-breaks keep the result identical on every rank.
    largest_first = np.argsort(-sizes, kind="stable")
    ranks = np.empty(len(sizes), dtype=np.int64)
    loads = np.zeros(world_size, dtype=np.int64)
    for start in range(0, len(sizes), world_size):
        chunk = largest_first[start : start + world_size]
        least_loaded_first = np.argsort(loads, kind="stable")[: len(chunk)]
        ranks[chunk] = least_loaded_first
        loads[least_loaded_first] += sizes[chunk]
    return ranks


def _refine(sizes: npt.NDArray[np.int64], ranks: npt.NDArray[np.int64], world_size: int) -> None:
    """Move or swap row groups between a heavy and a light rank while that helps."""
    loads = np.bincount(ranks, weights=sizes, minlength=world_size).astype(np.int64)
    members: list[list[int]] = [[] for _ in range(world_size)]
    for index, rank in enumerate(ranks.tolist()):
        members[rank].append(index)
    for _ in range(_REFINE_ROUNDS_PER_RANK * world_size):
        high, low = int(np.argmax(loads)), int(np.argmin(loads))
        if loads[high] - loads[low] <= 1:
            return
        change = _best_change(sizes, members[high], members[low], int(loads[high] - loads[low]))
        if change is None:
            # Rarely needed, so the full sort happens only here.
            by_load = np.argsort(loads, kind="stable").tolist()
            for high, low in _pairs_to_try(by_load)[1:]:
                gap = int(loads[high] - loads[low])
                change = _best_change(sizes, members[high], members[low], gap)
                if change is not None:
                    break
            else:
                return
        give, take = change  # row group high gives to low, and (or -1) the one it takes back
        moved = int(sizes[give]) - (int(sizes[take]) if take >= 0 else 0)
        members[high].remove(give)
        members[low].append(give)
        ranks[give] = low
        if take >= 0:
            members[low].remove(take)
            members[high].append(take)
            ranks[take] = high
        loads[high] -= moved
        loads[low] += moved


def _pairs_to_try(by_load: list[int]) -> list[tuple[int, int]]:
    """(heavier, lighter) pairs: the extremes first, then each extreme with its next partners.

    When the two extremes cannot trade, bringing the lightest rank up (or the heaviest down)
    with another partner still shrinks the spread; a few partners each way suffice in practice.
    """
    lightest, heaviest = by_load[0], by_load[-1]
    pairs = [(heaviest, lightest)]
    for step in range(1, min(_PARTNERS_PER_EXTREME, len(by_load) - 1) + 1):
        pairs.append((by_load[-1 - step], lightest))
        pairs.append((heaviest, by_load[step]))
    return pairs


def _best_change(
    sizes: npt.NDArray[np.int64], high: list[int], low: list[int], gap: int
) -> tuple[int, int] | None:
    """The move (take = -1) or swap whose size difference ``d`` best halves ``gap``.

    A change shifting ``d`` rows from high to low leaves the pair ``|gap - 2d|`` apart; it
    helps when ``0 < d < gap``. Returns ``(give, take)`` indices or None.
    """
    high_sizes = sizes[high]
    # A move is a swap with an empty row group: add a zero-sized candidate on the low side.
    low_sizes = np.append(sizes[low], 0)
    order = np.argsort(low_sizes, kind="stable")
    sorted_low = low_sizes[order]
    # For each high-side row group, the low-side size nearest to (its size - gap / 2).
    wanted = high_sizes - gap / 2
    right = np.clip(np.searchsorted(sorted_low, wanted), 0, len(sorted_low) - 1)
    left = np.clip(right - 1, 0, len(sorted_low) - 1)
    best_score = gap
    best: tuple[int, int] | None = None
    for candidates in (left, right):
        shift = high_sizes - sorted_low[candidates]
        score = np.abs(gap - 2 * shift)
        score[(shift <= 0) | (shift >= gap)] = gap
        pick = int(np.argmin(score))
        if int(score[pick]) < best_score:
            best_score = int(score[pick])
            low_pick = int(order[candidates[pick]])
            take = low[low_pick] if low_pick < len(low) else -1
            best = (high[pick], take)
    return best
