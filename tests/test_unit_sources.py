"""``as_source`` for every kind of source, ``known_batches``, and ``count_rows``.

Real objects only: lists, generators, torch ``DataLoader``s (map-style and iterable, one with
worker processes) and a petastorm reader over a Parquet file written here.
"""

from __future__ import annotations

import math
import multiprocessing
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ddp_even.sources import FactorySource, IterableSource, ShardSource, as_source, count_rows


class _Stream(IterableDataset[int]):
    """An iterable dataset whose ``__len__`` is only a hint (it yields fewer)."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(5))

    def __len__(self) -> int:
        return 100


# --- as_source dispatch ---------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_list_is_a_restartable_source_of_known_length() -> None:
    batches = [[1, 2], [3, 4], [5]]
    source = as_source(batches)
    assert type(source) is IterableSource
    assert source.restartable
    assert not source.endless
    assert not source.continues
    assert source.known_batches() == 3
    for _ in range(2):  # every pass starts afresh
        opened = source.open_pass()
        assert list(opened) == batches
        opened.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("drop_last", "expected"), [(False, math.ceil(10 / 3)), (True, 10 // 3)])
def test_a_map_style_dataloader_knows_its_batches(drop_last: bool, expected: int) -> None:
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=3, drop_last=drop_last)
    source = as_source(loader)
    assert type(source) is IterableSource
    assert source.restartable
    assert source.known_batches() == expected
    batches = list(source.open_pass())
    assert len(batches) == expected
    assert sum(count_rows(batch) or 0 for batch in batches) == (9 if drop_last else 10)


@pytest.mark.timeout(30)
def test_an_iterable_dataset_length_is_not_trusted() -> None:
    loader = DataLoader(_Stream(), batch_size=2)
    source = as_source(loader)
    assert type(source) is IterableSource
    assert source.restartable
    assert source.known_batches() is None
    assert [batch.tolist() for batch in source.open_pass()] == [[0, 1], [2, 3], [4]]


@pytest.mark.timeout(30)
def test_a_generator_is_a_one_shot_source() -> None:
    def generate() -> Iterator[list[int]]:
        yield [1]
        yield [2]

    source = as_source(generate())
    assert type(source) is IterableSource
    assert not source.restartable
    assert source.known_batches() is None
    assert list(source.open_pass()) == [[1], [2]]
    with pytest.raises(TypeError, match="one-shot iterator and was already consumed"):
        source.open_pass()


@pytest.mark.timeout(30)
def test_a_factory_is_called_once_per_pass() -> None:
    calls: list[int] = []

    def factory() -> list[list[int]]:
        calls.append(len(calls))
        return [[len(calls)], [len(calls) * 10]]

    source = as_source(factory)
    assert type(source) is FactorySource
    assert source.restartable
    assert source.known_batches() is None
    assert calls == []  # wrapping calls nothing
    assert list(source.open_pass()) == [[1], [10]]
    assert list(source.open_pass()) == [[2], [20]]
    assert len(calls) == 2


@pytest.mark.timeout(30)
def test_a_factory_returning_something_not_iterable_fails_at_the_pass() -> None:
    source = as_source(lambda: 3.5)
    with pytest.raises(TypeError, match="the source factory returned float, which is not iterable"):
        source.open_pass()


@pytest.mark.timeout(30)
def test_a_source_is_passed_through() -> None:
    source = as_source([[1]])
    assert as_source(source) is source
    assert isinstance(source, ShardSource)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["file:///data/train.parquet", b"file:///data"])
def test_a_string_is_refused_with_advice(text: str | bytes) -> None:
    with pytest.raises(TypeError, match=r"EvenLoader\.from_parquet\(url, batch_size=\.\.\.\)"):
        as_source(text)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("thing", "name"), [(42, "int"), (object(), "object"), (None, "NoneType")])
def test_something_neither_iterable_nor_callable_is_refused(thing: object, name: str) -> None:
    with pytest.raises(TypeError, match=f"cannot read batches from {name}: pass a petastorm"):
        as_source(thing)


@pytest.mark.timeout(60)
def test_wrapping_a_dataloader_with_workers_starts_no_worker() -> None:
    loader = DataLoader(TensorDataset(torch.arange(12)), batch_size=4, num_workers=2)
    before = set(multiprocessing.active_children())
    source = as_source(loader)
    assert source.restartable
    assert source.known_batches() == 3
    assert set(multiprocessing.active_children()) == before
    assert loader._iterator is None
    # The check can see workers: iterating starts them.
    batches = iter(loader)
    try:
        assert len(set(multiprocessing.active_children()) - before) == 2
        assert sum(len(batch[0]) for batch in batches) == 12
    finally:
        del batches


# --- count_rows -----------------------------------------------------------------------------


class _Pair(NamedTuple):
    x: Any
    y: Any


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("batch", "rows"),
    [
        (torch.zeros(4, 3), 4),
        (torch.zeros(0, 3), 0),
        (torch.tensor(7.0), None),
        (np.zeros((6, 2)), 6),
        (np.float64(1.0), None),
        ({"x": torch.zeros(4, 3), "y": torch.zeros(4)}, 4),
        ({"x": torch.zeros(4, 3), "y": torch.zeros(5)}, None),
        ({"x": np.zeros(3), "scale": 2.0, "name": "abc"}, 3),
        ({"ids": [1, 2, 3], "x": torch.zeros(3, 2)}, 3),
        ({}, None),
        (OrderedDict(x=torch.zeros(2, 3), y=torch.zeros(2)), 2),
        (MappingProxyType({"x": np.zeros(5)}), 5),
        (_Pair(torch.zeros(3, 2), torch.zeros(3)), 3),
        ((torch.tensor(1.0), torch.zeros(3)), 3),
        ((["a", "b", "c"], torch.tensor([0, 1, 1])), 3),
        ([torch.zeros(5, 2), torch.zeros(5)], 5),
        ([torch.zeros(5, 2), torch.zeros(4)], None),
        ([7, 8], 2),
        (["a", "bb", "ccc"], 3),
        ([{"x": 1}, {"x": 2}, {"x": 3}], 3),
        ([(1, "a"), (2, "b")], 2),
        ([[1, 2, 3], [4]], 2),
        ([[1], [2, 3], [4, 5, 6]], 3),
        ([[1, 2], [3, 4]], None),
        ([[1, 2, 3], [4, 5, 6], [7, 8, 9]], None),
        ([], 0),
        (42, None),
        ("abcd", None),
        (None, None),
    ],
    ids=repr,
)
def test_count_rows(batch: Any, rows: int | None) -> None:
    counted = count_rows(batch)
    assert counted == rows
    assert counted is None or type(counted) is int


@pytest.mark.timeout(30)
def test_count_rows_of_a_collated_batch() -> None:
    rows = [(torch.tensor([float(i), 1.0]), i % 2) for i in range(7)]
    for batch_size, sizes in [(3, [3, 3, 1]), (7, [7])]:
        loader: DataLoader[Any] = DataLoader(rows, batch_size=batch_size)  # type: ignore[arg-type]
        assert [count_rows(batch) for batch in loader] == sizes


# --- petastorm ------------------------------------------------------------------------------


@pytest.fixture
def parquet_url(tmp_path: Path) -> str:
    table = pa.table({"id": list(range(10)), "x": [float(i) / 2 for i in range(10)]})
    pq.write_table(table, str(tmp_path / "part-0.parquet"), row_group_size=4)
    return tmp_path.as_uri()


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_a_petastorm_reader_is_found_by_the_registry(parquet_url: str) -> None:
    from petastorm import make_batch_reader

    from ddp_even.petastorm.sources import PetastormSource

    reader = make_batch_reader(parquet_url, reader_pool_type="dummy", num_epochs=1)
    try:
        source = as_source(reader)
        assert type(source) is PetastormSource and source._loader is None
        assert source.restartable  # the user's reader, read once per epoch: it can be reset
        assert not source.endless
        opened = source.open_pass()
        assert opened.reading is not None
        assert opened.reading.row_groups == frozenset({0, 1, 2})  # 10 rows in row groups of 4
        items = list(opened)
        opened.close()
        assert sorted(opened.count_samples(item) or 0 for item in items) == [2, 4, 4]
        assert sorted(int(i) for item in items for i in item.id) == list(range(10))
        assert not reader.stopped  # the user's reader stays theirs
    finally:
        reader.stop()
        reader.join()


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_a_petastorm_loader_and_a_factory_of_readers(parquet_url: str) -> None:
    from petastorm import make_batch_reader
    from petastorm.pytorch import DataLoader as PetastormDataLoader

    from ddp_even.petastorm.sources import PetastormSource

    reader = make_batch_reader(parquet_url, reader_pool_type="dummy", num_epochs=1)
    try:
        source = as_source(PetastormDataLoader(reader, batch_size=3))
        assert type(source) is PetastormSource and source._loader is not None
        batches = list(source.open_pass())
        assert [count_rows(batch) for batch in batches] == [3, 3, 3, 1]
    finally:
        reader.stop()
        reader.join()

    made: list[Any] = []

    def factory() -> Any:
        made.append(make_batch_reader(parquet_url, reader_pool_type="dummy", num_epochs=1))
        return made[-1]

    owned = as_source(factory)
    assert type(owned) is FactorySource
    opened = owned.open_pass()
    assert sum(opened.count_samples(item) or 0 for item in opened) == 10
    opened.close()
    assert len(made) == 1
    assert made[0].stopped  # a reader the factory made is stopped with its pass


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_a_petastorm_reader_stopped_mid_pass_gives_a_whole_next_pass(parquet_url: str) -> None:
    from petastorm import make_batch_reader

    reader = make_batch_reader(parquet_url, reader_pool_type="dummy", num_epochs=1)
    try:
        source = as_source(reader)
        opened = source.open_pass()
        next(opened)  # truncate stopped the epoch after one item
        opened.close()
        second = source.open_pass()
        ids = sorted(int(i) for item in second for i in item.id)
        second.close()
        assert ids == list(range(10))
    finally:
        reader.stop()
        reader.join()
