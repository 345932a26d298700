"""Hive-partitioned datasets (``year=2024/city=.../part.parquet``) read by ``from_parquet``.

Each partition key is a column of every batch, typed as pyarrow's own hive partitioning types
it (compared with ``pyarrow.dataset``'s schema of the same directory), selectable in
``schema_fields``, and usable in a predicate whose kept rows the plan counts exactly; on 2 gloo
ranks a pad epoch filtered on a key trains every kept row once. No petastorm: both lanes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

from ddp_even import EvenLoader
from ddp_even.arrow.passes import make_shard_factory
from tests.helpers.spawn import run_ranks

BATCH = 4
# (year, city, rows): one file per partition, row groups of 3 rows.
PARTITIONS = [(2023, "oslo", 7), (2024, "oslo", 5), (2024, "new york", 9)]


def _write(root: Path) -> dict[int, tuple[int, str]]:
    """The dataset, and each row's (year, city) by its ``id``."""
    keys: dict[int, tuple[int, str]] = {}
    start = 0
    for year, city, rows in PARTITIONS:
        directory = root / f"year={year}" / f"city={city.replace(' ', '%20')}"
        directory.mkdir(parents=True)
        ids = list(range(start, start + rows))
        table = pa.table({"id": ids, "x": [float(i) for i in ids]})
        pq.write_table(table, directory / "part-0.parquet", row_group_size=3)
        keys.update({row: (year, city) for row in ids})
        start += rows
    return keys


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[int, str]]]:
    root = tmp_path_factory.mktemp("hive") / "ds"
    keys = _write(root)
    return str(root), keys


def _read(url: str, **options: Any) -> list[dict[str, Any]]:
    _, passes = make_shard_factory(url, 0, 1, BATCH, **options)
    with passes() as shard_pass:
        return list(shard_pass)


@pytest.mark.timeout(60)
def test_partition_keys_are_columns_typed_as_pyarrow_types_them(
    dataset: tuple[str, dict[int, tuple[int, str]]],
) -> None:
    url, keys = dataset
    batches = _read(url)
    expected = ds.dataset(url, partitioning="hive").schema
    assert expected.field("year").type == pa.int32() and expected.field("city").type == pa.string()
    for batch in batches:
        assert list(batch) == ["id", "x", "year", "city"]
        assert batch["year"].dtype == torch.int32
        for row, year, city in zip(batch["id"].tolist(), batch["year"], batch["city"], strict=True):
            assert (int(year), city) == keys[row]
    assert sorted(row for batch in batches for row in batch["id"].tolist()) == sorted(keys)


@pytest.mark.timeout(60)
def test_schema_fields_select_partition_keys(
    dataset: tuple[str, dict[int, tuple[int, str]]],
) -> None:
    url, _ = dataset
    batches = _read(url, reader_kwargs={"schema_fields": ["city", "id"]})
    assert all(list(batch) == ["city", "id"] for batch in batches)
    with pytest.raises(ValueError, match=r"names 'yaer'.*did you mean 'year'"):
        make_shard_factory(url, 0, 1, BATCH, reader_kwargs={"schema_fields": ["yaer"]})


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "predicate",
    [pc.field("city") == "new york", (pc.field("year") == 2024) & (pc.field("id") > 10)],
    ids=["a key", "a key and a column"],
)
def test_a_predicate_on_partition_keys_is_counted_exactly(
    dataset: tuple[str, dict[int, tuple[int, str]]], predicate: pc.Expression
) -> None:
    url, keys = dataset
    table = ds.dataset(url, partitioning="hive").to_table(filter=predicate)
    kept = sorted(table["id"].to_pylist())
    assert 0 < len(kept) < len(keys), "the test must drop rows"
    plan, passes = make_shard_factory(url, 0, 1, BATCH, predicate=predicate)
    assert plan.total_rows == len(kept)
    with passes() as shard_pass:
        assert sorted(row for batch in shard_pass for row in batch["id"].tolist()) == kept


def _pad_epoch_on_a_key(rank: int, world_size: int, url: str) -> dict[str, Any]:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    loader = EvenLoader.from_parquet(
        url, BATCH, "pad", sharding="rows", predicate=pc.field("city") == "oslo"
    )
    trained, steps = [], 0
    for batch in loader:
        (model(batch["x"].float().reshape(-1, 1)).sum() * loader.batch_weight).backward()
        steps += 1
        if not loader.padding:
            trained += batch["id"].tolist()
            assert set(batch["city"]) == {"oslo"}
    return {"trained": trained, "steps": steps}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_two_ranks_train_every_row_a_key_keeps_once(
    dataset: tuple[str, dict[int, tuple[int, str]]],
) -> None:
    url, keys = dataset
    runs = run_ranks(_pad_epoch_on_a_key, 2, url, timeout=100)
    assert runs[0]["steps"] == runs[1]["steps"]
    trained = sorted(row for run in runs for row in run["trained"])
    assert trained == sorted(row for row, (_, city) in keys.items() if city == "oslo")
