"""Failures reach every rank: dead and stalled peers time out with a name; consumers may stop.

* A rank that dies (``os._exit``, SIGKILL) or stalls (frozen by SIGSTOP: no sign of life) while
  the others wait at an agreement: the others raise :class:`PeerTimeoutError` naming it, at
  once for a dead rank, after the loader's ``timeout`` for a stalled one; a stalled rank that
  wakes up raises too. (A rank that is merely slow, alive, is waited for: ``test_liveness.py``.)
* ``break``, an exception in the training step, or a loader dropped mid-epoch, on every rank
  at the same step: the next epoch yields what it must and no control collective is left
  behind on any rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest

from ddp_even.modes import MODES
from tests.helpers.scenarios import (
    Outcome,
    Scenario,
    expected_batches,
    run_scenarios_one_model,
    shard,
    train_step,
)
from tests.helpers.spawn import RankError, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.in_memory]

# ---------------------------------------------------------------------------------------------
# Dead and stalled peers


@dataclass(frozen=True)
class PeerFault:
    mode: str
    # "exit" (os._exit(1)), "kill" (SIGKILL to itself) or "stall" (SIGSTOP to itself,
    # continued ``stall_s`` later by a helper process, then goes on).
    fault: str
    # "factory" (ranks agree every window) or "list" (known lengths: one agreement at the
    # start, the next collective is the statistics gather at the end of the epoch).
    source: str = "factory"
    sync_every: int | None = None
    victims: tuple[int, ...] = (2,)
    # The victims fault after this many training steps.
    after: int = 3
    length: int = 12
    # The loader's timeout: a stalled peer costs it; a dead one must cost far less.
    timeout: float = 10.0
    world_size: int = 3

    @property
    def stall_s(self) -> float:
        # Long enough for the others to time out and leave.
        return self.timeout + 4.0


def _fault(case: PeerFault) -> None:
    if case.fault == "exit":
        os._exit(1)
    if case.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    # Frozen: its heartbeat stops too. A stopped process cannot continue itself.
    subprocess.Popen(["sh", "-c", f"sleep {case.stall_s}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def _peer_fault_worker(rank: int, world_size: int, case: PeerFault) -> dict[str, Any]:
    """Iterate one epoch; a victim faults after ``case.after`` steps; report how it ended."""
    import torch

    from ddp_even import EvenLoader, PeerTimeoutError

    torch.manual_seed(0)
    model: Any = None
    if case.mode == "join":
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = shard(rank, case.length)
    source: Any = batches if case.source == "list" else (lambda: iter(batches))
    loader: EvenLoader[Any] = EvenLoader(
        source,
        case.mode,
        sync_every=case.sync_every,
        joinables=[model] if model is not None else (),
        timeout=case.timeout,
    )
    steps = 0
    asked = time.monotonic()
    try:
        for batch in loader:
            if model is not None:
                train_step(model, optimizer, batch)
            else:
                # No collective of its own: the ranks meet only in the loader.
                time.sleep(0.002)
            steps += 1
            if rank in case.victims and steps == case.after:
                _fault(case)
            asked = time.monotonic()
    except PeerTimeoutError as error:
        return {
            "error": "PeerTimeoutError",
            "missing": error.missing_ranks,
            "late": error.late,
            "rank": error.rank,
            "message": str(error),
            # From asking for the next batch to the error: what the user waits.
            "waited": time.monotonic() - asked,
            "steps": steps,
        }
    return {"error": None, "steps": steps}


PEER_FAULTS = [
    PeerFault("truncate", "exit", sync_every=1),
    PeerFault("cycle", "kill", sync_every=3),
    PeerFault("join", "exit", sync_every=1),
    PeerFault("truncate", "kill", source="list"),
    PeerFault("cycle", "exit", victims=(0,)),
    PeerFault("truncate", "exit", victims=(1, 3), world_size=4),
    PeerFault("truncate", "stall", sync_every=1, timeout=5),
    PeerFault("join", "stall", sync_every=2, after=4, timeout=5),
    PeerFault("cycle", "stall", source="list", timeout=5),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", PEER_FAULTS, ids=str)
def test_a_dead_or_stalled_peer_is_named_on_every_other_rank(case: PeerFault) -> None:
    began = time.monotonic()
    results = run_ranks(
        _peer_fault_worker, case.world_size, case, timeout=90, capture_exceptions=True
    )
    elapsed = time.monotonic() - began
    survivors = [rank for rank in range(case.world_size) if rank not in case.victims]
    for rank in survivors:
        result = results[rank]
        assert isinstance(result, dict), (rank, result)
        assert result["error"] == "PeerTimeoutError", (rank, result)
        assert result["missing"] == case.victims, (rank, result)
        assert not result["late"] and result["rank"] == rank
        names = ", ".join(str(victim) for victim in case.victims)
        assert f"rank(s) {names} did not answer" in result["message"]
        if case.fault == "stall":
            # Waited for the timeout of silence (counted from the peer's last heartbeat, at
            # most a second before it froze).
            assert case.timeout - 1.5 <= result["waited"] <= case.timeout + 4, result
        else:
            # A dead peer is noticed at once (its process is gone), not after the timeout.
            assert result["waited"] < case.timeout - 4, result
        assert result["steps"] >= case.after
    for victim in case.victims:
        result = results[victim]
        if case.fault == "stall":
            # It woke up after the others had given up on it: it raises too, naming itself.
            assert isinstance(result, dict), result
            assert result["error"] == "PeerTimeoutError" and result["late"], result
            assert result["missing"] == (victim,), result
            assert "after every other rank had stopped waiting" in result["message"]
        else:
            how = "exit code 1" if case.fault == "exit" else "signal SIGKILL"
            died = f"rank {victim} died ({how}) without a result"
            assert result == RankError("ProcessExited", died)
    # The bounds that matter are each rank's ``waited`` above; the whole run adds the ranks'
    # start-up (5-15 s on a busy 2-core machine) and a stalled rank's nap.
    assert elapsed < case.timeout + case.stall_s + 50


# ---------------------------------------------------------------------------------------------
# A source that fails on one rank, and a break on one rank only


def _loop_worker(
    rank: int,
    world_size: int,
    mode: str,
    source_kind: str,
    sync_every: int | None,
    ddp: bool,
    failing: tuple[int, int] | None,
    break_rank: int | None,
) -> dict[str, Any]:
    """Two epochs over 8 batches; a source may fail on one rank, or one rank may break at 3."""
    import torch

    from ddp_even import EvenLoader, EvenLoaderError, PeerSourceError, PeerTimeoutError
    from tests.helpers.scenarios import Scenario, _source

    scenario = Scenario((8,) * world_size, mode, source=source_kind, failing=failing)
    model: Any = None
    if ddp:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader: EvenLoader[Any] = EvenLoader(
        _source(scenario, rank),
        mode,
        sync_every=sync_every,
        joinables=[model] if mode == "join" else (),
        timeout=6,
    )
    seen: list[list[int]] = []
    began = time.monotonic()
    try:
        for epoch in range(2):
            seen.append([])
            for batch in loader:
                if model is not None:
                    train_step(model, optimizer, batch)
                seen[-1].append(batch)
                if rank == break_rank and epoch == 0 and len(seen[-1]) == 3:
                    break
    except (EvenLoaderError, OSError, RuntimeError) as error:
        result: dict[str, Any] = {"error": type(error).__name__, "message": str(error)}
        if isinstance(error, PeerSourceError):
            result["peer"] = (error.failed_rank, error.error_type, error.step)
        if isinstance(error, PeerTimeoutError):
            result["missing"] = error.missing_ranks
        return {**result, "seen": seen, "seconds": time.monotonic() - began}
    return {"error": None, "seen": seen, "seconds": time.monotonic() - began}


def _dicts(results: list[dict[str, Any] | RankError]) -> list[dict[str, Any]]:
    """The ranks' results, every one of them a returned dict (no rank died or raised)."""
    assert all(isinstance(result, dict) for result in results), results
    return [result for result in results if isinstance(result, dict)]


