"""Files with different columns are refused when the dataset is planned, on every rank alike.

A column added in later files once changed a batch's keys mid-epoch (``['id']`` then ``['id',
'x']``, the batch spanning both files without ``x``), or, the files the other way round, raised
a bare ``KeyError: 'x'`` mid-epoch. Now planning compares every file's footer with the first's
and raises a ``DatasetError`` naming both files and each column they differ in, before the
first step; files with the same columns in another order read as one dataset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddp_even import DatasetError, EvenLoader
from ddp_even.parquet import read_row_groups
from tests.helpers.spawn import run_ranks


def _write(root: Path, tables: list[pa.Table]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for index, table in enumerate(tables):
        pq.write_table(table, root / f"part-{index}.parquet", row_group_size=5)
    return root.as_uri()


def _ids(start: int, stop: int) -> pa.Array:
    return pa.array(range(start, stop), pa.int64())


def _added_column(root: Path) -> str:
    """x added from the second file on (a column added to a table that is appended to)."""
    return _write(
        root,
        [
            pa.table({"id": _ids(0, 12)}),
            pa.table({"id": _ids(12, 20), "x": pa.array([0.5] * 8)}),
            pa.table({"id": _ids(20, 31), "x": pa.array([1.5] * 11)}),
        ],
    )


def test_a_column_only_some_files_have_is_named_with_both_files(tmp_path: Path) -> None:
    url = _added_column(tmp_path / "added")
    with pytest.raises(DatasetError) as refused:
        read_row_groups(url)
    message = str(refused.value)
    assert "part-0.parquet and " in message and "part-1.parquet have different columns" in message
    assert "(x only in part-1.parquet)" in message
    assert "\n" not in message


def test_a_column_of_another_type_is_named_with_both_types(tmp_path: Path) -> None:
    url = _write(
        tmp_path / "typed",
        [
            pa.table({"id": _ids(0, 6), "label": pa.array([1] * 6, pa.int64())}),
            pa.table({"id": _ids(6, 9), "label": pa.array([1.0] * 3, pa.float64())}),
        ],
    )
    with pytest.raises(DatasetError, match=r"label is int64 in one, double in the other"):
        read_row_groups(url)


def test_the_same_columns_in_another_order_read_as_one_dataset(tmp_path: Path) -> None:
    url = _write(
        tmp_path / "ordered",
        [
            pa.table({"id": _ids(0, 7), "x": pa.array([0.0] * 7)}),
            pa.table({"x": pa.array([1.0] * 6), "id": _ids(7, 13)}),
        ],
    )
    loader = EvenLoader.from_parquet(url, 4, "truncate")
    batches = list(loader)
    assert sorted(int(i) for batch in batches for i in batch["id"]) == list(range(13))
    assert all(set(batch) == {"id", "x"} for batch in batches)


def test_a_file_without_rows_is_not_compared(tmp_path: Path) -> None:
    url = _write(
        tmp_path / "empty",
        [pa.table({"id": _ids(0, 7)}), pa.table({"other": pa.array([], pa.string())})],
    )
    assert read_row_groups(url).total_rows == 7


def _plan_on_rank(rank: int, world_size: int, url: str) -> dict[str, Any]:
    try:
        EvenLoader.from_parquet(url, 4, "pad")
    except DatasetError as error:
        return {"refused": str(error)}
    return {"refused": None}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_every_rank_refuses_before_the_first_step_with_the_same_message(tmp_path: Path) -> None:
    url = _added_column(tmp_path / "added")
    ranks = run_ranks(_plan_on_rank, 2, url, timeout=90)
    messages = [rank["refused"] for rank in ranks]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "x only in part-1.parquet" in messages[0]
