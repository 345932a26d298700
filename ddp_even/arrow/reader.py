"""One pass over a rank's planned rows, read with pyarrow: row groups read ahead, batches out.

A thread walks the pass's row groups in the order given, each once. For each it first decides
which rows the pass keeps (:func:`_selection`: the predicate's rows, checked against the plan's
count, permuted by the epoch's seed before the rank's ranges are cut, as petastorm's planned
readers do), then reads its other columns in parts, one per reading thread, and converts them
to tensors once (:mod:`ddp_even.arrow.columns`). At most ``prefetch`` row groups are in flight.
Batches of ``batch_size`` rows, the last one short as petastorm's ``BatchedDataLoader`` gives
it, are cut a few at a time as the loop asks: cut ahead, a row group's hundreds of views per
column would outlive Python's young collections, and the full collections they bring would cost
more than cutting them (``benchmarks/bench_arrow.py``). Closing the pass stops the thread.
"""

from __future__ import annotations

import itertools
import operator
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from ddp_even.arrow.columns import BatchCutter, Columns, Decoding
from ddp_even.errors import RowCountMismatchError
from ddp_even.parquet.partitions import PartitionKeys
from ddp_even.planning.row_groups import RowGroups
from ddp_even.planning.sharding import RowRange
from ddp_even.sources.base import ShardPass, ShardSource
from ddp_even.storage import ResolvedDataset

__all__ = ["ArrowPass", "PassRows", "source_for"]

# How long the reading thread waits to put a row group in a full queue before it looks again
# whether the pass was closed.
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
    # The hive partition keys of each file: columns of every batch.
    partitions: PartitionKeys
    decoding: Decoding


