"""A row group's columns as torch tensors, converted once; batches as views of them.

Each column becomes a tensor of its own dtype (without a copy where pyarrow hands out one
contiguous buffer) or, what no tensor holds, a Python list: docs/using.md has the table of
every type. A column's dtype is the same in every row group: integers and booleans with a null
anywhere in the dataset are floats, with NaN, as pandas and petastorm give them (``with_nulls``,
decided at planning: :mod:`ddp_even.parquet.nulls`); dates, times, timestamps and durations are
int64 in their unit, a null :data:`NULL_TIME`. A batch inside one row group is a slice of its
tensors (a view); one across two row groups is concatenated. :class:`Decoding` is that
conversion, and a predicate on the stored values; a reader of another format on top of Parquet
(petastorm's Unischema codecs and ``TransformSpec``: :mod:`ddp_even.petastorm.decoding`)
subclasses it. The pyarrow reader and the count of a predicate's rows before planning call the
same object, so what was counted is what is read.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import torch

from ddp_even.parquet.predicates import kept_mask

__all__ = ["NULL_TIME", "BatchCutter", "Columns", "Decoding", "floats", "to_columns"]

#: A batch (or a row group): each column's values, a tensor or a list.
Columns = dict[str, Any]

#: What a null date, time, timestamp or duration holds in its int64 tensor: the smallest int64,
#: numpy's and pandas' NaT (``tensor.numpy().view("datetime64[ns]")`` shows it as NaT). A float
#: with NaN would hold a nanosecond timestamp only to the nearest 128 ns or so.
NULL_TIME = int(np.iinfo(np.int64).min)

# Batches cut at once: few enough that they are handed out before Python's next young
# collection (about 700 new objects; a batch is 1 + one per column), enough that each
# column's cut is one call for many batches.
_CUT_AT_ONCE = 32

# Tensors are made on pyarrow's own (read-only) buffers, which nothing else holds: writing to a
# batch in place is harmless, and torch's warning about it would come once per column.
warnings.filterwarnings(
    "ignore",
    message="The given NumPy array is not writable",
    category=UserWarning,
    module=r"ddp_even\.arrow\.columns",
)


def to_columns(table: pa.Table, with_nulls: Collection[str] = ()) -> Columns:
    """Each column of ``table`` as a tensor (or a list); the integer and boolean columns named
    in ``with_nulls`` as floats whether or not these rows hold a null.

    Example:
        >>> columns = to_columns(pa.table({"id": [1, 2], "name": ["a", "b"]}))
        >>> columns["id"], columns["name"]
        (tensor([1, 2]), ['a', 'b'])
        >>> to_columns(pa.table({"id": [1, 2]}), with_nulls={"id"})["id"]
        tensor([1., 2.], dtype=torch.float64)
    """
    return {name: _column(table.column(name), name in with_nulls) for name in table.column_names}


def _column(column: pa.ChunkedArray, as_float: bool = False) -> Any:
    kind = column.type
    if pa.types.is_dictionary(kind):
        column = column.cast(kind.value_type)
        kind = column.type
    if _is_time(kind):
        return torch.from_numpy(_time_values(column))
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
    if not numeric and not pa.types.is_boolean(kind):
        return column.to_pylist()
    if as_float or (column.null_count and pa.types.is_boolean(kind)):
        column = floats(column)
    values = (
        column.to_numpy()
        if column.num_chunks == 1
        else column.combine_chunks().to_numpy(zero_copy_only=False)
    )
    if values.dtype == np.dtype(object):  # pyarrow left something torch cannot hold
        return column.to_pylist()
    return torch.from_numpy(values)


def floats(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """An integer column as float64, as pyarrow converts one with nulls (the nearest float: unsafe
    beyond 2**53 too), a boolean one as float32; any other as it is."""
    if pa.types.is_boolean(column.type):
        return column.cast(pa.float32())
    if pa.types.is_integer(column.type):
        return column.cast(pa.float64(), safe=False)
    return column


def _is_time(kind: pa.DataType) -> bool:
    """Dates, times, timestamps and durations: one integer each (intervals are not)."""
    return bool(
        pa.types.is_date(kind)
        or pa.types.is_time(kind)
        or pa.types.is_timestamp(kind)
        or pa.types.is_duration(kind)
    )


def _time_values(column: pa.ChunkedArray) -> np.ndarray[Any, np.dtype[np.int64]]:
    """A time column's integers in its own unit, int64 whatever its nulls (a null is
    :data:`NULL_TIME`), so that every row group of it gives the same dtype."""
    kind = column.type
    # date32 and time32 hold 32-bit integers, which pyarrow casts only to int32: then widened.
    narrow = pa.types.is_date32(kind) or pa.types.is_time32(kind)
    integers = column.cast(pa.int32()).cast(pa.int64()) if narrow else column.cast(pa.int64())
    if integers.null_count:
        integers = integers.fill_null(NULL_TIME)
    return np.asarray(integers.to_numpy(), dtype=np.int64)


class Decoding:
    """Plain Parquet: each column as :func:`to_columns` makes it.

    Example:
        >>> import pyarrow.compute as pc
        >>> table = pa.table({"id": [1, 2, 3]})
        >>> Decoding().columns(table)["id"], Decoding().kept(pc.field("id") > 1, table).tolist()
        (tensor([1, 2, 3]), [False, True, True])
    """

    #: What the counts of a predicate's rows are cached under, beside the predicate itself.
    kind = b"arrow"
    #: Whether :meth:`columns` needs every column of a row group at once (a transform of whole
    #: rows); otherwise the reader decodes a row group's columns in parts, side by side.
    whole_row_group = False

    #: The integer and boolean columns that hold a null somewhere in the dataset: float in
    #: every row group (:mod:`ddp_even.parquet.nulls`), so that a column's dtype never changes.
    with_nulls: frozenset[str] = frozenset()

    def for_dataset(self, with_nulls: Collection[str]) -> Self:
        """This decoding, for a dataset whose columns ``with_nulls`` hold a null somewhere."""
        decoding = copy.copy(self)
        decoding.with_nulls = frozenset(with_nulls)
        return decoding

    def columns(self, table: pa.Table) -> Columns:
        """``table``'s rows as a batch's columns."""
        return to_columns(table, self.with_nulls)

    def kept(self, predicate: Any, table: pa.Table) -> npt.NDArray[np.bool_]:
        """Which rows of ``table`` (a row group's predicate columns) ``predicate`` keeps."""
        return kept_mask(predicate, table)


def _sliced(columns: Columns, start: int, stop: int) -> Columns:
    """Rows ``start`` to ``stop`` of every column (views of the tensors)."""
    return {name: values[start:stop] for name, values in columns.items()}


def _concatenated(parts: Sequence[Columns]) -> Columns:
    """``parts`` (the same columns each) one after the other."""
    if len(parts) == 1:
        return parts[0]
    joined: Columns = {}
    for name, first in parts[0].items():
        pieces = [part[name] for part in parts]
        if isinstance(first, torch.Tensor):
            joined[name] = torch.cat(pieces)
        else:
            joined[name] = [value for piece in pieces for value in piece]
    return joined


class BatchCutter:
    """Cuts row groups' columns into batches of ``batch_size`` rows, a few at a time, carrying
    the rows of a batch that a row group leaves unfinished into the next.

    Example:
        >>> cutter = BatchCutter(3)
        >>> [len(batch["id"]) for cut in cutter.batches(to_columns(pa.table({"id": range(7)})), 7)
        ...  for batch in cut]
        [3, 3]
        >>> [batch["id"].tolist() for cut in cutter.rest() for batch in cut]
        [[6]]
    """

    def __init__(self, batch_size: int) -> None:
        self._batch_size = batch_size
        self._carried: list[Columns] = []
        self._carried_rows = 0

    def batches(self, columns: Columns, rows: int) -> Iterator[list[Columns]]:
        """The batches these ``rows`` rows complete (after those carried over), in lists of
        at most :data:`_CUT_AT_ONCE`."""
        start = 0
        if self._carried:
            start = min(self._batch_size - self._carried_rows, rows)
            self._carried.append(_sliced(columns, 0, start))
            self._carried_rows += start
            if self._carried_rows < self._batch_size:
                return
            yield [_concatenated(self._carried)]
            self._carried, self._carried_rows = [], 0
        whole_stop = start + (rows - start) // self._batch_size * self._batch_size
        for cut_start in range(start, whole_stop, _CUT_AT_ONCE * self._batch_size):
            cut_stop = min(cut_start + _CUT_AT_ONCE * self._batch_size, whole_stop)
            split = (
                _split(values, cut_start, cut_stop, self._batch_size) for values in columns.values()
            )
            yield [dict(zip(columns, batch, strict=True)) for batch in zip(*split, strict=True)]
        if whole_stop < rows:
            self._carried = [_sliced(columns, whole_stop, rows)]
            self._carried_rows = rows - whole_stop

    def rest(self) -> list[list[Columns]]:
        """The pass's short last batch, if any."""
        rest = [[_concatenated(self._carried)]] if self._carried else []
        self._carried, self._carried_rows = [], 0
        return rest


def _split(values: Any, start: int, stop: int, size: int) -> Sequence[Any]:
    """Rows ``start`` to ``stop`` (a multiple of ``size`` apart) in parts of ``size``."""
    if isinstance(values, torch.Tensor):
        # Views, made in C++ in one call rather than one slice at a time.
        parts: Sequence[Any] = values[start:stop].view(-1, size, *values.shape[1:]).unbind()
        return parts
    return [values[offset : offset + size] for offset in range(start, stop, size)]
