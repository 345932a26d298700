"""The traps real jobs hit, each on real gloo ranks: pauses, failures before the first step,
endless and mis-sharded readers, empty shards, off-plan readers, wrong statistics, misuse.

Each test states the scenario, runs it on spawned ranks with a hard timeout, and checks what
every rank saw against what the scenario says must happen.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.datasets import shard_ids, write_plain_dataset
from tests.helpers.scenarios import shard, train_step
from tests.helpers.spawn import RankError, run_ranks

pytestmark = pytest.mark.multirank


class _Collect(logging.Handler):
    """The library's log records of one rank, as text."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @classmethod
    def attached(cls, level: int = logging.WARNING) -> _Collect:
        handler = cls(level)
        library = logging.getLogger("ddp_even")
        library.addHandler(handler)
        library.setLevel(min(level, library.getEffectiveLevel()))
        return handler


def _ddp_model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


# ---------------------------------------------------------------------------------------------
# A pause is not a failure


def _pausing_worker(rank: int, world_size: int, source_kind: str, pause_at: str) -> dict[str, Any]:
    """Rank 0 pauses 6 s (a checkpoint, an evaluation) with the loader's timeout at 3 s."""
    from ddp_even import EvenLoader

    model, optimizer = _ddp_model()
    batches = shard(rank, 6)
    source: Any = batches if source_kind == "list" else (lambda: iter(batches))
    # Between steps the others wait in DDP's all-reduce, so a short timeout is fine; at an
    # epoch's end they wait in the loader, so that case keeps the default (the training
    # group's own timeout).
    timeout = 3.0 if pause_at == "step" else None
    loader: EvenLoader[Any] = EvenLoader(source, "truncate", timeout=timeout)
    seen = []
    for epoch in range(2):
        for batch in loader:
            train_step(model, optimizer, batch)
            seen.append(batch)
            if rank == 0 and epoch == 0 and pause_at == "step" and len(seen) == 2:
                time.sleep(6)
        if rank == 0 and epoch == 0 and pause_at == "epoch":
            time.sleep(6)
    return {"seen": seen, "epochs": [stats.epoch for stats in loader.history]}


@pytest.mark.in_memory
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("source_kind", "pause_at"), [("factory", "step"), ("list", "step"), ("factory", "epoch")]
)
def test_a_pause_longer_than_the_timeout_is_not_a_failure(source_kind: str, pause_at: str) -> None:
    results = run_ranks(_pausing_worker, 2, source_kind, pause_at, timeout=90)
    for rank, result in enumerate(results):
        assert result["seen"] == shard(rank, 6) * 2
        assert result["epochs"] == [0, 1]


# ---------------------------------------------------------------------------------------------
# The roll call names the rank, always


def _dies_before_first_agreement_worker(
    rank: int, world_size: int, fault: str, victim: int
) -> dict[str, Any]:
    from ddp_even import EvenLoader, PeerTimeoutError

    batches = shard(rank, 5)

    def one_pass() -> Any:
        # Opening the reader: where a rank usually dies (OOM, a bad path) or hangs.
        if rank == victim:
            if fault == "exit":
                os._exit(1)
            # Frozen (SIGSTOP), continued 8 s later: no sign of life meanwhile.
            subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        return iter(batches)

    loader: EvenLoader[Any] = EvenLoader(one_pass, "truncate", timeout=4)
    began = time.monotonic()
    try:
        list(loader)
    except PeerTimeoutError as error:
        return {
            "missing": error.missing_ranks,
            "late": error.late,
            "message": str(error),
            "waited": time.monotonic() - began,
        }
    return {"missing": None}


@pytest.mark.in_memory
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["exit", "stall"])
def test_a_rank_lost_before_the_first_agreement_is_named(fault: str) -> None:
    results = run_ranks(
        _dies_before_first_agreement_worker,
        3,
        fault,
        2,
        timeout=90,
        capture_exceptions=True,
        pg_timeout=20,
    )
    for rank in (0, 1):
        result = results[rank]
        assert isinstance(result, dict), result
        assert result["missing"] == (2,), result
        assert "rank(s) 2 did not answer" in result["message"]
        assert not result["late"]
    if fault == "stall":
        # It woke up after the others had given up: it raises too, naming itself.
        late = results[2]
        assert isinstance(late, dict), late
        assert late["late"] and late["missing"] == (2,), late
    else:
        assert results[2] == RankError(
            "ProcessExited", "rank 2 died (exit code 1) without a result"
        )


