"""A pyarrow expression's columns come from the expression itself, not from its text.

``predicate_fields`` once took every column whose name the expression's text contained:
``pc.field(1) == 1`` prints as ``(FieldPath(1) == 1)``, which contains the names ``e`` and
``d``, so the pyarrow reader read columns ``e`` and ``d`` and evaluated ``pc.field(1)`` on
``d``: it kept other rows than pyarrow keeps. Here: the fields of named, nested and positional
references on a schema whose names hide in each other's text, and two gloo ranks reading
exactly the rows the predicate keeps by its column 1, on both stacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from ddp_even import EvenLoader
from ddp_even.parquet.predicates import kept_mask, predicate_fields
from tests.helpers.spawn import run_ranks

# Names that hide in each other's text and in "FieldPath": every one is a substring trap.
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("label", pa.int64()),
        ("e", pa.int64()),
        ("d", pa.int64()),
        ("a b", pa.float64()),
        ("s", pa.struct([("x", pa.int32())])),
    ]
)
ROWS = 48
SIZES = [10, 7, 15, 16]  # rows per row group, in one file


def _table() -> pa.Table:
    ids = np.arange(ROWS, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "label": ids % 4,  # column 1: what pc.field(1) names
            "e": ids % 5,
            "d": (ids // 4) % 2,  # a column the old guess evaluated pc.field(1) on
            "a b": ids * 0.5,
            "s": [{"x": int(i % 3)} for i in ids],
        },
        schema=SCHEMA,
    )


@pytest.mark.parametrize(
    ("predicate", "fields"),
    [
        (pc.field("label") == 1, ["label"]),
        (pc.field("e") == 1, ["e"]),  # "e" is in "label" and in the text of every expression
        (pc.field("d") > pc.field("e"), ["e", "d"]),
        (pc.field("a b") > 1.0, ["a b"]),
        (pc.field("s", "x") == 1, ["s"]),
        ((pc.field("id") > 3) & (pc.field("s", "x") == pc.field("e")), ["id", "e", "s"]),
        (pc.field("label").isin([1, 2]), ["label"]),
        (pc.field("id") > 0, ["id"]),
    ],
)
def test_named_references_are_read_from_the_expression(predicate: Any, fields: list[str]) -> None:
    assert predicate_fields(predicate, SCHEMA) == fields


def test_a_string_literal_naming_columns_adds_none() -> None:
    # Its text mentions every column; the expression reads one.
    predicate = pc.field("id").cast(pa.string()) == "label e d a b s FieldPath(3)"
    assert predicate_fields(predicate, SCHEMA) == ["id"]


@pytest.mark.parametrize(
    ("predicate", "fields"),
    [
        (pc.field(1) == 1, ["id", "label"]),  # column 1 is label: read where it stands
        (pc.field(3) == 0, ["id", "label", "e", "d"]),
        (pc.field(5, 0) == 2, list(SCHEMA.names)),
        ((pc.field(1) == 1) & (pc.field("id") > 2), ["id", "label"]),
    ],
)
def test_positional_references_are_resolved_against_the_schema(
    predicate: Any, fields: list[str]
) -> None:
    assert predicate_fields(predicate, SCHEMA) == fields
    # Evaluated on those columns alone, in that order, it keeps what it keeps on the table.
    table = _table()
    assert (
        kept_mask(predicate, table.select(fields)).tolist() == kept_mask(predicate, table).tolist()
    )


def test_an_unknown_name_is_kept_for_the_caller_to_name() -> None:
    assert predicate_fields((pc.field("lable") == 1) & (pc.field("id") > 0), SCHEMA) == [
        "id",
        "lable",
    ]


def _rank_rows(rank: int, world_size: int, url: str, cache: str) -> list[int]:
    import os

    os.environ["DDP_EVEN_CACHE_DIR"] = cache
    loader = EvenLoader.from_parquet(url, 4, "pad", predicate=pc.field(1) == 1)
    rows: list[int] = []
    for batch in loader:
        if not loader.padding:
            rows += [int(value) for value in batch["id"]]
    return rows


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_two_ranks_keep_the_rows_of_column_1(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    table = _table()
    with pq.ParquetWriter(str(root / "part-0.parquet"), SCHEMA) as writer:
        start = 0
        for size in SIZES:
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size
    ranks = run_ranks(_rank_rows, 2, root.as_uri(), str(tmp_path / "cache"), timeout=90)
    expected = [row for row in range(ROWS) if row % 4 == 1]  # label == 1, by construction
    assert sorted(row for rows in ranks for row in rows) == expected