@pytest.mark.timeout(120)
def test_a_source_failing_mid_epoch_stops_every_rank_at_the_same_step() -> None:
    # No DDP in the loop: with it, a rank raising alone would hang the others in its all-reduce.
    results = _dicts(
        run_ranks(
            _loop_worker,
            3,
            "truncate",
            "factory",
            None,
            False,
            (1, 3),
            None,
            timeout=90,
            capture_exceptions=True,
        )
    )
    # Every rank stops at the same step: at the latest where batch 3 would have gone out (a
    # window read ahead may hear of the failure earlier).
    stopped = len(results[0]["seen"][0])
    assert stopped <= 3, results
    for rank, result in enumerate(results):
        assert result["seen"] == [shard(rank, 8)[:stopped]], (rank, result)
    _check_rank_1_failed_and_the_others_heard(results, at_step=stopped)


@pytest.mark.timeout(120)
def test_with_known_lengths_a_source_failing_mid_epoch_stops_every_rank_at_the_next_check() -> None:
    """A list's length is known: no agreement between steps, only the checks of the sources
    (every ``CHECK_EVERY`` steps and after the last). Until the next one, the failing rank hands
    out its last batch again, so that DDP's all-reduce (in this loop) never waits for it."""
    from ddp_even.runtime.settings import CHECK_EVERY

    assert CHECK_EVERY > 8, "the check that reports the failure is the one after the last step"
    results = _dicts(
        run_ranks(
            _loop_worker,
            3,
            "truncate",
            "list",
            None,
            True,
            (1, 3),
            None,
            timeout=90,
            capture_exceptions=True,
        )
    )
    for rank, result in enumerate(results):
        own = shard(rank, 8)
        expected = own if rank != 1 else own[:3] + [own[2]] * 5
        assert result["seen"] == [expected], (rank, result)
    _check_rank_1_failed_and_the_others_heard(results, at_step=8)


