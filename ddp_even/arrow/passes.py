"""A rank's planned passes, read with pyarrow: the options, the plan, the factory.

:func:`make_shard_factory` takes what ``EvenLoader.from_parquet`` takes and returns ``(plan,
factory)``: every sharding, predicates, seeded shuffles, exact and elastic resume, every mode,
the statistics and every store hold alike. It plans through
:func:`~ddp_even.parquet.dataset_plan.plan_dataset`; each call of the factory is one pass
(:class:`~ddp_even.arrow.reader.ArrowPass`). Its options (``reader_kwargs``,
``loader_kwargs``) are listed in docs/using.md ("The reader"); an option of petastorm's own
reader is refused in one line that says how to get the same here.
"""

from __future__ import annotations

import difflib
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ddp_even.arrow.columns import Decoding
from ddp_even.arrow.reader import ArrowPass, PassRows
from ddp_even.checks import check_positive_int, taken_once
from ddp_even.errors import PlanMismatchError
from ddp_even.modes import MODES
from ddp_even.parquet.dataset_plan import DatasetPlan, PredicateCounting, plan_dataset
from ddp_even.parquet.metadata import changed_row_groups
from ddp_even.parquet.predicates import check_predicate, dataset_schema, predicate_fields
from ddp_even.planning.pass_order import PassOrder, epoch_seed, pass_rows
from ddp_even.planning.plans import ShardPlan
from ddp_even.planning.provenance import Provenance
from ddp_even.planning.sharding import Sharding, sharding_from
from ddp_even.sources import PlannedSource
from ddp_even.storage import DatasetLocation, ResolvedDataset, StorageOptions, resolve_dataset

if TYPE_CHECKING:
    from ddp_even.parquet.predicate_counts import Share

__all__ = ["ArrowPasses", "make_shard_factory"]

logger = logging.getLogger("ddp_even")

_READER_OPTIONS = {
    "schema_fields",
    "seed",
    "shuffle_row_groups",
    "shuffle_rows",
    "predicate",
    "storage_options",
    "filesystem",
    "transform_spec",
}
_LOADER_OPTIONS = {"prefetch", "threads", "pin_memory"}
_THREADS_INSTEAD = "from_parquet reads with threads of its own: loader_kwargs={'threads': N}"
_LOCAL_COPY = "petastorm's local cache; read a local copy of the dataset instead"
_IN_THE_LOOP = "batches are dicts of tensors: transform them in the training loop"
# Options of petastorm's own reader and loaders, and how to get the same here.
_PETASTORM_ONLY = {
    "reader_pool_type": _THREADS_INSTEAD,
    "workers_count": _THREADS_INSTEAD,
    "results_queue_size": "row groups in flight: loader_kwargs={'prefetch': N}",
    "shuffle_row_drop_partitions": "shuffle rows inside row groups: shuffle_rows=True",
    "shuffling_queue_capacity": "shuffle rows inside row groups: reader_kwargs shuffle_rows=True",
    **dict.fromkeys(["cache_type", "cache_location", "cache_size_limit"], _LOCAL_COPY),
    **dict.fromkeys(["cache_row_size_estimate", "cache_extra_settings"], _LOCAL_COPY),
    "hdfs_driver": "HDFS is read through pyarrow.fs: pass filesystem= or storage_options=",
    "zmq_copy_buffers": "petastorm's process pool: " + _THREADS_INSTEAD,
    **dict.fromkeys(["collate_fn", "transform_fn"], _IN_THE_LOOP),
    **dict.fromkeys(["cur_shard", "shard_count"], "sharding follows the plan (sharding=)"),
    "shard_seed": "sharding follows the plan: seed= shuffles the reading order",
    "num_epochs": "each pass reads one epoch's shard; EvenLoader runs the epochs",
    "rowgroup_selector": "it changes which row groups exist: filter rows with predicate=",
    "filters": "filter rows with predicate= (a pyarrow expression)",
}
_WRAP_YOUR_OWN = (
    "; or build petastorm's reader yourself and wrap it: EvenLoader(lambda: "
    "DataLoader(make_reader(...)))"
)
# Row groups in flight (read, or waiting to be handed out), and threads reading them.
_PREFETCH = 4
_THREADS = 2


