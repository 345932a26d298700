"""Petastorm's formats on top of the pyarrow reader: Unischema codecs and ``TransformSpec``,
decoded and applied as petastorm's ``make_reader``, loaders and workers do (docs/using.md, "The
reader", says what each gives). The rows themselves (which, in which order) are the pyarrow
reader's (:mod:`ddp_even.arrow.reader`), so every sharding, resume and statistic holds alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

# petastorm itself, first: 0.12.1 installed beside pyarrow 15 or later fails here (it imports
# pyarrow.filesystem), so that from_parquet refuses reader="row" at once, in one line.
import numpy as np
import numpy.typing as npt
import petastorm  # noqa: F401
import pyarrow as pa
import torch

from ddp_even.arrow.columns import Columns, Decoding, floats, to_columns
from ddp_even.errors import DatasetError
from ddp_even.parquet.predicates import is_expression
from ddp_even.storage import ResolvedDataset

__all__ = ["PetastormDecoding", "read_unischema"]

# Numpy types promoted as petastorm's pytorch loaders promote them: a field's arrays (uint16,
# uint32 and bool), its scalars (bool alone; torch's collation keeps the others).
_PROMOTED = {np.dtype(np.uint16): np.int32, np.dtype(np.uint32): np.int64, np.dtype(bool): np.uint8}
_PROMOTED_SCALARS = {np.dtype(bool): np.uint8}


def read_unischema(resolved: ResolvedDataset) -> Any:
    """The Unischema petastorm stored in the dataset's ``_common_metadata``; a
    :class:`~ddp_even.errors.DatasetError` saying what to do when there is none."""
    from petastorm.etl.dataset_metadata import UNISCHEMA_KEY
    from petastorm.etl.legacy import depickle_legacy_package_name_compatible

    path = f"{resolved.paths[0].rstrip('/')}/_common_metadata"
    stored = None
    if not resolved.is_list:
        with contextlib.suppress(OSError, DatasetError):
            stored = (resolved.storage.read_summary(path).metadata or {}).get(UNISCHEMA_KEY)
    if stored is None:
        raise DatasetError(
            f"{resolved.describe()} has no petastorm Unischema (no _common_metadata with one): "
            "reader='row' decodes datasets petastorm wrote; read plain Parquet with "
            "reader='batch' (the default)"
        )
    return depickle_legacy_package_name_compatible(stored)


class PetastormDecoding(Decoding):
    """Rows decoded by a Unischema (``schema``; None: plain Parquet, ``make_batch_reader``'s
    values) and transformed by ``transform_spec`` (None only with a ``schema``)."""

    def __init__(self, schema: Any, transform_spec: Any) -> None:
        self._schema = schema
        self._transform = transform_spec
        self.kind = b"row" if schema is not None else b"batch"
        self.whole_row_group = transform_spec is not None

    def columns(self, table: pa.Table) -> Columns:
        if self._schema is None:
            return to_columns(self._transformed_frame(table), self.with_nulls)
        if self._transform is None:
            return {
                name: self._decoded_column(name, table.column(name)) for name in table.column_names
            }

        return _collated(self._transformed_rows(self._decoded_rows(table)))

    def kept(self, predicate: Any, table: pa.Table) -> npt.NDArray[np.bool_]:
        if self._schema is None or is_expression(predicate):
            return super().kept(predicate, table)
        # make_reader's workers: each row's predicate fields decoded, then judged alone.
        return np.array(
            [bool(predicate.do_include(row)) for row in self._decoded_rows(table)], dtype=bool
        )

    def _decoded_rows(self, table: pa.Table) -> list[dict[str, Any]]:
        from petastorm.utils import decode_row

        return [decode_row(row, self._schema) for row in table.to_pylist()]

    def _decoded_column(self, name: str, column: pa.ChunkedArray) -> Any:
        field = self._schema.fields.get(name)
        if field is None:  # a partition key petastorm's schema does not name
            return to_columns(pa.table({name: column}), self.with_nulls)[name]
        if column.null_count:
            raise TypeError(
                f"field {name!r} holds nulls, which no tensor can: petastorm's loaders refuse "
                "them too. Fill them when writing, or drop the field (schema_fields)"
            )
        codec = field.codec
        plain_number = np.dtype(field.numpy_dtype).kind in "biufc"  # a number or a boolean
        if (codec is None or type(codec).__name__ == "ScalarCodec") and plain_number:
            # Whole columns at once: what decode_row does value by value (numpy_dtype(value)).
            values = column.to_numpy().astype(field.numpy_dtype)
            return _tensor(values, scalars=True)
        decoded = [
            codec.decode(field, value) if codec is not None else value
            for value in column.to_pylist()
        ]
        return _stacked(decoded)

    def _transformed_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        func, removed = self._transform.func, self._transform.removed_fields
        if func is not None:
            rows = [func(row) for row in rows]
        return [{k: v for k, v in row.items() if k not in removed} for row in rows]

    def _transformed_frame(self, table: pa.Table) -> pa.Table:
        # A column with nulls somewhere is float in every row group's frame, as in a batch; a
        # dictionary's is not (pandas makes it a categorical, its values as they are).
        for index, name in enumerate(table.column_names):
            if name in self.with_nulls:
                table = table.set_column(index, name, floats(table.column(index)))
        frame = table.to_pandas()
        if self._transform.func is not None:
            frame = self._transform.func(frame)
        for name in set(frame.columns) & set(self._transform.removed_fields):
            del frame[name]
        return pa.Table.from_pandas(frame, preserve_index=False)


def _collated(rows: list[dict[str, Any]]) -> Columns:
    """Decoded rows as a batch's columns (each field stacked), as petastorm's loader collates."""
    if not rows:
        return {}
    return {name: _stacked([row[name] for row in rows]) for name in rows[0]}


def _stacked(values: Sequence[Any]) -> Any:
    """Values of one field: a tensor when they are numbers or arrays of one shape, else a
    list (strings, decimals), as torch's default collation gives them."""
    if values and all(isinstance(value, np.ndarray | np.generic | int | float) for value in values):
        stacked = np.stack([np.asarray(value) for value in values])
        if stacked.dtype.kind in "biuf":
            return _tensor(stacked, scalars=not isinstance(values[0], np.ndarray))
    return list(values)


def _tensor(values: npt.NDArray[Any], scalars: bool) -> torch.Tensor:
    promoted = (_PROMOTED_SCALARS if scalars else _PROMOTED).get(values.dtype)
    return torch.from_numpy(values.astype(promoted) if promoted is not None else values)
