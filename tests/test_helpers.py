"""The test kit itself: multi-rank runner and Parquet/petastorm datasets."""

from __future__ import annotations

import os
import pickle
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from tests.helpers.datasets import (
    VEC_SIZE,
    batches_for,
    file_sizes,
    flat_sizes,
    shard_ids,
    shard_row_groups,
    shard_rows,
    write_plain_dataset,
    write_unischema_dataset,
)
from tests.helpers.spawn import RankError, RankFailedError, run_ranks

SKEWED = [50, 7, 30, 1, 64, 13, 20]
MULTI_FILE = [[5, 9], [1], [12, 3, 8], [4], [2, 6]]


# --- workers (module level, so they pickle by reference) -----------------------------------


def _all_reduce_worker(rank: int, world_size: int) -> dict[str, object]:
    t = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "sum": int(t.item()),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "extra": os.environ.get("DDP_EVEN_TEST_VAR"),
    }


def _record_pid(piddir: str, rank: int, pid: int, kind: str = "rank") -> None:
    Path(piddir, f"{kind}-{rank}-{pid}").touch()


def _recorded_pids(piddir: Path) -> list[int]:
    return [int(p.name.rsplit("-", 1)[1]) for p in piddir.iterdir()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _raise_on_one_rank(rank: int, world_size: int, bad_rank: int, piddir: str) -> None:
    _record_pid(piddir, rank, os.getpid())
    if rank == bad_rank:
        raise ValueError(f"boom on rank {rank}")
    dist.barrier()  # never completes: the bad rank never enters it
    time.sleep(600)


def _raise_everywhere(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("missing")
    if rank == 2:
        os._exit(3)
    raise ValueError(f"bad {rank}")


def _mixed(rank: int, world_size: int) -> int:
    if rank == 0:
        return 42
    raise RuntimeError("only rank 1 fails")


def _hang(rank: int, world_size: int, piddir: str) -> None:
    grandchild = subprocess.Popen(["sleep", "600"])
    _record_pid(piddir, rank, os.getpid())
    _record_pid(piddir, rank, grandchild.pid, "grandchild")
    if rank == 0:
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 1 never joins
    time.sleep(600)


# --- run_ranks ------------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 3])
def test_run_ranks_returns_values_in_rank_order(world_size: int) -> None:
    results = run_ranks(
        _all_reduce_worker, world_size, timeout=120, env={"DDP_EVEN_TEST_VAR": "yes"}
    )
    total = world_size * (world_size + 1) // 2
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["world_size"] == world_size
        assert r["sum"] == total
        assert r["omp"] == "1"
        assert r["threads"] == 1
        assert r["extra"] == "yes"


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(150)
def test_run_ranks_surfaces_a_rank_exception_and_kills_the_others(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_raise_on_one_rank, 2, 1, str(tmp_path), timeout=120)
    assert time.monotonic() - start < 60  # fails fast, not at the timeout
    err = info.value
    assert err.rank == 1
    assert err.error == RankError("ValueError", "boom on rank 1")
    text = str(err)
    assert "rank 1" in text
    assert "Traceback (most recent call last)" in text
    assert "_raise_on_one_rank" in text
    assert 'raise ValueError(f"boom on rank {rank}")' in text
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 2
    assert not [pid for pid in pids if _alive(pid)]


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(250)
def test_run_ranks_capture_exceptions() -> None:
    results = run_ranks(_raise_everywhere, 3, timeout=120, capture_exceptions=True)
    assert results[0] == RankError("ValueError", "bad 0")
    assert results[1] == RankError("KeyError", "'missing'")
    assert isinstance(results[2], RankError)
    assert results[2].type_name == "ProcessExited"
    assert "exit code 3" in results[2].message
    assert "raise ValueError" in results[0].traceback

    assert run_ranks(_mixed, 2, timeout=120, capture_exceptions=True) == [
        42,
        RankError("RuntimeError", "only rank 1 fails"),
    ]


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(120)
def test_run_ranks_timeout_kills_everything(tmp_path: Path) -> None:
    # Ranks come from this process's fork server, which its first run_ranks starts (seconds:
    # it imports torch); once it runs, ranks start and record their pids within a second.
    run_ranks(_all_reduce_worker, 2, timeout=120)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(_hang, 2, str(tmp_path), timeout=10)
    elapsed = time.monotonic() - start
    assert 10 <= elapsed < 60
    assert "ranks still running: [0, 1]" in str(info.value)
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 4  # two ranks, one grandchild each
    deadline = time.monotonic() + 5
    while [pid for pid in pids if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)]


@pytest.mark.timeout(10)
def test_run_ranks_rejects_unpicklable_functions_up_front() -> None:
    def local(rank: int, world_size: int) -> int:
        return rank

    with pytest.raises((pickle.PicklingError, AttributeError)):
        run_ranks(local, 2, timeout=5)
    with pytest.raises(ValueError):
        run_ranks(_mixed, 0)


# --- datasets -------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_sharding_arithmetic() -> None:
    assert shard_row_groups(7, 3, 0) == [0, 3, 6]
    assert shard_row_groups(7, 3, 2) == [2, 5]
    assert shard_row_groups(2, 3, 2) == []
    assert shard_ids([2, 3, 4], 2, 0) == [0, 1, 5, 6, 7, 8]
    assert shard_ids([[2], [3, 4]], 2, 1) == [2, 3, 4]
    assert shard_rows(SKEWED, 3, 0) == 50 + 1 + 20
    assert file_sizes([1, 2]) == [[1, 2]]
    assert flat_sizes(MULTI_FILE) == [5, 9, 1, 12, 3, 8, 4, 2, 6]
    assert [batches_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        batches_for(3, 0)


@pytest.mark.timeout(10)
def test_row_group_sizes_are_validated(tmp_path: Path) -> None:
    for bad in ([3, 0, 2], [[1], []], [], [1, [2]], [-1]):
        with pytest.raises(ValueError):
            write_plain_dataset(tmp_path / "x", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        write_plain_dataset(tmp_path / "y", [1], partition_by="label")


def _file_layout(url: str) -> dict[str, list[int]]:
    root = Path(url.removeprefix("file://"))
    layout = {}
    for path in sorted(root.rglob("*.parquet")):
        md = pq.read_metadata(str(path))
        layout[str(path.relative_to(root))] = [
            md.row_group(k).num_rows for k in range(md.num_row_groups)
        ]
    return layout


def _read_batch_ids(url: str, rank: int, world_size: int) -> list[int]:
    from petastorm import make_batch_reader

    with make_batch_reader(
        url, num_epochs=1, cur_shard=rank, shard_count=world_size, workers_count=1
    ) as reader:
        return sorted(int(i) for batch in reader for i in batch.id)


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_plain_dataset_shards_exactly(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "plain", SKEWED)
    assert url.startswith("file:///")
    assert _file_layout(url) == {"part-00000.parquet": SKEWED}
    table = pq.read_table(url.removeprefix("file://"))
    assert table.column("id").to_pylist() == list(range(sum(SKEWED)))
    assert table.column("value").to_pylist() == [i * 0.5 for i in range(sum(SKEWED))]
    assert table.column("label").to_pylist() == [i % 3 for i in range(sum(SKEWED))]
    assert [str(t) for t in table.schema.types] == ["int64", "float", "int64"]
    for rank in range(3):
        assert _read_batch_ids(url, rank, 3) == shard_ids(SKEWED, 3, rank)


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_multi_file_dataset_shards_exactly(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "multi", MULTI_FILE)
    assert _file_layout(url) == {
        f"part-{k:05d}.parquet": sizes for k, sizes in enumerate(MULTI_FILE)
    }
    for world_size in (2, 4):
        for rank in range(world_size):
            assert _read_batch_ids(url, rank, world_size) == shard_ids(MULTI_FILE, world_size, rank)


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_partitioned_dataset_shards_exactly(tmp_path: Path) -> None:
    from petastorm import make_batch_reader

    sizes = [[k + 1] for k in range(12)]  # 12 partitions: path order must not be "1, 10, 11, 2"
    url = write_plain_dataset(tmp_path / "parts", sizes, partition_by="part")
    assert "part=00011/part-00000.parquet" in _file_layout(url)
    for rank in range(3):
        assert _read_batch_ids(url, rank, 3) == shard_ids(sizes, 3, rank)
    with make_batch_reader(url, num_epochs=1, workers_count=1) as reader:
        pairs = {(int(i), int(p)) for b in reader for i, p in zip(b.id, b.part, strict=True)}
    starts = [sum(range(1, k + 1)) for k in range(12)]
    assert pairs == {(starts[k] + j, k) for k in range(12) for j in range(k + 1)}


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_unischema_dataset_shards_exactly_and_decodes(tmp_path: Path) -> None:
    from petastorm import make_reader

    for name, sizes in (("one", SKEWED), ("multi", MULTI_FILE)):
        url = write_unischema_dataset(tmp_path / name, sizes)
        for rank in range(3):
            with make_reader(
                url, num_epochs=1, cur_shard=rank, shard_count=3, workers_count=1
            ) as reader:
                rows = list(reader)
            assert sorted(int(row.id) for row in rows) == shard_ids(sizes, 3, rank)
            for row in rows:
                assert row.value == pytest.approx(row.id * 0.5)
                assert row.label == row.id % 3
                assert row.vec.dtype.name == "float32"
                assert row.vec.shape == (VEC_SIZE,)
                assert (row.vec == row.id).all()


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_batches_for_matches_petastorm_loader(tmp_path: Path) -> None:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    url = write_plain_dataset(tmp_path / "plain", SKEWED)
    for rank in range(3):
        with make_batch_reader(
            url, num_epochs=1, cur_shard=rank, shard_count=3, workers_count=1
        ) as reader:
            sizes = [len(b["id"]) for b in BatchedDataLoader(reader, batch_size=16)]
        rows = shard_rows(SKEWED, 3, rank)
        assert sum(sizes) == rows
        assert len(sizes) == batches_for(rows, 16)