def make_shard_factory(
    dataset: DatasetLocation,
    rank: int,
    world_size: int,
    batch_size: int,
    *,
    sharding: Sharding = "round_robin",
    reader: str = "batch",
    reader_kwargs: Mapping[str, Any] | None = None,
    loader_kwargs: Mapping[str, Any] | None = None,
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
    predicate: Any = None,
    share: Share | None = None,
) -> tuple[ShardPlan, ArrowPasses]:
    """Plan the shards of ``dataset`` and return ``(plan, factory)`` for ``rank``, read with
    pyarrow: ``factory(epoch=N)`` is one pass over this rank's shard of epoch ``N``, batches as
    dicts of tensors (see the module's docstring for the options). ``share``, an all-gather
    among the ranks (every rank then calls this together), spreads the count of a predicate's
    rows over them.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=2)
        >>> plan, factory = make_shard_factory(root, rank=1, world_size=2, batch_size=4,
        ...                                    sharding="rows")
        >>> rows = sum(len(batch["x"]) for batch in factory())
        >>> rows == plan.rows_per_rank[1]
        True
    """
    if reader not in ("batch", "row"):
        raise ValueError(
            f"reader must be 'batch' (Parquet's values) or 'row' (a petastorm Unischema "
            f"dataset, decoded by its codecs), got {reader!r}"
        )
    options = _checked(dict(reader_kwargs or {}), _READER_OPTIONS, "reader_kwargs")
    loading = _checked(dict(loader_kwargs or {}), _LOADER_OPTIONS, "loader_kwargs")
    prefetch = loading.get("prefetch", _PREFETCH)
    check_positive_int("prefetch", prefetch)
    threads = loading.get("threads", _THREADS)
    check_positive_int("threads", threads)
    pin_memory = bool(loading.get("pin_memory", False))
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs a CUDA device, and torch sees none")
    storage_options = taken_once("storage_options", storage_options, options)
    filesystem = taken_once("filesystem", filesystem, options)
    predicate = taken_once("predicate", predicate, options)
    if predicate is not None:
        check_predicate(predicate)
    transform_spec = options.get("transform_spec")
    # Resolved once: the Unischema (reader="row") and the plan read the same storage.
    resolved = resolve_dataset(dataset, storage_options=storage_options, filesystem=filesystem)
    decoding = _decoding(resolved, reader, transform_spec)
    planned = plan_dataset(
        resolved,
        world_size,
        batch_size,
        sharding=sharding_from(sharding, None),
        counting=(
            None
            if predicate is None
            else PredicateCounting(predicate, kind=decoding.kind, kept=decoding.kept)
        ),
        rank=rank,
        share=share,
    )
    plan = planned.plan
    plan.row_groups_of(rank)  # checks rank
    if plan.empty_ranks and rank == 0:
        # Logged once (rank 0), since every rank computes the same plan.
        logger.warning(
            "ddp_even: rank(s) %s get no batch from %s: %s",
            ", ".join(map(str, plan.empty_ranks)),
            planned.resolved.describe(),
            "; ".join(f"{mode}: {plan.stats(mode).note}" for mode in MODES),
        )
    schema = dataset_schema(planned.resolved, planned.footers, planned.partitions)
    columns = _columns(options.get("schema_fields"), schema.names, decoding)
    # Integers and booleans with a null anywhere: float in every batch of every rank.
    decoding = decoding.for_dataset(planned.with_nulls)
    order = PassOrder(options.get("seed"), bool(options.get("shuffle_row_groups", True)))
    fields = [] if predicate is None else predicate_fields(predicate, schema)
    passes = ArrowPasses(
        planned,
        rank,
        order,
        functools.partial(
            PassRows,
            planned.resolved,
            planned.row_groups,
            columns=columns,
            predicate=predicate,
            predicate_fields=fields,
            shuffle_rows=bool(options.get("shuffle_rows", False)),
            partitions=planned.partitions,
            decoding=decoding,
        ),
        functools.partial(
            ArrowPass,
            batch_size=batch_size,
            prefetch=prefetch,
            threads=threads,
            pin_memory=pin_memory,
        ),
        order.why_not_known(plan, bool(options.get("shuffle_rows", False))),
        Provenance.of(
            data=planned.footers.identity(),
            predicate=predicate,
            reader="arrow" if reader == "batch" else reader,
            schema_fields=columns,
            seed=options.get("seed"),
            shuffle_rows=options.get("shuffle_rows", False),
            shuffle_row_groups=order.shuffle_row_groups,
            transform_spec=transform_spec,
            batch_size=batch_size,
            sharding=plan.sharding,
        ),
    )
    return plan, passes


class ArrowPasses(PlannedSource):
    """The factory :func:`make_shard_factory` returns: one :class:`ArrowPass` per call, as
    :class:`~ddp_even.sources.base.PlannedSource` says; a re-planned rest of epoch ``N`` keeps
    epoch ``N``'s row shuffle."""

    def __init__(
        self,
        dataset_plan: DatasetPlan,
        rank: int,
        order: PassOrder,
        pass_rows: functools.partial[PassRows],
        open_pass: functools.partial[ArrowPass],
        why_not_in_plan_order: str | None,
        provenance: Provenance,
    ) -> None:
        super().__init__(dataset_plan, order, why_not_in_plan_order, provenance)
        self._rank = rank
        self._pass_rows = pass_rows
        self._open_pass = open_pass
        # Seeds of shuffles the order does not fix (unseeded): one draw per pass.
        self._unseeded = np.random.default_rng()

    def __call__(self, epoch: int = 0, shard_plan: ShardPlan | None = None) -> ArrowPass:
        plan, rank, sizes = self.plan, self._rank, self.row_group_sizes
        seed = epoch_seed(self.order.seed, epoch, rank, plan)
        if shard_plan is not None:
            rows = pass_rows(shard_plan, rank, sizes, None)  # a re-planned rest, in its order
        elif self.order.is_known(plan):
            rows = self.order.rows(plan, sizes, rank, epoch)
        else:
            rows = pass_rows(plan, rank, sizes, int(self._unseeded.integers(2**63)))
        changed = changed_row_groups(
            self.dataset_plan.resolved,
            self.dataset_plan.footers,
            sorted({group for group, _, _ in rows}),
        )
        if changed is not None:
            # Before any row is read, so that it reaches every rank at the epoch's agreement.
            raise PlanMismatchError(
                f"{changed}: the dataset changed since it was planned. Plan again (a new "
                "EvenLoader.from_parquet)"
            )
        return self._open_pass(self._pass_rows(rows=rows, row_seed=seed))


