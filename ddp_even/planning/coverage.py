"""Whether the ranks' readers read a dataset's row groups once between them.

Petastorm gives a reader built with ``cur_shard=c, shard_count=K`` the row groups ``i % K ==
c`` (after any it leaves out first: a predicate on hive partition keys, a row-group selector),
and nothing checks that each rank passed its own rank and the world size: a larger
``shard_count`` leaves row groups unread, a smaller one (or a ``cur_shard`` repeated) reads
some twice. Readers without a shard read every row group on every rank, which is a way to train
too. Each rank describes its reading in words every rank shares exactly when together they
cover the dataset once, or all of it each (:func:`reading_described`); only when they differ do
the ranks gather their row groups for :func:`coverage_problem`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["coverage_problem", "reading_described"]


def reading_described(
    row_groups: frozenset[int], dataset_row_groups: int, rank: int, world_size: int, selects: bool
) -> str:
    """This rank's reading as every rank describes its own when the ranks shard alike.

    ``selects``: the reader may leave row groups out before it shards, so its row groups may
    be a part of its round-robin shard.

    Example::

        >>> reading_described(frozenset({1, 3}), 4, rank=1, world_size=2, selects=False)
        'round robin over 2 ranks of 4 row groups'
        >>> reading_described(frozenset(range(4)), 4, rank=1, world_size=2, selects=False)
        'every row group of 4'
        >>> reading_described(frozenset({1}), 4, rank=1, world_size=2, selects=False)
        "rank 1's own row groups"
    """
    own_shard = frozenset(range(rank, dataset_row_groups, world_size))
    if row_groups == own_shard:
        return f"round robin over {world_size} ranks of {dataset_row_groups} row groups"
    if row_groups == frozenset(range(dataset_row_groups)):
        return f"every row group of {dataset_row_groups}"
    if selects and row_groups <= own_shard:
        return f"round robin over {world_size} ranks of a part of {dataset_row_groups} row groups"
    # Unlike any other rank's: the ranks then gather what each reads (coverage_problem).
    return f"rank {rank}'s own row groups"


def coverage_problem(
    readings: Sequence[frozenset[int]],
    dataset_row_groups: int,
    selects: bool,
    ranks: Sequence[int],
) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]], str] | None:
    """``(unread, read_by, message)`` when ``readings`` (one per rank, in the order of
    ``ranks``) do not read the dataset once between them, nor all of it each; None when they do.

    ``unread``: the row groups no rank reads (none is told when the readers may leave row
    groups out before sharding: ``selects``); ``read_by``: each row group several ranks read,
    with those ranks; ``message``: what is wrong, what each rank reads and what to do.

    Example::

        >>> unread, read_by, message = coverage_problem(
        ...     [frozenset({0, 3}), frozenset({1, 4})], 6, selects=False, ranks=[0, 1])
        >>> unread, read_by
        ((2, 5), {})
        >>> print(message)
        the ranks' readers do not read the dataset once between them: row group(s) [2, 5] are ...
        >>> coverage_problem([frozenset(range(6))] * 2, 6, selects=False, ranks=[0, 1]) is None
        True
    """
    everything = frozenset(range(dataset_row_groups))
    same = all(reading == readings[0] for reading in readings)
    if same and (selects or readings[0] == everything):
        return None  # every rank reads every row group (or all of what the reader kept)
    readers: dict[int, list[int]] = {}
    for rank, reading in zip(ranks, readings, strict=True):
        for index in reading:
            readers.setdefault(index, []).append(rank)
    unread = () if selects else tuple(sorted(everything - readers.keys()))
    read_by = (
        {} if same else {index: tuple(by) for index, by in sorted(readers.items()) if len(by) > 1}
    )
    if not unread and not read_by:
        return None
    described = ", ".join(
        f"rank {rank} reads row groups {_few(sorted(reading))}"
        + _looks_like(reading, dataset_row_groups)
        for rank, reading in zip(ranks, readings, strict=True)
    )
    found = []
    if unread:
        found.append(f"row group(s) {_few(unread)} are read by no rank")
    if read_by:
        shared = ", ".join(
            f"{index} (ranks {'/'.join(map(str, by))})" for index, by in list(read_by.items())[:4]
        )
        more = f" and {len(read_by) - 4} more" if len(read_by) > 4 else ""
        found.append(f"some are read by several ranks: {shared}{more}")
    message = (
        f"the ranks' readers do not read the dataset once between them: {'; '.join(found)}. "
        f"{described}. Build every rank's reader with cur_shard=rank, "
        f"shard_count={len(readings)} (the rank and world size of the training group), or "
        "leave both out on every rank for each rank to read every row group"
    )
    return unread, read_by, message


def _looks_like(reading: frozenset[int], dataset_row_groups: int) -> str:
    """What a reader of these row groups was likely built with, where the row groups say."""
    if reading == frozenset(range(dataset_row_groups)):
        return " (as a reader without cur_shard/shard_count would)"
    ordered = sorted(reading)
    if len(ordered) < 2:
        return ""
    shard_count = math.gcd(*(later - earlier for earlier, later in itertools.pairwise(ordered)))
    first = ordered[0]
    if first < shard_count and reading == frozenset(range(first, dataset_row_groups, shard_count)):
        return f" (as cur_shard={first}, shard_count={shard_count} would)"
    return ""


def _few(indices: Sequence[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return f"[{shown}{', ...' if len(indices) > 8 else ''}]"
