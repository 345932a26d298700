"""Every Parquet column type comes out of the pyarrow reader as docs/using.md's table says.

A file with a column of each type, three row groups (the first and last with nulls, the middle
without), batches of 4 rows that cross row groups, read by ``from_parquet``.
Each column is checked on its own: its Python type or tensor dtype in every batch, and every
row's value against what was written (the expected values are computed from the written
Python values, not by pyarrow). Dates, times, timestamps and durations are int64 in every
batch, a null as ``NULL_TIME``, never float: a nanosecond timestamp in a float64 is off by up
to 128 ns, and a column whose dtype changes from batch to batch breaks the user's model.
"""

from __future__ import annotations

import datetime
import decimal
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ddp_even import EvenLoader
from ddp_even.arrow.columns import NULL_TIME, to_columns

SIZES = [5, 4, 6]  # rows per row group
ROWS = sum(SIZES)
NULL_ROWS = {1, 3, 12}  # in the first and the last row group; none in the middle one
BATCH = 4
EPOCH = datetime.date(1970, 1, 1)
TIMESTAMP_NS = 1_704_067_200_123_456_789  # 2024-01-01T00:00:00.123456789: not a float64


def _row_group(row: int) -> int:
    return int(np.searchsorted(np.cumsum(SIZES), row, side="right"))


def _has_null(group: int) -> bool:
    start = sum(SIZES[:group])
    return any(start <= row < start + SIZES[group] for row in NULL_ROWS)


@dataclass(frozen=True)
class Column:
    """A column written with ``kind`` and ``written(row)``, read back as ``read(row)`` (None:
    a null), as a tensor of ``dtype`` or, with ``dtype`` None, a list of ``python``."""

    kind: pa.DataType
    written: Callable[[int], Any]
    read: Callable[[int], Any]
    dtype: torch.dtype | None = None
    python: type | None = None
    nulls: bool = True  # written with nulls in NULL_ROWS


def _date(row: int) -> datetime.date:
    return datetime.date(2024, 1, 1) + datetime.timedelta(days=row)


