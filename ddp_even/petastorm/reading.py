"""What a petastorm reader reads: its row groups, the dataset's, what it was built from, and
the plan of its batches from the Parquet footers.

:class:`ReaderReading` is the :class:`~ddp_even.sources.base.PassReading` of every pass over a
petastorm reader or loader. Petastorm keeps most of it private (attributes listed in
``ddp_even/petastorm/__init__.py``); what a reader hides is said, not guessed: a process pool
keeps the workers' settings (``seed``, ``shuffle_rows``, ``transform_spec``, ``filters``) in
its worker processes, so a provenance names them :class:`~ddp_even.planning.provenance.Untold`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

import pyarrow.filesystem
import pyarrow.parquet as pq
from petastorm.reader import Reader
from petastorm.workers_pool.process_pool import ProcessPool
from petastorm.workers_pool.thread_pool import ThreadPool

from ddp_even.errors import DatasetError
from ddp_even.planning.plans import ShardPlan
from ddp_even.planning.provenance import Provenance, Untold
from ddp_even.sources.base import PassReading

__all__ = ["ReaderReading", "round_robin_plan", "row_groups_read_by"]

logger = logging.getLogger("ddp_even")

# A process pool's workers are other processes, started with the reader's settings.
_HIDDEN_BY_PROCESSES = "a process pool keeps it in its worker processes"
# Petastorm's row-group index (``petastorm.etl.rowgroup_indexing.ROWGROUPS_INDEX_KEY``): a
# ``rowgroup_selector`` reads it, and leaves row groups out before the reader shards.
_ROW_GROUP_INDEX_KEY = b"dataset-toolkit.rowgroups_index.v1"
# The workers' constructor arguments (``Reader.__init__``'s ``worker_args``), by position.
_ROW_GROUPS, _TRANSFORM_SPEC, _FILTERS, _SHUFFLE_ROWS, _SEED = 4, 6, 8, 9, 10


def row_groups_read_by(reader: Reader) -> frozenset[int]:
    """The global row-group indices ``reader`` reads."""
    return frozenset(int(item["piece_index"]) for item in _ventilated_items(reader))


def _ventilated_items(reader: Reader) -> list[dict[str, Any]]:
    """The reader's work items, copied in one step: ``list()`` of a list runs no Python code
    that would let the ventilator thread shuffle it half-way through the copy."""
    return list(reader.ventilator._items_to_ventilate)


def _a_worker(reader: Reader) -> Any:
    """One of the reader's workers (they share their settings), or None in a process pool."""
    pool = reader._workers_pool
    if isinstance(pool, ThreadPool):
        return pool._workers[0]._worker_impl if pool._workers else None
    return getattr(pool, "_worker", None)  # DummyPool's; a process pool has none here


class ReaderReading(PassReading):
    """What a pass over a petastorm ``reader`` (wrapped in ``loader``, if any) reads."""

    def __init__(self, reader: Reader, row_groups: frozenset[int], loader: Any = None) -> None:
        self._reader = reader
        self._loader = loader
        self.row_groups = row_groups

    def dataset_row_groups(self) -> int:
        return len(self._pieces)

    def selects(self) -> bool:
        dataset = self._reader.dataset
        summary = dataset._common_metadata
        indexed = summary is not None and _ROW_GROUP_INDEX_KEY in (summary.metadata or {})
        return bool(dataset._partitions) or indexed

    def provenance(self) -> Provenance:
        return self._provenance

    # Worked out once, when first asked (a state saved, a resume checked).
    @functools.cached_property
    def _provenance(self) -> Provenance:
        reader, loader = self._reader, self._loader
        items = _ventilated_items(reader)
        worker = _a_worker(reader)

        def worker_setting(position: int) -> Any:
            return Untold(_HIDDEN_BY_PROCESSES) if worker is None else worker.args[position]

        return Provenance.of(
            data=self._data_identity(),
            reader="make_batch_reader" if reader.is_batched_reader else "make_reader",
            shard=tuple(sorted(self.row_groups)),
            num_epochs=reader.num_epochs,
            ngram=reader.ngram,
            schema_fields=tuple(reader.schema.fields),
            predicate=items[0]["worker_predicate"] if items else None,
            transform_spec=worker_setting(_TRANSFORM_SPEC),
            filters=worker_setting(_FILTERS),
            seed=worker_setting(_SEED),
            shuffle_row_groups=bool(reader.ventilator._randomize_item_order),
            shuffle_rows=worker_setting(_SHUFFLE_ROWS),
            shuffle_row_drop_partitions=(
                items[0]["shuffle_row_drop_partition"][1] if items else None
            ),
            loader=None if loader is None else type(loader).__qualname__,
            batch_size=None if loader is None else loader.batch_size,
            shuffling_queue_capacity=getattr(loader, "shuffling_queue_capacity", None),
        )

    def unrepeatable(self) -> str | None:
        if getattr(self._loader, "shuffling_queue_capacity", 0):
            return "its loader's shuffling queue mixes rows at random"
        reader = self._reader
        if reader.ventilator._randomize_item_order:
            worker = _a_worker(reader)
            if worker is None:
                return "it shuffles row groups, and its process pool hides whether with a seed"
            if worker.args[_SEED] is None:
                return "it shuffles row groups without a seed"
        pool = reader._workers_pool  # a planned reader's hands out in order: not one of these
        if isinstance(pool, ThreadPool | ProcessPool) and pool.workers_count > 1:
            return f"its {pool.workers_count} workers hand row groups out as they finish"
        return None

    def plan_for(self, rank: int, world_size: int) -> ShardPlan | None:
        # Only loaders batch rows predictably; a reader's items are rows or row groups.
        if self._loader is None:
            return None
        return round_robin_plan(self._reader, self._loader.batch_size, rank, world_size)

    @functools.cached_property
    def _pieces(self) -> list[Any]:
        """Petastorm's list of the dataset's row groups (one piece each), as the reader has it."""
        worker = _a_worker(self._reader)
        if worker is not None:
            return list(worker.args[_ROW_GROUPS])
        from petastorm.etl.dataset_metadata import load_row_groups

        return list(load_row_groups(self._reader.dataset))

    def _data_identity(self) -> bytes | Untold:
        """The files, their row groups and their footers, read through the reader's own
        filesystem: another dataset, or this one rewritten, has another."""
        from ddp_even.parquet.metadata import footer_digest

        pieces = self._pieces
        paths = list(dict.fromkeys(str(piece.path) for piece in pieces))
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(f"{piece.path}#{piece.row_group}\n".encode())
        try:
            for path in paths:
                with self._reader.dataset._fs.open(path, "rb") as file:
                    digest.update(footer_digest(pq.read_metadata(file)))
        except Exception as error:  # any filesystem's failure: what cannot be read is untold
            return Untold(f"its footers could not be read again ({error})")
        return digest.digest()


