"""How often an epoch with known lengths checks its sources (``runtime/settings.py``).

Every ``CHECK_EVERY`` steps while steps are long; further apart, the same on every rank, when
``CHECK_EVERY`` steps take less than ``CHECK_PERIOD_S``; and a source that fails deep in such an
epoch still stops every rank at the same step.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from ddp_even.agreement.wire import SHORT_MOST
from ddp_even.runtime.settings import (
    CHECK_EVERY,
    CHECK_PERIOD_S,
    LARGEST_PROPOSAL,
    MOST_STEPS_BETWEEN_CHECKS,
    CheckSchedule,
)
from tests.helpers.scenarios import shard
from tests.helpers.spawn import run_ranks


def _paced(steps: int, seconds: float) -> CheckSchedule:
    """A schedule whose last ``steps`` steps took ``seconds``."""
    return CheckSchedule(next_step=steps, _from_step=0, _from_s=time.monotonic() - seconds)


def _spacing(proposal: int) -> int:
    return CHECK_EVERY << proposal


def test_long_steps_keep_the_fewest_steps_between_checks() -> None:
    proposal = _paced(CHECK_EVERY, seconds=10 * CHECK_PERIOD_S).proposal(CHECK_EVERY)
    assert _spacing(proposal) == CHECK_EVERY


def test_short_steps_propose_the_most_steps_of_a_power_of_two_within_one_period() -> None:
    # 100 steps in two periods: 50 steps a period, so 32 (16 * 2**1), the clock moving on a
    # little meanwhile.
    assert _spacing(_paced(100, seconds=2 * CHECK_PERIOD_S).proposal(100)) == 32
    # 200 steps in one period: 128 (16 * 2**3).
    assert _spacing(_paced(200, seconds=CHECK_PERIOD_S).proposal(200)) == 128


def test_very_short_steps_are_bounded_by_the_most_steps_between_checks() -> None:
    proposal = _paced(CHECK_EVERY, seconds=1e-6).proposal(CHECK_EVERY)
    assert proposal == LARGEST_PROPOSAL
    assert _spacing(proposal) == MOST_STEPS_BETWEEN_CHECKS


def test_every_proposal_fits_the_agreements_short_form() -> None:
    assert LARGEST_PROPOSAL <= SHORT_MOST


def test_the_pace_is_measured_since_the_last_check() -> None:
    schedule = _paced(CHECK_EVERY, seconds=10 * CHECK_PERIOD_S)
    assert schedule.proposal(CHECK_EVERY) == 0
    # The next CHECK_EVERY steps took no time at all: the slow ones before do not count.
    assert schedule.proposal(2 * CHECK_EVERY) > 0


def test_a_resumed_epoch_checks_on_the_uninterrupted_runs_first_multiple() -> None:
    assert CheckSchedule.after(0).next_step == CHECK_EVERY
    assert CheckSchedule.after(CHECK_EVERY + 3).next_step == 2 * CHECK_EVERY
    assert CheckSchedule.after(2 * CHECK_EVERY).next_step == 3 * CHECK_EVERY


def test_the_spacing_after_a_check_is_the_one_every_rank_agreed() -> None:
    schedule = CheckSchedule.after(0)
    schedule.checked(CHECK_EVERY, agreed=None)
    assert schedule.next_step == 2 * CHECK_EVERY
    schedule.checked(2 * CHECK_EVERY, agreed=3)
    assert schedule.next_step == 2 * CHECK_EVERY + 8 * CHECK_EVERY


def test_a_later_epoch_starts_at_the_spacing_its_previous_epoch_agreed() -> None:
    schedule = CheckSchedule.after(0, spacing=2)
    assert schedule.next_step == 4 * CHECK_EVERY
    schedule.checked(4 * CHECK_EVERY, agreed=None)  # nothing settled yet: the same spacing
    assert schedule.next_step == 8 * CHECK_EVERY
    schedule.checked(8 * CHECK_EVERY, agreed=0)  # then what the ranks agree
    assert schedule.next_step == 9 * CHECK_EVERY
    # Resumed part-way, on that spacing's first multiple after the saved step.
    assert CheckSchedule.after(4 * CHECK_EVERY + 1, spacing=2).next_step == 8 * CHECK_EVERY


FAST_STEPS = 6000
SLOW_STEPS = 5 * CHECK_EVERY
# Steps of an eighth of a period: CHECK_EVERY of them take twice a period, so the spacing stays
# CHECK_EVERY (a loaded machine only makes a sleep longer).
SLOW_STEP_S = CHECK_PERIOD_S / 8


def _checks_worker(rank: int, world_size: int) -> dict[str, Any]:
    """A fast epoch and a slow one over lists (known lengths); the all-reduces between steps."""
    from ddp_even import EvenLoader
    from tests.helpers.collectives import AllReduceCounter

    def epoch(batches: list[list[int]], step_s: float) -> tuple[list[list[int]], int]:
        loader: EvenLoader[list[int]] = EvenLoader(batches, "truncate", timeout=30)
        counter = AllReduceCounter()
        seen: list[list[int]] = []
        try:
            for batch in loader:
                if not seen:
                    counter.start()  # after the epoch's agreement: the checks only
                seen.append(batch)
                if step_s:
                    time.sleep(step_s)
        finally:
            counter.stop()
        return seen, counter.calls

    fast, fast_checks = epoch(shard(rank, FAST_STEPS + rank), 0.0)
    slow, slow_checks = epoch(shard(rank, SLOW_STEPS + rank), SLOW_STEP_S)
    return {"fast": fast, "fast_checks": fast_checks, "slow": slow, "slow_checks": slow_checks}


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(120)
def test_short_steps_are_checked_further_apart_and_long_ones_every_16() -> None:
    results = run_ranks(_checks_worker, 2, timeout=90)
    for rank, result in enumerate(results):
        assert result["fast"] == shard(rank, FAST_STEPS)
        assert result["slow"] == shard(rank, SLOW_STEPS)
        # Slow steps: a check every CHECK_EVERY steps, the last at the last step.
        assert result["slow_checks"] == SLOW_STEPS // CHECK_EVERY, result["slow_checks"]
    # Fast steps: the same checks on both ranks, far fewer than one every CHECK_EVERY steps
    # (the first two are CHECK_EVERY apart, then at most MOST_STEPS_BETWEEN_CHECKS).
    assert results[0]["fast_checks"] == results[1]["fast_checks"]
    fewest = 2 + FAST_STEPS // MOST_STEPS_BETWEEN_CHECKS
    assert fewest <= results[0]["fast_checks"] < FAST_STEPS // CHECK_EVERY // 4, results[0]


FAILS_AFTER = 2000


def _failing_worker(rank: int, world_size: int) -> dict[str, Any]:
    """A fast epoch of FAST_STEPS batches over lists; rank 1's raises after FAILS_AFTER of them."""
    from ddp_even import EvenLoader, PeerSourceError
    from tests.helpers.scenarios import Scenario, _source

    scenario = Scenario((FAST_STEPS,) * world_size, "truncate", source="list")
    if rank == 1:
        scenario = Scenario(scenario.lengths, "truncate", source="list", failing=(1, FAILS_AFTER))
    loader: EvenLoader[list[int]] = EvenLoader(_source(scenario, rank), "truncate", timeout=30)
    seen: list[list[int]] = []
    try:
        for batch in loader:
            seen.append(batch)
    except PeerSourceError as error:
        return {"seen": seen, "error": "PeerSourceError", "peer": (error.failed_rank, error.step)}
    except OSError as error:
        return {"seen": seen, "error": "OSError", "message": str(error)}
    return {"seen": seen, "error": None}


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(120)
def test_a_source_failing_deep_in_a_fast_epoch_stops_every_rank_at_the_same_step() -> None:
    results = run_ranks(_failing_worker, 2, timeout=90)
    stopped = len(results[0]["seen"])
    assert len(results[1]["seen"]) == stopped, [len(result["seen"]) for result in results]
    # Heard of at most two spacings after the failure, long before the epoch's last step.
    assert FAILS_AFTER + 2 * MOST_STEPS_BETWEEN_CHECKS < FAST_STEPS
    assert FAILS_AFTER < stopped <= FAILS_AFTER + 2 * MOST_STEPS_BETWEEN_CHECKS
    assert results[0]["seen"] == shard(0, stopped)
    assert results[0]["error"] == "PeerSourceError" and results[0]["peer"][0] == 1, results[0]
    own = shard(1, FAILS_AFTER)
    # Until every rank heard of it, rank 1 handed out its last batch again.
    assert results[1]["seen"] == own + [own[-1]] * (stopped - FAILS_AFTER)
    assert results[1] == {
        "seen": results[1]["seen"],
        "error": "OSError",
        "message": f"corrupt row group after {FAILS_AFTER} batches",
    }


