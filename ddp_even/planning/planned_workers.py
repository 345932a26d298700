"""Petastorm's reader workers, keeping of each row group the rows a shard plan gives the rank.

Imported only when a planned reader is built (it imports petastorm). Each work item of a
planned reader carries ``planned_rows=(expected, ((start, stop), ...))``: the rows the plan
expects the row group to yield (after the row predicate, if any) and the ranges of them this
rank keeps (two when it resumes the tails of two ranks' shards on fewer ranks).
The worker runs petastorm's own ``process`` (reading, the predicate, Unischema decoding, the
transform, the local cache: all unchanged), catches what it publishes, checks its length
against ``expected`` and publishes the kept range. A row group the plan splits between ranks is
therefore read whole by each of them (the cost of a split), and every rank keeps a disjoint
range of the same row order: petastorm's row shuffle (``shuffle_rows``) is held back for split
row groups and applied to the kept range instead. It is held back with a row predicate too:
petastorm 0.12.1's ``make_batch_reader`` shuffles the predicate's columns and the other columns
with two different permutations, so with ``shuffle_rows=True`` and a predicate it returns rows
whose columns do not belong together (measured: 85 of 96 rows; ``tests/test_row_sharding.py``
shows it).

The classes are defined at module level so that petastorm's process pool can pickle them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from petastorm.arrow_reader_worker import ArrowReaderWorker
from petastorm.py_dict_reader_worker import PyDictReaderWorker

__all__ = ["PlannedArrowWorker", "PlannedRowWorker", "RowCountMismatchError"]


class RowCountMismatchError(RuntimeError):
    """A row group yielded a different number of rows from the plan's count.

    The dataset changed since it was planned, its footers disagree with its data, or a row
    predicate or transform is not deterministic (the plan counted its rows once).
    """


class _PlannedRows:
    """What both workers add to petastorm's: the plan's row count check and row range."""

    publish_func: Any
    _shuffle_rows: bool
    _split_pieces: Any

    def process(
        self,
        piece_index: int,
        worker_predicate: Any,
        shuffle_row_drop_partition: tuple[int, int],
        planned_rows: tuple[int, tuple[tuple[int, int], ...]] | None = None,
    ) -> None:
        if planned_rows is None:
            super().process(piece_index, worker_predicate, shuffle_row_drop_partition)  # type: ignore[misc]
            return
        expected, kept_ranges = planned_rows
        split = kept_ranges != ((0, expected),)
        publish, shuffle = self.publish_func, self._shuffle_rows
        shuffle_here = shuffle and (split or worker_predicate is not None)
        published: list[Any] = []
        self.publish_func = published.append
        if shuffle_here:
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
        if rows is None or all(start == stop for start, stop in kept_ranges):
            return
        if split:
            rows = self._concatenated([rows[start:stop] for start, stop in kept_ranges])
        if shuffle_here:
            rows = self._shuffled(rows)
        publish(rows)

    def _shuffled(self, rows: Any) -> Any:
        raise NotImplementedError

    def _concatenated(self, parts: list[Any]) -> Any:
        raise NotImplementedError


class PlannedArrowWorker(_PlannedRows, ArrowReaderWorker):  # type: ignore[misc]
    """``make_batch_reader``'s worker (rows as a ``pyarrow.Table``) following a plan."""

    _random_state: np.random.RandomState

    def _shuffled(self, rows: Any) -> Any:
        return rows.take(self._random_state.permutation(rows.num_rows))

    def _concatenated(self, parts: list[Any]) -> Any:
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


class PlannedRowWorker(_PlannedRows, PyDictReaderWorker):  # type: ignore[misc]
    """``make_reader``'s worker (rows as dicts) following a plan."""

    _shuffle_seed: Any

    def _shuffled(self, rows: Any) -> Any:
        order = np.random.RandomState(self._shuffle_seed).permutation(len(rows))
        return [rows[index] for index in order]

    def _concatenated(self, parts: list[Any]) -> Any:
        return [row for part in parts for row in part]
