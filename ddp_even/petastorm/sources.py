"""Petastorm loaders and readers as shard sources: the one runtime module that knows petastorm.

* A ``Reader`` can only be ``reset()`` after its last row was read; mid-pass it raises
  ``NotImplementedError``. A pass that stopped early (truncate) is read to its end first.
* A reader with ``num_epochs=None`` never ends: it is never reset nor read to its end; each
  epoch continues it (and needs ``steps_per_epoch``).
* ``petastorm.pytorch.DataLoader`` keeps the rows of its short last batch and emits them
  again at the start of the next pass; the accumulator is emptied before each pass.
* ``DataLoader.__iter__`` resets its reader itself on every pass after the first.
* A reader the loader opened (through a factory) is stopped and joined when its pass ends;
  a reader the user passed in stays theirs to stop.
* Which row groups a reader reads is in its ventilator's items (petastorm has no public
  accessor); sharding and plans are checked against it. The ventilator thread shuffles that
  list in place at the start of each pass, so it is copied in one step before it is read.
* Petastorm's thread pool can end a pass with row groups still in flight
  (:mod:`ddp_even.petastorm.thread_pool`); every reader read here gets the race-free version.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow.filesystem
import torch
from petastorm.pytorch import LoaderBase
from petastorm.reader import Reader
from petastorm.workers_pool.thread_pool import ThreadPool

from ddp_even.petastorm.thread_pool import close_end_of_results_race
from ddp_even.sources.base import ContinuingStream, ShardPass, ShardSource, count_rows

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan

logger = logging.getLogger("ddp_even")


def source_for(obj: Any, *, owned: bool) -> ShardSource[Any]:
    """Wrap a petastorm ``DataLoader``/``BatchedDataLoader`` or ``Reader``."""
    if isinstance(obj, LoaderBase):
        return PetastormLoaderSource(obj, owned=owned)
    if isinstance(obj, Reader):
        return PetastormReaderSource(obj, owned=owned)
    raise TypeError(
        f"unsupported petastorm object {type(obj).__name__}: pass a petastorm.pytorch "
        "DataLoader or BatchedDataLoader, or a reader from make_reader / make_batch_reader"
    )


def _stop(reader: Reader) -> None:
    reader.stop()
    reader.join()


def _read_to_end(reader: Reader) -> None:
    """Let ``reader.reset()`` work after a pass that stopped early."""
    if reader.last_row_consumed:
        return
    leftover = sum(1 for _ in reader)
    logger.info(
        "read %d leftover item(s) of an unfinished petastorm reader so that it can be reset; "
        "pass a factory (lambda: DataLoader(make_reader(...))) to start each pass afresh instead",
        leftover,
    )


def row_groups_read_by(reader: Reader) -> frozenset[int] | None:
    """The global row-group indices ``reader`` reads, or None if petastorm hides them."""
    try:
        items = _ventilated_items(reader)
        return frozenset(int(item["piece_index"]) for item in items)
    except (AttributeError, KeyError, TypeError):
        return None


def _ventilated_items(reader: Reader) -> list[dict[str, Any]]:
    """The reader's work items, copied in one step: ``list()`` of a list runs no Python code
    that would let the ventilator thread shuffle it half-way through the copy."""
    return list(reader.ventilator._items_to_ventilate)


class _PetastormSource(ShardSource[Any]):
    def __init__(self, reader: Reader, *, owned: bool) -> None:
        close_end_of_results_race(getattr(reader, "_workers_pool", None))
        self._reader = reader
        self._owned = owned
        self._passes_opened = 0
        self._stream: ContinuingStream[Any] | None = None

    @property
    def restartable(self) -> bool:
        # A reader the user passed in can be reset (unless it never ends); one a factory
        # made is used for one pass.
        return not self._owned and not self.endless

    @property
    def endless(self) -> bool:
        return self._reader.num_epochs is None

    @property
    def continues(self) -> bool:
        return self.endless and not self._owned

    def check_shard(self, rank: int, world_size: int) -> None:
        read = row_groups_read_by(self._reader)
        if world_size == 1 or not read:
            return
        others = sorted(index for index in read if index % world_size != rank)
        indices = sorted(read)
        spacing = math.gcd(*(b - a for a, b in itertools.pairwise(indices)))
        if others or (spacing and spacing != world_size and spacing % world_size == 0):
            shards = f"shard_count={spacing}" if spacing > 1 else "no cur_shard/shard_count"
            raise ValueError(
                f"rank {rank} of {world_size} was given a petastorm reader of row groups "
                f"{indices[:6]}{'...' if len(indices) > 6 else ''}, which looks like {shards}, "
                f"not rank {rank}'s shard of {world_size}: build it with "
                f"cur_shard={rank}, shard_count={world_size} (rank and world size of the "
                "training group)"
            )

    def _begin_pass(self) -> None:
        if self._passes_opened > 0:
            if self._owned:
                raise RuntimeError("a reader made by a factory serves a single pass")
            _read_to_end(self._reader)
        self._passes_opened += 1

    def _closer(self) -> Any:
        return (lambda: _stop(self._reader)) if self._owned else None

    def open_pass(self) -> ShardPass[Any]:
        row_groups = row_groups_read_by(self._reader)
        count_samples = self._count_samples()
        if self._stream is None:
            self._begin_pass()
            batches = self._fresh_pass()
            if not self.continues:
                return ShardPass(
                    batches,
                    on_close=self._closer(),
                    count_samples=count_samples,
                    row_groups=row_groups,
                    endless=self.endless,
                    plan_for=self._footer_plans(),
                    unrepeatable=self._unrepeatable(),
                )
            self._stream = ContinuingStream(batches)
        # An endless reader: every epoch continues the one stream.
        return self._stream.resume(count_samples=count_samples, row_groups=row_groups, endless=True)

    @abstractmethod
    def _fresh_pass(self) -> Iterator[Any]:
        """The batches of a new pass (``_begin_pass`` has run)."""

    def _count_samples(self) -> Callable[[Any], int | None] | None:
        return None  # the default: rows from the batch's shape

    def _unrepeatable(self) -> str | None:
        """Why two passes of this reader may yield other batches or another order, or None."""
        worker = _a_worker(self._reader)
        seed = None if worker is None else worker.args[10]
        if getattr(self._reader.ventilator, "_randomize_item_order", False) and seed is None:
            return "it shuffles row groups without a seed"
        pool = self._reader._workers_pool  # a planned reader's hands out in order: not this
        if isinstance(pool, ThreadPool) and pool.workers_count > 1:
            return f"its {pool.workers_count} threads hand row groups out as they finish"
        return None

    def _footer_plans(self) -> Callable[[int, int], ShardPlan | None] | None:
        """``plan(rank, world_size)`` from the Parquet footers, where batches may follow from
        them (only loaders batch rows predictably; a reader's items are rows or row groups)."""
        return None


class PetastormLoaderSource(_PetastormSource):
    """A ``petastorm.pytorch.DataLoader`` or ``BatchedDataLoader``."""

    def __init__(self, loader: LoaderBase, *, owned: bool) -> None:
        super().__init__(loader.reader, owned=owned)
        self._loader = loader

    def _footer_plans(self) -> Callable[[int, int], ShardPlan | None]:
        return functools.partial(round_robin_plan, self._reader, self._loader.batch_size)

    def _count_samples(self) -> Callable[[Any], int | None] | None:
        return _rows_of_columns

    def _unrepeatable(self) -> str | None:
        if getattr(self._loader, "shuffling_queue_capacity", 0):
            return "its loader's shuffling queue mixes rows at random"
        return super()._unrepeatable()

    def _fresh_pass(self) -> Iterator[Any]:
        # DataLoader would emit the previous pass's short last batch again (see module doc).
        self._loader._batch_acc = []
        return iter(self._loader)


class PetastormReaderSource(_PetastormSource):
    """A reader from ``make_reader`` (one row per item) or ``make_batch_reader``."""

    def _fresh_pass(self) -> Iterator[Any]:
        if self._passes_opened > 1:
            self._reader.reset()
        return _items(self._reader)

    def _count_samples(self) -> Callable[[Any], int | None] | None:
        return count_rows if self._reader.batched_output else _one_row


def round_robin_plan(
    reader: Reader, batch_size: int, rank: int, world_size: int
) -> ShardPlan | None:
    """The plan of a reader built with ``cur_shard=rank, shard_count=world_size``, or None.

    Its rows follow from the footers when nothing drops or adds rows: no row predicate, no
    ``transform_spec`` (it may drop rows), no NGram, one epoch, the round robin's row groups
    exactly (no ``rowgroup_selector``), on the local disk. Where the reader hides any of that
    (a process pool hides its transform), the lengths are not trusted.

    Every rank's reader is built alike, so rank 0 alone says what was found, unless a rank's
    finding is its own (another shard, metadata it could not read).
    """
    why_not = _why_rows_unknown(reader)
    said_by_this_rank = rank == 0
    if why_not is None:
        from ddp_even.parquet import DatasetError, read_row_groups
        from ddp_even.planning import plan_shards

        try:
            plan = plan_shards(read_row_groups(reader.dataset.paths), world_size, batch_size)
        except DatasetError as error:
            why_not = f"rank {rank} could not read its metadata again ({error})"
            said_by_this_rank = True
        else:
            if row_groups_read_by(reader) == frozenset(plan.shards[rank]):
                if said_by_this_rank:
                    logger.info(
                        "ddp_even: batches per rank follow from the Parquet footers (%s): one "
                        "agreement per epoch, no collective between steps",
                        ", ".join(map(str, plan.batches_per_rank)),
                    )
                return plan
            why_not = f"it does not read rank {rank}'s round-robin shard of {world_size}"
            said_by_this_rank = True
    if said_by_this_rank:
        logger.info(
            "ddp_even: the petastorm reader's batch counts are not known up front: %s", why_not
        )
    return None


def _why_rows_unknown(reader: Reader) -> str | None:
    try:
        items = _ventilated_items(reader)
        # _fs: the public .fs of pyarrow 14's legacy ParquetDataset warns (FutureWarning).
        local = isinstance(reader.dataset._fs, pyarrow.filesystem.LocalFileSystem)
        worker = _a_worker(reader)
    except AttributeError as error:  # another petastorm version: no guess
        return f"its internals are not petastorm 0.12's ({error})"
    if reader.num_epochs != 1:
        return "it reads more than one epoch per pass"
    if reader.ngram is not None:
        return "an NGram yields windows, not rows"
    if any(item.get("worker_predicate") is not None for item in items):
        return "a row predicate drops rows after reading"
    if worker is None:
        return "its worker pool (a process pool) does not show whether a transform_spec is set"
    if getattr(worker, "_transform_spec", None) is not None:
        return "a transform_spec may drop rows"
    if not local:
        return "the dataset is not on the local disk"
    return None


def _a_worker(reader: Reader) -> Any:
    pool = reader._workers_pool
    if hasattr(pool, "_workers"):  # ThreadPool
        return pool._workers[0]._worker_impl if pool._workers else None
    return getattr(pool, "_worker", None)  # DummyPool


def _items(reader: Reader) -> Iterator[Any]:
    yield from reader


def _rows_of_columns(batch: Any) -> int | None:
    """Rows in a petastorm loader's batch: every column holds the same rows, so the first
    tensor column says (7 µs a batch less than asking every column, with 17 of them)."""
    if type(batch) is dict:
        for column in batch.values():
            if isinstance(column, torch.Tensor) and column.ndim > 0:
                return int(column.shape[0])
            break
    return count_rows(batch)


def _one_row(_row: Any) -> int:
    return 1