def _store_host_worker(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader, PeerTimeoutError

    batches = shard(rank, 8)
    loader: EvenLoader[Any] = EvenLoader(lambda: iter(batches), "truncate", timeout=30)
    try:
        for steps, _ in enumerate(loader, start=1):
            if rank == 2 and steps == 3:
                os._exit(1)
    except PeerTimeoutError as error:
        # Rank 0 hosts the store and raises too: it must not take the store away before
        # rank 1 has finished its roll call.
        return {"missing": error.missing_ranks, "message": str(error)}
    return {"missing": None}


@pytest.mark.in_memory
@pytest.mark.timeout(150)
def test_survivors_name_the_dead_rank_whichever_finishes_first_with_the_store_on_rank_0() -> None:
    for _ in range(3):
        results = run_ranks(
            _store_host_worker, 3, timeout=60, capture_exceptions=True, tcp_store=True
        )
        for rank in (0, 1):
            result = results[rank]
            assert isinstance(result, dict), result
            assert result["missing"] == (2,), result


def _subgroup_worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from ddp_even import EvenLoader, PeerSourceError

    training = dist.new_group([1, 2])
    if rank == 0:
        return {"error": None}

    def one_pass() -> Any:
        for index, batch in enumerate(shard(rank, 6)):
            if rank == 2 and index == 2:
                raise OSError("corrupt row group")
            yield batch

    loader: EvenLoader[Any] = EvenLoader(one_pass, "truncate", group=training, timeout=20)
    try:
        list(loader)
    except PeerSourceError as error:
        return {"error": "PeerSourceError", "failed_rank": error.failed_rank, "text": str(error)}
    except OSError as error:
        return {"error": "OSError", "text": str(error)}
    return {"error": None}


@pytest.mark.in_memory
@pytest.mark.timeout(90)
def test_errors_in_a_subgroup_name_global_ranks() -> None:
    results = run_ranks(_subgroup_worker, 3, timeout=60)
    assert results[1]["error"] == "PeerSourceError"
    assert results[1]["failed_rank"] == 2, results[1]
    assert "rank 2's data source raised OSError" in results[1]["text"]
    assert results[2] == {"error": "OSError", "text": "corrupt row group"}


# ---------------------------------------------------------------------------------------------
# Endless and mis-sharded sources


def _endless_worker(rank: int, world_size: int, url: str, mode: str, how: str) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader

    model, optimizer = _ddp_model()
    reader = make_batch_reader(
        url,
        num_epochs=None,
        cur_shard=rank,
        shard_count=world_size,
        shuffle_row_groups=False,
        reader_pool_type="dummy",
    )
    try:
        source: Any = reader if how == "reader" else BatchedDataLoader(reader, batch_size=4)
        loader: EvenLoader[Any] = EvenLoader(source, mode, steps_per_epoch=3)
        epochs = []
        for _ in range(3):
            ids = []
            for batch in loader:
                values = torch.as_tensor(batch.value if how == "reader" else batch["value"])
                train_step(model, optimizer, values.reshape(-1).tolist())
                ids.extend(torch.as_tensor(batch.id if how == "reader" else batch["id"]).tolist())
            epochs.append(ids)
        return {"epochs": epochs, "steps": [stats.steps for stats in loader.history]}
    finally:
        reader.stop()
        reader.join()


@pytest.mark.petastorm
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "how"), [("truncate", "reader"), ("cycle", "loader")])
def test_an_endless_reader_runs_any_number_of_epochs_with_steps_per_epoch(
    tmp_path: Path, mode: str, how: str
) -> None:
    sizes = [4, 4, 4, 4, 4, 4]
    url = write_plain_dataset(tmp_path, sizes)
    results = run_ranks(_endless_worker, 2, url, mode, how, timeout=90)
    for rank, result in enumerate(results):
        assert result["steps"] == [(3, 3)] * 3
        # One stream continued across epochs: 9 batches of 4 rows, wrapping over the
        # 12-row shard at the reader's own epoch boundary, nothing skipped or repeated early.
        stream = [row for epoch in result["epochs"] for row in epoch]
        own = shard_ids(sizes, 2, rank)
        assert stream == (own * 3)[: len(stream)] and len(stream) == 36


