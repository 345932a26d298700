"""Which rank reads which row group: petastorm's round robin, or a balanced assignment.

Both return one rank number per row group (index = global row-group index). They are pure
functions of the row-group sizes and the world size, so every rank computes the same
assignment on its own, without communicating.

The balanced assignment keeps row groups whole (petastorm reads whole row groups) and makes
rows per rank as even as that allows, in two steps:

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
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["balanced_assignment", "round_robin_assignment"]

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
