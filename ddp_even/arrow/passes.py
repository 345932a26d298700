"""A rank's planned passes read with pyarrow alone: the options, the plan, the factory.

:func:`make_shard_factory` takes what ``EvenLoader.from_parquet`` takes and returns ``(plan,
factory)`` as :func:`ddp_even.petastorm.readers.make_shard_factory` does, so that every
guarantee of the planned path (every sharding, predicates, seeded shuffles, exact and elastic
resume, every mode, the statistics, every store) holds alike. It plans through
:func:`~ddp_even.parquet.dataset_plan.plan_dataset`; each call of the factory is one pass
(:class:`~ddp_even.arrow.reader.ArrowPass`).

Reader options (``reader_kwargs``): ``schema_fields`` (the columns to read, by name), ``seed``,
``shuffle_row_groups`` (on by default, as petastorm's), ``shuffle_rows``, ``predicate`` (a
``pyarrow.compute`` expression, or a petastorm-style predicate called on a pandas frame of its
columns), ``storage_options``, ``filesystem``. Loader options (``loader_kwargs``):
``threads`` (threads reading each row group's columns in parts, 2 by default), ``prefetch``
(row groups in flight, read or waiting, 4 by default: with the batches of one being handed out,
what a pass holds) and ``pin_memory`` (batches in pinned memory, for a GPU). An option only
petastorm has is refused in one line that says so.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ddp_even.arrow.reader import ArrowPass, PassRows
from ddp_even.checks import check_positive_int, taken_once
from ddp_even.errors import PlanMismatchError
from ddp_even.parquet.dataset_plan import DatasetPlan, PredicateCounting, plan_dataset
from ddp_even.parquet.metadata import changed_row_groups
from ddp_even.parquet.predicates import is_expression, predicate_fields
from ddp_even.planning.pass_order import PassOrder, epoch_seed, pass_rows
from ddp_even.planning.plans import ShardPlan
from ddp_even.planning.provenance import Provenance
from ddp_even.planning.sharding import Sharding, sharding_from
from ddp_even.sources import PlannedSource
from ddp_even.storage import DatasetLocation, StorageOptions

if TYPE_CHECKING:
    from ddp_even.agreement.transport import Agreer

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
}
_LOADER_OPTIONS = {"prefetch", "threads", "pin_memory"}
# Petastorm's own options, which this reader has no use for or cannot honour.
_PETASTORM_ONLY = {
    "transform_spec": "a TransformSpec runs in petastorm's workers",
    "reader_pool_type": "pyarrow reads in one thread of its own, with its own thread pool",
    "workers_count": "pyarrow reads in one thread of its own, with its own thread pool",
    "results_queue_size": "the queue holds prefetch row groups (loader_kwargs)",
    "shuffle_row_drop_partitions": "row groups are read whole",
    "cache_type": "petastorm's local cache",
    "cache_location": "petastorm's local cache",
    "cache_size_limit": "petastorm's local cache",
    "cache_row_size_estimate": "petastorm's local cache",
    "cache_extra_settings": "petastorm's local cache",
    "hdfs_driver": "HDFS is read through pyarrow.fs",
    "zmq_copy_buffers": "petastorm's process pool",
    "shuffling_queue_capacity": "petastorm's loader's shuffling queue",
    "collate_fn": "petastorm's row loader",
    "transform_fn": "petastorm's loader",
}
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
    balanced: bool | None = None,
    loader: str = "batched_dataloader",
    reader: str = "batch",
    reader_kwargs: Mapping[str, Any] | None = None,
    loader_kwargs: Mapping[str, Any] | None = None,
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
    predicate: Any = None,
    agreer: Agreer | None = None,
) -> tuple[ShardPlan, ArrowPasses]:
    """Plan the shards of ``dataset`` and return ``(plan, factory)`` for ``rank``, read with
    pyarrow: ``factory(epoch=N)`` is one pass over this rank's shard of epoch ``N``, batches as
    dicts of tensors (see the module's docstring for the options).

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
    if loader != "batched_dataloader" or reader != "batch":
        raise ValueError(
            f"loader={loader!r} and reader={reader!r} are petastorm's (its row loader and "
            "make_reader's Unischema codecs): install ddp_even[petastorm] and pass "
            "engine='petastorm'; pyarrow hands out batches as dicts of tensors"
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
    planned = plan_dataset(
        dataset,
        world_size,
        batch_size,
        sharding=sharding_from(sharding, balanced),
        storage_options=storage_options,
        filesystem=filesystem,
        counting=None if predicate is None else PredicateCounting(predicate, kind=b"arrow"),
        rank=rank,
        share=agreer.gather_counts if agreer is not None else None,
    )
    plan = planned.plan
    plan.row_groups_of(rank)  # checks rank
    columns = options.get("schema_fields")
    if columns is not None:
        columns = [str(name) for name in columns]
        if not columns:
            raise ValueError(
                "schema_fields=[] reads no column: name at least one, or leave schema_fields "
                "out to read every column"
            )
    order = PassOrder(options.get("seed"), bool(options.get("shuffle_row_groups", True)))
    fields: list[str] = []
    if predicate is not None:
        schema = planned.resolved.storage.read_footer(planned.footers.files[0])
        fields = predicate_fields(predicate, schema.schema.to_arrow_schema())
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
            reader="arrow",
            schema_fields=options.get("schema_fields"),
            seed=options.get("seed"),
            shuffle_rows=options.get("shuffle_rows", False),
            shuffle_row_groups=order.shuffle_row_groups,
            batch_size=batch_size,
            sharding=plan.sharding,
        ),
        agreer,
    )
    return plan, passes


class ArrowPasses(PlannedSource):
    """The factory :func:`make_shard_factory` returns: one :class:`ArrowPass` per call.

    ``passes(epoch=N)`` reads this rank's shard of ``plan`` for epoch ``N`` in the order
    ``order`` gives; ``passes(epoch=N, shard_plan=rest)`` this rank's pieces of a re-planned
    rest of epoch ``N`` (:mod:`ddp_even.resume.remainder`), with epoch ``N``'s row shuffle.
    """

    def __init__(
        self,
        dataset_plan: DatasetPlan,
        rank: int,
        order: PassOrder,
        pass_rows: functools.partial[PassRows],
        open_pass: functools.partial[ArrowPass],
        why_not_in_plan_order: str | None,
        provenance: Provenance,
        agreer: Agreer | None,
    ) -> None:
        super().__init__(dataset_plan, order, why_not_in_plan_order, provenance, agreer)
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
                f"{where}[{name!r}] is petastorm's ({_PETASTORM_ONLY[name]}): install "
                "ddp_even[petastorm] and pass engine='petastorm', or leave it out"
            )
        if name not in accepted:
            raise ValueError(
                f"{where}[{name!r}] is not an option of the pyarrow reader; it takes "
                f"{', '.join(sorted(accepted))}"
            )
    predicate = options.get("predicate")
    if (
        predicate is not None
        and not is_expression(predicate)
        and not hasattr(predicate, "do_include")
    ):
        raise TypeError("predicate must be a pyarrow expression or a petastorm-style predicate")
    return options