def _endless_without_steps(rank: int, world_size: int, url: str, as_factory: bool) -> str:
    from petastorm import make_batch_reader

    from ddp_even import EvenLoader

    def endless() -> Any:
        return make_batch_reader(
            url, num_epochs=None, cur_shard=rank, shard_count=world_size, reader_pool_type="dummy"
        )

    if not as_factory:
        return _construction_error(endless())
    try:
        list(EvenLoader(endless, "truncate", timeout=20))
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.petastorm
@pytest.mark.timeout(90)
@pytest.mark.parametrize("as_factory", [False, True])
def test_an_endless_reader_without_steps_per_epoch_is_refused(
    tmp_path: Path, as_factory: bool
) -> None:
    url = write_plain_dataset(tmp_path, [4, 4, 4, 4])
    for message in run_ranks(_endless_without_steps, 2, url, as_factory, timeout=60):
        assert "num_epochs=None" in message and "steps_per_epoch" in message, message


def _construction_error(reader: Any) -> str:
    """What ``EvenLoader(reader)`` says when it refuses the reader (which is stopped after)."""
    from ddp_even import EvenLoader

    try:
        EvenLoader(reader, "truncate")
    except ValueError as error:
        return str(error)
    finally:
        reader.stop()
        reader.join()
    return "accepted"


def _no_group_worker() -> list[str]:
    from ddp_even import EvenLoader

    collected = _Collect.attached()
    assert list(EvenLoader([[1], [2]])) == [[1], [2]]
    return collected.messages


@pytest.mark.timeout(30)
def test_world_size_in_the_environment_without_a_process_group_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    messages = _no_group_worker()
    assert any(
        "WORLD_SIZE=4" in message and "init_process_group" in message for message in messages
    )


# ---------------------------------------------------------------------------------------------
# No silent zero-step epochs, no wrong statistics


def _empty_rank_worker(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    from ddp_even import EvenLoader

    model, optimizer = _ddp_model()
    batches = shard(rank, 0 if rank == 1 else 3)
    joinables = [model] if mode == "join" else ()
    loader: EvenLoader[Any] = EvenLoader(
        lambda: iter(batches), mode, joinables=joinables, timeout=20
    )
    collected = _Collect.attached()
    for _ in range(2):
        for batch in loader:
            train_step(model, optimizer, batch)
    return {
        "warnings": collected.messages,
        "summaries": [stats.summary() for stats in loader.history],
        "empty": [stats.empty_ranks for stats in loader.history],
    }


@pytest.mark.in_memory
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["truncate", "join"])
def test_an_empty_rank_is_a_warning_every_epoch(mode: str) -> None:
    results = run_ranks(_empty_rank_worker, 2, mode, timeout=60)
    for result in results:
        assert result["empty"] == [(1,), (1,)]
        assert all("EMPTY: rank 1" in summary for summary in result["summaries"])
    named = [message for message in results[0]["warnings"] if "rank(s) 1 had no batch" in message]
    assert len(named) == 2, results[0]["warnings"]  # one per epoch, on rank 0


