"""The one way from a dataset and its options to a shard plan (:func:`plan_dataset`): the
dataset resolved, its row groups read from Parquet metadata (no data), a row predicate's kept
rows counted (once, cached), then every rank's shard planned.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from ddp_even.checks import check_positive_int
from ddp_even.parquet.metadata import read_row_groups
from ddp_even.parquet.nulls import NullColumns
from ddp_even.parquet.partitions import PartitionKeys, partition_keys
from ddp_even.parquet.predicate_counts import KeptRows, Share, count_in_columns, matching_rows
from ddp_even.parquet.predicates import check_predicate_fields
from ddp_even.planning.plans import ShardPlan, plan_shards
from ddp_even.planning.row_groups import Progress, RowGroups
from ddp_even.planning.sharding import Sharding, sharding_from
from ddp_even.storage import DatasetLocation, ResolvedDataset, StorageOptions, resolve_dataset

__all__ = ["DatasetPlan", "PredicateCounting", "plan_dataset", "plan_for_dataset"]

logger = logging.getLogger("ddp_even")


@dataclass(frozen=True)
class PredicateCounting:
    """A row predicate, and how the training reader judges a row group's rows with it.

    ``kept(predicate, table)`` judges a row group's predicate columns as the reader does
    (None: as ``make_batch_reader`` does, a pandas frame, or an expression by pyarrow);
    ``kind`` names what the counts mean, in their cache key.
    """

    predicate: Any
    kind: bytes = b"batch"
    kept: KeptRows | None = None


@dataclass(frozen=True)
class DatasetPlan:
    """A dataset planned for training.

    ``footers``: its row groups as the metadata said at planning (every pass checks its files
    against them); ``row_groups``: the rows a predicate keeps in each (the footers' without
    one), which ``plan`` shares out.
    """

    resolved: ResolvedDataset
    footers: RowGroups
    row_groups: RowGroups
    plan: ShardPlan
    #: The hive partition keys of ``footers.files``: columns of every row.
    partitions: PartitionKeys
    #: The integer and boolean columns that hold a null in some row group, as the footers'
    #: statistics say (or may: :mod:`ddp_even.parquet.nulls`): float in every batch.
    with_nulls: frozenset[str] = frozenset()

    def for_ranks(self, world_size: int, sharding: Sharding | None = None) -> ShardPlan:
        """The same row groups planned for ``world_size`` ranks (another ``sharding``).

        Example:
            >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
            >>> root = tempfile.mkdtemp()
            >>> pq.write_table(pa.table({"x": list(range(9))}), f"{root}/a.parquet",
            ...                row_group_size=3)
            >>> planned = plan_dataset(root, world_size=3, batch_size=2)
            >>> planned.plan.rows_per_rank, planned.for_ranks(2).rows_per_rank
            ((3, 3, 3), (6, 3))
        """
        return plan_shards(
            self.row_groups,
            world_size,
            self.plan.batch_size,
            sharding=self.plan.sharding if sharding is None else sharding,
        )


def plan_dataset(
    dataset: DatasetLocation | ResolvedDataset,
    world_size: int,
    batch_size: int,
    *,
    sharding: Sharding = "round_robin",
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
    progress: Progress | None = None,
    counting: PredicateCounting | None = None,
    rank: int = 0,
    share: Share | None = None,
) -> DatasetPlan:
    """Plan ``dataset``'s shards for ``world_size`` ranks, batches of ``batch_size`` rows.

    ``dataset``, ``storage_options``, ``filesystem`` and ``progress`` are
    :func:`~ddp_even.parquet.metadata.read_row_groups`'s (or ``dataset`` is one already
    resolved). With ``counting``, a row predicate's kept rows are counted first
    (:mod:`ddp_even.parquet.predicate_counts`, cached) and the plan shares those out; ``share``
    (an all-gather among the ranks, this one ``rank``) spreads that scan over the ranks, which
    must all call this together. Raises :class:`~ddp_even.errors.DatasetError` when the dataset
    cannot be read, and ``ValueError`` for bad arguments.
    """
    check_positive_int("world_size", world_size)
    check_positive_int("batch_size", batch_size)
    resolved = resolve_dataset(dataset, storage_options=storage_options, filesystem=filesystem)
    nulls = NullColumns()
    footers = read_row_groups(resolved, progress=progress, nulls=nulls)
    logger.debug(
        "ddp_even: %d row groups, %d rows in %d files (from %s)",
        len(footers),
        footers.total_rows,
        len(footers.files),
        footers.source,
    )
    partitions = partition_keys(
        None if resolved.is_list else resolved.paths[0].rstrip("/"), footers.files
    )
    row_groups = footers
    if counting is not None:
        predicate = counting.predicate
        fields = check_predicate_fields(predicate, resolved, footers, partitions)
        row_groups = matching_rows(
            footers,
            predicate,
            key_parts=[counting.kind],
            count_share=functools.partial(
                count_in_columns,
                resolved,
                footers,
                predicate=predicate,
                fields=fields,
                partitions=partitions,
                kept=counting.kept,
            ),
            rank=rank,
            world_size=world_size,
            share=share,
        )
    plan = plan_shards(row_groups, world_size, batch_size, sharding=sharding)
    return DatasetPlan(resolved, footers, row_groups, plan, partitions, nulls.names)


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
    """Read a dataset's row groups from metadata (no data) and plan its shards: the
    row groups and the plan of :func:`plan_dataset` (``balanced=True`` is the old spelling of
    ``sharding="row_groups"``).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=4)
        >>> row_groups, plan = plan_for_dataset(root, world_size=2, batch_size=3)
        >>> plan.shards, plan.rows_per_rank, plan.batches_per_rank
        (((0, 2), (1,)), (6, 4), (2, 2))
    """
    planned = plan_dataset(
        dataset,
        world_size,
        batch_size,
        sharding=sharding_from(sharding, balanced),
        storage_options=storage_options,
        filesystem=filesystem,
        progress=progress,
    )
    return planned.footers, planned.plan
