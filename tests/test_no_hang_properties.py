"""Randomized: whatever the shards, modes, windows and faults, no rank hangs and nothing is lost.

Hypothesis draws the cases in this process (world sizes 1 to 4, shard lengths 0 to 50 with
empty shards, every mode, windows, ``steps_per_epoch``, source kinds, a source failing on one
rank after k batches); all the cases of one world size then run, one after the other, in a
single spawned process group sharing one DDP model (world size 1: in this process, without a
process group). Checked here, for every case:

* no hang: the group finishes within its time limit (each case within ``CASE_SECONDS``);
* either every rank yields exactly the prescribed batches (``expected_batches``), or every
  rank raises the same error at the same step (the failing rank its own ``OSError``, the
  others ``PeerSourceError`` naming it); an error the case makes unavoidable is raised;
* nothing lost: cycle yields every own batch at least once per epoch, pad and join every batch
  exactly once (pad's padding flagged, of weight 0), and the statistics say exactly what
  happened, truncated ranks included;
* nothing left behind: every rank issued the same number of control collectives, and the
  DDP replicas stayed equal.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddp_even.modes import MODES
from tests.helpers.scenarios import (
    Outcome,
    Scenario,
    expected_batches,
    expected_weights,
    run_scenarios_in_process,
    run_scenarios_one_model,
    shard,
)
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.in_memory

# Cases per world size, and the most one case may take (a hang shows as far more: the
# loader's timeout in these cases is 30 s).
CASES = {1: 400, 2: 250, 3: 160, 4: 120}
CASE_SECONDS = 10.0


SOURCES = ("list", "factory", "iterator")
WINDOWS = (None, 1, 2, 7)
# Hypothesis leans to the first of a few options; the kinds of case are taken in turn
# instead, and hypothesis draws the numbers (where its lean to 0, 1 and 50 is welcome).
# Share's hand-over has its own multi-rank tests (tests/test_share.py), whose cases name which
# batch each rank hands out; the prescriptions here are the other modes'.
PRESCRIBED_MODES = [mode for mode in MODES if not MODES[mode].hands_over]
GRID = list(itertools.product(PRESCRIBED_MODES, SOURCES, WINDOWS))


@dataclass(frozen=True)
class Numbers:
    lengths: tuple[int, ...]
    steps_per_epoch: int | None
    # (rank, batches): that rank's source raises when asked for batch ``batches``.
    failing: tuple[int, int] | None
    two_epochs: bool


@st.composite
def numbers(draw: st.DrawFn, world_size: int) -> Numbers:
    return Numbers(
        lengths=tuple(draw(st.lists(st.integers(0, 50), min_size=world_size, max_size=world_size))),
        steps_per_epoch=draw(st.none() | st.integers(1, 60)),
        failing=draw(st.none() | st.tuples(st.integers(0, world_size - 1), st.integers(0, 50))),
        two_epochs=draw(st.booleans()),
    )


def known_lengths(
    mode: str, source: str, sync_every: int | None, steps_per_epoch: int | None
) -> bool:
    """Whether the loader agrees once per epoch: known lengths, or cycle's fixed step count
    (pad needs a plan, which these cases have not)."""
    whole_epoch = (source == "list" and mode != "pad") or (
        mode == "cycle" and steps_per_epoch is not None
    )
    return whole_epoch and sync_every is None and mode != "join"


def make_case(drawn: Numbers, mode: str, source: str, sync_every: int | None) -> Scenario:
    steps_per_epoch = drawn.steps_per_epoch
    if drawn.failing is not None and known_lengths(mode, source, sync_every, steps_per_epoch):
        # By design one agreement per epoch cannot carry a source failure in mid-epoch to the
        # other ranks (README, "Failure behaviour"; a strict xfail in tests/test_failures.py):
        # such cases run through windows instead.
        source = "factory"
        if known_lengths(mode, source, sync_every, steps_per_epoch):
            sync_every = 1
    return Scenario(
        drawn.lengths,
        mode,
        steps_per_epoch=None if mode == "join" else drawn.steps_per_epoch,
        sync_every=sync_every,
        source=source,
        # A one-shot iterator has one epoch in it.
        epochs=2 if drawn.two_epochs and source != "iterator" else 1,
        failing=drawn.failing,
        timeout=30,
    )


@functools.cache  # derandomized: the same cases every time, so draw them once a run
def draw_cases(world_size: int, count: int) -> list[Scenario]:
    """``count`` cases, the same on every run (derandomized), drawn here in the parent."""
    drawn: list[Numbers] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(numbers(world_size))
    def collect(case: Numbers) -> None:
        drawn.append(case)

    collect()
    return [make_case(case, *GRID[index % len(GRID)]) for index, case in enumerate(drawn)]


# ---------------------------------------------------------------------------------------------
# What a case prescribes


def _own_batches_yielded(case: Scenario, rank: int) -> int:
    return min(len(expected_batches(case, rank)), case.lengths[rank])


@dataclass(frozen=True)
class Allowed:
    """The errors a case may raise ("failure": the failing source's), and if one must come."""

    kinds: frozenset[str]
    mandatory: bool


def allowed_errors(case: Scenario) -> Allowed:
    if case.mode == "cycle" and case.source == "iterator":
        return Allowed(frozenset({"TypeError"}), True)  # refused when the loader is made
    kinds = set()
    mandatory = False
    if case.failing is not None:
        rank, fail_after = case.failing
        if fail_after < case.lengths[rank]:
            # Reading ahead may reach the corrupt batch even past what the rank yields.
            kinds.add("failure")
            # It must reach it to yield what it must.
            mandatory = fail_after < _own_batches_yielded(case, rank)
    if case.mode == "cycle" and 0 in case.lengths:
        kinds.add("EmptyShardError")
        mandatory = True
    if case.mode == "pad" and not any(case.lengths) and case.steps_per_epoch is not None:
        # Nothing on any rank to pad with, and steps asked for.
        kinds.add("EmptyShardError")
        mandatory = True
    return Allowed(frozenset(kinds), mandatory)


def _check_failure_pattern(case: Scenario, outcomes: list[Outcome]) -> None:
    """The failing source's error: its own OSError on its rank, PeerSourceError elsewhere."""
    assert case.failing is not None
    failing_rank, fail_after = case.failing
    own = outcomes[failing_rank].error
    assert own == ("OSError", f"corrupt row group after {fail_after} batches"), own
    steps = set()
    for rank, outcome in enumerate(outcomes):
        if rank == failing_rank:
            continue
        assert outcome.error is not None and outcome.error[0] == "PeerSourceError"
        assert outcome.peer_failure is not None
        named, error_type, step = outcome.peer_failure
        assert (named, error_type) == (failing_rank, "OSError")
        assert f"after {fail_after} batches" in outcome.error[1]
        steps.add(step)
    if case.mode != "join":
        assert len(steps) <= 1, f"ranks stopped at different steps: {steps}"


def _check_errors(case: Scenario, outcomes: list[Outcome]) -> None:
    errors = [outcome.error for outcome in outcomes]
    assert all(error is not None for error in errors), f"some ranks raised, others not: {errors}"
    allowed = allowed_errors(case)
    failing_pattern = case.failing is not None and outcomes[case.failing[0]].error == (
        "OSError",
        f"corrupt row group after {case.failing[1]} batches",
    )
    if failing_pattern:
        assert "failure" in allowed.kinds, f"the source failed where it cannot: {errors}"
        _check_failure_pattern(case, outcomes)
    else:
        assert len(set(errors)) == 1, f"ranks raised different errors: {errors}"
        assert errors[0] is not None and errors[0][0] in allowed.kinds, (allowed, errors)
        if errors[0][0] == "EmptyShardError":
            empty = ", ".join(str(rank) for rank, n in enumerate(case.lengths) if n == 0)
            assert f"rank(s) {empty} have no batch" in errors[0][1]
    # Up to the error, each rank yielded what the mode prescribes, nothing more.
    for rank, outcome in enumerate(outcomes):
        full = expected_batches(case, rank)
        *finished, last = outcome.epochs or [[]]
        assert all(epoch == full for epoch in finished), (rank, "a finished epoch differs")
        assert last == full[: len(last)], (rank, "yielded beyond or besides the prescription")
    if case.mode != "join":
        assert len({len((outcome.epochs or [[]])[-1]) for outcome in outcomes}) == 1
        # Every rank stopped at the same step, so the replicas took the same steps. (In join
        # mode ranks that had joined missed the last steps, and torch's Join does not sync
        # the model when it is left by an exception.)
        assert len({tuple(outcome.final_weight or []) for outcome in outcomes}) == 1


def _passes(case: Scenario, steps: int, length: int) -> int:
    if case.mode == "pad":
        return 1  # never restarts; reading ahead starts the source
    if steps == 0:
        # Reading ahead (before the epoch's first agreement) starts the source; with known
        # lengths, a source whose length is 0 is never started.
        whole_epoch = known_lengths(case.mode, case.source, case.sync_every, case.steps_per_epoch)
        return 0 if whole_epoch and length == 0 else 1
    return math.ceil(steps / length)


def _check_epoch(case: Scenario, outcomes: list[Outcome], epoch: int) -> None:
    stats = outcomes[0].stats[epoch]
    assert stats, "no statistics for a finished epoch"
    assert stats["epoch"] == epoch and stats["mode"] == case.mode
    assert stats["world_size"] == len(case.lengths)
    for rank, outcome in enumerate(outcomes):
        full = expected_batches(case, rank)
        yielded = outcome.epochs[epoch]
        length = case.lengths[rank]
        own = shard(rank, length)
        assert yielded == full, (rank, epoch)
        assert outcome.stats[epoch] == stats, "statistics must be equal on every rank"
        past_own_data = [index >= length for index in range(len(full))]
        pads = case.mode == "pad"
        assert outcome.repeating[epoch] == ([False] * len(full) if pads else past_own_data)
        assert outcome.padding[epoch] == (past_own_data if pads else [False] * len(full))
        # Nothing lost.
        if case.mode == "join":
            assert Counter(map(tuple, yielded)) == Counter(map(tuple, own)), "join: once each"
        if pads:
            real = [batch for batch, pad in zip(yielded, past_own_data, strict=True) if not pad]
            assert real == own[: len(full)], "pad: every own batch once, in order"
            assert outcome.weights[epoch] == pytest.approx(expected_weights(case, rank))
        if case.mode == "cycle" and (case.steps_per_epoch or length) >= length:
            assert {tuple(batch) for batch in own} <= {tuple(batch) for batch in yielded}
        # The statistics say what happened.
        own_yielded = min(len(full), length)
        assert stats["steps"][rank] == len(full)
        assert stats["own_batches"][rank] == own_yielded
        assert stats["repeated_batches"][rank] == (0 if pads else len(full) - own_yielded)
        assert stats["padded_batches"][rank] == (len(full) - own_yielded if pads else 0)
        assert stats["samples"][rank] == len(full)
        assert stats["passes"][rank] == _passes(case, len(full), length), (rank, stats)
        cut = length > own_yielded
        if case.failing is not None and case.failing[0] == rank and case.failing[1] < length:
            # Its data past the cut may be the corrupt batch: it may not know it had more.
            assert stats["truncated"][rank] in (cut, False)
        else:
            assert stats["truncated"][rank] == cut, (rank, stats)
    own_total = sum(stats["own_batches"])
    repeated = sum(stats["repeated_batches"])
    assert stats["oversampling"] == pytest.approx(repeated / own_total if own_total else 0.0)


def check_case(case: Scenario, outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        assert outcome.seconds < CASE_SECONDS, f"took {outcome.seconds:.1f} s"
    assert len({outcome.control_collectives for outcome in outcomes}) == 1, (
        "ranks issued different numbers of control collectives: "
        f"{[outcome.control_collectives for outcome in outcomes]}"
    )
    if any(outcome.error is not None for outcome in outcomes):
        _check_errors(case, outcomes)
        return
    assert not allowed_errors(case).mandatory, "an unavoidable error was not raised"
    assert len({tuple(outcome.final_weight or []) for outcome in outcomes}) == 1, "DDP diverged"
    for outcome in outcomes:
        assert len(outcome.epochs) == case.epochs
    for epoch in range(case.epochs):
        _check_epoch(case, outcomes, epoch)


def _check_all(cases: list[Scenario], per_rank: list[list[Outcome]]) -> None:
    failures = []
    for index, case in enumerate(cases):
        if any(index >= len(outcomes) for outcomes in per_rank):
            failures.append(f"{case}\n    not run: the process group broke in an earlier case")
            break
        try:
            check_case(case, [outcomes[index] for outcomes in per_rank])
        except AssertionError as error:
            failures.append(f"{case}\n    {error}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(
        failures[:10]
    )


# ---------------------------------------------------------------------------------------------
# The tests


def assert_the_cases_cover_what_they_must(cases: list[Scenario]) -> None:
    """The randomized tests are only as good as their cases: check what they reach (before
    running them, where they are drawn anyway)."""
    assert len(set(cases)) >= 0.8 * len(cases)
    assert {case.mode for case in cases} == set(PRESCRIBED_MODES)
    assert {case.source for case in cases} == {"list", "factory", "iterator"}
    assert {case.sync_every for case in cases} == {None, 1, 2, 7}
    assert any(0 in case.lengths for case in cases), "no empty shard"
    assert any(max(case.lengths) >= 40 for case in cases), "no long shard"
    assert any(case.steps_per_epoch is not None for case in cases)
    assert any("failure" in allowed_errors(case).kinds for case in cases), "no failure"
    assert any(not allowed_errors(case).kinds for case in cases), "no clean case"
    assert any("EmptyShardError" in allowed_errors(case).kinds for case in cases)


def test_world_size_1_without_a_process_group() -> None:
    cases = draw_cases(1, CASES[1])
    assert_the_cases_cover_what_they_must(cases)
    _check_all(cases, [run_scenarios_in_process(cases)])


@pytest.mark.multirank
@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_no_hang_and_nothing_lost(world_size: int) -> None:
    cases = draw_cases(world_size, CASES[world_size])
    assert_the_cases_cover_what_they_must(cases)
    began = time.monotonic()
    # The training group times out too (torch's default is 30 minutes), so that a case
    # leaving some ranks in DDP's all-reduce fails by name instead of the whole group.
    per_rank = run_ranks(
        run_scenarios_one_model, world_size, cases, timeout=200, pg_timeout=CASE_SECONDS * 3
    )
    elapsed = time.monotonic() - began
    _check_all(cases, per_rank)
    assert elapsed < 200
