"""How a row group's kept rows become a batch's columns, and how a predicate judges them.

:class:`Decoding` is plain Parquet, as pyarrow reads it (:func:`~ddp_even.arrow.columns.
to_columns`; a predicate on the stored values, :func:`~ddp_even.parquet.predicates.kept_mask`).
A reader of another format on top of Parquet (petastorm's Unischema codecs and ``TransformSpec``:
:mod:`ddp_even.petastorm.decoding`) is a subclass; the pyarrow reader and the count of a
predicate's rows before planning call the same object, so what was counted is what is read.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any, Self

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ddp_even.arrow.columns import Columns, to_columns
from ddp_even.parquet.predicates import kept_mask

__all__ = ["Decoding"]


class Decoding:
    """Plain Parquet: each column as :func:`~ddp_even.arrow.columns.to_columns` makes it.

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
