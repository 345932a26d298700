"""Small, real Parquet datasets for tests, and the sharding petastorm applies to them.

Row groups are numbered globally in file order (files sorted by path, row groups in file order).
Every dataset has the same rows: ``id`` (int64, 0, 1, 2, ... consecutive in global row-group
order), ``value`` (float32, ``id * 0.5``) and ``label`` (int64, ``id % 3``).

``row_group_sizes`` is either a flat list (one file with those row groups) or a list of lists
(one file per inner list, ``part-00000.parquet``, ``part-00001.parquet``, ...).
"""

from __future__ import annotations

import functools
import json
import math
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "VEC_SIZE",
    "batches_for",
    "file_sizes",
    "flat_sizes",
    "shard_ids",
    "shard_row_groups",
    "shard_rows",
    "write_plain_dataset",
    "write_unischema_dataset",
]

RowGroupSizes = Sequence[int] | Sequence[Sequence[int]]

#: Length of the ``vec`` ndarray field of :func:`write_unischema_dataset`.
VEC_SIZE = 4


def file_sizes(row_group_sizes: RowGroupSizes) -> list[list[int]]:
    """Row-group sizes per file: a flat list is one file, a list of lists one file per list."""
    items: list[Any] = list(row_group_sizes)
    if not items:
        raise ValueError("row_group_sizes is empty")
    nested = [isinstance(item, Sequence) for item in items]
    if all(nested):
        files = [[int(size) for size in item] for item in items]
    elif not any(nested):
        files = [[int(size) for size in items]]
    else:
        raise ValueError("row_group_sizes mixes ints and lists")
    for sizes in files:
        if not sizes:
            raise ValueError("a file needs at least one row group")
        if any(size <= 0 for size in sizes):
            raise ValueError(f"row group sizes must be positive, got {sizes}")
    return files


def flat_sizes(row_group_sizes: RowGroupSizes) -> list[int]:
    """All row-group sizes in global row-group order."""
    return [size for sizes in file_sizes(row_group_sizes) for size in sizes]


def shard_row_groups(num_row_groups: int, world_size: int, rank: int) -> list[int]:
    """Global row-group indices petastorm gives shard ``rank`` of ``world_size``."""
    return [i for i in range(num_row_groups) if i % world_size == rank]


def shard_ids(row_group_sizes: RowGroupSizes, world_size: int, rank: int) -> list[int]:
    """Sorted ``id`` values of the rows in shard ``rank`` of ``world_size``."""
    sizes = flat_sizes(row_group_sizes)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    ids: list[int] = []
    for i in shard_row_groups(len(sizes), world_size, rank):
        ids.extend(range(starts[i], starts[i + 1]))
    return ids


def shard_rows(row_group_sizes: RowGroupSizes, world_size: int, rank: int) -> int:
    """Number of rows in shard ``rank`` of ``world_size``."""
    sizes = flat_sizes(row_group_sizes)
    return sum(sizes[i] for i in shard_row_groups(len(sizes), world_size, rank))


def batches_for(rows: int, batch_size: int) -> int:
    """Batches a petastorm loader emits for ``rows`` rows (the last batch may be short)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return math.ceil(rows / batch_size)


def _columns(start: int, size: int) -> dict[str, object]:
    ids = np.arange(start, start + size, dtype=np.int64)
    return {"id": ids, "value": (ids * 0.5).astype(np.float32), "label": ids % 3}


class _TableFactory:
    def __init__(self, schema: pa.Schema, vec: bool) -> None:
        self.schema = schema
        self.vec = vec

    def __call__(self, start: int, size: int) -> pa.Table:
        columns = _columns(start, size)
        if self.vec:
            columns["vec"] = [_encode_vec(i) for i in range(start, start + size)]
        return pa.table(columns, schema=self.schema)


def _write_files(
    root: Path,
    files: list[list[int]],
    schema: pa.Schema,
    make_table: _TableFactory,
    partition_by: str | None = None,
) -> list[str]:
    """Write one Parquet file per entry of ``files``; returns paths relative to ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    relpaths: list[str] = []
    start = 0
    for index, sizes in enumerate(files):
        if partition_by is None:
            relpath = f"part-{index:05d}.parquet"
        else:
            relpath = f"{partition_by}={index:05d}/part-00000.parquet"
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        with pq.ParquetWriter(str(path), schema) as writer:
            for size in sizes:
                writer.write_table(make_table(start, size), row_group_size=size)
                start += size
        written = pq.read_metadata(str(path))
        got = [written.row_group(k).num_rows for k in range(written.num_row_groups)]
        if got != sizes:
            raise RuntimeError(f"{path}: wrote row groups {got}, wanted {sizes}")
        relpaths.append(relpath)
    return relpaths