def _lossy_cycle_worker(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader
    from ddp_even.planning import plan_shards

    model, optimizer = _ddp_model()
    # Rows 8 per rank, batches of 2: 4 batches each by the plan; rank 0's source loses one.
    plan = plan_shards([8, 8], world_size=2, batch_size=2)
    rows = list(range(rank * 100, rank * 100 + 8))
    if rank == 0:
        rows = rows[:-2]
    batches = [rows[start : start + 2] for start in range(0, len(rows), 2)]
    collected = _Collect.attached()
    loader: EvenLoader[Any] = EvenLoader(batches, "cycle", plan=plan, timeout=20)
    for batch in loader:
        train_step(model, optimizer, batch)
    stats = loader.stats
    return {
        "truncated": stats.truncated,
        "dropped_batches": stats.dropped_batches,
        "lost_rows": stats.lost_rows,
        "repeated": stats.repeated_batches,
        "warnings": collected.messages,
        "summary": stats.summary(),
    }


@pytest.mark.timeout(90)
def test_cycle_with_a_plan_reports_a_lossy_reader_as_lost_rows() -> None:
    results = run_ranks(_lossy_cycle_worker, 2, timeout=60)
    for result in results:
        assert result["truncated"] == (False, False)
        assert result["dropped_batches"] == (0, 0)
        assert result["lost_rows"] == (2, 0)
        assert result["repeated"] == (1, 0)
        assert "rows lost by the source 2/0" in result["summary"]
    assert any("rank 0 read 3 batches / 6 rows" in text for text in results[0]["warnings"])


def _off_plan_worker(rank: int, world_size: int, url: str, mode: str) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader, OffPlanError
    from ddp_even.parquet import plan_for_dataset

    model, _ = _ddp_model()
    _, balanced = plan_for_dataset(url, world_size, 4, sharding="row_groups")

    def round_robin() -> Any:
        reader = make_batch_reader(
            url, num_epochs=1, cur_shard=rank, shard_count=world_size, reader_pool_type="dummy"
        )
        return BatchedDataLoader(reader, batch_size=4)

    joinables = [model] if mode == "join" else ()
    loader: EvenLoader[Any] = EvenLoader(
        round_robin, mode, plan=balanced, joinables=joinables, timeout=20
    )
    steps = 0
    try:
        for _ in loader:
            steps += 1
    except OffPlanError as error:
        return {"error": "OffPlanError", "ranks": sorted(error.off_plan), "steps": steps}
    return {"error": None, "steps": steps}


@pytest.mark.petastorm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["truncate", "cycle"])
def test_a_plan_that_does_not_match_the_readers_fails_on_every_rank_before_a_step(
    tmp_path: Path, mode: str
) -> None:
    # Round robin gives rank 0 row groups 0, 2, 4 (40 + 1 + 1 rows), rank 1 gets 1, 3, 5;
    # a balanced plan moves row groups between them.
    url = write_plain_dataset(tmp_path, [40, 1, 1, 1, 1, 20])
    results = run_ranks(_off_plan_worker, 2, url, mode, timeout=90)
    for result in results:
        assert result == {"error": "OffPlanError", "ranks": [0, 1], "steps": 0}


def _texts_and_labels_worker(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader

    batches = [([f"text {index}"] * 6, torch.zeros(6)) for index in range(2)]
    loader: EvenLoader[Any] = EvenLoader(batches, "truncate", timeout=20)
    list(loader)
    ragged = [[[1, 2, 3], [4], [5, 6]], [[7], [8, 9]]]
    ragged_loader: EvenLoader[Any] = EvenLoader(ragged, "truncate", timeout=20)
    list(ragged_loader)
    return {"samples": loader.stats.samples, "ragged": ragged_loader.stats.samples}


@pytest.mark.in_memory
@pytest.mark.timeout(60)
def test_samples_are_counted_from_the_fields_of_tuple_batches() -> None:
    for result in run_ranks(_texts_and_labels_worker, 2, timeout=45):
        assert result["samples"] == (12, 12)
        assert result["ragged"] == (5, 5)


def _truncated_plan_worker(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader
    from ddp_even.planning import plan_shards

    plan = plan_shards([6, 2], world_size=2, batch_size=2)
    rows = [list(range(rank * 10, rank * 10 + 6)), list(range(10, 12))][rank]
    batches = [rows[start : start + 2] for start in range(0, len(rows), 2)]
    collected = _Collect.attached(logging.INFO)
    loader: EvenLoader[Any] = EvenLoader(batches, "truncate", plan=plan, timeout=20)
    list(loader)
    return {"summary": loader.stats.summary(), "logged": collected.messages}


@pytest.mark.timeout(60)
def test_the_epoch_line_says_what_was_dropped() -> None:
    results = run_ranks(_truncated_plan_worker, 2, timeout=45)
    line = "dropped batches 2/0 (rows 4/0)"
    assert all(line in result["summary"] for result in results)
    assert any(line in message for message in results[0]["logged"])


# ---------------------------------------------------------------------------------------------
# Misuse gets a clear error on every rank


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), -1.0, 0])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(timeout: float) -> None:
    from ddp_even import EvenLoader

    with pytest.raises(ValueError, match="finite positive number of seconds"):
        EvenLoader([[1]], timeout=timeout)


