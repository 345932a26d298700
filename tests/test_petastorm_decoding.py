"""A dataset petastorm wrote, read by ``from_parquet``: what petastorm's own reader hands out.

One Unischema dataset of every kind of field a user has (scalars without a codec, numpy types
torch lacks, strings, an ``NdarrayCodec`` matrix, a ``CompressedNdarrayCodec`` array), written as
petastorm writes it (no Spark: the Unischema pickled into ``_common_metadata``). Every batch of
``from_parquet(reader="row")`` must equal the batch of petastorm's ``DataLoader(make_reader(...))``
over the same rows: the same fields, dtypes, shapes and values; a ``transform_spec`` too, for the
row reader and the batch reader; a petastorm predicate on a decoded field keeps what
``make_reader`` keeps.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ddp_even.arrow.passes import make_shard_factory

pytestmark = pytest.mark.petastorm

BATCH = 4
ROWS_PER_GROUP = (5, 3, 6)


def _unischema() -> Any:
    from petastorm.codecs import CompressedNdarrayCodec, NdarrayCodec
    from petastorm.unischema import Unischema, UnischemaField

    return Unischema(
        "Everything",
        [
            UnischemaField("id", np.int64, (), None, False),
            UnischemaField("flag", np.bool_, (), None, False),
            UnischemaField("count", np.uint16, (), None, False),
            UnischemaField("name", np.str_, (), None, False),
            UnischemaField("matrix", np.float64, (2, 3), NdarrayCodec(), False),
            UnischemaField("image", np.uint8, (4, 4, 3), CompressedNdarrayCodec(), False),
        ],
    )


def _write(directory: Path) -> str:
    from petastorm.etl.dataset_metadata import ROW_GROUPS_PER_FILE_KEY, UNISCHEMA_KEY

    schema = _unischema()
    directory.mkdir(parents=True)
    ids = np.arange(sum(ROWS_PER_GROUP))
    encode = {name: field for name, field in schema.fields.items()}

    def encoded(name: str, value: Any) -> bytes:
        field = encode[name]
        return bytes(field.codec.encode(field, value))

    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "flag": pa.array(ids % 3 == 0),
            "count": pa.array(ids * 1000, pa.uint16()),
            "name": pa.array([f"row-{row}" for row in ids]),
            "matrix": pa.array(
                [encoded("matrix", np.full((2, 3), row / 2, np.float64)) for row in ids]
            ),
            "image": pa.array(
                [encoded("image", np.full((4, 4, 3), row * 10 % 256, np.uint8)) for row in ids]
            ),
        }
    )
    path = directory / "part-00000.parquet"
    with pq.ParquetWriter(path, table.schema) as writer:
        start = 0
        for rows in ROWS_PER_GROUP:
            writer.write_table(table.slice(start, rows))
            start += rows
    metadata = {
        UNISCHEMA_KEY: pickle.dumps(schema),
        ROW_GROUPS_PER_FILE_KEY: json.dumps({path.name: len(ROWS_PER_GROUP)}).encode(),
    }
    pq.write_metadata(table.schema.with_metadata(metadata), str(directory / "_common_metadata"))
    return directory.resolve().as_uri()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory.mktemp("decoding") / "ds")


def _petastorms(url: str, batch_reader: bool = False, **options: Any) -> list[dict[str, Any]]:
    from petastorm import make_batch_reader, make_reader
    from petastorm.pytorch import BatchedDataLoader, DataLoader

    settings = {"num_epochs": 1, "shuffle_row_groups": False, "reader_pool_type": "dummy"}
    if batch_reader:
        with BatchedDataLoader(make_batch_reader(url, **settings, **options), BATCH) as loader:
            return list(loader)
    with DataLoader(make_reader(url, **settings, **options), batch_size=BATCH) as loader:
        return list(loader)


def _ours(url: str, **options: Any) -> list[dict[str, Any]]:
    reader_kwargs = {"shuffle_row_groups": False, **options.pop("reader_kwargs", {})}
    _, passes = make_shard_factory(url, 0, 1, BATCH, reader_kwargs=reader_kwargs, **options)
    with passes() as shard_pass:
        return list(shard_pass)


def _assert_same_batches(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    assert len(ours) == len(theirs)
    for mine, petastorms in zip(ours, theirs, strict=True):
        assert list(mine) == list(petastorms) or set(mine) == set(petastorms)
        for name, expected in petastorms.items():
            got = mine[name]
            if isinstance(expected, torch.Tensor):
                assert isinstance(got, torch.Tensor), name
                assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
                assert torch.equal(got, expected), name
            else:
                assert list(got) == list(expected), name


@pytest.mark.timeout(60)
def test_every_field_is_decoded_as_petastorms_reader_hands_it_out(url: str) -> None:
    ours, theirs = _ours(url, reader="row"), _petastorms(url)
    _assert_same_batches(ours, theirs)
    first = ours[0]
    # What petastorm's loaders promote, and the codecs' shapes, spelled out.
    assert (first["flag"].dtype, first["count"].dtype) == (torch.uint8, torch.uint16)
    assert first["matrix"].shape == (BATCH, 2, 3) and first["image"].shape == (BATCH, 4, 4, 3)
    assert first["name"] == ["row-0", "row-1", "row-2", "row-3"]


@pytest.mark.timeout(60)
def test_schema_fields_take_unischema_fields_and_petastorms_regular_expressions(url: str) -> None:
    schema = _unischema()
    ours = _ours(url, reader="row", reader_kwargs={"schema_fields": [schema.id, "ma.*"]})
    assert list(ours[0]) == ["id", "matrix"]
    _assert_same_batches(ours, _petastorms(url, schema_fields=[schema.id, "ma.*"]))


@pytest.mark.timeout(60)
def test_a_row_predicate_sees_decoded_rows_as_in_make_reader(url: str) -> None:
    from petastorm.predicates import in_lambda

    # On the decoded matrix: petastorm calls it per row with the decoded value.
    def keeps(matrix: Any) -> bool:
        return bool(matrix[0, 0] >= 2.0)

    predicate = in_lambda(["matrix"], keeps)
    ours = _ours(url, reader="row", predicate=predicate)
    theirs = _petastorms(url, predicate=predicate)
    ids = [int(row) for batch in ours for row in batch["id"]]
    assert ids == list(range(4, sum(ROWS_PER_GROUP)))
    assert sorted(ids) == sorted(int(row) for batch in theirs for row in batch["id"])


@pytest.mark.timeout(60)
def test_a_row_transform_is_applied_to_each_decoded_row_as_petastorm_does(url: str) -> None:
    from petastorm.transform import TransformSpec

    def doubled(row: dict[str, Any]) -> dict[str, Any]:
        row["twice"] = row["matrix"] * 2
        return row

    spec = TransformSpec(
        doubled, edit_fields=[("twice", np.float64, (2, 3), False)], removed_fields=["image"]
    )
    ours = _ours(url, reader="row", reader_kwargs={"transform_spec": spec})
    assert "image" not in ours[0] and torch.equal(ours[0]["twice"], ours[0]["matrix"] * 2)
    _assert_same_batches(ours, _petastorms(url, transform_spec=spec))


@pytest.mark.timeout(60)
def test_a_batch_transform_gets_a_row_groups_frame_as_make_batch_reader_gives_it(
    tmp_path: Path,
) -> None:
    from petastorm.transform import TransformSpec

    from tests.helpers.datasets import write_plain_dataset

    plain = write_plain_dataset(tmp_path / "plain", [[5, 3], [6]])

    def shifted(frame: Any) -> Any:
        return frame.assign(value=frame["value"] + 100.0)

    spec = TransformSpec(shifted, removed_fields=["label"])
    ours = _ours(plain, reader_kwargs={"transform_spec": spec})
    theirs = _petastorms(plain, batch_reader=True, transform_spec=spec)
    _assert_same_batches(ours, theirs)
    assert "label" not in ours[0] and float(ours[0]["value"][0]) >= 100.0


@pytest.mark.timeout(60)
def test_reader_row_on_plain_parquet_says_it_needs_a_unischema(tmp_path: Path) -> None:
    from ddp_even.errors import DatasetError
    from tests.helpers.datasets import write_plain_dataset

    plain = write_plain_dataset(tmp_path / "plain", [[5]])
    with pytest.raises(DatasetError, match=r"has no petastorm Unischema.*reader='batch'"):
        make_shard_factory(plain, 0, 1, BATCH, reader="row")
