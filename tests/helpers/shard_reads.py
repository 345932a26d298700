"""What real petastorm readers deliver for one shard: the ``id`` values and the batch sizes.

Every reader here is built through petastorm's public API (``make_reader`` /
``make_batch_reader`` with ``cur_shard`` / ``shard_count``, the ``petastorm.pytorch``
loaders), single-threaded (``reader_pool_type="dummy"``) and unshuffled, so the tests
compare the plan against petastorm itself rather than against ddp_even's own readers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.parquet as pq

from tests.helpers.datasets import write_plain_dataset, write_unischema_dataset

#: ``raw``: iterate the reader; the others wrap it in that ``petastorm.pytorch`` loader.
Loader = Literal["raw", "dataloader", "batched_dataloader"]
Reader = Literal["batch", "row"]

_DETERMINISTIC = {"reader_pool_type": "dummy", "shuffle_row_groups": False}


@dataclass(frozen=True)
class ShardRead:
    """The rows one pass over a shard delivered."""

    ids: list[int]
    #: Rows per item the loader yielded (per reader item for ``raw``).
    batch_sizes: list[int]

    @property
    def rows(self) -> int:
        return len(self.ids)

    @property
    def batches(self) -> int:
        return len(self.batch_sizes)


def read_shard(
    url: str | list[str],
    rank: int,
    world_size: int,
    *,
    reader: Reader = "batch",
    loader: Loader = "batched_dataloader",
    batch_size: int = 4,
) -> ShardRead:
    """Read shard ``rank`` of ``world_size`` once with petastorm's own sharding."""
    from petastorm import make_batch_reader, make_reader

    make = make_batch_reader if reader == "batch" else make_reader
    with make(url, cur_shard=rank, shard_count=world_size, **_DETERMINISTIC) as petastorm_reader:
        return drain(petastorm_reader, loader, batch_size)


def drain(petastorm_reader: Any, loader: Loader, batch_size: int) -> ShardRead:
    """Iterate a reader (or a petastorm.pytorch loader on it) to the end."""
    from petastorm.pytorch import BatchedDataLoader, DataLoader

    if loader == "raw":
        items: Any = petastorm_reader
    elif loader == "dataloader":
        items = DataLoader(petastorm_reader, batch_size=batch_size)
    else:
        items = BatchedDataLoader(petastorm_reader, batch_size=batch_size)
    return collect(items)


def collect(items: Any) -> ShardRead:
    """The ids and batch sizes of whatever ``items`` yields (loader batches or reader items).

    A row reader yields one id per item, a batch reader an array per row group, a loader a
    tensor per batch: all are flattened.
    """
    ids: list[int] = []
    sizes: list[int] = []
    for item in items:
        column = item["id"] if isinstance(item, dict) else item.id
        values = np.atleast_1d(np.asarray(column)).reshape(-1).tolist()
        ids.extend(int(v) for v in values)
        sizes.append(len(values))
    return ShardRead(ids=ids, batch_sizes=sizes)


def ids_of_row_groups(
    files: tuple[str, ...], file_of: Any, index_in_file: Any, picks: Any
) -> list[int]:
    """The ``id`` values stored in the given global row groups (reads those row groups)."""
    ids: list[int] = []
    for global_index in picks:
        path = files[int(file_of[global_index])]
        table = pq.ParquetFile(path).read_row_group(
            int(index_in_file[global_index]), columns=["id"]
        )
        ids.extend(table.column("id").to_pylist())
    return ids


def write_summary_metadata(root: Path, *, skip: tuple[str, ...] = (), common: bool = False) -> None:
    """Write a ``_metadata`` file listing every data file's row groups (except ``skip``).

    With ``common=True`` also write a schema-only ``_common_metadata``, as Spark does.
    """
    relpaths = sorted(
        os.path.relpath(os.path.join(directory, name), root)
        for directory, _, names in os.walk(root)
        for name in names
        if name.endswith(".parquet")
    )
    collected = []
    schema = None
    for relpath in relpaths:
        footer = pq.read_metadata(root / relpath)
        schema = footer.schema.to_arrow_schema()
        if relpath in skip:
            continue
        footer.set_file_path(relpath)
        collected.append(footer)
    assert schema is not None, f"no Parquet files under {root}"
    pq.write_metadata(schema, root / "_metadata", metadata_collector=collected)
    if common:
        pq.write_metadata(schema, root / "_common_metadata")


@dataclass(frozen=True)
class Layouts:
    """The same row groups written the ways petastorm datasets come; each ``root -> url``."""

    sizes: Sequence[Sequence[int]]

    def plain(self, root: Path) -> str:
        return write_plain_dataset(root, self.sizes)

    def partitioned(self, root: Path) -> str:
        return write_plain_dataset(root, self.sizes, partition_by="part")

    def with_metadata(self, root: Path) -> str:
        url = write_plain_dataset(root, self.sizes)
        write_summary_metadata(root, common=True)
        return url

    def unischema(self, root: Path) -> str:
        return write_unischema_dataset(root, self.sizes)