def _some_ranks_only_worker(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader, EvenLoaderError

    if rank != 0:
        time.sleep(8)  # validation on rank 0 only: the others never start the loader
        return {"error": None}
    began = time.monotonic()
    try:
        list(EvenLoader(shard(rank, 3), "truncate", timeout=3))
    except EvenLoaderError as error:
        return {"error": str(error), "waited": time.monotonic() - began}
    return {"error": None}


@pytest.mark.in_memory
@pytest.mark.timeout(90)
def test_iterating_on_some_ranks_only_names_the_ranks_that_never_joined() -> None:
    # Without a heartbeat (no EvenLoader yet) they may be in a long set-up: waited for up to
    # the training group's timeout, as DDP's first all-reduce would.
    result = run_ranks(_some_ranks_only_worker, 3, timeout=60, pg_timeout=5)[0]
    message = result["error"]
    assert message is not None and "rank(s) 1, 2 did not answer" in message, message
    assert "rank 1 never made an EvenLoader" in message and "rank 2 never made" in message
    assert "training group's timeout (5 s)" in message, message
    assert result["waited"] < 5 + 4


def _nested_worker(rank: int, world_size: int, how: str) -> str:
    from ddp_even import EvenLoader, EvenLoaderError

    loader: EvenLoader[Any] = EvenLoader(shard(rank, 4), "truncate", timeout=20)
    try:
        if how == "zip":
            list(zip(loader, loader, strict=False))
        else:
            for _ in loader:
                list(loader)
    except EvenLoaderError as error:
        return str(error)
    return "no error"


@pytest.mark.in_memory
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["zip", "nested"])
def test_iterating_one_loader_twice_at_once_raises(how: str) -> None:
    for message in run_ranks(_nested_worker, 2, how, timeout=60):
        assert "cannot be iterated twice at once" in message, message


class _HugeShard(Sequence[list[int]]):
    """A shard claiming more batches than one agreement can carry."""

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        return [index]


def _too_many_worker(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader, EvenLoaderError

    source = _HugeShard(2**33 if rank == 1 else 5)
    began = time.monotonic()
    try:
        list(EvenLoader(source, "truncate", timeout=20))
    except EvenLoaderError as error:
        return {"error": str(error), "waited": time.monotonic() - began}
    return {"error": None}


@pytest.mark.in_memory
@pytest.mark.timeout(90)
def test_a_count_too_large_on_one_rank_raises_on_every_rank_at_once() -> None:
    for result in run_ranks(_too_many_worker, 2, timeout=60):
        assert result["error"] is not None and "rank 1: 8589934592" in result["error"]
        assert result["waited"] < 10


def _fixed_cycle_worker(rank: int, world_size: int, sync_every: int | None) -> dict[str, Any]:
    from ddp_even import EvenLoader
    from tests.helpers.scenarios import control_collectives_issued

    batches = shard(rank, 3 + 4 * rank)
    loader: EvenLoader[Any] = EvenLoader(
        lambda: iter(batches), "cycle", steps_per_epoch=10, sync_every=sync_every, timeout=20
    )
    before = control_collectives_issued()
    seen = list(loader)
    return {"seen": seen, "collectives": control_collectives_issued() - before}


@pytest.mark.in_memory
@pytest.mark.timeout(90)
def test_cycle_with_steps_per_epoch_agrees_once_per_epoch_unless_a_window_is_set() -> None:
    from ddp_even.runtime.settings import CHECK_EVERY

    assert CHECK_EVERY > 10
    once = run_ranks(_fixed_cycle_worker, 2, None, timeout=60)
    windowed = run_ranks(_fixed_cycle_worker, 2, 5, timeout=60)
    for rank in range(2):
        own = shard(rank, 3 + 4 * rank)
        expected = (own * 4)[:10]
        assert once[rank]["seen"] == expected and windowed[rank]["seen"] == expected
        # One agreement (in both forms: it opens the epoch), the check of the sources after
        # the last step (10 < CHECK_EVERY) and the statistics gather; with windows of 5, two
        # agreements (the first in both forms) and the gather.
        assert once[rank]["collectives"] == 4, once[rank]
        assert windowed[rank]["collectives"] == 4, windowed[rank]
