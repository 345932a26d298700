"""Spark's own engine: ``TorchDistributor`` running ddp_even over a petastorm converter.

``pyspark.ml.torch.distributor.TorchDistributor(num_processes=2, use_gpu=False)`` with
``local_mode=True`` (``torchrun`` on the driver) and with ``local_mode=False`` (one Spark
barrier task per rank, each starting ``torchrun``: how it runs on a cluster), on the run's one
Spark session (``tests/conftest.py``; ``local[2]``, because a barrier stage of 2 tasks needs
2 task slots at once). Each run trains one epoch in every ddp_even mode
(``tests/helpers/distributor_job.py``); rank and world size come from the process group
made from what TorchDistributor set. On the driver the tests check each rank's rows against
petastorm's round robin over the converter's files (read with pyarrow), the statistics, the
DDP replicas, and that the job left no ``torchrun`` or rank process behind. The errors:
too few task slots and a converter whose files the ranks cannot see, said at once.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddp_even.errors import ConverterDeletedError, TooFewTaskSlotsError
from ddp_even.petastorm.spark_converter import check_distributor
from tests.helpers import distributor_job
from tests.helpers.spark import round_robin_ids, skewed_dataframe

pytestmark = [pytest.mark.petastorm, pytest.mark.spark]

WORLD_SIZE = 2
# 110 rows in 6 partitions (one row group each): however Spark orders the files, the two
# shards differ by at least one batch of 8, so truncate drops and cycle repeats.
SIZES = [40, 5, 25, 3, 30, 7]
BATCH_SIZE = 8
MODES = ["truncate", "cycle", "pad", "join"]
# Processes a finished job must not leave behind (command-line fragments).
LAUNCHER_PROCESSES = ("torch.distributed.run", "torch_run_process_wrapper")


@pytest.fixture(scope="module")
def converters(spark: Any) -> Iterator[tuple[Any, Any]]:
    """A converter of ``SIZES`` and one deleted before any training."""
    from petastorm.spark import make_spark_converter
    from pyspark import cloudpickle

    # The ranks unpickle the training function: by value, so they need no `tests` package.
    cloudpickle.register_pickle_by_value(distributor_job)
    converter = make_spark_converter(skewed_dataframe(spark, SIZES))
    deleted = make_spark_converter(skewed_dataframe(spark, [3, 4, 5, 6]))
    deleted.delete()
    yield converter, deleted
    converter.delete()
    cloudpickle.unregister_pickle_by_value(distributor_job)


def _descendants(pid: int) -> dict[int, str]:
    """Command lines of every live process below ``pid`` (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses: the parent follows the last ')'.
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # exited while being read
        children.setdefault(parent, []).append(int(entry.name))
        commands[int(entry.name)] = command
    found: dict[int, str] = {}
    pending = list(children.get(pid, []))
    while pending:
        child = pending.pop()
        found[child] = commands.get(child, "")
        pending += children.get(child, [])
    return found


def _left_behind(rank_pids: list[int], grace_s: float = 10.0) -> list[str]:
    """Rank processes still alive, and launcher processes below this one, after a grace."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [f"rank pid {pid}" for pid in rank_pids if Path(f"/proc/{pid}").exists()]
        launchers = [
            f"{pid}: {command[:200]}"
            for pid, command in _descendants(os.getpid()).items()
            if any(fragment in command for fragment in LAUNCHER_PROCESSES)
        ]
        if not (alive or launchers) or time.monotonic() > deadline:
            return alive + launchers
        time.sleep(0.5)


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("local_mode", [True, False], ids=["local_mode", "barrier_tasks"])
def test_torch_distributor_trains_every_mode(
    spark: Any, converters: tuple[Any, Any], local_mode: bool
) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    converter, _ = converters
    distributor = TorchDistributor(num_processes=WORLD_SIZE, local_mode=local_mode, use_gpu=False)
    check_distributor(distributor, converter)
    reports = distributor.run(distributor_job.train_every_mode, converter, MODES, BATCH_SIZE)

    assert [report["rank"] for report in reports] == list(range(WORLD_SIZE))
    for rank, report in enumerate(reports):
        # The process group is the one torchrun's environment describes.
        assert report["world_size"] == WORLD_SIZE
        assert report["env"]["RANK"] == str(rank)
        assert report["env"]["WORLD_SIZE"] == str(WORLD_SIZE)
    own = round_robin_ids(list(converter.file_urls), WORLD_SIZE)
    own_batches = [math.ceil(len(ids) / BATCH_SIZE) for ids in own]
    assert min(own_batches) < max(own_batches), "the shards must be uneven for this test"
    expected_steps = {
        "truncate": [min(own_batches)] * WORLD_SIZE,
        "cycle": [max(own_batches)] * WORLD_SIZE,
        "pad": [max(own_batches)] * WORLD_SIZE,
        "join": own_batches,
    }
    for mode in MODES:
        seen = [report["modes"][mode] for report in reports]
        stats = seen[0]["stats"]
        assert all(rank_seen["stats"] == stats for rank_seen in seen), (mode, "stats differ")
        assert len({tuple(rank_seen["weights"]) for rank_seen in seen}) == 1, "replicas diverged"
        assert list(stats["steps"]) == expected_steps[mode], mode
        every_row: list[int] = []
        for rank, rank_seen in enumerate(seen):
            rows = [i for batch in rank_seen["batches"] for i in batch]
            assert len(rank_seen["batches"]) == expected_steps[mode][rank], (mode, rank)
            assert stats["samples"][rank] == len(rows), (mode, rank)
            if mode == "pad":
                # The shard's batches, then padding (flagged) until the longest shard ends:
                # the rows that trained are the real ones.
                flags = rank_seen["padding"]
                assert flags == [step >= own_batches[rank] for step in range(len(flags))], rank
                assert stats["padded_batches"][rank] == max(own_batches) - own_batches[rank]
                real = [
                    batch for batch, pad in zip(rank_seen["batches"], flags, strict=True) if not pad
                ]
                rows = [i for batch in real for i in batch]
            every_row += rows
            if mode == "cycle":
                # Every row of the shard, the short shard's first rows again.
                assert set(rows) == set(own[rank]), (mode, rank)
            else:
                assert len(rows) == len(set(rows)), (mode, rank, "a row repeated")
                assert set(rows) <= set(own[rank]), (mode, rank)
        if mode in ("join", "pad"):
            assert sorted(every_row) == list(range(sum(SIZES))), f"{mode}: every real row once"
        if mode == "cycle":
            assert set(every_row) == set(range(sum(SIZES))), "cycle: every row"
            assert len(every_row) > sum(SIZES), "cycle repeats the short shard's rows"
        if mode == "truncate":
            assert len(every_row) < sum(SIZES), "truncate drops the long shard's last batches"
    assert _left_behind([report["pid"] for report in reports]) == []
    # The session is still usable after the job (a barrier stage leaves no slot taken).
    assert spark.range(0, 10, 1, 2).count() == 10


@pytest.mark.timeout(120)
def test_too_few_task_slots_are_refused_before_spark_waits(converters: tuple[Any, Any]) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    converter, _ = converters
    # 3 barrier tasks on local[2]: Spark itself would retry for 10 minutes (measured: 608 s).
    distributor = TorchDistributor(num_processes=3, local_mode=False, use_gpu=False)
    started = time.monotonic()
    with pytest.raises(TooFewTaskSlotsError, match=r"num_processes=2 or fewer") as raised:
        check_distributor(distributor, converter)
    assert time.monotonic() - started < 10  # local[2]: no wait for executors
    assert (raised.value.tasks, raised.value.slots) == (3, 2)
    assert "local[2]" in str(raised.value) and "local_mode=True" in str(raised.value)
    # On the driver the same three ranks fit: local mode needs no task slots.
    check_distributor(TorchDistributor(num_processes=3, local_mode=True, use_gpu=False))


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_ranks_that_cannot_see_the_converter_fail_the_job_at_once(
    converters: tuple[Any, Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """What a rank sees when its machine cannot reach the cache: the files are not there."""
    from pyspark.ml.torch.distributor import TorchDistributor

    _, deleted = converters
    distributor = TorchDistributor(num_processes=WORLD_SIZE, local_mode=False, use_gpu=False)
    with pytest.raises(ConverterDeletedError, match="PARENT_CACHE_DIR_URL_CONF"):
        check_distributor(distributor, deleted)
    # Run anyway: every rank raises when its loader is built and the Spark job fails.
    started = time.monotonic()
    # py4j's error type varies by release; the message says what failed.
    with pytest.raises(Exception) as raised:
        distributor.run(distributor_job.train_every_mode, deleted, ["join"], BATCH_SIZE)
    elapsed = time.monotonic() - started
    assert "barrier" in str(raised.value), raised.value
    # The ranks' output reaches the driver (TorchDistributor streams it to the driver's stderr
    # from barrier tasks), where ddp_even's message says what to do.
    captured = capfd.readouterr()
    output = captured.out + captured.err
    assert output.count("ConverterDeletedError: the Spark converter's Parquet files") >= 1
    assert "PARENT_CACHE_DIR_URL_CONF" in output
    # No rank waited for another: a rank left alone would have raised after the job's 60 s
    # agreement timeout. Ending took 22-35 s here, 103 s under a load average of 23.
    assert "PeerTimeoutError" not in output
    assert elapsed < 240, f"the job took {elapsed:.0f} s to fail"
    assert _left_behind([]) == []
