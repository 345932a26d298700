"""The reader and loader options a planned pass accepts, refuses, or reads its order from.

``make_shard_factory`` passes petastorm's own options on, except those that would make the plan
wrong or that it sets itself (each refused with the reason), and says why a pass may read in
another order than :mod:`ddp_even.planning.pass_order` computes (which resuming relies on).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Literal

from ddp_even.planning.pass_order import PassOrder
from ddp_even.planning.sharding import SHARDINGS, Sharding

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan

#: What ``factory()`` wraps around the reader: ``petastorm.pytorch.BatchedDataLoader``,
#: ``petastorm.pytorch.DataLoader``, or nothing (iterate the reader itself).
LoaderKind = Literal["batched_dataloader", "dataloader", "reader"]
#: ``"batch"``: ``make_batch_reader`` (plain Parquet); ``"row"``: ``make_reader`` (Unischema).
ReaderKind = Literal["batch", "row"]

_LOADER_KINDS: tuple[LoaderKind, ...] = ("batched_dataloader", "dataloader", "reader")
_READER_KINDS: tuple[ReaderKind, ...] = ("batch", "row")

__all__ = [
    "READING_ORDER_OPTIONS",
    "LoaderKind",
    "ReaderKind",
    "check_kinds",
    "check_loader_options",
    "check_reader_options",
    "why_not_in_plan_order",
]

# Options this module sets itself, or that would make the plan wrong; each with the reason.
_REFUSED_READER_OPTIONS = {
    "cur_shard": "sharding follows the plan; pass rank and world_size instead",
    "shard_count": "sharding follows the plan; pass rank and world_size instead",
    "shard_seed": "sharding follows the plan; use seed to shuffle the reading order",
    "num_epochs": "each factory() call reads one pass; call it again for the next pass",
    "rowgroup_selector": "it changes which row groups exist; the plan cannot follow it",
    "filters": "petastorm 0.12.1 applies filters only to partition directories; the plan does not",
    "pyarrow_serialize": "it is deprecated in petastorm and has no effect",
}

# Reader options that decide which rows a pass reads and in which order: a saved state of one
# loader does not fit another whose options differ (its provenance names them).
READING_ORDER_OPTIONS = (
    "schema_fields",
    "seed",
    "shuffle_rows",
    "shuffle_row_groups",
    "shuffle_row_drop_partitions",
    "transform_spec",
)

_ACCEPTED_READER_OPTIONS = (
    "schema_fields",
    "reader_pool_type",
    "workers_count",
    "results_queue_size",
    "seed",
    "shuffle_rows",
    "shuffle_row_groups",
    "shuffle_row_drop_partitions",
    "cache_type",
    "cache_location",
    "cache_size_limit",
    "cache_row_size_estimate",
    "cache_extra_settings",
    "hdfs_driver",
    "transform_spec",
    "zmq_copy_buffers",
    # Taken out before the reader is built: they choose the filesystem for planning too,
    # and the predicate is counted before planning.
    "storage_options",
    "filesystem",
    "predicate",
)


def check_kinds(loader: object, reader: object) -> None:
    """``ValueError`` unless ``loader`` is a :data:`LoaderKind` and ``reader`` a :data:`ReaderKind`.

    Example:
        >>> check_kinds("dataloader", "row")
        >>> check_kinds("torch", "batch")
        Traceback (most recent call last):
        ...
        ValueError: loader must be one of batched_dataloader, dataloader, reader; got 'torch'
    """
    if loader not in _LOADER_KINDS:
        raise ValueError(f"loader must be one of {', '.join(_LOADER_KINDS)}; got {loader!r}")
    if reader not in _READER_KINDS:
        raise ValueError(f"reader must be one of {', '.join(_READER_KINDS)}; got {reader!r}")


def why_not_in_plan_order(
    reader_options: dict[str, Any], loader_options: dict[str, Any], plan: ShardPlan
) -> str | None:
    """Why a pass may hand out rows in another order than :class:`PassOrder` computes, or None.

    Without a reason, rank ``r`` has read the first ``step * batch_size`` rows of
    ``order.rows(plan, sizes, r, epoch)`` after ``step`` steps (a row offset inside a row group
    included), which resuming without reading them again, and elastic resume, rely on.
    """
    if reader_options.get("shuffle_row_drop_partitions", 1) > 1:
        return (
            "row groups are read as separate parts (shuffle_row_drop_partitions > 1), and a "
            "row offset does not say which parts were read"
        )
    order = PassOrder(reader_options.get("seed"), reader_options.get("shuffle_row_groups", True))
    unordered = order.why_not_known(plan, bool(reader_options.get("shuffle_rows", False)))
    if unordered is not None:
        return unordered
    if (
        reader_options.get("reader_pool_type", "thread") == "process"
        and reader_options.get("workers_count", 10) != 1
    ):
        return (
            "a process pool with several workers delivers row groups in the order they finish "
            "(pass reader_pool_type='thread' or 'dummy', or workers_count=1, in reader_kwargs)"
        )
    if loader_options.get("shuffling_queue_capacity", 0):
        return "the loader's shuffling queue mixes rows (shuffling_queue_capacity)"
    return None


def check_reader_options(options: dict[str, Any], sharding: Sharding) -> dict[str, Any]:
    if SHARDINGS[sharding].splits_row_groups and options.get("shuffle_row_drop_partitions", 1) != 1:
        raise ValueError(
            "shuffle_row_drop_partitions is not supported with sharding='rows', which already "
            "splits row groups into ranges; use shuffle_rows=True to shuffle inside row groups"
        )
    for name in options:
        if name in _REFUSED_READER_OPTIONS:
            raise ValueError(
                f"reader option {name!r} is not supported: {_REFUSED_READER_OPTIONS[name]}"
            )
        if name not in _ACCEPTED_READER_OPTIONS:
            raise ValueError(
                f"unknown reader option {name!r}; accepted: {', '.join(_ACCEPTED_READER_OPTIONS)}"
            )
    if options.get("schema_fields") is not None:
        from petastorm.ngram import NGram

        if isinstance(options["schema_fields"], NGram):
            raise ValueError(
                "schema_fields=NGram(...) is not supported: an NGram yields windows, not rows, "
                "so batches per rank cannot be planned"
            )
    return options


def check_loader_options(loader: LoaderKind, options: dict[str, Any]) -> dict[str, Any]:
    if loader == "reader":
        if options:
            raise ValueError(
                "loader_kwargs need a loader: use loader='dataloader' or 'batched_dataloader'"
            )
        return options
    from petastorm import pytorch

    loader_class = (
        pytorch.BatchedDataLoader if loader == "batched_dataloader" else pytorch.DataLoader
    )
    accepted = [name for name in inspect.signature(loader_class).parameters if name != "reader"]
    for name in options:
        if name == "batch_size":
            raise ValueError("pass batch_size to make_shard_factory, not in loader_kwargs")
        if name not in accepted:
            raise ValueError(
                f"unknown option {name!r} for {loader_class.__name__}; accepted: "
                f"{', '.join(n for n in accepted if n != 'batch_size')}"
            )
    return options