COLUMNS: dict[str, Column] = {
    # Times: int64 in the unit the file stores, whatever the row group's nulls.
    "date32": Column(pa.date32(), _date, lambda r: (_date(r) - EPOCH).days, torch.int64),
    # Parquet stores every date in days: a date64 comes back a date32.
    "date64": Column(pa.date64(), _date, lambda r: (_date(r) - EPOCH).days, torch.int64),
    "time32_ms": Column(
        pa.time32("ms"), lambda r: r * 1000 + 7, lambda r: r * 1000 + 7, torch.int64
    ),
    # Parquet has no seconds: time32[s] and timestamp[s] come back in milliseconds.
    "time32_s": Column(pa.time32("s"), lambda r: r, lambda r: r * 1000, torch.int64),
    "time64_us": Column(
        pa.time64("us"), lambda r: r * 10**6 + 3, lambda r: r * 10**6 + 3, torch.int64
    ),
    "time64_ns": Column(
        pa.time64("ns"), lambda r: r * 10**9 + 5, lambda r: r * 10**9 + 5, torch.int64
    ),
    "timestamp_ns": Column(
        pa.timestamp("ns"), lambda r: TIMESTAMP_NS + r, lambda r: TIMESTAMP_NS + r, torch.int64
    ),
    "timestamp_us_utc": Column(
        pa.timestamp("us", tz="Europe/Paris"),
        lambda r: TIMESTAMP_NS // 1000 + r,
        lambda r: TIMESTAMP_NS // 1000 + r,  # since the epoch in UTC, whatever the zone
        torch.int64,
    ),
    "timestamp_s": Column(
        pa.timestamp("s"),
        lambda r: 1_704_067_200 + r,
        lambda r: (1_704_067_200 + r) * 1000,
        torch.int64,
    ),
    "duration_ms": Column(pa.duration("ms"), lambda r: r * 7, lambda r: r * 7, torch.int64),
    # Numbers.
    "float32": Column(pa.float32(), lambda r: r / 4, lambda r: r / 4, torch.float32),
    "float64": Column(pa.float64(), lambda r: r / 8, lambda r: r / 8, torch.float64),
    # Exact values: Python objects, not tensors.
    "decimal": Column(
        pa.decimal128(12, 3),
        lambda r: decimal.Decimal(r) / 8,
        lambda r: (decimal.Decimal(r) / 8).quantize(decimal.Decimal("0.001")),
        python=decimal.Decimal,
    ),
    "string": Column(pa.string(), lambda r: f"row {r}", lambda r: f"row {r}", python=str),
    "large_string": Column(pa.large_string(), lambda r: f"é{r}", lambda r: f"é{r}", python=str),
    "binary": Column(pa.binary(), lambda r: bytes([r, 0]), lambda r: bytes([r, 0]), python=bytes),
    "list": Column(
        pa.list_(pa.int32()),
        lambda r: list(range(r % 3)),
        lambda r: list(range(r % 3)),
        python=list,
    ),
    "fixed_size_list": Column(
        pa.list_(pa.float32(), 2),
        lambda r: [r, -r],
        lambda r: [r, -r],
        python=list,
        nulls=False,  # pyarrow 14 cannot write a null one to Parquet
    ),
    "struct": Column(
        pa.struct([("a", pa.int64()), ("b", pa.string())]),
        lambda r: {"a": r, "b": str(r)},
        lambda r: {"a": r, "b": str(r)},
        python=dict,
    ),
    "map": Column(
        pa.map_(pa.string(), pa.int64()), lambda r: [("k", r)], lambda r: [("k", r)], python=list
    ),
    # A dictionary comes out as its values: strings as a list of str.
    "dictionary": Column(
        pa.dictionary(pa.int32(), pa.string()),
        lambda r: ["red", "green", "blue"][r % 3],
        lambda r: ["red", "green", "blue"][r % 3],
        python=str,
    ),
}
# Without nulls: their own dtype in every batch.
NO_NULLS: dict[str, Column] = {
    "int64": Column(pa.int64(), lambda r: r, lambda r: r, torch.int64),
    "uint8": Column(pa.uint8(), lambda r: r, lambda r: r, torch.uint8),
    "int16": Column(pa.int16(), lambda r: -r, lambda r: -r, torch.int16),
    "bool": Column(pa.bool_(), lambda r: r % 2 == 0, lambda r: r % 2 == 0, torch.bool),
}
# With nulls in some row groups, as pandas and petastorm give them: float (NaN) in every batch,
# also those of the row group without one.
WITH_NULLS: dict[str, tuple[Column, torch.dtype]] = {
    "int32_nulls": (Column(pa.int32(), lambda r: r, lambda r: r, torch.int32), torch.float64),
    "bool_nulls": (
        Column(pa.bool_(), lambda r: r % 2 == 0, lambda r: r % 2 == 0, torch.bool),
        torch.float32,
    ),
}


