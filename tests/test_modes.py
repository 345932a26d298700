"""Every mode on 2, 3, 4 and 8 gloo ranks with uneven in-memory shards and a real DDP model.

Each test starts one process group and runs all its scenarios in it; what every rank must
yield is computed from the definition of the mode (``expected_batches``), not by ddp_even.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers.scenarios import (
    Outcome,
    Scenario,
    expected_batches,
    expected_weights,
    run_scenarios,
)
from tests.helpers.spawn import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.in_memory]


def _scenarios(lengths: tuple[int, ...]) -> list[Scenario]:
    shortest_positive = min(length for length in lengths if length > 0)
    cases = [
        Scenario(lengths, "truncate"),
        Scenario(lengths, "truncate", sync_every=3),
        Scenario(lengths, "truncate", source="list"),
        Scenario(lengths, "truncate", steps_per_epoch=1),
        Scenario(lengths, "join"),
        Scenario(lengths, "join", sync_every=2),
        Scenario(lengths, "join", source="iterator", epochs=1),
        Scenario(lengths, "truncate", source="iterator", epochs=1),
        Scenario(lengths, "join", break_after=1),
        # Pad runs over empty shards too: they pad with another rank's first batch.
        Scenario(lengths, "pad"),
        Scenario(lengths, "pad", sync_every=3),
        Scenario(lengths, "pad", source="list"),
        Scenario(lengths, "pad", source="iterator", epochs=1),
        Scenario(lengths, "pad", steps_per_epoch=2 * max(lengths) + 1, sync_every=2),
        Scenario(lengths, "pad", steps_per_epoch=1),
        Scenario(lengths, "pad", break_after=2),
    ]
    if min(lengths) > 0:
        cases += [
            Scenario(lengths, "truncate", break_after=1),
            Scenario(lengths, "cycle"),
            Scenario(lengths, "cycle", sync_every=4),
            Scenario(lengths, "cycle", source="list"),
            Scenario(lengths, "cycle", steps_per_epoch=2 * max(lengths) + 1, sync_every=3),
            Scenario(lengths, "cycle", steps_per_epoch=shortest_positive),
            Scenario(lengths, "cycle", break_after=2),
        ]
    return cases


def _passes(scenario: Scenario, steps: int, length: int) -> int:
    if scenario.mode == "pad":
        # Never restarts; without a plan it reads ahead, which starts the source.
        return 1
    if steps == 0:
        # Reading ahead (before the epoch's first agreement) starts the source; with known
        # lengths, a source whose length is 0 is never started.
        return 0 if scenario.source == "list" and length == 0 else 1
    return math.ceil(steps / length)


def _check_epoch(scenario: Scenario, outcomes: list[Outcome], epoch: int) -> None:
    world_size = len(scenario.lengths)
    stats = outcomes[0].stats[epoch]
    for rank, outcome in enumerate(outcomes):
        expected = expected_batches(scenario, rank)
        length = scenario.lengths[rank]
        assert outcome.epochs[epoch] == expected, (scenario, rank, epoch)
        past_own_data = [index >= length for index in range(len(expected))]
        pads = scenario.mode == "pad"
        assert outcome.repeating[epoch] == ([False] * len(expected) if pads else past_own_data)
        assert outcome.padding[epoch] == (past_own_data if pads else [False] * len(expected))
        if pads:
            assert outcome.weights[epoch] == pytest.approx(expected_weights(scenario, rank))
        assert outcome.stats[epoch] == stats, "stats must be equal on every rank"
        own = min(len(expected), length)
        assert stats["steps"][rank] == len(expected)
        assert stats["own_batches"][rank] == own
        assert stats["repeated_batches"][rank] == (0 if pads else len(expected) - own)
        assert stats["padded_batches"][rank] == (len(expected) - own if pads else 0)
        assert stats["padded_rows"][rank] == stats["padded_batches"][rank]
        assert stats["samples"][rank] == len(expected)
        assert stats["truncated"][rank] == (length > own)
        assert stats["passes"][rank] == _passes(scenario, len(expected), length)
    assert stats["world_size"] == world_size
    assert stats["epoch"] == epoch
    own_total = sum(stats["own_batches"])
    repeated_total = sum(stats["repeated_batches"])
    assert stats["oversampling"] == pytest.approx(repeated_total / own_total if own_total else 0)


def _check_stopped_epoch(scenario: Scenario, outcomes: list[Outcome]) -> None:
    for rank, outcome in enumerate(outcomes):
        full = expected_batches(scenario, rank)
        assert outcome.epochs[0] == full[: scenario.break_after]
        if scenario.mode == "join":
            # Ranks that had joined gathered the statistics, so every rank did.
            stats = outcome.stats[0]
            assert stats["steps"][rank] == len(outcome.epochs[0])
            assert stats["truncated"][rank] == (len(full) > len(outcome.epochs[0]))
        else:
            assert outcome.stats[0] == {}, "an epoch left early has no gathered stats"


def _check(scenario: Scenario, outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        assert outcome.error is None, (scenario, outcome.error)
        assert len(outcome.epochs) == scenario.epochs
    for epoch in range(scenario.epochs):
        if epoch == 0 and scenario.break_after is not None:
            _check_stopped_epoch(scenario, outcomes)
            continue
        _check_epoch(scenario, outcomes, epoch)
    weights = {tuple(outcome.final_weight or []) for outcome in outcomes}
    assert len(weights) == 1, f"DDP replicas diverged: {weights}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lengths", [(7, 3), (4, 0, 9), (5, 2, 1, 3)], ids=str)
def test_every_mode_yields_the_prescribed_batches(lengths: tuple[int, ...]) -> None:
    scenarios = _scenarios(lengths)
    per_rank = run_ranks(run_scenarios, len(lengths), scenarios, timeout=200)
    for index, scenario in enumerate(scenarios):
        _check(scenario, [outcomes[index] for outcomes in per_rank])


@pytest.mark.timeout(300)
def test_eight_ranks_take_the_prescribed_steps_in_every_mode() -> None:
    lengths = (6, 2, 9, 1, 4, 7, 3, 5)
    scenarios = [
        *(Scenario(lengths, mode) for mode in ("truncate", "cycle", "pad", "join")),
        *(Scenario(lengths, mode, source="list") for mode in ("truncate", "cycle", "pad")),
    ]
    per_rank = run_ranks(run_scenarios, len(lengths), scenarios, timeout=250)
    for index, scenario in enumerate(scenarios):
        _check(scenario, [outcomes[index] for outcomes in per_rank])


@pytest.mark.timeout(120)
def test_cycle_over_an_empty_shard_raises_the_same_error_on_every_rank() -> None:
    scenarios = [Scenario((3, 0, 2), "cycle"), Scenario((3, 0, 2), "cycle", steps_per_epoch=4)]
    per_rank = run_ranks(run_scenarios, 3, scenarios, timeout=100)
    for index in range(len(scenarios)):
        errors = {outcomes[index].error for outcomes in per_rank}
        assert len(errors) == 1, errors
        (error,) = errors
        assert error is not None and error[0] == "EmptyShardError"
        assert "rank(s) 1 have no batch" in error[1]