class ArrowPass(ShardSource[Columns]):
    """One pass's batches, read ahead by a thread of its own; close it when done (or use it in
    a ``with`` block, as petastorm's readers). As a source it serves this one pass, its batches
    counted by their first column, which every column matches."""

    def __init__(
        self, reading: PassRows, batch_size: int, prefetch: int, threads: int, pin_memory: bool
    ) -> None:
        self._pin_memory = pin_memory
        self._prefetch = prefetch
        self._threads = threads
        # Each item: one row group's kept rows (columns, and how many), the pass's end (None),
        # or what the thread raised. One waits while the last is cut into batches.
        self._queue: queue.Queue[tuple[Columns, int] | BaseException | None] = queue.Queue(1)
        self._closed = threading.Event()
        self._cutter = BatchCutter(batch_size)
        # The batches of the row group being handed out, a few at a time, and those cut.
        self._cuts: Iterator[list[Columns]] = iter(())
        self._ready: list[Columns] = []
        self._done = False
        self._thread = threading.Thread(
            target=self._read, args=(reading,), name="ddp_even-arrow-reader", daemon=True
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
            cut = next(self._cuts, None)
            if cut is not None:
                cut.reverse()  # handed out from the end: pop() is O(1)
                self._ready = cut
                continue
            if self._done:
                raise StopIteration
            item = self._queue.get()
            if item is None or isinstance(item, BaseException):
                self._done = True
                if item is not None:
                    raise item
                self._cuts = iter(self._cutter.rest())
                continue
            self._cuts = self._cutter.batches(*item)
        batch = self._ready.pop()
        if self._pin_memory:
            batch = {name: _pinned(values) for name, values in batch.items()}
        return batch

    @property
    def restartable(self) -> bool:
        return False  # a factory makes a pass for each pass

    def open_pass(self) -> ShardPass[Columns]:
        return ShardPass(self, on_close=self.close, count_samples=_rows)

    def close(self) -> None:
        """Stop reading ahead (the thread ends within about 0.1 s) and let go of what it read."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
        self._cuts, self._ready = iter(()), []

    def _read(self, reading: PassRows) -> None:
        try:
            footers = _Footers(reading)
            with ThreadPoolExecutor(self._threads, thread_name_prefix="ddp_even-arrow") as pool:
                # ``prefetch`` row groups at most in flight, queued in order.
                in_flight: deque[_RowGroupRead] = deque()
                groups = iter(_by_row_group(reading.rows))
                while True:
                    while len(in_flight) < self._prefetch and not self._closed.is_set():
                        group_ranges = next(groups, None)
                        if group_ranges is None:
                            break
                        in_flight.append(
                            _RowGroupRead.submit(pool, footers, *group_ranges, self._threads)
                        )
                    if not in_flight or self._closed.is_set():
                        break
                    read = in_flight.popleft()
                    if read.rows and not self._put((read.columns(), read.rows)):
                        break
                for read in in_flight:
                    read.cancel()
            if not self._closed.is_set():
                self._put(None)
        except BaseException as error:  # any failure reaches the consumer, which raises it
            self._put(error)

    def _put(self, item: tuple[Columns, int] | BaseException | None) -> bool:
        """Queue ``item`` unless the pass was closed meanwhile (then False)."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=_PUT_WAIT_S)
            except queue.Full:
                continue
            return True
        return False


def _by_row_group(rows: Sequence[RowRange]) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """Consecutive ranges of one row group together (a rank may keep two ranges of one)."""
    for group, ranges in itertools.groupby(rows, key=operator.itemgetter(0)):
        yield group, [(start, stop) for _, start, stop in ranges]


class _Footers:
    """Each file's footer, read once per pass, for the threads that open its row groups."""

    def __init__(self, reading: PassRows) -> None:
        self.reading = reading
        # Each dict operation is atomic: threads that open a file at once both store its footer.
        self._footers: dict[int, pq.FileMetaData] = {}

    def open(self, file_index: int) -> tuple[pq.ParquetFile, Any]:
        """The file (to close after), parsed with the footer read before."""
        storage = self.reading.resolved.storage
        source = storage.filesystem.open_input_file(self.reading.row_groups.files[file_index])
        parquet_file = pq.ParquetFile(source, metadata=self._footers.get(file_index))
        self._footers.setdefault(file_index, parquet_file.metadata)
        return parquet_file, source

    def footer(self, file_index: int) -> pq.FileMetaData:
        """The file's footer, opening the file only the first time (a request on a store)."""
        if file_index not in self._footers:
            self.open(file_index)[1].close()
        return self._footers[file_index]

    def columns(self, file_index: int) -> list[str]:
        """The columns the pass hands out from this file: those asked for, or all of them
        (the stored ones, then the partition keys)."""
        if self.reading.columns is not None:
            return list(self.reading.columns)
        stored = self.footer(file_index).schema.to_arrow_schema().names
        return [*stored, *self.reading.partitions.names]

    def read(self, group: int, names: list[str]) -> pa.Table:
        """Stored columns ``names`` of row group ``group``."""
        row_groups = self.reading.row_groups
        parquet_file, source = self.open(int(row_groups.file_of[group]))
        try:
            # Decoded in this thread alone: the pass's threads read parts side by side, also
            # where OMP_NUM_THREADS=1 (torchrun's default) leaves pyarrow's own pool one thread.
            return parquet_file.read_row_group(
                int(row_groups.index_in_file[group]), columns=names, use_threads=False
            )
        finally:
            source.close()

    def predicate_columns(self, group: int) -> pa.Table:
        """Row group ``group``'s columns its predicate reads, partition keys included."""
        reading = self.reading
        keys = reading.partitions
        stored = [name for name in reading.predicate_fields if name not in keys.names]
        file_index = int(reading.row_groups.file_of[group])
        return keys.added_to(self.read(group, stored), file_index, reading.predicate_fields)


@dataclass(frozen=True)
class _Selection:
    """The rows of one row group a pass keeps, in its order: decided once, applied to each
    part of the row group's columns alike."""

    # The predicate's verdict on each row (None: every row), and the columns decoded for it.
    kept: pa.Array | None
    predicate_columns: pa.Table | None
    # The order of the kept rows before the ranges are cut (None: as stored).
    seeded_order: npt.NDArray[np.int64] | None
    ranges: list[tuple[int, int]]
    kept_rows: int
    # The rows the ranges keep, and their order (None: as cut).
    rows: int
    unseeded_order: npt.NDArray[np.int64] | None

    def applied(self, table: pa.Table) -> pa.Table:
        if self.kept is not None:
            table = table.filter(self.kept)
        if self.seeded_order is not None:
            table = table.take(self.seeded_order)
        if self.ranges != [(0, self.kept_rows)]:
            table = pa.concat_tables(
                [table.slice(start, stop - start) for start, stop in self.ranges]
            )
        if self.unseeded_order is not None:
            table = table.take(self.unseeded_order)
        return table


def _selection(footers: _Footers, group: int, ranges: list[tuple[int, int]]) -> _Selection:
    """Row group ``group``'s rows this pass keeps: filtered, checked, shuffled, cut."""
    reading = footers.reading
    row_groups = reading.row_groups
    file_index = int(row_groups.file_of[group])
    index_in_file = int(row_groups.index_in_file[group])
    kept = fields = None
    if reading.predicate is not None:
        fields = footers.predicate_columns(group)
        kept = pa.array(reading.decoding.kept(reading.predicate, fields))
        kept_rows = kept.true_count
    else:
        kept_rows = footers.footer(file_index).row_group(index_in_file).num_rows
    expected = int(row_groups.num_rows[group])
    if kept_rows != expected:
        raise RowCountMismatchError(
            f"{_described(reading, group)} yielded {kept_rows} rows, the shard plan counted "
            f"{expected}: "
            "the dataset changed since it was planned, or the row predicate is not "
            "deterministic. Plan again (a new EvenLoader.from_parquet)"
        )
    seeded_order = unseeded_order = None
    rows = sum(stop - start for start, stop in ranges)
    if reading.shuffle_rows and reading.row_seed is not None:
        # The same permutation on every rank, before the ranges are cut: ranks sharing a row
        # group keep disjoint rows, and a resume can start at a row offset.
        seeded_order = np.random.default_rng([reading.row_seed, group, 0]).permutation(expected)
    if reading.shuffle_rows and reading.row_seed is None:
        # Unseeded: only after the cut, or ranks sharing a row group would overlap.
        unseeded_order = np.random.default_rng().permutation(rows)
    return _Selection(kept, fields, seeded_order, ranges, expected, rows, unseeded_order)


@dataclass(frozen=True)
class _RowGroupRead:
    """One row group being read: which rows it keeps is decided when it is submitted, its
    columns are read in parts side by side (so that a pass's first and last row groups, too,
    keep every thread busy)."""

    rows: int
    # The columns in the pass's order (None: as the decoding hands them out).
    names: list[str] | None
    parts: list[Future[Columns]]
    # The row group, for people.
    where: str

    @classmethod
    def submit(
        cls,
        pool: ThreadPoolExecutor,
        footers: _Footers,
        group: int,
        ranges: list[tuple[int, int]],
        threads: int,
    ) -> _RowGroupRead:
        reading = footers.reading
        selection = _selection(footers, group, ranges)
        if not selection.rows:  # a predicate kept none of this rank's rows: nothing to read
            return cls(0, None, [], _described(reading, group))
        file_index = int(reading.row_groups.file_of[group])
        names = footers.columns(file_index)
        # Columns not read from the file: the predicate's, decoded already, and partition keys.
        decoded = selection.predicate_columns
        known = reading.partitions.added_to(
            decoded if decoded is not None else pa.table({}),
            file_index,
            names,
            rows=int(reading.row_groups.num_rows[group]),
        )
        known = known.select([name for name in names if name in known.column_names])
        to_read = [name for name in names if name not in known.column_names]
        if reading.decoding.whole_row_group:
            # A transform sees whole rows: one part, every column.
            whole = pool.submit(_read_columns, footers, group, to_read, selection, known)
            return cls(selection.rows, None, [whole], _described(reading, group))
        parts = [
            pool.submit(_read_columns, footers, group, part, selection)
            for part in _column_parts(to_read, threads)
        ]
        if known.num_columns:
            parts.append(pool.submit(_kept_columns, known, selection, reading.decoding))
        return cls(selection.rows, names, parts, _described(reading, group))

    def columns(self) -> Columns:
        """Its columns, in the pass's order, once every part is read."""
        read = {name: values for part in self.parts for name, values in part.result().items()}
        if self.names is not None:
            return {name: read[name] for name in self.names}
        for values in read.values():
            if len(values) != self.rows:
                raise RowCountMismatchError(
                    f"{self.where} yielded {len(values)} rows after the transform_spec, the "
                    f"shard plan counted {self.rows}: a transform_spec must keep every row "
                    "(the plan counts them); filter rows with predicate= instead"
                )
        return read

    def cancel(self) -> None:
        for part in self.parts:
            part.cancel()


def _described(reading: PassRows, group: int) -> str:
    row_groups = reading.row_groups
    file_index = int(row_groups.file_of[group])
    return f"row group {group} ({row_groups.files[file_index]} #{row_groups.index_in_file[group]})"


def _column_parts(names: list[str], threads: int) -> list[list[str]]:
    """``names`` in as many parts as threads read them (no more than one column each)."""
    count = min(threads, len(names))
    return [names[index::count] for index in range(count)]


def _read_columns(
    footers: _Footers,
    group: int,
    names: list[str],
    selection: _Selection,
    known: pa.Table | None = None,
) -> Columns:
    """Columns ``names`` of row group ``group`` (and the ``known`` ones beside them), the rows
    ``selection`` keeps, decoded."""
    table = footers.read(group, names)
    if known is not None:
        for name in known.column_names:
            table = table.append_column(known.schema.field(name), known.column(name))
    return _kept_columns(table, selection, footers.reading.decoding)


def _kept_columns(table: pa.Table, selection: _Selection, decoding: Decoding) -> Columns:
    return decoding.columns(selection.applied(table))


def _pinned(values: Any) -> Any:
    return values.pin_memory() if hasattr(values, "pin_memory") else values


def source_for(reading: ArrowPass, *, owned: bool) -> ShardSource[Columns]:
    """The source registry's hook: a pass the factory made is the source of that one pass."""
    return reading


def _rows(batch: Columns) -> int | None:
    for values in batch.values():
        return len(values)
    return None
