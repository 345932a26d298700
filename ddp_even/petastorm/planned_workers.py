"""Petastorm's reader workers, keeping of each row group the rows a shard plan gives the rank.

Imported only when a planned reader is built (it imports petastorm). Each work item of a
planned reader carries ``planned_rows=(expected, ((start, stop), ...))``: the rows the plan
expects the item to yield (after the row predicate, if any) and the ranges of them this rank
keeps (two when it resumes the tails of two ranks' shards on fewer ranks); with several thread
workers it also carries its ``position`` in the ventilation order.
The worker runs petastorm's own ``process`` (reading, the predicate, Unischema decoding, the
transform, the local cache: all unchanged), catches what it publishes, checks its length
against ``expected`` and publishes the kept range (as ``(position, rows)``, exactly once per
numbered item, ``rows`` None when nothing is kept: see
:mod:`ddp_even.petastorm.ordered_results`). A row group the plan splits between ranks is
therefore read whole by each of them (the cost of a split), and every rank keeps a disjoint
range of the same row order.

Petastorm's row shuffle (``shuffle_rows``) is always held back. With a seed (the epoch's) the
worker permutes each row group itself, seeded by ``(seed, row group, part)``, before cutting the
kept ranges: the same permutation on every rank and in every pass of that epoch, so split row
groups stay disjoint and a resumed pass can start at a row offset. Without a seed it shuffles
the kept rows only, after the cut. Petastorm's own shuffle draws from each worker's random
state (which rows it gets depends on which thread read what before), and with a row predicate
petastorm 0.12.1's ``make_batch_reader`` shuffles the predicate's columns and the other columns
with two different permutations, so it returns rows whose columns do not belong together
(measured: 85 of 96 rows; ``tests/test_row_sharding.py`` shows it).

The classes are defined at module level so that petastorm's process pool can pickle them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from petastorm.arrow_reader_worker import ArrowReaderWorker
from petastorm.py_dict_reader_worker import PyDictReaderWorker

from ddp_even.errors import RowCountMismatchError

__all__ = ["PlannedArrowWorker", "PlannedRowWorker"]


class _PlannedRows:
    """What both workers add to petastorm's: the plan's row count check and row range."""

    publish_func: Any
    _shuffle_rows: bool
    _split_pieces: Any

    def __init__(self, worker_id: int, publish_func: Any, args: Any) -> None:
        super().__init__(worker_id, publish_func, args)  # type: ignore[call-arg]
        # The reader's seed (the epoch's): it seeds the row shuffle of each row group.
        self._row_seed: int | None = args[10]

    def process(
        self,
        piece_index: int,
        worker_predicate: Any,
        shuffle_row_drop_partition: tuple[int, int],
        planned_rows: tuple[int, tuple[tuple[int, int], ...]] | None = None,
        position: int | None = None,
    ) -> None:
        if planned_rows is None:
            super().process(piece_index, worker_predicate, shuffle_row_drop_partition)  # type: ignore[misc]
            return
        expected, kept_ranges = planned_rows
        publish, shuffle = self.publish_func, self._shuffle_rows
        published: list[Any] = []
        self.publish_func = published.append
        # Petastorm's own row shuffle is always held back: it draws from each worker's random
        # state, so it depends on which thread read what, and with a predicate it misaligns
        # columns (see the module docstring). The rows are shuffled below instead.
        self._shuffle_rows = False
        try:
            super().process(piece_index, worker_predicate, shuffle_row_drop_partition)  # type: ignore[misc]
        finally:
            self.publish_func, self._shuffle_rows = publish, shuffle
        rows = published[0] if published else None
        count = 0 if rows is None else len(rows)
        if count != expected:
            piece = self._split_pieces[piece_index]
            raise RowCountMismatchError(
                f"row group {piece_index} ({piece.path} #{piece.row_group}) yielded {count} "
                f"rows, the shard plan counted {expected}: the dataset changed since it was "
                "planned, its footers disagree with its data, or the row predicate or transform "
                "is not deterministic. Plan again (a new EvenLoader.from_parquet)"
            )
        if rows is not None and not all(start == stop for start, stop in kept_ranges):
            if shuffle and self._row_seed is not None:
                # The same permutation on every rank, before the ranges are cut: ranks sharing
                # a row group keep disjoint rows, and a resume can start at a row offset.
                key = [self._row_seed, piece_index, shuffle_row_drop_partition[0]]
                rows = self._taken(rows, np.random.default_rng(key).permutation(count))
            if kept_ranges != ((0, expected),):
                rows = self._concatenated([rows[start:stop] for start, stop in kept_ranges])
            if shuffle and self._row_seed is None:
                # Unseeded: only after the cut, or ranks sharing a row group would overlap.
                rows = self._taken(rows, np.random.default_rng().permutation(len(rows)))
        else:
            rows = None
        if position is not None:
            # Exactly one result per numbered item, so the reader can hand them out in order.
            publish((position, rows))
        elif rows is not None:
            publish(rows)

    def _taken(self, rows: Any, order: Any) -> Any:
        raise NotImplementedError

    def _concatenated(self, parts: list[Any]) -> Any:
        raise NotImplementedError


class PlannedArrowWorker(_PlannedRows, ArrowReaderWorker):  # type: ignore[misc]
    """``make_batch_reader``'s worker (rows as a ``pyarrow.Table``) following a plan."""

    def _taken(self, rows: Any, order: Any) -> Any:
        return rows.take(order)

    def _concatenated(self, parts: list[Any]) -> Any:
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


class PlannedRowWorker(_PlannedRows, PyDictReaderWorker):  # type: ignore[misc]
    """``make_reader``'s worker (rows as dicts) following a plan."""

    def _taken(self, rows: Any, order: Any) -> Any:
        return [rows[index] for index in order]

    def _concatenated(self, parts: list[Any]) -> Any:
        return [row for part in parts for row in part]
