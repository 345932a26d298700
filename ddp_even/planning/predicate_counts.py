"""Rows per row group that pass a row predicate, counted once before training.

Petastorm applies a row predicate (``in_lambda``, ``in_set``, ...) in its workers after a row
group is read, so the rows a shard yields cannot be known from the footers. They can be
counted: reading only the predicate's columns of every row group, through petastorm's own
worker (same decoding, same partition values, same predicate call as the training reader),
and counting what it keeps. The scan is spread over the ranks (rank ``r`` counts row groups
``i % W == r``) and the counts are shared, so it costs each rank ``1/W`` of a scan of the
predicate's columns; a plan of the matching rows follows from the counts as from footers.

Counts are cached on disk, keyed by the dataset's files and row-group sizes, the reader kind and
the predicate (pickled with ``dill``, so lambdas count by their code), in
``$DDP_EVEN_CACHE_DIR`` (default ``~/.cache/ddp_even``); a second run over the same dataset and
predicate does not scan. The ranks first agree that every one of them has the entry (ranks on
other machines may not), else they all scan. A cached count that no longer matches the data
is caught when the row group is read
(:class:`~ddp_even.planning.planned_workers.RowCountMismatchError`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import posixpath
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ddp_even.planning.datasets import RowGroups
from ddp_even.planning.storage import ResolvedDataset

__all__ = ["Share", "cache_directory", "check_predicate_fields", "matching_rows"]

logger = logging.getLogger("ddp_even")

#: Every rank's list of ints, in rank order, from this rank's list (an all-gather).
Share = Callable[[list[int]], list[list[int]]]

# Bumped when the meaning of a cache entry changes.
_CACHE_FORMAT = 1


def cache_directory() -> Path:
    """Where predicate counts are cached: ``$DDP_EVEN_CACHE_DIR`` or ``~/.cache/ddp_even``.

    Example:
        >>> cache_directory().name in ("ddp_even", os.environ.get("DDP_EVEN_CACHE_DIR", ""))
        True
    """
    configured = os.environ.get("DDP_EVEN_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "ddp_even"


def check_predicate_fields(
    predicate: Any, resolved: ResolvedDataset, row_groups: RowGroups
) -> list[str]:
    """The predicate's fields, or a ``ValueError`` naming those the dataset does not have.

    Every rank reads the same footer, so every rank raises the same error.
    """
    if not hasattr(predicate, "get_fields") or not hasattr(predicate, "do_include"):
        raise TypeError(
            f"predicate must be a petastorm predicate (petastorm.predicates.in_lambda, in_set, "
            f"...), got {type(predicate).__name__}"
        )
    fields = sorted(predicate.get_fields())
    if not fields:
        raise ValueError("the predicate names no fields: its get_fields() must return some")
    first_file = row_groups.files[0]
    columns = set(resolved.storage.read_footer(first_file).schema.to_arrow_schema().names)
    partitions = {
        part.split("=", 1)[0] for part in posixpath.dirname(first_file).split("/") if "=" in part
    }
    missing = [field for field in fields if field not in columns | partitions]
    if missing:
        raise ValueError(
            f"the predicate reads field(s) {', '.join(missing)}, which {resolved.describe()} "
            f"does not have; its columns are: {', '.join(sorted(columns | partitions))}"
        )
    return fields


def matching_rows(
    row_groups: RowGroups,
    predicate: Any,
    *,
    key_parts: Sequence[bytes],
    count_share: Callable[[Sequence[int]], list[int]],
    rank: int,
    world_size: int,
    share: Share,
) -> RowGroups:
    """``row_groups`` with ``num_rows`` replaced by the rows ``predicate`` keeps in each.

    ``count_share(indices)`` counts the matching rows of the given row groups on this rank;
    ``share`` all-gathers among the ranks (every rank must call this together). ``key_parts``
    name what the counts depend on besides the row groups and the predicate (the reader kind).
    """
    cache_file = _cache_file(row_groups, predicate, key_parts)
    cached = _read_cache(cache_file, len(row_groups))
    if all(has[0] for has in share([int(cached is not None)])):
        assert cached is not None
        logger.info("ddp_even: predicate counts from the cache %s", cache_file)
        return _with_counts(row_groups, cached)
    began = time.perf_counter()
    mine = range(rank, len(row_groups), world_size)
    counts = count_share(mine)
    width = -(-len(row_groups) // world_size)
    gathered = share([*counts, *[-1] * (width - len(counts))])
    everything = np.empty(len(row_groups), dtype=np.int64)
    for other in range(world_size):
        indices = np.arange(other, len(row_groups), world_size)
        everything[indices] = gathered[other][: len(indices)]
    logger.info(
        "ddp_even: counted the rows the predicate keeps in %d row groups (%d on this rank) in "
        "%.2f s: %d of %d rows",
        len(row_groups),
        len(mine),
        time.perf_counter() - began,
        int(everything.sum()),
        row_groups.total_rows,
    )
    if rank == 0 and cache_file is not None:
        _write_cache(cache_file, everything)
    return _with_counts(row_groups, everything)


def _with_counts(row_groups: RowGroups, counts: npt.NDArray[np.int64]) -> RowGroups:
    return dataclasses.replace(row_groups, num_rows=np.array(counts, dtype=np.int64))


def _cache_file(row_groups: RowGroups, predicate: Any, key_parts: Sequence[bytes]) -> Path | None:
    import dill

    try:
        predicate_bytes = dill.dumps(predicate, recurse=True)
    except Exception as error:  # any pickling failure means: no cache, not no training
        logger.info("ddp_even: predicate counts are not cached (cannot pickle it: %s)", error)
        return None
    digest = hashlib.sha256()
    for part in (
        str(_CACHE_FORMAT).encode(),
        *key_parts,
        "\n".join(row_groups.files).encode(),
        row_groups.file_of.tobytes(),
        row_groups.index_in_file.tobytes(),
        row_groups.num_rows.tobytes(),
        predicate_bytes,
    ):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return cache_directory() / f"predicate-counts-{digest.hexdigest()[:40]}.npy"


def _read_cache(path: Path | None, expected_length: int) -> npt.NDArray[np.int64] | None:
    if path is None or not path.exists():
        return None
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        logger.warning("ddp_even: ignoring an unreadable predicate-count cache %s: %s", path, error)
        return None
    if counts.shape != (expected_length,) or counts.dtype != np.int64:
        return None
    return np.asarray(counts, dtype=np.int64)


def _write_cache(path: Path, counts: npt.NDArray[np.int64]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        with open(partial, "wb") as handle:
            np.save(handle, counts)
        os.replace(partial, path)
    except OSError as error:
        logger.warning("ddp_even: could not cache predicate counts in %s: %s", path, error)