_PLAIN_SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float32()), ("label", pa.int64())])


def write_plain_dataset(
    directory: Path,
    row_group_sizes: RowGroupSizes,
    *,
    partition_by: str | None = None,
) -> str:
    """Write a plain Parquet dataset (no petastorm metadata) and return its ``file://`` URL.

    With ``partition_by``, file ``k`` goes to the hive partition directory
    ``{partition_by}=0000k/`` (zero-padded so that path order is file order), and readers see a
    partition column ``partition_by`` holding ``k``. It must not be one of the data columns.
    """
    files = file_sizes(row_group_sizes)
    if partition_by is not None and partition_by in _PLAIN_SCHEMA.names:
        raise ValueError(f"partition_by={partition_by!r} collides with a data column")
    directory = Path(directory)
    factory = _TableFactory(_PLAIN_SCHEMA, vec=False)
    _write_files(directory, files, _PLAIN_SCHEMA, factory, partition_by)
    return directory.resolve().as_uri()


_UNISCHEMA_ARROW = pa.schema(
    [("id", pa.int64()), ("value", pa.float32()), ("label", pa.int64()), ("vec", pa.binary())]
)


@functools.cache
def _unischema() -> Any:
    from petastorm.codecs import NdarrayCodec
    from petastorm.unischema import Unischema, UnischemaField

    return Unischema(
        "DdpEvenTestSchema",
        [
            UnischemaField("id", np.int64, (), None, False),
            UnischemaField("value", np.float32, (), None, False),
            UnischemaField("label", np.int64, (), None, False),
            UnischemaField("vec", np.float32, (VEC_SIZE,), NdarrayCodec(), False),
        ],
    )


def _encode_vec(row_id: int) -> bytes:
    field = _unischema().vec
    return bytes(field.codec.encode(field, np.full(VEC_SIZE, row_id, np.float32)))


def write_unischema_dataset(directory: Path, row_group_sizes: RowGroupSizes) -> str:
    """Write a petastorm Unischema dataset (no Spark) and return its ``file://`` URL.

    Fields: ``id``, ``value``, ``label`` (scalars, no codec) and ``vec`` (float32 array of shape
    ``(VEC_SIZE,)`` equal to ``id`` everywhere, ``NdarrayCodec``). ``make_reader`` reads it.
    """
    from petastorm.etl.dataset_metadata import ROW_GROUPS_PER_FILE_KEY, UNISCHEMA_KEY

    files = file_sizes(row_group_sizes)
    directory = Path(directory)
    relpaths = _write_files(
        directory, files, _UNISCHEMA_ARROW, _TableFactory(_UNISCHEMA_ARROW, vec=True)
    )
    row_groups_per_file = {path: len(sizes) for path, sizes in zip(relpaths, files, strict=True)}
    metadata = {
        UNISCHEMA_KEY: pickle.dumps(_unischema()),
        ROW_GROUPS_PER_FILE_KEY: json.dumps(row_groups_per_file).encode(),
    }
    pq.write_metadata(_UNISCHEMA_ARROW.with_metadata(metadata), str(directory / "_common_metadata"))
    return directory.resolve().as_uri()
