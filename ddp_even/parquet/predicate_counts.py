"""Rows per row group that pass a row predicate, counted once before training.

A predicate is applied after a row group is read, so the rows a shard yields are counted: only
the predicate's columns of every row group are read (hive partition keys included) and judged
as the training reader will judge them (:func:`count_in_columns`). Rank ``r`` counts row groups
``i % W == r`` and the counts are shared (:func:`matching_rows`); a plan follows from them as
from footers.

Counts are cached in :func:`cache_directory`, keyed by the dataset's files, row-group sizes and
footer digests (a file rewritten in place misses the cache), the reader kind and the
predicate's code (:func:`~ddp_even.planning.provenance.code_identity`: an edited predicate
misses it). The ranks use the cache only when every one of them has the entry (ranks on other
machines may not). A count that no longer matches the data (a predicate that is not
deterministic) is caught when the row group is read
(:class:`~ddp_even.errors.RowCountMismatchError`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from ddp_even.parquet.partitions import PartitionKeys
from ddp_even.parquet.predicates import check_mask, is_expression, kept_mask
from ddp_even.planning.provenance import code_identity
from ddp_even.planning.row_groups import RowGroups
from ddp_even.storage import ResolvedDataset

__all__ = ["KeptRows", "Share", "cache_directory", "count_in_columns", "matching_rows"]

logger = logging.getLogger("ddp_even")

#: Every rank's list of ints, in rank order, from this rank's list (an all-gather).
Share = Callable[[list[int]], list[list[int]]]
#: ``kept(predicate, table)``: which rows of a row group's predicate columns a reader keeps.
KeptRows = Callable[[Any, pa.Table], npt.NDArray[np.bool_]]

# Bytes of a failing rank's error the others are told (its type and message).
_SAID = 1024
# Bumped when the meaning of a cache entry changes (4: predicates by their code; summaries).
_CACHE_FORMAT = 4
# Files read at once by a scan of stored columns.
_SCAN_THREADS = 4
# Uncompressed bytes of predicate columns read and converted together (per file being read).
_READ_BYTES = 32 << 20


def cache_directory() -> Path:
    """Where predicate counts are cached: ``$DDP_EVEN_CACHE_DIR`` or ``~/.cache/ddp_even``."""
    configured = os.environ.get("DDP_EVEN_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "ddp_even"


def count_in_columns(
    resolved: ResolvedDataset,
    row_groups: RowGroups,
    indices: Sequence[int],
    predicate: Any,
    fields: list[str],
    *,
    partitions: PartitionKeys,
    kept: KeptRows | None = None,
) -> list[int]:
    """Rows ``predicate`` keeps in each of ``indices``, reading its columns with pyarrow.

    Each row group's predicate columns (hive partition keys among them) are judged as the
    reader judges them: by ``kept(predicate, table)`` where given (a reader decoding the
    values first), else as ``make_batch_reader``'s worker does, a pandas ``DataFrame`` of its
    own given to ``predicate.do_include`` (or an expression evaluated by pyarrow). Each file is
    opened once and its row groups read several at a time; files are read in parallel (pyarrow
    releases the GIL while it reads and decodes).
    """
    by_file: dict[int, list[int]] = {}
    for index in indices:
        by_file.setdefault(int(row_groups.file_of[index]), []).append(index)
    storage = resolved.storage
    stored = [field for field in fields if field not in partitions.names]
    keys = [field for field in fields if field in partitions.names]

    def count_file(file_index: int) -> list[tuple[int, int]]:
        wanted = by_file[file_index]
        positions = [int(row_groups.index_in_file[index]) for index in wanted]
        kept_rows: list[int] = []
        with storage.filesystem.open_input_file(row_groups.files[file_index]) as source:
            # pre_buffer: the column chunks of one read come in few, coalesced requests.
            parquet_file = pq.ParquetFile(source, pre_buffer=True)
            for batch in _read_batches(parquet_file, positions, stored):
                table = parquet_file.read_row_groups(batch, columns=stored)
                sizes = [parquet_file.metadata.row_group(position).num_rows for position in batch]
                # Partition keys: the same value in every row of the file.
                table = partitions.added_to(table, file_index, keys, rows=sum(sizes))
                if kept is not None or is_expression(predicate):
                    judge = kept or kept_mask
                    kept_rows.extend(
                        int(np.count_nonzero(judge(predicate, part)))
                        for part in _slices(table, sizes)
                    )
                    continue
                for frame in _frames_per_row_group(table, sizes):
                    verdict = predicate.do_include(frame)
                    check_mask(verdict)
                    kept_rows.append(int(np.count_nonzero(np.asarray(verdict))))
        return list(zip(wanted, kept_rows, strict=True))

    if len(by_file) <= 1:  # no thread to start (which waits for a scheduler on a busy machine)
        counted = [count_file(file_index) for file_index in by_file]
    else:
        with ThreadPoolExecutor(max_workers=min(_SCAN_THREADS, len(by_file))) as pool:
            counted = list(pool.map(count_file, by_file))
    counts = dict(pair for pairs in counted for pair in pairs)
    return [counts[index] for index in indices]


def _read_batches(
    parquet_file: pq.ParquetFile, positions: list[int], fields: list[str]
) -> Iterator[list[int]]:
    """``positions`` (row groups of one file) in runs read together: runs whose predicate
    columns hold at most ``_READ_BYTES`` uncompressed, so that small row groups share the
    costs of a read and a conversion while memory stays bounded; one row group at a time when
    a column's pandas conversion may depend on the rows converted with it (see
    :func:`_frames_per_row_group`)."""
    schema = parquet_file.schema_arrow
    if _has_pandas_metadata(schema) or not all(_flat(schema.field(name).type) for name in fields):
        yield from ([position] for position in positions)
        return
    metadata = parquet_file.metadata
    # Flat columns: one Parquet leaf each, whose path is the column's name.
    leaves = [
        column
        for column in range(metadata.num_columns)
        if metadata.schema.column(column).path in fields
    ]
    batch: list[int] = []
    held = 0
    for position in positions:
        row_group = metadata.row_group(position)
        size = sum(row_group.column(column).total_uncompressed_size for column in leaves)
        if batch and held + size > _READ_BYTES:
            yield batch
            batch, held = [], 0
        batch.append(position)
        held += size
    if batch:
        yield batch


def _frames_per_row_group(table: pa.Table, sizes: list[int]) -> Iterator[Any]:
    """The DataFrame ``to_pandas`` makes of each row group alone, given ``table``: the rows of
    consecutive row groups of ``sizes`` rows, of flat columns (numbers, strings, times).

    A ``to_pandas`` call costs about half a millisecond whatever the rows (pyarrow 14 rebuilds
    the column index each time): more than reading a small row group's column. Without nulls,
    flat columns convert each row the same whatever rows are converted with it, so all rows
    are converted once and sliced; with nulls the dtype depends on the rows (integers with a
    null become floats), so each row group is converted alone.
    """
    if len(sizes) > 1 and all(column.null_count == 0 for column in table.columns):
        import pandas as pd  # type: ignore[import-untyped]  # installed with petastorm

        whole = table.to_pandas()
        offset = 0
        for size in sizes:
            # A shallow copy with its own index: to_pandas numbers a row group's rows from 0.
            frame = whole.iloc[offset : offset + size].copy(deep=False)
            frame.index = pd.RangeIndex(size)
            yield frame
            offset += size
        return
    for part in _slices(table, sizes):
        yield part.to_pandas()


def _slices(table: pa.Table, sizes: list[int]) -> Iterator[pa.Table]:
    """The rows of each row group of ``table`` (consecutive row groups of ``sizes`` rows)."""
    offset = 0
    for size in sizes:
        yield table.slice(offset, size)
        offset += size


def _has_pandas_metadata(schema: pa.Schema) -> bool:
    # With it, to_pandas rebuilds the index and dtypes pandas stored: not row by row.
    return bool(schema.metadata) and b"pandas" in schema.metadata


def _flat(kind: pa.DataType) -> bool:
    """Whether pandas gets a column of ``kind`` value by value (no dictionary, no nesting)."""
    return bool(
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
        or pa.types.is_temporal(kind)
        or pa.types.is_decimal(kind)
    )


def matching_rows(
    row_groups: RowGroups,
    predicate: Any,
    *,
    key_parts: Sequence[bytes],
    count_share: Callable[[Sequence[int]], list[int]],
    rank: int,
    world_size: int,
    share: Share | None,
) -> RowGroups:
    """``row_groups`` with ``num_rows`` replaced by the rows ``predicate`` keeps in each.

    ``count_share(indices)`` counts the matching rows of the given row groups on this rank;
    ``share`` all-gathers among the ranks (every rank must call this together; None: this rank
    counts alone). ``key_parts`` name what the counts depend on besides the row groups and the
    predicate (the reader kind).
    """
    if share is None or world_size == 1:  # this rank counts every row group
        rank, world_size, share = 0, 1, _alone
    cache_file = _cache_file(row_groups, predicate, key_parts)
    cached = _read_cache(cache_file, len(row_groups))
    if all(has[0] for has in share([int(cached is not None)])):
        assert cached is not None
        if rank == 0:  # every rank read the same cache
            logger.info("ddp_even: predicate counts from the cache %s", cache_file)
        return _with_counts(row_groups, cached)
    began = time.perf_counter()
    mine = range(rank, len(row_groups), world_size)
    width = -(-len(row_groups) // world_size)
    gathered = _counted_or_failed(count_share, mine, width, share)
    everything = np.empty(len(row_groups), dtype=np.int64)
    for other in range(world_size):
        indices = np.arange(other, len(row_groups), world_size)
        everything[indices] = gathered[other][1 : len(indices) + 1]
    # Logged by every rank: each counted its own share, in its own time.
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
    # No rank returns before rank 0 has written the cache: a plan made next, on any rank,
    # finds it (a rank that looked too early would send every rank counting again).
    share([0])
    return _with_counts(row_groups, everything)


def _alone(values: list[int]) -> list[list[int]]:
    return [values]


def _counted_or_failed(
    count_share: Callable[[Sequence[int]], list[int]],
    mine: Sequence[int],
    width: int,
    share: Share,
) -> list[list[int]]:
    """Every rank's counts (after a leading 0); a rank whose count raised fails every rank.

    The rank that failed raises its own error; the others raise
    :class:`~ddp_even.errors.PeerSourceError` naming it, so that no rank is left waiting in
    the all-gather of a rank that left.
    """
    failure: Exception | None = None
    try:
        counts = count_share(mine)
    except Exception as error:  # any failure of the user's predicate must reach every rank
        failure, counts = error, []
    gathered = share([int(failure is not None), *counts, *[-1] * (width - len(counts))])
    failed = [other for other, vector in enumerate(gathered) if vector[0]]
    if not failed:
        return gathered
    text = b"" if failure is None else f"{type(failure).__name__}\n{failure}".encode()[:_SAID]
    said = share([*text, *[0] * (_SAID - len(text))])
    if failure is not None:
        raise failure
    from ddp_even.errors import PeerSourceError

    type_name, _, message = (
        bytes(said[failed[0]]).rstrip(b"\0").decode(errors="replace").partition("\n")
    )
    logger.error("ddp_even: rank %d could not count the predicate's rows", failed[0])
    raise PeerSourceError(
        failed[0], type_name, f"{message}, while counting the predicate's rows", step=0
    )


def _with_counts(row_groups: RowGroups, counts: npt.NDArray[np.int64]) -> RowGroups:
    return dataclasses.replace(row_groups, num_rows=np.array(counts, dtype=np.int64))


def _cache_file(row_groups: RowGroups, predicate: Any, key_parts: Sequence[bytes]) -> Path | None:
    try:
        predicate_bytes = code_identity(predicate)
    except Exception as error:  # any failure to name it means: no cache, not no training
        logger.info("ddp_even: predicate counts are not cached (cannot identify it: %s)", error)
        return None
    digest = hashlib.sha256()
    for part in (
        str(_CACHE_FORMAT).encode(),
        *key_parts,
        # Files, row groups and sizes; footers (a file rewritten in place gets another), or a
        # summary's digest and each file's size and time.
        row_groups.identity(),
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