def _checked(options: dict[str, Any], accepted: set[str], where: str) -> dict[str, Any]:
    for name in options:
        if name in _PETASTORM_ONLY:
            raise ValueError(
                f"{where}[{name!r}] is an option of petastorm's own reader, which from_parquet "
                f"does not use: {_PETASTORM_ONLY[name]}{_WRAP_YOUR_OWN}"
            )
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            raise ValueError(
                f"{where}[{name!r}] is not an option of from_parquet's reader"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; it takes {', '.join(sorted(accepted))}"
            )
    return options


def _decoding(resolved: ResolvedDataset, reader: str, transform_spec: Any) -> Decoding:
    """Plain Parquet, or petastorm's decoding on top where ``reader="row"`` or a transform."""
    if reader == "batch" and transform_spec is None:
        return Decoding()
    try:
        # It imports petastorm itself: 0.12.1 fails there on pyarrow 15 and later.
        from ddp_even.petastorm.decoding import PetastormDecoding, read_unischema
    except ImportError as error:  # petastorm missing, or broken on this pyarrow
        # One line, on every rank before planning; petastorm's own traceback says no more.
        raise ImportError(_without_petastorm(reader, error)) from None
    schema = read_unischema(resolved) if reader == "row" else None
    return PetastormDecoding(schema, transform_spec)


def _without_petastorm(reader: str, error: ImportError) -> str:
    """Why ``reader="row"`` (or a ``transform_spec``) cannot be read here, and what to do."""
    import importlib.metadata
    import importlib.util

    import pyarrow as pa

    wanted = "reader='row'" if reader == "row" else "transform_spec"
    instead = (
        "read plain Parquet with reader='batch' (the default), which needs no petastorm"
        if reader == "row"
        else "leave transform_spec out and transform batches in the training loop"
    )
    try:
        found = importlib.util.find_spec("petastorm") is not None
        version = importlib.metadata.version("petastorm") if found else ""
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        found, version = True, ""
    if not found:
        return (
            f"{wanted} is petastorm's and needs petastorm, which is not installed ({error}): "
            f"pip install 'ddp_even[petastorm]' (pyarrow < 15, numpy < 2), or {instead}"
        )
    installed = f"petastorm {version}" if version else "petastorm"
    return (
        f"{wanted} is petastorm's, and {installed} is installed but cannot be imported with "
        f"pyarrow {pa.__version__} ({error}): it needs pyarrow < 15 and numpy < 2 (pip install "
        f"'ddp_even[petastorm]' in an environment with those), or {instead}"
    )


def _columns(
    schema_fields: Sequence[Any] | None, names: Sequence[str], decoding: Decoding
) -> list[str] | None:
    """``schema_fields`` as column names; a ``ValueError`` naming the nearest columns for one
    the dataset lacks (a regular expression, as petastorm's readers take them, with
    ``reader="row"``)."""
    if schema_fields is None:
        return None
    if isinstance(schema_fields, str) or not isinstance(schema_fields, Sequence):
        raise TypeError(
            f"schema_fields must be a list of column names, got {type(schema_fields).__name__}"
        )
    if not schema_fields:
        raise ValueError(
            "schema_fields=[] reads no column: name at least one, or leave schema_fields "
            "out to read every column"
        )
    columns: list[str] = []
    for field in schema_fields:
        name = getattr(field, "name", field)  # a petastorm UnischemaField
        if not isinstance(name, str):
            raise TypeError(f"schema_fields holds {name!r}: name columns with strings")
        if name in names:
            columns.append(name)
            continue
        matched = (
            [column for column in names if re.fullmatch(name, column)]
            if decoding.kind == b"row"
            else []
        )
        if not matched:
            close = difflib.get_close_matches(name, names, n=3)
            raise ValueError(
                f"schema_fields names {name!r}, which the dataset does not have"
                + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                + f"; its columns are: {', '.join(names)}"
                + ("" if decoding.kind == b"row" else ". Regular expressions need reader='row'")
            )
        columns.extend(column for column in matched if column not in columns)
    return columns
