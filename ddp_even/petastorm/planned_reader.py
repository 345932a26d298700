"""Petastorm's ``Reader``, reading exactly the rows a plan gives a rank, in a known order.

Mechanism. Petastorm's public options cannot select an arbitrary set of row groups:
``cur_shard``/``shard_count`` take ``i % shard_count == cur_shard``, ``rowgroup_selector``
needs an index stored in ``_common_metadata`` (built with Spark), and a list of file URLs
selects whole files. So each reader is petastorm's own ``Reader`` with two steps overridden:
``Reader._partition_row_groups``, the step that turns petastorm's list of all row groups into
this shard's list, and ``Reader._create_ventilator``, which orders them (below). Everything
else (listing, reading, decoding, workers, caching, transforms, the pytorch loaders) is
petastorm's. The override also checks petastorm's list
against the plan's (same files, same row groups, same order) and raises if they differ, so a
plan can never silently describe different shards from the ones read. For round-robin plans
it defers to petastorm's own sharding and only checks the result.

Reading order. The reader ventilates its row groups in the order
:mod:`ddp_even.planning.pass_order` computes (plan order, or seeded by the epoch), with
petastorm's own shuffle of work items off, and a thread pool of several workers hands its
results out in that order (:mod:`ddp_even.petastorm.ordered_results`). Petastorm still
shuffles for an unseeded ``shuffle_row_groups``, and with ``shuffle_row_drop_partitions > 1``
(the parts of different row groups are meant to interleave).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ddp_even.errors import PlanMismatchError
from ddp_even.petastorm.legacy_filesystem import legacy_filesystem
from ddp_even.planning.pass_order import pass_rows
from ddp_even.planning.plans import ShardPlan, scan_plan
from ddp_even.planning.row_groups import RowGroups
from ddp_even.planning.sharding import SHARDINGS, RowRange, Sharding
from ddp_even.storage import ResolvedDataset

if TYPE_CHECKING:
    from ddp_even.petastorm.reader_options import ReaderKind

__all__ = ["build_reader", "count_matching"]


def count_matching(
    url: str | list[str],
    resolved: ResolvedDataset,
    kind: ReaderKind,
    row_groups: RowGroups,
    indices: Sequence[int],
    predicate: Any,
    fields: list[str],
    options: dict[str, Any],
) -> list[int]:
    """Rows ``predicate`` keeps in each of ``indices``, through petastorm's own worker.

    A reader over those row groups, of the predicate's columns only, with a pool that runs
    its worker in this thread; each row group is processed on its own so that its kept rows
    can be counted (a reader's output does not say which row group a row came from).
    """
    if not indices:
        return []
    scan_options = {
        "schema_fields": fields,
        "predicate": predicate,
        "reader_pool_type": "dummy",
        "shuffle_row_groups": False,
        "hdfs_driver": options.get("hdfs_driver", "libhdfs3"),
    }
    scanned = scan_plan(row_groups, indices)
    scan_reader = build_reader(url, resolved, kind, row_groups, scanned, 0, scan_options)
    try:
        pool = scan_reader._workers_pool
        # Row groups a predicate on partition columns ruled out have no work item: 0 rows.
        items = {item["piece_index"]: item for item in scan_reader.ventilator._items_to_ventilate}
        counts = []
        for index in indices:
            item = items.get(index)
            if item is not None:
                pool._worker.process(index, item["worker_predicate"], (0, 1))
            counts.append(sum(len(published) for published in pool._results_queue))
            pool._results_queue.clear()
        return counts
    finally:
        scan_reader.stop()
        scan_reader.join()


def build_reader(
    url: str | list[str],
    resolved: ResolvedDataset,
    kind: ReaderKind,
    row_groups: RowGroups,
    plan: ShardPlan,
    rank: int,
    options: dict[str, Any],
    *,
    rows: Sequence[RowRange] | None = None,
    petastorm_shuffles: bool = False,
) -> Any:
    """What ``make_reader`` / ``make_batch_reader`` do, with :func:`_planned_reader_class`.

    The reader reads ``rows`` (pieces of ``plan``'s shard of ``rank``, by default the whole
    shard in plan order) in that order, unless ``petastorm_shuffles`` lets petastorm's
    ventilator shuffle them (an unseeded ``shuffle_row_groups``).
    """
    from petastorm.cache import NullCache
    from petastorm.etl.dataset_metadata import PetastormMetadataError
    from petastorm.fs_utils import get_filesystem_and_path_or_paths
    from petastorm.local_disk_cache import LocalDiskCache
    from petastorm.reader import normalize_dataset_url_or_urls
    from petastorm.reader_impl.arrow_table_serializer import ArrowTableSerializer
    from petastorm.reader_impl.pickle_serializer import PickleSerializer
    from petastorm.workers_pool.dummy_pool import DummyPool
    from petastorm.workers_pool.process_pool import ProcessPool
    from petastorm.workers_pool.thread_pool import ThreadPool

    from ddp_even.petastorm.planned_workers import PlannedArrowWorker, PlannedRowWorker
    from ddp_even.petastorm.pools import close_end_of_results_race

    filesystem: Any
    dataset_path: str | list[str]
    if resolved.storage.filesystem is None:
        filesystem, dataset_path = get_filesystem_and_path_or_paths(
            normalize_dataset_url_or_urls(url), options.get("hdfs_driver", "libhdfs3")
        )
    else:
        # The filesystem planning listed, so petastorm names the files as the plan does; as a
        # legacy one, because pyarrow 14 takes petastorm's legacy dataset path only for those.
        filesystem = legacy_filesystem(resolved.storage.filesystem)
        dataset_path = resolved.petastorm_paths

    cache_type = options.get("cache_type", "null")
    if cache_type in (None, "null"):
        cache: Any = NullCache()
    elif cache_type == "local-disk":
        cache = LocalDiskCache(
            options.get("cache_location"),
            options.get("cache_size_limit"),
            options.get("cache_row_size_estimate"),
            **(options.get("cache_extra_settings") or {}),
        )
    else:
        raise ValueError(f"unknown cache_type {cache_type!r}: use 'null' or 'local-disk'")

    pool_type = options.get("reader_pool_type", "thread")
    workers_count = options.get("workers_count", 10)
    if pool_type == "thread":
        pool: Any = ThreadPool(workers_count, options.get("results_queue_size", 50))
    elif pool_type == "process":
        serializer = ArrowTableSerializer() if kind == "batch" else PickleSerializer()
        pool = ProcessPool(
            workers_count, serializer, zmq_copy_buffers=options.get("zmq_copy_buffers", True)
        )
    elif pool_type == "dummy":
        pool = DummyPool()
    else:
        raise ValueError(
            f"unknown reader_pool_type {pool_type!r}: use 'thread', 'process' or 'dummy'"
        )
    close_end_of_results_race(pool)

    reader_class = _planned_reader_class()
    try:
        return reader_class(
            filesystem,
            dataset_path,
            planned_row_groups=row_groups,
            planned_rows=(
                pass_rows(plan, rank, row_groups.num_rows.tolist(), None) if rows is None else rows
            ),
            petastorm_shuffles=petastorm_shuffles,
            sharding=plan.sharding,
            worker_class=PlannedArrowWorker if kind == "batch" else PlannedRowWorker,
            is_batched_reader=kind == "batch",
            reader_pool=pool,
            cache=cache,
            num_epochs=1,
            cur_shard=rank,
            shard_count=plan.world_size,
            schema_fields=options.get("schema_fields"),
            predicate=options.get("predicate"),
            seed=options.get("seed"),
            shuffle_rows=options.get("shuffle_rows", False),
            shuffle_row_groups=options.get("shuffle_row_groups", True),
            shuffle_row_drop_partitions=options.get("shuffle_row_drop_partitions", 1),
            transform_spec=options.get("transform_spec"),
        )
    except PetastormMetadataError as error:
        raise RuntimeError(
            f"petastorm could not read the dataset's Unischema ({error}); for a plain Parquet "
            "dataset use reader='batch'"
        ) from error


@functools.cache
def _planned_reader_class() -> type:
    """Petastorm's ``Reader`` with the shard-selection step following the plan.

    Defined on first use so that importing this module does not import petastorm.
    """
    from petastorm.reader import Reader
    from petastorm.workers_pool.thread_pool import ThreadPool

    from ddp_even.petastorm.ordered_results import ResultsInOrder, ShardVentilator

    class PlannedShardReader(Reader):  # type: ignore[misc]  # petastorm has no type hints
        """A petastorm ``Reader`` that reads the rows ``planned_rows`` lists, in that order.

        Its ventilator is ddp_even's (:class:`~ddp_even.petastorm.ordered_results.
        ShardVentilator`): the row groups in the order of ``planned_rows``, each work item
        saying which of its rows to keep. Petastorm shuffles that order only when
        ``petastorm_shuffles`` (an unseeded shuffle) or, with ``shuffle_row_groups``, when row
        groups are read in parts (``shuffle_row_drop_partitions > 1``), whose interleaving is
        the point of that option. A thread pool of several workers hands its results out in
        ventilation order (:class:`~ddp_even.petastorm.ordered_results.ResultsInOrder`).
        """

        _workers_pool: Any  # petastorm's, or ResultsInOrder standing in for it

        def __init__(
            self,
            *args: Any,
            planned_row_groups: RowGroups,
            planned_rows: Sequence[RowRange],
            petastorm_shuffles: bool,
            sharding: Sharding,
            **kwargs: Any,
        ) -> None:
            self._planned_row_groups = planned_row_groups
            # Each row group once, where it first comes, with all its ranges in listed order.
            self._planned_ranges: dict[int, list[tuple[int, int]]] = {}
            for group, start, stop in planned_rows:
                self._planned_ranges.setdefault(group, []).append((start, stop))
            self._planned_shard = frozenset(self._planned_ranges)
            self._petastorm_shuffles = petastorm_shuffles
            self._sharding = sharding
            self._in_order: ResultsInOrder | None = None
            super().__init__(*args, **kwargs)
            if self._in_order is not None:
                self._in_order.pool = self._workers_pool
                self._workers_pool = self._in_order

        def _create_ventilator(
            self,
            row_group_indexes: list[int],
            shuffle_row_groups: bool,
            shuffle_row_drop_partitions: int,
            num_epochs: int,
            worker_predicate: Any,
            max_ventilation_queue_size: int,
            seed: int | None,
        ) -> Any:
            selected = set(row_group_indexes)
            sizes = self._planned_row_groups.num_rows
            parts = shuffle_row_drop_partitions
            items = []
            for group, kept in self._planned_ranges.items():
                if group not in selected:
                    continue  # ruled out by a predicate on partition columns: no rows
                expected = int(sizes[group])
                for part in range(parts):
                    # Every work item says which rows the plan expects and which to keep.
                    part_rows = _part_rows(expected, part, parts)
                    items.append(
                        {
                            "piece_index": group,
                            "worker_predicate": worker_predicate,
                            "shuffle_row_drop_partition": (part, parts),
                            "planned_rows": (
                                (expected, tuple(kept))
                                if parts == 1
                                else (part_rows, ((0, part_rows),))
                            ),
                        }
                    )
            shuffled = self._petastorm_shuffles or (shuffle_row_groups and parts > 1)
            # Several threads finish row groups in any order; tagged with their position,
            # their results are handed out in ventilation order (a shuffled order needs none).
            pool = self._workers_pool  # set by Reader.__init__ before this call
            in_order = not shuffled and isinstance(pool, ThreadPool) and pool.workers_count > 1
            if in_order:
                for position, item in enumerate(items):
                    item["position"] = position
            ventilator = ShardVentilator(
                pool.ventilate,
                items,
                iterations=num_epochs,
                randomize_item_order=shuffled,
                random_seed=seed,
                max_ventilation_queue_size=max_ventilation_queue_size,
                counts_handed_out=in_order,
            )
            if in_order:
                self._in_order = ResultsInOrder(ventilator)
            return ventilator

        def _partition_row_groups(
            self,
            dataset: Any,
            row_groups: Sequence[Any],
            shard_count: int,
            cur_shard: int,
            filtered_row_group_indexes: list[int],
            seed: int | None,
        ) -> list[int]:
            _check_same_row_groups(row_groups, self._planned_row_groups)
            if SHARDINGS[self._sharding].is_petastorms:
                selected: list[int] = super()._partition_row_groups(
                    dataset, row_groups, shard_count, cur_shard, filtered_row_group_indexes, seed
                )
                if set(selected) != self._planned_shard:
                    raise PlanMismatchError(
                        f"petastorm gave shard {cur_shard} row groups {sorted(selected)[:8]}..., "
                        f"the plan {sorted(self._planned_shard)[:8]}..."
                    )
                return selected
            # The set only: _create_ventilator orders the row groups.
            return [index for index in filtered_row_group_indexes if index in self._planned_shard]

        def reset(self) -> None:
            super().reset()
            if self._in_order is not None:
                self._in_order.restart()

    return PlannedShardReader


def _part_rows(rows: int, part: int, parts: int) -> int:
    """Rows of part ``part`` of ``parts`` of a row group, as petastorm 0.12.1's workers cut it
    (``ArrowReaderWorker._read_with_shuffle_row_drop``: row ``i`` goes to part
    ``floor(i / (rows / min(rows, parts)))``)."""
    if parts == 1:
        return rows
    if rows == 0:
        return 0
    owners = np.floor(np.arange(rows) / (float(rows) / min(rows, parts)))
    return int(np.count_nonzero(owners == part))


def _check_same_row_groups(pieces: Sequence[Any], planned: RowGroups) -> None:
    if len(pieces) != len(planned):
        raise PlanMismatchError(
            f"petastorm lists {len(pieces)} row groups, the plan {len(planned)}: "
            "the dataset changed since planning, or ddp_even lists it wrongly (please report)"
        )
    files = planned.files
    file_of = planned.file_of.tolist()
    index_in_file = planned.index_in_file.tolist()
    for global_index, piece in enumerate(pieces):
        if (
            piece.path != files[file_of[global_index]]
            or piece.row_group != index_in_file[global_index]
        ):
            raise PlanMismatchError(
                f"row group {global_index}: petastorm reads {piece.path} #{piece.row_group}, "
                f"the plan {files[file_of[global_index]]} #{index_in_file[global_index]}: "
                "the dataset changed since planning, or ddp_even lists it wrongly (please report)"
            )
