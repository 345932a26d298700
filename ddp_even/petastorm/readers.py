"""Plan a dataset's shards and make the factory of this rank's passes over its shard.

:func:`make_shard_factory` plans (:mod:`ddp_even.planning`), checks the reader and loader
options, and returns a :class:`PlannedPasses`: each call builds a fresh reader that follows the
plan (:mod:`ddp_even.petastorm.planned_reader`, which imports petastorm when a reader is built)
wrapped in petastorm's loader.

A row ``predicate`` is counted before planning (:mod:`ddp_even.parquet.predicate_counts`)
and then applied by the readers as petastorm applies it. Reader options the plan cannot honour
are refused with a ``ValueError``: ``rowgroup_selector`` and ``filters`` change which rows
exist; ``cur_shard``, ``shard_count``, ``shard_seed`` and ``num_epochs`` are set here; an
``NGram`` in ``schema_fields`` turns rows into windows; ``shuffle_row_drop_partitions`` with
``sharding="rows"`` or a predicate. A ``transform_spec`` is passed on, but must not drop
rows (the plan counts rows).

Remote datasets (``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, fsspec URLs) are planned and
read through one filesystem, resolved by :mod:`ddp_even.storage.resolve` from the URL,
``storage_options`` or ``filesystem`` (given as arguments or, as petastorm names them, in
``reader_kwargs``); petastorm gets it as the legacy filesystem it needs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ddp_even.checks import taken_once
from ddp_even.errors import PlanMismatchError
from ddp_even.modes import MODES
from ddp_even.parquet.dataset_plan import DatasetPlan, PredicateCounting, plan_dataset
from ddp_even.parquet.metadata import changed_row_groups
from ddp_even.parquet.predicates import is_expression
from ddp_even.petastorm.planned_reader import build_reader, count_matching
from ddp_even.petastorm.reader_options import (
    READING_ORDER_OPTIONS,
    LoaderKind,
    ReaderKind,
    check_kinds,
    check_loader_options,
    check_reader_options,
    why_not_in_plan_order,
)
from ddp_even.planning.pass_order import PassOrder, epoch_seed, pass_rows
from ddp_even.planning.plans import ShardPlan
from ddp_even.planning.provenance import Provenance
from ddp_even.planning.row_groups import RowGroups
from ddp_even.planning.sharding import Sharding, sharding_from
from ddp_even.sources import PlannedSource
from ddp_even.storage import DatasetLocation, ResolvedDataset, StorageOptions

if TYPE_CHECKING:
    from ddp_even.agreement.transport import Agreer

__all__ = ["PlannedPasses", "make_shard_factory", "petastorm_url"]

logger = logging.getLogger("ddp_even")


def make_shard_factory(
    dataset: DatasetLocation,
    rank: int,
    world_size: int,
    batch_size: int,
    *,
    sharding: Sharding = "round_robin",
    balanced: bool | None = None,
    loader: LoaderKind = "batched_dataloader",
    reader: ReaderKind = "batch",
    reader_kwargs: Mapping[str, Any] | None = None,
    loader_kwargs: Mapping[str, Any] | None = None,
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
    predicate: Any = None,
    agreer: Agreer | None = None,
) -> tuple[ShardPlan, PlannedPasses]:
    """Plan the shards of ``dataset`` and return ``(plan, factory)`` for ``rank``.

    ``factory(epoch=0)`` builds a fresh petastorm reader (``num_epochs=1``) over exactly
    ``plan.row_groups_of(rank)`` (and, with ``sharding="rows"``, only the rows
    ``plan.row_ranges_of(rank)`` gives it of split row groups), wraps it in the chosen loader
    with ``batch_size``, and returns that loader (or the reader itself with
    ``loader="reader"``); leaving its ``with`` block stops the reader, and
    :class:`~ddp_even.EvenLoader` does the same when it is given the factory (it passes the
    epoch number). ``sharding`` is explained in :mod:`ddp_even.planning.sharding`
    (``balanced=True`` is its deprecated spelling ``"row_groups"``). A ``seed`` in
    ``reader_kwargs`` is mixed with the epoch, so that each epoch shuffles differently but
    reproducibly; with ``"replicate"`` it is mixed with the rank too, and every rank reads
    every row group in its own order (seed 0 when none is given). With a seed, the shuffles
    are ddp_even's own, not petastorm's (:mod:`ddp_even.planning.pass_order`):
    ``shuffle_row_groups`` (on by default) permutes the shard's row groups, ``shuffle_rows``
    each row group's rows (the same permutation on every rank); several thread workers
    (``workers_count``) still hand out row groups in that order. So every pass of an epoch
    reads the same rows in the same order. Without a seed ``shuffle_row_groups`` is
    petastorm's, and ``shuffle_rows`` shuffles each kept range at random. ``reader_kwargs``
    go to the petastorm reader (see the module docstring for the few that are refused),
    ``loader_kwargs`` to the loader (for example ``shuffling_queue_capacity``). With
    ``loader="reader"`` the plan's batches assume you batch the rows yourself with
    ``batch_size``. ``storage_options`` (a dict, as petastorm and
    fsspec take it) or ``filesystem`` (a ``pyarrow.fs`` or fsspec filesystem) reach remote
    storage; both plan and readers use them (see :mod:`ddp_even.storage.resolve`).

    ``predicate`` (a petastorm row predicate, also accepted in ``reader_kwargs``) is counted
    before planning: the rows it keeps in each row group are counted by reading its columns
    only, and the plan shares out the matching rows (see
    :mod:`ddp_even.parquet.predicate_counts`, which also caches the counts). ``agreer``, the
    ranks' agreement (:mod:`ddp_even.agreement.transport`), spreads that scan over them (each
    counts ``1/W`` of the row groups, then they all-gather the counts); without it this process
    counts every row group itself. The factory keeps it for the loader to go on with.

    Every rank computes the same plan from the same metadata, so no communication is needed.
    Raises ``ValueError`` when petastorm could not build the readers (more ranks than row
    groups with round robin) or for a refused option, and
    :class:`~ddp_even.errors.DatasetError` when the dataset cannot be read.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=2)
        >>> plan, factory = make_shard_factory(root, rank=1, world_size=2, batch_size=4,
        ...     sharding="rows", reader_kwargs={"reader_pool_type": "dummy"})
        >>> with factory() as shard_pass:
        ...     rows = sum(len(batch["x"]) for batch in shard_pass)
        >>> rows == plan.rows_per_rank[1]
        True
    """
    check_kinds(loader, reader)
    options = check_reader_options(dict(reader_kwargs or {}), sharding_from(sharding, balanced))
    storage_options = taken_once("storage_options", storage_options, options)
    filesystem = taken_once("filesystem", filesystem, options)
    predicate = taken_once("predicate", predicate, options)
    if is_expression(predicate):
        raise TypeError(
            "petastorm applies petastorm predicates (petastorm.predicates.in_lambda, ...), not "
            "a pyarrow expression: pass engine='arrow' to filter with it"
        )
    if predicate is not None and options.get("shuffle_row_drop_partitions", 1) != 1:
        raise ValueError(
            "shuffle_row_drop_partitions is not supported with a predicate: the plan counts the "
            "rows it keeps per row group, not per part"
        )
    loader_options = check_loader_options(loader, dict(loader_kwargs or {}))
    url = petastorm_url(dataset)
    counting = None
    if predicate is not None:
        counting = PredicateCounting(
            predicate,
            kind=reader.encode(),
            on_columns=reader == "batch",
            by_reader=functools.partial(
                _count_by_reader, url, reader, predicate=predicate, options=options
            ),
        )
        options["predicate"] = predicate
    planned = plan_dataset(
        dataset,
        world_size,
        batch_size,
        sharding=sharding_from(sharding, balanced),
        storage_options=storage_options,
        filesystem=filesystem,
        counting=counting,
        rank=rank,
        share=agreer.gather_counts if agreer is not None else None,
    )
    plan, row_groups, resolved = planned.plan, planned.row_groups, planned.resolved
    plan.row_groups_of(rank)  # checks rank
    if plan.petastorm_error is not None:
        raise ValueError(f"{plan.describe_too_many_ranks()}. Use fewer ranks or sharding='rows'")
    if plan.empty_ranks and rank == 0:
        # Logged once (rank 0), since every rank computes the same plan.
        logger.warning(
            "ddp_even: rank(s) %s get no batch from %s: %s",
            ", ".join(map(str, plan.empty_ranks)),
            resolved.describe(),
            "; ".join(f"{mode}: {plan.stats(mode).note}" for mode in MODES),
        )

    sizes = row_groups.num_rows.tolist()
    order = PassOrder(options.get("seed"), bool(options.get("shuffle_row_groups", True)))

    def build(epoch: int, shard_plan: ShardPlan | None) -> Any:
        # The seed is the epoch's, also for a re-planned rest of the epoch: its row shuffle
        # (shuffle_rows) must cut each row group as the interrupted pass did.
        seed = epoch_seed(options.get("seed"), epoch, rank, plan)
        epoch_options = {**options, "seed": seed}
        if shard_plan is None:
            shard_plan = plan
            rows = (
                order.rows(plan, sizes, rank, epoch)
                if order.is_known(plan)
                else pass_rows(plan, rank, sizes, None)  # petastorm shuffles it, unseeded
            )
        else:
            # Another plan (a re-planned rest, remainder.py) is read in its own order.
            rows = pass_rows(shard_plan, rank, sizes, None)
        changed = changed_row_groups(
            resolved, planned.footers, sorted({group for group, _, _ in rows})
        )
        if changed is not None:
            # Before any row is read, so that it reaches every rank at the epoch's agreement.
            raise PlanMismatchError(
                f"{changed}: the dataset changed since it was planned. Plan again (a new "
                "EvenLoader.from_parquet or make_shard_factory)"
            )
        petastorm_reader = build_reader(
            url,
            resolved,
            reader,
            row_groups,
            shard_plan,
            rank,
            epoch_options,
            rows=rows,
            petastorm_shuffles=not order.is_known(plan),
        )
        try:
            return _build_loader(petastorm_reader, loader, batch_size, loader_options)
        except BaseException:
            petastorm_reader.stop()
            petastorm_reader.join()
            raise

    why_not = why_not_in_plan_order(options, loader_options, plan)
    provenance = Provenance.of(
        data=planned.footers.identity(),
        predicate=predicate,
        reader=reader,
        **{name: options.get(name) for name in READING_ORDER_OPTIONS},
        loader=loader,
        loader_options=loader_options,
        batch_size=batch_size,
        sharding=plan.sharding,
    )
    return plan, PlannedPasses(build, planned, why_not, order, provenance, agreer)


class PlannedPasses(PlannedSource):
    """The factory :func:`make_shard_factory` returns: a fresh loader per call.

    ``passes(epoch=N)`` reads this rank's shard of ``plan`` for epoch ``N`` in the order
    ``order`` gives (the epoch seeds the shuffles); ``passes(epoch=N, shard_plan=rest)`` reads
    this rank's pieces of a re-planned rest of epoch ``N`` (from
    :mod:`ddp_even.resume.remainder`: the rows not yet read, on as many or on another number
    of ranks), in the order its ``row_ranges`` list them, with epoch ``N``'s row shuffle.
    """

    def __init__(
        self,
        build: Callable[[int, ShardPlan | None], Any],
        dataset_plan: DatasetPlan,
        why_not_in_plan_order: str | None,
        order: PassOrder,
        provenance: Provenance,
        agreer: Agreer | None = None,
    ) -> None:
        super().__init__(dataset_plan, order, why_not_in_plan_order, provenance, agreer)
        self._build = build

    def __call__(self, epoch: int = 0, shard_plan: ShardPlan | None = None) -> Any:
        return self._build(epoch, shard_plan)


def _count_by_reader(
    url: str | list[str],
    reader: ReaderKind,
    resolved: ResolvedDataset,
    row_groups: RowGroups,
    indices: Sequence[int],
    fields: list[str],
    *,
    predicate: Any,
    options: dict[str, Any],
) -> list[int]:
    """A predicate's kept rows counted through petastorm's own worker (a row reader's
    decoded fields, hive partition keys): what the pipeline cannot count from columns."""
    return count_matching(url, resolved, reader, row_groups, indices, predicate, fields, options)


def petastorm_url(dataset: DatasetLocation) -> str | list[str]:
    """The URL (or list of URLs) petastorm needs for ``dataset``: paths become ``file://`` URLs.

    Paths are not percent-encoded, because petastorm does not decode them.

    Example:
        >>> petastorm_url("/data/set=1")
        'file:///data/set=1'
        >>> petastorm_url(["file:///a.parquet", "/b.parquet"])
        ['file:///a.parquet', 'file:///b.parquet']
    """
    if isinstance(dataset, str | os.PathLike):
        return _one_url(dataset)
    return [_one_url(item) for item in dataset]


def _one_url(location: str | os.PathLike[str]) -> str:
    text = os.fspath(location)
    if "://" in text or text.startswith("file:"):
        return text
    return "file://" + os.path.abspath(text)


def _build_loader(
    petastorm_reader: Any, loader: LoaderKind, batch_size: int, options: dict[str, Any]
) -> Any:
    if loader == "reader":
        return petastorm_reader
    from petastorm import pytorch

    if loader == "batched_dataloader":
        return pytorch.BatchedDataLoader(petastorm_reader, batch_size=batch_size, **options)
    return pytorch.DataLoader(petastorm_reader, batch_size=batch_size, **options)
