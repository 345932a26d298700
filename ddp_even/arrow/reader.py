"""One pass over a rank's planned rows, read with pyarrow: row groups read ahead, batches out.

A thread reads the pass's row groups in the order given (:func:`~ddp_even.planning.pass_order.
pass_rows`), each whole and once: the predicate applied (:func:`~ddp_even.parquet.predicates.
kept_mask`, what was counted before planning), the kept rows checked against the plan's count
(:class:`~ddp_even.errors.RowCountMismatchError` otherwise), permuted by the epoch's seed when
rows are shuffled (the same permutation on every rank, before the plan's ranges are cut, as
petastorm's planned readers do), cut to the rank's ranges, and converted to tensors once
(:mod:`ddp_even.arrow.columns`). At most ``prefetch`` row groups wait in the queue, so reading
overlaps the training step and memory stays bounded. The pass hands out batches of
``batch_size`` rows (views where a batch lies in one row group), the last one short, as
petastorm's ``BatchedDataLoader`` does.

Closing the pass (the end, a ``break``, an exception, an epoch let go of) stops the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ddp_even.arrow.columns import Columns, concatenated, sliced, to_columns
from ddp_even.errors import RowCountMismatchError
from ddp_even.parquet.predicates import kept_mask
from ddp_even.planning.row_groups import RowGroups
from ddp_even.planning.sharding import RowRange
from ddp_even.sources.base import ShardPass, ShardSource
from ddp_even.storage import ResolvedDataset

__all__ = ["ArrowPass", "PassRows", "source_for"]

logger = logging.getLogger("ddp_even")

# How long the reading thread waits to put a row group's batches in a full queue before it
# looks again whether the pass was closed.
_PUT_WAIT_S = 0.1


@dataclass(frozen=True)
class PassRows:
    """What one pass reads and how: the dataset, its row groups (with the rows the plan counted
    in each, after the predicate), the ranges in reading order, and the reading options."""

    resolved: ResolvedDataset
    row_groups: RowGroups
    rows: Sequence[RowRange]
    columns: Sequence[str] | None
    predicate: Any
    predicate_fields: Sequence[str]
    # Shuffle each row group's rows: with ``row_seed`` the same permutation on every rank.
    shuffle_rows: bool
    row_seed: int | None


class ArrowPass:
    """One pass's batches, read ahead by a thread of its own; close it when done (or use it in
    a ``with`` block, as petastorm's readers)."""

    def __init__(
        self, reading: PassRows, batch_size: int, prefetch: int, threads: int, pin_memory: bool
    ) -> None:
        self._pin_memory = pin_memory
        self._prefetch = prefetch
        self._threads = threads
        # Each item: the batches one row group completes (the thread cuts them), the pass's
        # end (None), or what the thread raised. One waits while the last is handed out.
        self._queue: queue.Queue[list[Columns] | BaseException | None] = queue.Queue(1)
        self._closed = threading.Event()
        self._ready: list[Columns] = []
        self._done = False
        self._thread = threading.Thread(
            target=self._read, args=(reading, batch_size), name="ddp_even-arrow-reader", daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Iterator[Columns]:
        return self

    def __enter__(self) -> ArrowPass:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __next__(self) -> Columns:
        while not self._ready:
            if self._done:
                raise StopIteration
            item = self._queue.get()
            if item is None or isinstance(item, BaseException):
                self._done = True
                if item is not None:
                    raise item
                continue
            item.reverse()  # handed out from the end: pop() is O(1)
            self._ready = item
        batch = self._ready.pop()
        if self._pin_memory:
            batch = {name: _pinned(values) for name, values in batch.items()}
        return batch

    def close(self) -> None:
        """Stop reading ahead (the thread ends within about 0.1 s) and let go of what it read."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
        self._ready = []

    def _read(self, reading: PassRows, batch_size: int) -> None:
        try:
            cutter = _BatchCutter(batch_size)
            footers = _Footers(reading)
            with ThreadPoolExecutor(self._threads, thread_name_prefix="ddp_even-arrow") as pool:
                # Row groups read and converted in parallel, ``prefetch`` at most in flight,
                # cut into batches here in order.
                in_flight: deque[Future[tuple[Columns, int]]] = deque()
                groups = iter(_by_row_group(reading.rows))
                while True:
                    while len(in_flight) < self._prefetch and not self._closed.is_set():
                        group_ranges = next(groups, None)
                        if group_ranges is None:
                            break
                        in_flight.append(pool.submit(_read_row_group, footers, *group_ranges))
                    if not in_flight or self._closed.is_set():
                        break
                    columns, rows = in_flight.popleft().result()
                    if not self._put(cutter.batches(columns, rows)):
                        break
                for future in in_flight:
                    future.cancel()
            if not self._closed.is_set() and self._put(cutter.rest()):
                self._put(None)
        except BaseException as error:  # any failure reaches the consumer, which raises it
            self._put(error)

    def _put(self, item: list[Columns] | BaseException | None) -> bool:
        """Queue ``item`` unless the pass was closed meanwhile (then False)."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=_PUT_WAIT_S)
            except queue.Full:
                continue
            return True
        return False


class _BatchCutter:
    """Cuts row groups' columns into batches of ``batch_size`` rows, carrying the rows of a
    batch that a row group leaves unfinished into the next."""

    def __init__(self, batch_size: int) -> None:
        self._batch_size = batch_size
        self._carried: list[Columns] = []
        self._carried_rows = 0

    def batches(self, columns: Columns, rows: int) -> list[Columns]:
        """The batches these ``rows`` rows complete (after those carried over)."""
        done: list[Columns] = []
        start = 0
        if self._carried:
            start = min(self._batch_size - self._carried_rows, rows)
            self._carried.append(sliced(columns, 0, start))
            self._carried_rows += start
            if self._carried_rows < self._batch_size:
                return done
            done.append(concatenated(self._carried))
            self._carried, self._carried_rows = [], 0
        whole = (rows - start) // self._batch_size
        stop = start + whole * self._batch_size
        if whole:
            # One split per column: views, cut in C++ rather than one slice at a time.
            split = {
                name: _split(values, start, stop, self._batch_size)
                for name, values in columns.items()
            }
            done.extend(
                {name: parts[index] for name, parts in split.items()} for index in range(whole)
            )
        if stop < rows:
            self._carried = [sliced(columns, stop, rows)]
            self._carried_rows = rows - stop
        return done

    def rest(self) -> list[Columns]:
        """The pass's short last batch, if any."""
        rest = [concatenated(self._carried)] if self._carried else []
        self._carried, self._carried_rows = [], 0
        return rest


def _split(values: Any, start: int, stop: int, size: int) -> Sequence[Any]:
    if hasattr(values, "split"):
        parts: Sequence[Any] = values[start:stop].split(size)
        return parts
    return [values[offset : offset + size] for offset in range(start, stop, size)]


def _by_row_group(rows: Sequence[RowRange]) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """Consecutive ranges of one row group together (a rank may keep two ranges of one)."""
    group: int | None = None
    ranges: list[tuple[int, int]] = []
    for index, start, stop in rows:
        if index != group and group is not None:
            yield group, ranges
            ranges = []
        group = index
        ranges.append((start, stop))
    if group is not None:
        yield group, ranges


class _Footers:
    """Each file's footer, read once per pass, for the threads that open its row groups."""

    def __init__(self, reading: PassRows) -> None:
        self.reading = reading
        self._footers: dict[int, pq.FileMetaData] = {}
        self._lock = threading.Lock()

    def open(self, file_index: int) -> tuple[pq.ParquetFile, Any]:
        """The file (to close after), parsed with the footer read before."""
        storage = self.reading.resolved.storage
        source = storage.open_input_file(self.reading.row_groups.files[file_index])
        with self._lock:
            footer = self._footers.get(file_index)
        parquet_file = pq.ParquetFile(source, metadata=footer)
        if footer is None:
            with self._lock:
                self._footers[file_index] = parquet_file.metadata
        return parquet_file, source


def _read_row_group(
    footers: _Footers, group: int, ranges: list[tuple[int, int]]
) -> tuple[Columns, int]:
    """Row group ``group``'s kept rows as columns of tensors, and how many."""
    reading = footers.reading
    parquet_file, source = footers.open(int(reading.row_groups.file_of[group]))
    try:
        table = _kept_rows(parquet_file, reading, group, ranges)
    finally:
        source.close()
    return to_columns(table), table.num_rows


def _kept_rows(
    parquet_file: pq.ParquetFile, reading: PassRows, group: int, ranges: list[tuple[int, int]]
) -> pa.Table:
    """Row group ``group``'s rows this pass keeps: filtered, checked, shuffled, cut, selected."""
    row_groups = reading.row_groups
    wanted = None
    if reading.columns is not None:
        wanted = list(dict.fromkeys([*reading.columns, *reading.predicate_fields]))
    # Decoded in this thread alone: the pass's threads read row groups side by side, also
    # where OMP_NUM_THREADS=1 (torchrun's default) leaves pyarrow's own pool one thread.
    table = parquet_file.read_row_group(
        int(row_groups.index_in_file[group]), columns=wanted, use_threads=False
    )
    if reading.predicate is not None:
        table = table.filter(
            pa.array(kept_mask(reading.predicate, table.select(reading.predicate_fields)))
        )
    expected = int(row_groups.num_rows[group])
    if table.num_rows != expected:
        raise RowCountMismatchError(
            f"row group {group} ({row_groups.files[int(row_groups.file_of[group])]} "
            f"#{int(row_groups.index_in_file[group])}) yielded {table.num_rows} rows, the shard "
            f"plan counted {expected}: the dataset changed since it was planned, or the row "
            "predicate is not deterministic. Plan again (a new EvenLoader.from_parquet)"
        )
    if reading.shuffle_rows and reading.row_seed is not None:
        # The same permutation on every rank, before the ranges are cut: ranks sharing a row
        # group keep disjoint rows, and a resume can start at a row offset.
        key = [reading.row_seed, group, 0]
        table = table.take(np.random.default_rng(key).permutation(table.num_rows))
    if ranges != [(0, expected)]:
        table = pa.concat_tables([table.slice(start, stop - start) for start, stop in ranges])
    if reading.shuffle_rows and reading.row_seed is None:
        # Unseeded: only after the cut, or ranks sharing a row group would overlap.
        table = table.take(np.random.default_rng().permutation(table.num_rows))
    if reading.columns is not None:
        table = table.select(list(reading.columns))
    return table


def _pinned(values: Any) -> Any:
    return values.pin_memory() if hasattr(values, "pin_memory") else values


def source_for(reading: ArrowPass, *, owned: bool) -> ShardSource[Columns]:
    """A pass the factory made, as the source of one pass (the source registry's hook): its
    batches counted by their first column, which every column matches."""
    return _OnePass(reading)


class _OnePass(ShardSource[Columns]):
    def __init__(self, reading: ArrowPass) -> None:
        self._reading = reading

    @property
    def restartable(self) -> bool:
        return False  # a factory makes a pass for each pass

    def open_pass(self) -> ShardPass[Columns]:
        return ShardPass(self._reading, on_close=self._reading.close, count_samples=_rows)


def _rows(batch: Columns) -> int | None:
    for values in batch.values():
        return len(values)
    return None
