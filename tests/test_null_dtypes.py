"""An integer or boolean column with a null anywhere in the dataset is float in every batch of an
epoch, on every rank: decided at planning from the footers' null counts, never from the row
group being read.

Each dataset is written here with pyarrow; the expected dtype and values are computed from what
was written (which rows hold a null), not by the reader. Without statistics the decision is
conservative: a nullable column counts as holding nulls, a required one (``nullable=False``)
cannot hold any.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ddp_even import EvenLoader
from ddp_even.parquet.nulls import NullColumns
from tests.helpers.spawn import run_ranks

BATCH = 3
GROUP_ROWS = 6
GROUPS = 4
NULL_ROW = 3 * GROUP_ROWS + 2  # in the last row group alone: rank 1's under round robin


def _label(row: int) -> int | None:
    return None if row == NULL_ROW else row * 10


def _flag(row: int) -> bool | None:
    return None if row == NULL_ROW else row % 3 == 0


def _write_dataset(root: Path) -> str:
    """One file of ``GROUPS`` row groups: ``label`` (int32) and ``flag`` (bool) hold one null,
    in the last row group; ``id`` (int64) and ``small`` (uint8, a dictionary) none."""
    root.mkdir()
    rows = range(GROUPS * GROUP_ROWS)
    table = pa.table(
        {
            "id": pa.array(rows, pa.int64()),
            "label": pa.array([_label(row) for row in rows], pa.int32()),
            "flag": pa.array([_flag(row) for row in rows], pa.bool_()),
            "small": pa.array([row % 7 for row in rows], pa.uint8()).dictionary_encode(),
        }
    )
    pq.write_table(table, str(root / "part-0.parquet"), row_group_size=GROUP_ROWS)
    return root.as_uri()


def read_every_batch(rank: int, world_size: int, url: str) -> list[dict[str, Any]]:
    loader = EvenLoader.from_parquet(url, BATCH, "pad", reader_kwargs={"seed": 3})
    out = []
    for batch in loader:
        out.append(
            {
                "id": batch["id"].tolist(),
                "dtypes": {name: str(values.dtype) for name, values in batch.items()},
                "label": batch["label"].tolist(),
                "flag": batch["flag"].tolist(),
                "small": batch["small"].tolist(),
            }
        )
    return out


def _check_values(batch: dict[str, Any]) -> None:
    for row, label, flag in zip(batch["id"], batch["label"], batch["flag"], strict=True):
        if row == NULL_ROW:
            assert math.isnan(label) and math.isnan(flag)
        else:
            assert label == float(row * 10)
            assert flag == (1.0 if row % 3 == 0 else 0.0)
    assert batch["small"] == [row % 7 for row in batch["id"]]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_rank_whose_row_groups_hold_no_null_gets_floats_too(tmp_path: Path) -> None:
    url = _write_dataset(tmp_path / "ds")
    ranks = run_ranks(read_every_batch, 2, url, timeout=100)
    # Round robin: rank 0 reads row groups 0 and 2, which hold no null; rank 1 the null.
    assert sorted(row for batch in ranks[0] for row in batch["id"]) == [
        *range(0, GROUP_ROWS),
        *range(2 * GROUP_ROWS, 3 * GROUP_ROWS),
    ]
    assert NULL_ROW in [row for batch in ranks[1] for row in batch["id"]]
    for batches in ranks:
        assert len(batches) == 2 * GROUP_ROWS // BATCH
        for batch in batches:
            assert batch["dtypes"] == {
                "id": "torch.int64",
                "label": "torch.float64",
                "flag": "torch.float32",
                "small": "torch.uint8",
            }, batch["id"]
            _check_values(batch)


def _read(url: str) -> list[dict[str, Any]]:
    return list(EvenLoader.from_parquet(url, BATCH, "truncate", reader_kwargs={"seed": 1}))


def test_without_statistics_a_nullable_integer_is_float_and_a_required_one_is_not(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    schema = pa.schema(
        [
            pa.field("nullable", pa.int64()),
            pa.field("required", pa.int64(), nullable=False),
            pa.field("counted", pa.int64()),  # statistics written for this one alone
        ]
    )
    rows = list(range(12))
    table = pa.table({"nullable": rows, "required": rows, "counted": rows}, schema=schema)
    pq.write_table(table, str(root / "a.parquet"), row_group_size=4, write_statistics=["counted"])
    footer = pq.read_metadata(str(root / "a.parquet"))
    assert footer.row_group(0).column(0).statistics is None  # written as the test means
    batches = _read(root.as_uri())
    assert sorted(row for batch in batches for row in batch["required"].tolist()) == rows
    for batch in batches:
        assert batch["nullable"].dtype == torch.float64  # may hold a null: no count says
        assert batch["required"].dtype == torch.int64
        assert batch["counted"].dtype == torch.int64
        assert batch["nullable"].tolist() == [float(row) for row in batch["required"].tolist()]


def test_a_metadata_summary_says_which_columns_hold_nulls(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    collected: list[pq.FileMetaData] = []
    for index, values in enumerate([[1, 2, 3, 4], [5, None, 7, 8]]):
        table = pa.table({"id": [index * 4 + k for k in range(4)], "x": pa.array(values)})
        pq.write_table(table, str(root / f"part-{index}.parquet"), metadata_collector=collected)
        collected[-1].set_file_path(f"part-{index}.parquet")
    pq.write_metadata(table.schema, str(root / "_metadata"), metadata_collector=collected)
    batches = list(EvenLoader.from_parquet(root.as_uri(), 2, "truncate"))
    assert [batch["x"].dtype for batch in batches] == [torch.float64] * 4
    by_id = dict(
        zip(
            [row for batch in batches for row in batch["id"].tolist()],
            [value for batch in batches for value in batch["x"].tolist()],
            strict=True,
        )
    )
    assert [by_id[row] for row in (0, 1, 2, 3, 4, 6, 7)] == [1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0]
    assert math.isnan(by_id[5])
    assert [batch["id"].dtype for batch in batches] == [torch.int64] * 4


def test_a_column_after_nested_ones_is_judged_by_its_own_chunk(tmp_path: Path) -> None:
    # The nested columns before it take several column chunks each (and hold nulls).
    table = pa.table(
        {
            "point": pa.array(
                [{"a": 1, "b": None}, None], pa.struct([("a", "int8"), ("b", "int8")])
            ),
            "tags": pa.array([None, {"k": 1}], pa.map_(pa.string(), pa.int64())),
            "nested": pa.array([[[1]], None], pa.list_(pa.list_(pa.int32()))),
            "clean": pa.array([1, 2], pa.int16()),
            "dirty": pa.array([None, True], pa.bool_()),
            "last": pa.array([3, 4], pa.uint32()),
        }
    )
    pq.write_table(table, str(tmp_path / "a.parquet"))
    found = NullColumns()
    found.add(pq.read_metadata(str(tmp_path / "a.parquet")))
    assert found.names == {"dirty"}


@pytest.mark.petastorm
def test_a_transform_gets_the_column_as_float_in_every_row_groups_frame(tmp_path: Path) -> None:
    from petastorm.transform import TransformSpec

    url = _write_dataset(tmp_path / "ds")
    seen: list[tuple[str, str]] = []

    def transform(frame: Any) -> Any:
        seen.append((str(frame["label"].dtype), str(frame["flag"].dtype)))
        return frame

    loader = EvenLoader.from_parquet(
        url, BATCH, "truncate", reader_kwargs={"transform_spec": TransformSpec(transform)}
    )
    batches = list(loader)
    assert seen == [("float64", "float32")] * GROUPS  # the row groups without a null too
    for batch in batches:
        assert batch["label"].dtype == torch.float64 and batch["flag"].dtype == torch.float32
        _check_values({name: batch[name].tolist() for name in ("id", "label", "flag", "small")})
