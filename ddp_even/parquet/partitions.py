"""Hive partition keys (``year=2024/part-0.parquet``): columns every row of a file holds.

A directory dataset's files may sit under ``key=value`` directories; their rows then have a
column ``key`` holding ``value``, as pyarrow's ``partitioning="hive"`` and petastorm give it.
The values are typed as pyarrow's hive partitioning infers them: ``int32`` when every value of
a key is an integer, else ``string`` (URL-decoded). A list of files has no partition keys (no
root to read directories from), as with pyarrow.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow as pa

__all__ = ["PartitionKeys", "partition_keys"]


@dataclass(frozen=True)
class PartitionKeys:
    """Each file's partition values, column by column.

    Example:
        >>> keys = partition_keys("/d", ["/d/year=2024/a.parquet", "/d/year=2025/b.parquet"])
        >>> keys.names, keys.schema.field("year").type
        (('year',), DataType(int32))
        >>> keys.added_to(pa.table({"x": [7, 8]}), 1, ["x", "year"]).to_pydict()
        {'x': [7, 8], 'year': [2025, 2025]}
    """

    names: tuple[str, ...]
    schema: pa.Schema
    # Per key, per file: the file's value (a typed array of one value per file).
    values: dict[str, pa.Array]

    def added_to(
        self, table: pa.Table, file_index: int, names: Sequence[str], rows: int | None = None
    ) -> pa.Table:
        """``table`` (rows of file ``file_index``; ``rows`` of them where it has no column)
        with the keys among ``names`` that it lacks, as columns."""
        if table.num_columns or rows is None:
            rows = table.num_rows
        keys = {
            name: pa.repeat(self.values[name][file_index], rows)
            for name in names
            if name in self.names and name not in table.column_names
        }
        if not table.num_columns:
            return pa.table(keys) if keys else table
        for name, column in keys.items():
            table = table.append_column(name, column)
        return table


def partition_keys(root: str | None, files: Sequence[str]) -> PartitionKeys:
    """The hive partition keys of ``files`` under directory ``root`` (None: a list of files).

    Every file must name the same keys in the same order (as pyarrow requires); otherwise a
    ``ValueError`` names two files that differ.
    """
    if root is None or not files:
        return PartitionKeys((), pa.schema([]), {})
    parsed = [_keys_of(posixpath.relpath(posixpath.dirname(path), root)) for path in files]
    names = tuple(name for name, _ in parsed[0])
    for path, keys in zip(files, parsed, strict=True):
        if tuple(name for name, _ in keys) != names:
            raise ValueError(
                f"{files[0]} and {path} are in different hive partition directories "
                f"({', '.join(names) or 'none'} against "
                f"{', '.join(name for name, _ in keys) or 'none'}): every file of a partitioned "
                "dataset needs the same key=value levels"
            )
    values = {name: _typed([keys[level][1] for keys in parsed]) for level, name in enumerate(names)}
    schema = pa.schema([(name, values[name].type) for name in names])
    return PartitionKeys(names, schema, values)


def _keys_of(relative_directory: str) -> list[tuple[str, str]]:
    if relative_directory in ("", "."):
        return []
    return [
        (name, unquote(value))
        for name, _, value in (
            part.partition("=") for part in relative_directory.split("/") if "=" in part
        )
    ]


def _typed(values: list[str]) -> pa.Array:
    """As pyarrow's hive partitioning infers a key's type: int32 if every value is one."""
    try:
        return pa.array([int(value) for value in values], pa.int32())
    except (ValueError, OverflowError):
        return pa.array(values, pa.string())