def _check_rank_1_failed_and_the_others_heard(results: list[dict[str, Any]], at_step: int) -> None:
    """Rank 1 raised its source's own error; every other rank a PeerSourceError naming it."""
    for rank, result in enumerate(results):
        if rank == 1:
            assert (result["error"], result["message"]) == (
                "OSError",
                "corrupt row group after 3 batches",
            )
        else:
            assert result["error"] == "PeerSourceError", (rank, result)
            assert result["peer"] == (1, "OSError", at_step)


def _empty_shard_worker(
    rank: int, world_size: int, lengths: tuple[int, ...], steps_per_epoch: int | None
) -> dict[str, Any]:
    from ddp_even import EvenLoader, EvenLoaderError

    loader: EvenLoader[Any] = EvenLoader(
        shard(rank, lengths[rank]), "cycle", steps_per_epoch=steps_per_epoch, timeout=5
    )
    seen = []
    try:
        for batch in loader:
            seen.append(batch)
    except EvenLoaderError as error:
        return {"error": type(error).__name__, "message": str(error), "seen": seen}
    return {"error": None, "seen": seen}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("steps_per_epoch", [None, 3])
def test_cycle_over_an_empty_shard_of_known_length_raises_on_every_rank(
    steps_per_epoch: int | None,
) -> None:
    results = run_ranks(
        _empty_shard_worker, 3, (2, 0, 2), steps_per_epoch, timeout=60, capture_exceptions=True
    )
    for result in results:
        assert isinstance(result, dict), result
        assert result["error"] == "EmptyShardError", result
        assert "rank(s) 1 have no batch" in result["message"]
        assert result["seen"] == []


