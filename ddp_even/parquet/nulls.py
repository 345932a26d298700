"""Which integer and boolean columns of a dataset hold a null, read from its footers (no data).

No tensor holds a null: an integer column with one comes out as float64 with NaN (a boolean one
as float32), as pandas and petastorm give it. So that such a column has the same dtype in every
batch of an epoch, and on every rank, it is decided once per column for the whole dataset, at
planning, from the statistics each row group's column chunk carries in its footer (its null
count): float in every row group if any row group holds a null, its own dtype otherwise.

Without statistics it is decided conservatively, never from the data: a column chunk without a
null count (written with ``write_statistics=False``, or by a writer that leaves it out) counts as
holding nulls, unless the schema says that the column cannot hold one (Parquet's ``REQUIRED``,
pyarrow's ``nullable=False``).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["NullColumns"]


class NullColumns:
    """The integer and boolean columns found to hold a null (or that may: no null count), over
    every footer (or ``_metadata`` summary) :meth:`add` was given.

    Example:
        >>> import io
        >>> table = pa.table({"a": [1, None, 3], "b": [1, 2, 3], "s": ["x", None, "z"]})
        >>> sink = io.BytesIO()
        >>> pq.write_table(table, sink, row_group_size=2)
        >>> found = NullColumns()
        >>> found.add(pq.read_metadata(io.BytesIO(sink.getvalue())))
        >>> sorted(found.names)
        ['a']
    """

    def __init__(self) -> None:
        self._found: set[str] = set()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._found)

    def add(self, footer: pq.FileMetaData) -> None:
        """Look through every row group of ``footer`` (a file's, or a summary's)."""
        leaves, unplaced = _nullable_leaves(footer)
        self._found.update(unplaced)  # no column chunk of its own found: counted as nulls
        leaves = {leaf: name for leaf, name in leaves.items() if name not in self._found}
        for group in range(footer.num_row_groups):
            if not leaves:
                return
            row_group = footer.row_group(group)
            for leaf, name in list(leaves.items()):
                statistics = row_group.column(leaf).statistics
                if statistics is None or not statistics.has_null_count or statistics.null_count:
                    self._found.add(name)
                    del leaves[leaf]


def _nullable_leaves(footer: pq.FileMetaData) -> tuple[dict[int, str], set[str]]:
    """The column chunk index (Parquet's leaf column) of each top-level integer or boolean
    column that may hold a null, and the names of any such column not placed: such a column is
    flat, one leaf whose path is its name."""
    wanted: set[str] = set()
    for field in footer.schema.to_arrow_schema():
        kind = field.type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if field.nullable and (pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
            wanted.add(field.name)
    placed = {
        index: path
        for index in range(footer.num_columns)
        if (path := footer.schema.column(index).path) in wanted
    }
    return placed, wanted - set(placed.values())