def round_robin_plan(
    reader: Reader, batch_size: int, rank: int, world_size: int
) -> ShardPlan | None:
    """The plan of a reader built with ``cur_shard=rank, shard_count=world_size``, or None
    where its rows may not follow from the footers (:func:`_why_rows_unknown` says why) or it
    reads other row groups than the round robin's.

    Every rank's reader is built alike, so rank 0 alone says what was found, unless a rank's
    finding is its own (another shard, metadata it could not read).
    """
    why_not = _why_rows_unknown(reader)
    said_by_this_rank = rank == 0
    if why_not is None:
        paths = reader.dataset.paths
        try:
            key = paths if isinstance(paths, str) else tuple(paths)
            plan = _footer_plan(key, _local_stamps(paths), world_size, batch_size)
        except (DatasetError, OSError) as error:
            why_not = f"rank {rank} could not read its metadata again ({error})"
            said_by_this_rank = True
        else:
            if row_groups_read_by(reader) == frozenset(plan.shards[rank]):
                if said_by_this_rank:
                    logger.info(
                        "ddp_even: batches per rank follow from the Parquet footers (%s): one "
                        "agreement per epoch; between steps only checks, spaced out and not "
                        "waited for, that no source failed",
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


def _local_stamps(paths: str | list[str]) -> tuple[tuple[str, int, int, int], ...]:
    """Every file under ``paths`` (local) with its inode, size and modification time: what a
    plan of their footers is worked out from. A stat each: an epoch plans again from them."""
    stamps = []
    for path in [paths] if isinstance(paths, str) else paths:
        files = [path]
        if os.path.isdir(path):
            files = sorted(
                os.path.join(root, name) for root, _, names in os.walk(path) for name in names
            )
        for file in files:
            info = os.stat(file)
            stamps.append((file, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(stamps)


@functools.lru_cache(maxsize=8)
def _footer_plan(
    paths: str | tuple[str, ...],
    stamps: tuple[tuple[str, int, int, int], ...],
    world_size: int,
    batch_size: int,
) -> ShardPlan:
    """The round robin of the dataset at ``paths``, kept while its files' ``stamps`` stay (a
    file added, removed or rewritten plans again): planning reads every footer, in threads
    that would compete with the reader's at every epoch's start."""
    from ddp_even.parquet.dataset_plan import plan_dataset

    return plan_dataset(paths, world_size, batch_size).plan


def _why_rows_unknown(reader: Reader) -> str | None:
    """What may drop or add rows, or hides whether it does (a process pool its transform)."""
    items = _ventilated_items(reader)
    worker = _a_worker(reader)
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
    # _fs: the public .fs of pyarrow 14's legacy ParquetDataset warns (FutureWarning).
    if not isinstance(reader.dataset._fs, pyarrow.filesystem.LocalFileSystem):
        return "the dataset is not on the local disk"
    return None