@pytest.mark.long
@pytest.mark.timeout(150)
def test_a_break_on_one_rank_only_never_hangs() -> None:
    """Not safe, but loud: what a `break` on rank 0 alone does (documented in the README).

    * windows, no other collective in the loop: rank 0's next epoch meets the others' next
      agreement: RankMismatchError on every rank at once;
    * known lengths: rank 0's next epoch's agreement meets the others' check of the sources
      after their last step: RankMismatchError on every rank at once, naming the epochs;
    * windows with DDP in the loop: the others wait for rank 0 in DDP's all-reduce; rank 0
      raises PeerTimeoutError naming them after ``timeout``; they fail when its process ends
      (or at the training group's timeout while it lives);
    * join with DDP: rank 0 joins early; the others go on, and every epoch ends normally.
    """
    cases = [
        ("truncate", "factory", 1, False),
        ("truncate", "list", None, False),
        ("truncate", "factory", 1, True),
        ("join", "factory", 1, True),
    ]
    outcomes: dict[tuple[str, str, bool], list[dict[str, Any]]] = {}
    for mode, source_kind, sync_every, ddp in cases:
        outcomes[(mode, source_kind, ddp)] = _dicts(
            run_ranks(
                _loop_worker,
                3,
                mode,
                source_kind,
                sync_every,
                ddp,
                None,
                0,
                timeout=60,
                capture_exceptions=True,
                # Gloo cannot cancel a collective in flight: a rank left in one exits when the
                # training group's timeout ends it.
                pg_timeout=9,
            )
        )
    results = outcomes[("truncate", "factory", False)]
    assert [result["error"] for result in results] == ["RankMismatchError"] * 3, results
    assert all(result["seconds"] < 5 for result in results), results

    results = outcomes[("truncate", "list", False)]
    assert [result["error"] for result in results] == ["RankMismatchError"] * 3, results
    for result in results:
        assert "rank 0: epoch 1," in result["message"], result
        assert (
            "rank 1: epoch 0," in result["message"] and "checking the sources" in result["message"]
        )
        assert result["seconds"] < 5, result

    results = outcomes[("truncate", "factory", True)]
    assert results[0]["error"] == "PeerTimeoutError" and results[0]["missing"] == (1, 2)
    assert 5 < results[0]["seconds"] < 6 + 6, results[0]
    for result in results[1:]:
        # In DDP's all-reduce: rank 0's process ends, or their own training timeout does.
        assert result["error"] == "RuntimeError", result
        assert "Connection closed" in result["message"] or "Timed out" in result["message"]

    results = outcomes[("join", "factory", True)]
    full = [shard(rank, 8) for rank in range(3)]
    assert [result["error"] for result in results] == [None] * 3, results
    assert results[0]["seen"] == [full[0][:3], full[0]]
    assert [result["seen"] for result in results[1:]] == [[full[1]] * 2, [full[2]] * 2]


# ---------------------------------------------------------------------------------------------
# Consumers that stop early on every rank


_LENGTHS = (5, 8, 3)


def _consumer_scenarios(mode: str, stop: str) -> list[Scenario]:
    """Every source kind and window of ``mode``, stopped in epoch 0 by ``stop`` at step 1-2."""
    cases = []
    for source in ("factory", "list", "iterator"):
        for sync_every in (None, 2):
            # A one-shot iterator has no next epoch (a new loader over a new one has).
            if source == "iterator" and (stop != "drop_after" or mode == "cycle"):
                continue
            if mode == "join" and source == "list":
                continue  # join never trusts a length: the same as factory
            # Step 2 at most: in join mode every rank must still be iterating (the shortest
            # shard has 3 batches), or it could not stop with the others.
            # A one-shot iterator's loader runs one epoch; the one made after the drop too.
            cases.append(
                Scenario(
                    _LENGTHS,
                    mode,
                    source=source,
                    sync_every=sync_every,
                    epochs=2 if source == "iterator" else 3,
                    timeout=15,
                    **{stop: 2 if stop == "break_after" else 1},  # type: ignore[arg-type]
                )
            )
    if mode == "cycle" and stop == "raise_after":
        cases.append(Scenario(_LENGTHS, "cycle", steps_per_epoch=11, sync_every=7, raise_after=8))
    if mode == "truncate" and stop == "break_after":
        cases.append(Scenario(_LENGTHS, "truncate", steps_per_epoch=2, break_after=1))
    return cases


