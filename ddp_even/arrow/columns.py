"""A row group's columns as torch tensors, converted once; batches as views of them.

Numbers and booleans become tensors of their own dtype (integers with nulls become float64 with
NaN, as pandas and petastorm give them; booleans with nulls float32), without a copy where
pyarrow hands out one contiguous buffer; times and dates become int64 tensors in their unit;
anything else (strings, binary, lists, structs) a Python list. A batch inside one row group is a
slice of its tensors (a view); one across two row groups is concatenated.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

__all__ = ["Columns", "concatenated", "sliced", "to_columns"]

#: A batch (or a row group): each column's values, a tensor or a list.
Columns = dict[str, Any]

# Tensors are made on pyarrow's own (read-only) buffers, which nothing else holds: writing to a
# batch in place is harmless, and torch's warning about it would come once per column.
warnings.filterwarnings(
    "ignore",
    message="The given NumPy array is not writable",
    category=UserWarning,
    module=r"ddp_even\.arrow\.columns",
)


def to_columns(table: pa.Table) -> Columns:
    """Each column of ``table`` as a tensor (or a list).

    Example:
        >>> columns = to_columns(pa.table({"id": [1, 2], "name": ["a", "b"]}))
        >>> columns["id"], columns["name"]
        (tensor([1, 2]), ['a', 'b'])
    """
    return {name: _column(table.column(name)) for name in table.column_names}


def _column(column: pa.ChunkedArray) -> Any:
    kind = column.type
    if pa.types.is_dictionary(kind):
        column = column.cast(kind.value_type)
        kind = column.type
    if pa.types.is_temporal(kind):
        column = column.cast(pa.int64())
        kind = column.type
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
    if not numeric and not pa.types.is_boolean(kind):
        return column.to_pylist()
    if column.null_count and pa.types.is_boolean(kind):
        column = column.cast(pa.float32())
    values = (
        column.to_numpy()
        if column.num_chunks == 1
        else column.combine_chunks().to_numpy(zero_copy_only=False)
    )
    if values.dtype == np.dtype(object):  # pyarrow left something torch cannot hold
        return column.to_pylist()
    return torch.from_numpy(values)


def sliced(columns: Columns, start: int, stop: int) -> Columns:
    """Rows ``start`` to ``stop`` of every column (views of the tensors)."""
    return {name: values[start:stop] for name, values in columns.items()}


def concatenated(parts: Sequence[Columns]) -> Columns:
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