EPOCH_STEPS = 3 * CHECK_EVERY


def _epochs_worker(rank: int, world_size: int, new_loader_on: int | None) -> dict[str, Any]:
    """Two fast epochs over a list (known lengths): the batches and the all-reduces between the
    first and the last step of each; the second on a new loader on rank ``new_loader_on``."""
    from ddp_even import EvenLoader, RankMismatchError
    from ddp_even.runtime import settings as check_settings
    from tests.helpers.collectives import AllReduceCounter

    # Whatever the machine's load: at any pace steps take less than an hour, so every rank
    # proposes the widest spacing. (At the real period a rank descheduled for 25 ms in 16 steps
    # proposes the narrowest, and a loaded run of these tests then saw the same spacing on both
    # loaders: no mismatch to refuse, no fewer checks to count.)
    check_settings.CHECK_PERIOD_S = 3600.0
    batches = shard(rank, EPOCH_STEPS + rank)
    loader: EvenLoader[list[int]] = EvenLoader(batches, "truncate", timeout=30)
    result: dict[str, Any] = {"seen": [], "checks": []}
    for epoch in range(2):
        if epoch == 1 and rank == new_loader_on:
            loader = EvenLoader(batches, "truncate", timeout=30)
            loader.set_epoch(1)
        counter, seen = AllReduceCounter(), []
        try:
            for batch in loader:
                if not seen:
                    counter.start()  # after the epoch's agreement: the checks only
                seen.append(batch)
        except RankMismatchError as error:
            result["error"] = str(error)
            return result
        finally:
            counter.stop()
        result["seen"].append(seen)
        result["checks"].append(counter.calls)
    return result


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(120)
def test_a_later_epoch_checks_at_the_spacing_its_previous_epoch_agreed() -> None:
    results = run_ranks(_epochs_worker, 2, None, timeout=90)
    for rank, result in enumerate(results):
        assert result["seen"] == [shard(rank, EPOCH_STEPS)] * 2
        # The first epoch: checks 16 steps apart and after the last step. The ranks agreed on
        # the widest spacing there, which the second epoch starts at: it checks only after its
        # last step.
        first, second = result["checks"]
        assert first == EPOCH_STEPS // CHECK_EVERY, result["checks"]
        assert second == 1, result["checks"]
    assert results[0]["checks"] == results[1]["checks"]


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(120)
def test_a_loader_made_anew_on_one_rank_is_refused_on_every_rank_before_the_first_step() -> None:
    results = run_ranks(_epochs_worker, 2, 1, timeout=90)
    for rank, result in enumerate(results):
        # The first epoch ran; the second stops before its first batch, on both ranks.
        assert result["seen"] == [shard(rank, EPOCH_STEPS)], rank
        error = result["error"]
        assert "not running the same loop" in error, error
        # The used loader's spacing against the new one's, rank by rank.
        assert "rank 0: epoch 1" in error and "checks_every=" in error, error
        assert error.count("checks_every=") == 1, error
