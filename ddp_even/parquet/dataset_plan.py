"""A dataset's shard plan in one call: its row groups read from Parquet metadata, then planned."""

from __future__ import annotations

import logging
from typing import Any

from ddp_even.checks import check_positive_int
from ddp_even.parquet.metadata import read_row_groups
from ddp_even.planning.plans import ShardPlan, plan_shards
from ddp_even.planning.row_groups import Progress, RowGroups
from ddp_even.planning.sharding import Sharding, sharding_from
from ddp_even.storage import DatasetLocation, StorageOptions

__all__ = ["plan_for_dataset"]

logger = logging.getLogger("ddp_even")


def plan_for_dataset(
    dataset: DatasetLocation,
    world_size: int,
    batch_size: int,
    *,
    sharding: Sharding = "round_robin",
    balanced: bool | None = None,
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
    progress: Progress | None = None,
) -> tuple[RowGroups, ShardPlan]:
    """Read a dataset's row groups from metadata (no data) and plan its shards.

    ``dataset`` is a URL (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ...), a
    local path, or a list of Parquet files, as given to petastorm; ``storage_options`` or
    ``filesystem`` reach remote storage (see :func:`~ddp_even.storage.resolve.resolve_dataset`),
    ``progress(done, total)`` follows the metadata reads. Raises
    :class:`~ddp_even.errors.DatasetError` when the dataset cannot be read, and
    ``ValueError`` for bad arguments.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=4)
        >>> row_groups, plan = plan_for_dataset(root, world_size=2, batch_size=3)
        >>> plan.shards, plan.rows_per_rank, plan.batches_per_rank
        (((0, 2), (1,)), (6, 4), (2, 2))
    """
    check_positive_int("world_size", world_size)
    check_positive_int("batch_size", batch_size)
    row_groups = read_row_groups(
        dataset, storage_options=storage_options, filesystem=filesystem, progress=progress
    )
    logger.debug(
        "ddp_even: %d row groups, %d rows in %d files (from %s)",
        len(row_groups),
        row_groups.total_rows,
        len(row_groups.files),
        row_groups.source,
    )
    sharding = sharding_from(sharding, balanced)
    return row_groups, plan_shards(row_groups, world_size, batch_size, sharding=sharding)