def _write(path: Path) -> None:
    arrays: dict[str, pa.Array] = {"id": pa.array(range(ROWS), pa.int64())}
    for name, column in COLUMNS.items():
        values = [
            None if row in NULL_ROWS and column.nulls else column.written(row)
            for row in range(ROWS)
        ]
        if pa.types.is_dictionary(column.kind):
            arrays[name] = pa.array(values, column.kind.value_type).dictionary_encode()
        else:
            arrays[name] = pa.array(values, column.kind)
    for name, column in NO_NULLS.items():
        arrays[name] = pa.array([column.written(row) for row in range(ROWS)], column.kind)
    for name, (column, _) in WITH_NULLS.items():
        values = [None if row in NULL_ROWS else column.written(row) for row in range(ROWS)]
        arrays[name] = pa.array(values, column.kind)
    table = pa.table(arrays)
    with pq.ParquetWriter(str(path), table.schema) as writer:
        start = 0
        for size in SIZES:
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size
    written = pq.read_metadata(str(path))
    assert [written.row_group(k).num_rows for k in range(written.num_row_groups)] == SIZES


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("types") / "data"
    root.mkdir()
    _write(root / "part-0.parquet")
    # One process, one rank: the types do not depend on the ranks (tests/test_null_dtypes.py
    # has several). Seeded: the row groups in another order than written, the one without nulls
    # first (a batch of its own), so that the other batches join row groups with and without.
    loader = EvenLoader.from_parquet(root.as_uri(), BATCH, "truncate", reader_kwargs={"seed": 2})
    read = list(loader)
    assert sorted(int(i) for batch in read for i in batch["id"]) == list(range(ROWS))
    assert len(read) == math.ceil(ROWS / BATCH)
    return read


def _same(got: Any, expected: Any) -> bool:
    if expected is None:
        return got is None
    return bool(got == expected)


@pytest.mark.parametrize("name", list(COLUMNS))
def test_a_column_comes_out_as_the_table_says(name: str, batches: list[dict[str, Any]]) -> None:
    column = COLUMNS[name]
    for batch in batches:
        ids = [int(i) for i in batch["id"]]
        values = batch[name]
        if column.dtype is not None:
            assert isinstance(values, torch.Tensor), name
            assert values.dtype == column.dtype, (name, ids)  # in every batch, nulls or not
            got = values.tolist()
            for row, value in zip(ids, got, strict=True):
                if row not in NULL_ROWS:
                    assert value == column.read(row), (name, row)
                elif column.dtype.is_floating_point:
                    assert math.isnan(value), (name, row)
                else:
                    assert value == NULL_TIME, (name, row)
        else:
            assert isinstance(values, list), name
            for row, value in zip(ids, values, strict=True):
                expected = None if row in NULL_ROWS and column.nulls else column.read(row)
                assert _same(value, expected), (name, row, value, expected)
                if expected is not None:
                    assert isinstance(value, column.python), (name, type(value))


@pytest.mark.parametrize("name", list(NO_NULLS))
def test_a_column_without_nulls_keeps_its_dtype(name: str, batches: list[dict[str, Any]]) -> None:
    column = NO_NULLS[name]
    for batch in batches:
        assert batch[name].dtype == column.dtype, name
        assert batch[name].tolist() == [column.read(int(row)) for row in batch["id"]]


@pytest.mark.parametrize("name", list(WITH_NULLS))
def test_integers_and_booleans_with_nulls_are_float_in_every_batch(
    name: str, batches: list[dict[str, Any]]
) -> None:
    column, with_nulls = WITH_NULLS[name]
    # A batch of the row group without a null: float too.
    assert [int(row) for row in batches[0]["id"]] == list(range(SIZES[0], SIZES[0] + SIZES[1]))
    for batch in batches:
        ids = [int(i) for i in batch["id"]]
        assert batch[name].dtype == with_nulls, (name, ids)  # a batch without a null too
        for row, value in zip(ids, batch[name].tolist(), strict=True):
            if row in NULL_ROWS:
                assert math.isnan(value), (name, row)
            else:
                assert value == column.read(row), (name, row)


def test_a_null_time_is_numpys_nat() -> None:
    values = to_columns(pa.table({"t": pa.array([TIMESTAMP_NS, None], pa.timestamp("ns"))}))["t"]
    assert values.dtype == torch.int64
    assert values.tolist() == [TIMESTAMP_NS, NULL_TIME]
    as_numpy = values.numpy().view("datetime64[ns]")
    assert as_numpy[0] == np.datetime64(TIMESTAMP_NS, "ns") and np.isnat(as_numpy[1])


def test_a_null_column_is_a_list_of_none() -> None:
    assert to_columns(pa.table({"n": pa.nulls(3)}))["n"] == [None, None, None]
