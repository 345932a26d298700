"""The predicate scan (``ddp_even.parquet.predicate_counts``): counts equal to what
petastorm's own ``make_batch_reader`` keeps per row group (hive partition keys among the
predicate's fields too), and the on-disk cache's hits and misses.

The reference counts come from petastorm alone: with ``shard_count`` equal to the number of
row groups, petastorm's round robin gives shard ``i`` exactly row group ``i``, so a reader of
that shard with the predicate yields the rows it keeps there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddp_even import PeerSourceError
from ddp_even.arrow.passes import make_shard_factory
from ddp_even.parquet import predicate_counts
from ddp_even.parquet.metadata import read_row_groups
from ddp_even.parquet.partitions import partition_keys
from ddp_even.parquet.predicate_counts import count_in_columns, matching_rows
from ddp_even.planning.row_groups import RowGroups
from ddp_even.storage import resolve_dataset
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.petastorm

# Two files; row groups of a few rows, so that several are read and converted together.
FILE_SIZES = [[5, 7, 3, 6], [4, 8, 2]]


def _table(first_id: int, size: int) -> pa.Table:
    ids = np.arange(first_id, first_id + size, dtype=np.int64)
    # Nulls in some row groups only: alone, those convert to float64, the others to int64.
    score = pa.array([None if i % 9 == 4 else int(i) for i in ids], pa.int64())
    return pa.table(
        {
            "id": ids,
            "score": score,
            "label": pa.array(["abc"[i % 3] for i in ids]),
            "flag": pa.array(ids % 4 == 0),
            "payload": pa.array([bytes(16)] * size, pa.binary()),
        }
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("predicate-scan")
    first_id = 0
    for number, sizes in enumerate(FILE_SIZES):
        tables = []
        for size in sizes:
            tables.append(_table(first_id, size))
            first_id += size
        with pq.ParquetWriter(root / f"part-{number:05d}.parquet", tables[0].schema) as writer:
            for table in tables:
                writer.write_table(table)
    return str(root)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DDP_EVEN_CACHE_DIR", str(cache))
    return cache


def _like(column: pd.Series, values: Any) -> pd.Series:
    # Petastorm's worker needs a Series (it calls .map on the mask), aligned with the frame.
    return pd.Series(values, index=column.index)


def _predicates() -> dict[str, tuple[list[str], Callable[..., Any]]]:
    return {
        "every third id": (["id"], lambda ids: ids % 3 == 0),
        # Row-group relative: each row group's own frame, numbered from 0, its own median.
        "first two rows of a row group": (["id"], lambda ids: _like(ids, ids.index < 2)),
        "above the row group's median": (["id"], lambda ids: ids > ids.median()),
        # Kept where the row group alone converts to int64 (no null there).
        "whole row groups without nulls": (
            ["score"],
            lambda score: _like(score, score.dtype == np.int64),
        ),
        "not null": (["score"], lambda score: score.notna()),
        "label and flag": (["flag", "label"], lambda flag, label: flag | (label == "b")),
    }


def _petastorm_counts(url: str, fields: list[str], predicate: Any, row_groups: int) -> list[int]:
    from petastorm import make_batch_reader

    counts = []
    for shard in range(row_groups):
        with make_batch_reader(
            "file://" + url,
            schema_fields=fields,
            predicate=predicate,
            cur_shard=shard,
            shard_count=row_groups,
            shuffle_row_groups=False,
            reader_pool_type="dummy",
            num_epochs=1,
        ) as reader:
            counts.append(sum(len(getattr(batch, fields[0])) for batch in reader))
    return counts


@pytest.fixture(scope="module")
def reference(dataset: str) -> dict[str, list[int]]:
    """Petastorm's counts for every predicate of :func:`_predicates`."""
    from petastorm.predicates import in_lambda

    row_groups = sum(len(sizes) for sizes in FILE_SIZES)
    return {
        name: _petastorm_counts(dataset, fields, in_lambda(fields, function), row_groups)
        for name, (fields, function) in _predicates().items()
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("read_bytes", [1, 32 << 20], ids=["one-row-group-a-read", "one-read"])
def test_counts_equal_what_petastorm_keeps(
    dataset: str,
    reference: dict[str, list[int]],
    read_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from petastorm.predicates import in_lambda

    monkeypatch.setattr(predicate_counts, "_READ_BYTES", read_bytes)
    resolved = resolve_dataset(dataset)
    row_groups = read_row_groups(resolved)
    keys = partition_keys(dataset, row_groups.files)
    assert keys.names == ()
    everything = list(range(len(row_groups)))
    for name, (fields, function) in _predicates().items():
        predicate = in_lambda(fields, function)
        counts = count_in_columns(
            resolved, row_groups, everything, predicate, fields, partitions=keys
        )
        assert counts == reference[name], name
        # One rank's share (i % 3 == 1), as the scan spreads row groups over the ranks.
        share = everything[1::3]
        assert count_in_columns(
            resolved, row_groups, share, predicate, fields, partitions=keys
        ) == [reference[name][index] for index in share], name


@pytest.mark.timeout(120)
def test_a_predicate_on_a_hive_partition_key_keeps_what_petastorm_keeps(tmp_path: Path) -> None:
    from petastorm import make_batch_reader
    from petastorm.predicates import in_lambda

    # part=00000/ (row groups 5, 7, 3), part=00001/ (4, 8), part=00002/ (2, 6).
    url = write_plain_dataset(tmp_path / "ds", [[5, 7, 3], [4, 8], [2, 6]], partition_by="part")
    predicate = in_lambda(
        ["part", "id"], lambda part, ids: (part.astype(int) != 1) & (ids % 3 != 0)
    )
    counts, ids = [], []
    for shard in range(7):  # one row group a shard: petastorm's count of each
        with make_batch_reader(
            url,
            predicate=predicate,
            cur_shard=shard,
            shard_count=7,
            shuffle_row_groups=False,
            reader_pool_type="dummy",
            num_epochs=1,
        ) as reader:
            kept = [int(i) for batch in reader for i in batch.id]
        counts.append(len(kept))
        ids += kept
    assert counts[3:5] == [0, 0] and sum(counts) > 0, "the test must drop a partition"
    plan, passes = make_shard_factory(url, 0, 1, 4, predicate=predicate)
    assert list(passes.row_group_sizes) == counts
    assert plan.total_rows == len(ids)
    with passes() as shard_pass:
        read = sorted(int(i) for batch in shard_pass for i in batch["id"])
    assert read == sorted(ids)


def _frames_as_read(path: Path, positions: list[int], column: str) -> Iterator[pd.DataFrame]:
    parquet_file = pq.ParquetFile(path)
    for batch in predicate_counts._read_batches(parquet_file, positions, [column]):
        table = parquet_file.read_row_groups(batch, columns=[column])
        sizes = [parquet_file.metadata.row_group(position).num_rows for position in batch]
        yield from predicate_counts._frames_per_row_group(table, sizes)


@pytest.mark.parametrize(
    ("column", "together"),
    [
        ("ints", True),
        ("ints_with_a_null", True),
        ("strings", True),
        ("times", True),
        ("categories", False),
        ("lists", False),
    ],
)
def test_each_row_group_gets_the_frame_petastorm_would_give_it(
    tmp_path: Path, column: str, together: bool
) -> None:
    rows = 30
    table = pa.table(
        {
            "ints": np.arange(rows),
            "ints_with_a_null": pa.array([None if i == 13 else i for i in range(rows)]),
            "strings": pa.array([str(i) for i in range(rows)]),
            "times": pa.array(pd.date_range("2024-01-01", periods=rows, freq="h", tz="UTC")),
            "categories": pa.array(["abc"[i // 10] for i in range(rows)]).dictionary_encode(),
            "lists": pa.array([[i, None] if i == 25 else [i] for i in range(rows)]),
        }
    )
    path = tmp_path / "types.parquet"
    pq.write_table(table, path, row_group_size=10)
    parquet_file = pq.ParquetFile(path)
    batches = list(predicate_counts._read_batches(parquet_file, [0, 1, 2], [column]))
    assert batches == ([[0, 1, 2]] if together else [[0], [1], [2]])
    frames = list(_frames_as_read(path, [0, 1, 2], column))
    assert len(frames) == 3
    for position, frame in enumerate(frames):
        alone = parquet_file.read_row_group(position, columns=[column]).to_pandas()
        pd.testing.assert_frame_equal(frame, alone, check_exact=True)
        assert frame.dtypes.tolist() == alone.dtypes.tolist()
        assert frame.index.equals(pd.RangeIndex(len(alone)))


def test_pandas_metadata_keeps_one_conversion_per_row_group(tmp_path: Path) -> None:
    frame = pd.DataFrame({"x": np.arange(30)}, index=pd.RangeIndex(100, 130))
    path = tmp_path / "pandas.parquet"
    pq.write_table(pa.Table.from_pandas(frame), path, row_group_size=10)
    batches = predicate_counts._read_batches(pq.ParquetFile(path), [0, 1, 2], ["x"])
    assert list(batches) == [[0], [1], [2]]


class Ranks:
    """``share`` as rank ``rank`` sees it: per call, its own list among the given others'."""

    def __init__(self, rank: int, *others: list[list[int]]) -> None:
        self.rank = rank
        self.others = list(others)  # per call: the other ranks' lists, in rank order

    def __call__(self, mine: list[int]) -> list[list[int]]:
        everyone = list(self.others.pop(0))
        everyone.insert(self.rank, mine)
        return everyone


def _counting(calls: list[list[int]]) -> Callable[[Any], list[int]]:
    def count_share(indices: Any) -> list[int]:
        calls.append(list(indices))
        return [index * 10 for index in indices]

    return count_share


def _groups(sizes: list[int], footer_digest: bytes | None = None) -> RowGroups:
    count = len(sizes)
    return RowGroups(
        files=("/data/a.parquet",),
        file_of=np.zeros(count, dtype=np.int64),
        index_in_file=np.arange(count, dtype=np.int64),
        num_rows=np.array(sizes, dtype=np.int64),
        footer_digests=None if footer_digest is None else (footer_digest,),
    )


def test_a_miss_scans_this_ranks_share_and_a_hit_on_every_rank_does_not(
    private_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from petastorm.predicates import in_lambda

    caplog.set_level(logging.INFO, logger="ddp_even")
    groups = _groups([100] * 5)
    predicate = in_lambda(["id"], lambda ids: ids % 2 == 0)
    calls: list[list[int]] = []

    def run(share: Ranks) -> list[int]:
        counted = matching_rows(
            groups,
            predicate,
            key_parts=[b"batch"],
            count_share=_counting(calls),
            rank=share.rank,
            world_size=2,
            share=share,
        )
        return counted.num_rows.tolist()

    # Miss: rank 0 counts 0, 2, 4; rank 1 sends "no failure" and its counts of 1 and 3
    # (padded with -1); a last round holds every rank until rank 0 has written the cache.
    written_before_the_last_round: list[bool] = []

    class CheckingRanks(Ranks):
        def __call__(self, mine: list[int]) -> list[list[int]]:
            if len(self.others) == 1:
                written = list(private_cache.glob("predicate-counts-*.npy"))
                written_before_the_last_round.append(len(written) == 1)
            return super().__call__(mine)

    assert run(CheckingRanks(0, [[0]], [[0, 10, 30, -1]], [[0]])) == [0, 10, 20, 30, 40]
    assert calls == [[0, 2, 4]]
    assert len(list(private_cache.glob("predicate-counts-*.npy"))) == 1
    assert written_before_the_last_round == [True]
    # Hit on every rank: nothing is counted.
    calls.clear()
    assert run(Ranks(0, [[1]])) == [0, 10, 20, 30, 40]
    assert calls == []
    assert any("from the cache" in message for message in caplog.messages)
    # Another rank lacks the entry: every rank scans again.
    assert run(Ranks(1, [[0]], [[0, 0, 20, 40]], [[0]])) == [0, 10, 20, 30, 40]
    assert calls == [[1, 3]]


def test_a_count_that_fails_on_one_rank_fails_every_rank(private_cache: Path) -> None:
    from petastorm.predicates import in_lambda

    groups = _groups([100] * 4)
    predicate = in_lambda(["id"], lambda ids: ids % 2 == 0)

    def fails(indices: Any) -> list[int]:
        raise OSError("row group 1 is unreadable")

    def run(rank: int, count_share: Any, *others: list[list[int]]) -> None:
        matching_rows(
            groups,
            predicate,
            key_parts=[b"batch"],
            count_share=count_share,
            rank=rank,
            world_size=2,
            share=Ranks(rank, *others),
        )

    said = [*b"OSError\nrow group 1 is unreadable"]
    # Rank 1 failed: rank 0 hears it in a second round and names it.
    with pytest.raises(PeerSourceError) as heard:
        run(0, _counting([]), [[0]], [[1, -1, -1]], [said + [0] * 991])
    assert (heard.value.failed_rank, heard.value.error_type) == (1, "OSError")
    assert heard.value.error_message == (
        "row group 1 is unreadable, while counting the predicate's rows"
    )
    # Rank 1 itself raises its own error, after telling the others.
    with pytest.raises(OSError, match="unreadable"):
        run(1, fails, [[0]], [[0, 0, 20]], [[0] * 1024])


@pytest.mark.timeout(60)
def test_a_predicate_returning_numpy_is_refused_before_training(tmp_path: Path) -> None:
    from petastorm.predicates import in_lambda

    url = write_plain_dataset(tmp_path / "ds", [[10, 20]])
    numpy_mask = in_lambda(["id"], lambda ids: ids.to_numpy() % 2 == 0)
    with pytest.raises(TypeError, match="returned a ndarray; make_batch_reader needs a pandas"):
        make_shard_factory(url, 0, 1, 4, predicate=numpy_mask)


def test_the_cache_key_follows_predicate_sizes_footers_and_reader_kind() -> None:
    from petastorm.predicates import in_lambda

    def key(
        sizes: list[int],
        function: Callable[..., Any],
        kind: bytes = b"batch",
        footer_digest: bytes = b"footer",
    ) -> Any:
        predicate = in_lambda(["id"], function)
        return predicate_counts._cache_file(_groups(sizes, footer_digest), predicate, [kind])

    def even(ids: Any) -> Any:
        return ids % 2 == 0

    def odd(ids: Any) -> Any:
        return ids % 2 == 1

    assert key([3, 4], even) == key([3, 4], even), "the same predicate built twice"
    assert key([3, 4], even) != key([3, 4], odd)
    assert key([3, 4], even) != key([3, 5], even)
    assert key([3, 4], even) != key([3, 4], even, b"row")
    assert key([3, 4], even) != key([3, 4], even, footer_digest=b"rewritten in place")


def test_a_cache_entry_of_another_length_is_ignored(private_cache: Path) -> None:
    private_cache.mkdir()
    path = private_cache / "predicate-counts-x.npy"
    np.save(path, np.arange(3, dtype=np.int64))
    assert predicate_counts._read_cache(path, 4) is None
    assert predicate_counts._read_cache(path, 3) is not None
    path.write_bytes(b"not numpy")
    assert predicate_counts._read_cache(path, 3) is None


def _raises_on_ids_10_to_29(ids: Any) -> Any:
    if ids.min() >= 10 and ids.max() < 30:
        raise ValueError("a predicate that cannot take ids 10 to 29")
    return ids % 2 == 0


def plan_with_a_failing_predicate(rank: int, world_size: int, url: str) -> tuple[str, str]:
    from petastorm.predicates import in_lambda

    from ddp_even import EvenLoader

    try:
        EvenLoader.from_parquet(
            url, batch_size=4, predicate=in_lambda(["id"], _raises_on_ids_10_to_29)
        )
    except (ValueError, PeerSourceError) as error:
        return type(error).__name__, str(error)
    return "", ""


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_predicate_failing_in_one_ranks_scan_stops_every_rank(tmp_path: Path) -> None:
    # Row groups 0, 1, 2: rank 1 scans row group 1 (ids 10 to 29), rank 0 the others.
    url = write_plain_dataset(tmp_path / "ds", [[10, 20, 30]])
    env = {"DDP_EVEN_CACHE_DIR": str(tmp_path / "cache")}
    first, second = run_ranks(plan_with_a_failing_predicate, 2, url, env=env, timeout=100)
    assert second == ("ValueError", "a predicate that cannot take ids 10 to 29")
    assert first == (
        "PeerSourceError",
        "rank 1's data source raised ValueError: a predicate that cannot take ids 10 to 29, "
        "while counting the predicate's rows (before the first step); every rank stops here",
    )