def _stopped_at(scenario: Scenario) -> int:
    for stop in (scenario.break_after, scenario.raise_after, scenario.drop_after):
        if stop is not None:
            return stop
    raise AssertionError(scenario)


def _check_consumer(scenario: Scenario, outcomes: list[Outcome]) -> None:
    for rank, outcome in enumerate(outcomes):
        assert outcome.error is None, (scenario, rank, outcome.error)
        full = expected_batches(scenario, rank)
        assert outcome.epochs[0] == full[: _stopped_at(scenario)], (scenario, rank)
        # Every later epoch: all the prescribed batches, and stats that say so.
        for epoch in range(1, scenario.epochs):
            assert outcome.epochs[epoch] == full, (scenario, rank, epoch)
            stats = outcome.stats[epoch]
            assert stats, (scenario, rank, epoch, "no statistics")
            assert stats["steps"][rank] == len(full)
            assert stats == outcomes[0].stats[epoch], "stats must be equal on every rank"
            if scenario.mode == "share":
                # Its shard: what it handed out and what it sent; its steps: those and what
                # it received or padded.
                own, length = stats["own_batches"][rank], scenario.lengths[rank]
                assert own + stats["sent_batches"][rank] == length
                handed_out = own + stats["received_batches"][rank] + stats["padded_batches"][rank]
                assert handed_out == len(full)
                assert stats["repeated_batches"][rank] == 0 and not stats["truncated"][rank]
                continue
            own = min(len(full), scenario.lengths[rank])
            assert stats["own_batches"][rank] == own
            # Pad hands out its extra batches as padding, not as repeats.
            extra = len(full) - own
            padded = scenario.mode == "pad"
            assert stats["repeated_batches"][rank] == (0 if padded else extra)
            assert stats["padded_batches"][rank] == (extra if padded else 0)
            assert stats["truncated"][rank] == (scenario.lengths[rank] > own)
        if scenario.drop_after is not None and outcome.closed_at_drop is not None:
            assert outcome.closed_at_drop, (
                scenario,
                rank,
                "dropping the loader left its pass (and its epoch) open until garbage "
                "collection, which closes it at a different moment on every rank",
            )
    # Nothing left in flight: every rank issued the same control collectives, and the DDP
    # replicas took the same steps.
    assert len({outcome.control_collectives for outcome in outcomes}) == 1, (
        scenario,
        [outcome.control_collectives for outcome in outcomes],
    )
    assert len({tuple(outcome.final_weight or []) for outcome in outcomes}) == 1, scenario


@pytest.mark.timeout(180)
def test_break_or_exception_on_every_rank_then_the_next_epochs_work() -> None:
    scenarios = [
        case
        for mode in MODES
        for stop in ("break_after", "raise_after")
        for case in _consumer_scenarios(mode, stop)
    ]
    per_rank = run_ranks(run_scenarios_one_model, 3, scenarios, timeout=150)
    for index, scenario in enumerate(scenarios):
        _check_consumer(scenario, [outcomes[index] for outcomes in per_rank])


@pytest.mark.timeout(180)
def test_a_loader_dropped_mid_epoch_closes_at_once_and_a_new_one_works() -> None:
    scenarios = [case for mode in MODES for case in _consumer_scenarios(mode, "drop_after")]
    per_rank = run_ranks(run_scenarios_one_model, 3, scenarios, timeout=150)
    failures = []
    for index, scenario in enumerate(scenarios):
        try:
            _check_consumer(scenario, [outcomes[index] for outcomes in per_rank])
        except AssertionError as error:
            failures.append(f"{scenario}: {error}")
    assert not failures, "\n".join(failures)
