"""The modes' pure arithmetic: window decisions, whole-epoch steps and epoch outcomes.

No process group: ``decide`` is fed the agreement every rank would hear, simulated here from
the shard lengths, and the expected numbers come from the definitions of the modes (truncate
stops at the shortest shard, cycle runs to the longest or exactly ``steps_per_epoch``, pad
takes cycle's steps and pads with a rank's last batch, join hands out every rank's batches).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import get_args

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_even.agreement.wire import Agreement
from ddp_even.modes import MODES, Mode, WindowDecision, mode_named
from ddp_even.names import ModeName

TRUNCATE, CYCLE, PAD, JOIN = MODES["truncate"], MODES["cycle"], MODES["pad"], MODES["join"]

lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=6)
positive_lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=6)
windows_st = st.integers(1, 9)
steps_per_epoch_st = st.none() | st.integers(0, 60)


def test_mode_name_names_every_mode_in_order() -> None:
    # EvenLoader(mode=...)'s Literal type, which IDEs complete, is the registry's list.
    assert get_args(ModeName) == tuple(MODES)


def _agreement(min_available: int, max_own_available: int) -> Agreement:
    return Agreement(
        min_available=min_available, max_own_available=max_own_available, has_problem=False
    )


def _windowed_epoch(
    mode: Mode, lengths: list[int], sync_every: int, steps_per_epoch: int | None
) -> list[WindowDecision]:
    """Every window's decision, with the offers ranks with shards of ``lengths`` make.

    A rank offers up to a window of batches: what is left of its own shard, or (cycle and pad,
    where short shards start again or pad) a full window, of which the own batches are what is
    left.
    """
    decisions: list[WindowDecision] = []
    done = 0
    for _ in range(1000):
        window = sync_every if steps_per_epoch is None else min(sync_every, steps_per_epoch - done)
        own = [min(window, max(0, length - done)) for length in lengths]
        available = [window] * len(lengths) if mode.goes_past_own_data else own
        decision = mode.decide(_agreement(min(available), max(own)), window, done, steps_per_epoch)
        assert 0 <= decision.steps <= window
        decisions.append(decision)
        done += decision.steps
        if decision.last:
            return decisions
    raise AssertionError(f"no last window after {len(decisions)} windows: {decisions[-3:]}")


# --- decide: worked examples ----------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("mode", "offered", "window", "steps_done", "steps_per_epoch", "expected"),
    [
        # Truncate: the fewest batches any rank offered; the epoch ends when a rank falls short.
        ("truncate", (2, 3), 3, 0, None, (2, True)),
        ("truncate", (3, 3), 3, 0, None, (3, False)),
        ("truncate", (0, 3), 3, 6, None, (0, True)),
        ("truncate", (5, 9), None, 0, None, (5, True)),
        # ... and stops at steps_per_epoch even with more data.
        ("truncate", (3, 3), 3, 8, 10, (2, True)),
        ("truncate", (2, 2), 2, 8, 10, (2, True)),
        ("truncate", (2, 2), 2, 6, 10, (2, False)),
        ("truncate", (9, 9), 10, 0, 10, (9, True)),
        # Cycle: the most own batches any rank still has; the others repeat.
        ("cycle", (3, 3), 3, 0, None, (3, False)),
        ("cycle", (3, 1), 3, 0, None, (1, True)),
        ("cycle", (3, 0), 3, 9, None, (0, True)),
        ("cycle", (4, 7), None, 0, None, (7, True)),
        # Cycle with steps_per_epoch: exactly the window, whatever the own batches.
        ("cycle", (3, 0), 3, 0, 5, (3, False)),
        ("cycle", (2, 0), 2, 3, 5, (2, True)),
        ("cycle", (1, 1), None, 0, 5, (5, True)),
        ("cycle", (1, 1), 0, 0, 0, (0, True)),
        # Pad: as cycle (every rank fills its window, with padding past its data).
        ("pad", (3, 1), 3, 0, None, (1, True)),
        ("pad", (0, 3), 3, 0, None, (3, False)),
        ("pad", (2, 0), 2, 3, 5, (2, True)),
        ("pad", (4, 7), None, 0, None, (7, True)),
        # Join (a single rank): as truncate.
        ("join", (2, 3), 3, 0, None, (2, True)),
        ("join", (3, 3), 3, 3, None, (3, False)),
    ],
)
def test_decide_examples(
    mode: str,
    offered: tuple[int, int],
    window: int | None,
    steps_done: int,
    steps_per_epoch: int | None,
    expected: tuple[int, bool],
) -> None:
    decision = MODES[mode].decide(_agreement(*offered), window, steps_done, steps_per_epoch)
    assert decision == WindowDecision(steps=expected[0], last=expected[1])


# --- decide: properties ---------------------------------------------------------------------


@pytest.mark.timeout(30)
@given(
    st.integers(0, 50),
    st.integers(0, 50),
    st.none() | windows_st,
    st.integers(0, 30),
    steps_per_epoch_st,
)
def test_truncate_never_exceeds_the_minimum_the_window_or_the_cap(
    fewest: int, most_own: int, window: int | None, steps_done: int, steps_per_epoch: int | None
) -> None:
    if steps_per_epoch is not None:
        steps_done = min(steps_done, steps_per_epoch)
    decision = TRUNCATE.decide(_agreement(fewest, most_own), window, steps_done, steps_per_epoch)
    limits = [fewest]
    if window is not None:
        limits.append(window)
    if steps_per_epoch is not None:
        limits.append(steps_per_epoch - steps_done)
    assert decision.steps == min(limits)
    # It goes on only when a full window was agreed and the cap is not reached.
    goes_on = (
        window is not None
        and decision.steps == window
        and (steps_per_epoch is None or steps_done + window < steps_per_epoch)
    )
    assert decision.last == (not goes_on)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "decides_as"),
    [(JOIN, TRUNCATE), (PAD, CYCLE)],
    ids=["join-as-truncate", "pad-as-cycle"],
)
@given(
    st.integers(0, 50),
    st.integers(0, 50),
    st.none() | windows_st,
    st.integers(0, 30),
    steps_per_epoch_st,
)
def test_join_decides_as_truncate_and_pad_as_cycle(
    mode: Mode,
    decides_as: Mode,
    fewest: int,
    most_own: int,
    window: int | None,
    steps_done: int,
    steps_per_epoch: int | None,
) -> None:
    if steps_per_epoch is not None:
        steps_done = min(steps_done, steps_per_epoch)
    agreement = _agreement(fewest, most_own)
    assert mode.decide(agreement, window, steps_done, steps_per_epoch) == decides_as.decide(
        agreement, window, steps_done, steps_per_epoch
    )


@pytest.mark.timeout(30)
@given(lengths_st, windows_st, steps_per_epoch_st)
def test_truncate_windows_stop_at_the_shortest_shard(
    lengths: list[int], sync_every: int, steps_per_epoch: int | None
) -> None:
    decisions = _windowed_epoch(TRUNCATE, lengths, sync_every, steps_per_epoch)
    shortest = min(lengths)
    expected = shortest if steps_per_epoch is None else min(shortest, steps_per_epoch)
    assert sum(decision.steps for decision in decisions) == expected
    # Only the last window may be short.
    assert all(decision.steps == sync_every for decision in decisions[:-1])


@pytest.mark.timeout(30)
@given(lengths_st, windows_st, st.sampled_from([CYCLE, PAD]))
def test_cycle_and_pad_windows_run_to_the_longest_shard(
    lengths: list[int], sync_every: int, mode: Mode
) -> None:
    decisions = _windowed_epoch(mode, lengths, sync_every, None)
    assert sum(decision.steps for decision in decisions) == max(lengths)
    assert all(decision.steps == sync_every for decision in decisions[:-1])


@pytest.mark.timeout(30)
@given(positive_lengths_st, windows_st, st.integers(0, 60), st.sampled_from([CYCLE, PAD]))
def test_cycle_and_pad_with_steps_per_epoch_take_exactly_that_many_steps(
    lengths: list[int], sync_every: int, steps_per_epoch: int, mode: Mode
) -> None:
    decisions = _windowed_epoch(mode, lengths, sync_every, steps_per_epoch)
    assert sum(decision.steps for decision in decisions) == steps_per_epoch
    assert len(decisions) == max(1, math.ceil(steps_per_epoch / sync_every))


@pytest.mark.timeout(30)
@given(
    positive_lengths_st,
    windows_st,
    steps_per_epoch_st,
    st.sampled_from(["truncate", "cycle", "pad"]),
)
def test_windows_add_up_to_the_whole_epoch_decision(
    lengths: list[int], sync_every: int, steps_per_epoch: int | None, mode_name: str
) -> None:
    mode = MODES[mode_name]
    windowed = sum(d.steps for d in _windowed_epoch(mode, lengths, sync_every, steps_per_epoch))
    # Known lengths: one agreement over every rank's whole shard; the window is the cap.
    whole = mode.decide(_agreement(min(lengths), max(lengths)), steps_per_epoch, 0, steps_per_epoch)
    assert whole.last
    assert windowed == whole.steps
    assert mode.steps_per_rank(lengths, steps_per_epoch) == (windowed,) * len(lengths)


# --- steps_per_rank -------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("mode", "steps_per_epoch", "expected"),
    [
        ("truncate", None, (4, 4, 4)),
        ("truncate", 2, (2, 2, 2)),
        ("truncate", 10, (4, 4, 4)),
        ("cycle", None, (7, 7, 7)),
        ("cycle", 3, (3, 3, 3)),
        ("cycle", 10, (10, 10, 10)),
        ("pad", None, (7, 7, 7)),
        ("pad", 3, (3, 3, 3)),
        ("join", None, (7, 4, 5)),
    ],
)
def test_steps_per_rank_examples(
    mode: str, steps_per_epoch: int | None, expected: tuple[int, ...]
) -> None:
    assert MODES[mode].steps_per_rank([7, 4, 5], steps_per_epoch) == expected


@pytest.mark.timeout(30)
@given(lengths_st)
def test_steps_per_rank_by_definition(lengths: list[int]) -> None:
    n = len(lengths)
    assert TRUNCATE.steps_per_rank(lengths) == (min(lengths),) * n
    assert CYCLE.steps_per_rank(lengths) == (max(lengths),) * n
    assert PAD.steps_per_rank(lengths) == (max(lengths),) * n
    assert JOIN.steps_per_rank(lengths) == tuple(lengths)


# --- epoch_outcome --------------------------------------------------------------------------


def _batch_sizes(rows: int, batch_size: int) -> list[int]:
    """The sizes of the batches of a shard of ``rows`` rows (the last one may be short)."""
    sizes = [batch_size] * (rows // batch_size)
    if rows % batch_size:
        sizes.append(rows % batch_size)
    return sizes


shards_st = st.tuples(st.lists(st.integers(0, 60), min_size=1, max_size=6), st.integers(1, 9))


def _rounded_percent(reported: float, exact: Fraction) -> bool:
    """``reported`` is ``exact`` rounded to three decimals."""
    return abs(Fraction(reported) - exact) <= Fraction(1, 2000) + Fraction(1, 10**9)


def _arrays(
    rows: list[int], batch_size: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    batches = [len(_batch_sizes(count, batch_size)) for count in rows]
    return np.array(rows, dtype=np.int64), np.array(batches, dtype=np.int64)


@pytest.mark.timeout(30)
@given(shards_st)
def test_truncate_outcome_drops_what_follows_the_shortest_shard(
    shards: tuple[list[int], int],
) -> None:
    rows, batch_size = shards
    outcome = TRUNCATE.epoch_outcome(*_arrays(rows, batch_size), batch_size)
    sizes = [_batch_sizes(count, batch_size) for count in rows]
    steps = min(len(shard) for shard in sizes)
    dropped = [sum(shard[steps:]) for shard in sizes]
    assert outcome.steps == steps
    assert list(outcome.dropped_batches) == [len(shard) - steps for shard in sizes]
    assert list(outcome.dropped_rows) == dropped
    assert list(outcome.repeated_batches) == [0] * len(rows)
    assert list(outcome.repeated_rows) == [0] * len(rows)
    assert list(outcome.idle_steps) == [0] * len(rows)
    expected = Fraction(100 * sum(dropped), max(sum(rows), 1))
    assert _rounded_percent(outcome.waste_percent, expected)


@pytest.mark.timeout(30)
@given(shards_st.filter(lambda shards: min(shards[0]) > 0))
def test_cycle_outcome_repeats_short_shards_from_the_start(shards: tuple[list[int], int]) -> None:
    rows, batch_size = shards
    outcome = CYCLE.epoch_outcome(*_arrays(rows, batch_size), batch_size)
    sizes = [_batch_sizes(count, batch_size) for count in rows]
    steps = max(len(shard) for shard in sizes)
    # What each rank hands out: its batches in order, again and again, for `steps` steps.
    handed = [[shard[step % len(shard)] for step in range(steps)] for shard in sizes]
    repeated_rows = [sum(out) - count for out, count in zip(handed, rows, strict=True)]
    assert outcome.steps == steps
    assert list(outcome.repeated_batches) == [steps - len(shard) for shard in sizes]
    assert list(outcome.repeated_rows) == repeated_rows
    assert list(outcome.dropped_batches) == [0] * len(rows)
    assert list(outcome.dropped_rows) == [0] * len(rows)
    assert list(outcome.idle_steps) == [0] * len(rows)
    # Over-sampling, as EpochStats.oversampling counts it: repeated batches over own batches.
    repeated = steps * len(rows) - sum(len(shard) for shard in sizes)
    expected = Fraction(100 * repeated, sum(len(shard) for shard in sizes))
    assert _rounded_percent(outcome.waste_percent, expected)


@pytest.mark.timeout(30)
@given(shards_st)
def test_pad_outcome_pads_short_shards_with_their_last_batch(shards: tuple[list[int], int]) -> None:
    rows, batch_size = shards
    outcome = PAD.epoch_outcome(*_arrays(rows, batch_size), batch_size)
    sizes = [_batch_sizes(count, batch_size) for count in rows]
    steps = max(len(shard) for shard in sizes)
    # An empty rank pads with the first batch of the lowest rank that has one.
    donated = next((shard[0] for shard in sizes if shard), 0)
    handed = [shard + [shard[-1] if shard else donated] * (steps - len(shard)) for shard in sizes]
    assert outcome.steps == steps
    assert list(outcome.padded_batches) == [steps - len(shard) for shard in sizes]
    padded_rows = [sum(out) - count for out, count in zip(handed, rows, strict=True)]
    assert list(outcome.padded_rows) == padded_rows
    for name in ("dropped_rows", "repeated_rows", "idle_steps"):
        assert list(getattr(outcome, name)) == [0] * len(rows)
    padded = steps * len(rows) - sum(len(shard) for shard in sizes)
    expected = Fraction(100 * padded, steps * len(rows)) if steps else Fraction(0)
    assert _rounded_percent(outcome.waste_percent, expected)


@pytest.mark.timeout(30)
@given(shards_st)
def test_join_outcome_idles_ranks_that_finish_first(shards: tuple[list[int], int]) -> None:
    rows, batch_size = shards
    outcome = JOIN.epoch_outcome(*_arrays(rows, batch_size), batch_size)
    batches = [len(_batch_sizes(count, batch_size)) for count in rows]
    steps = max(batches)
    idle = [steps - count for count in batches]
    assert outcome.steps == steps
    assert list(outcome.idle_steps) == idle
    assert list(outcome.dropped_rows) == [0] * len(rows)
    assert list(outcome.repeated_rows) == [0] * len(rows)
    expected = Fraction(100 * sum(idle), steps * len(rows)) if steps else Fraction(0)
    assert _rounded_percent(outcome.waste_percent, expected)


@pytest.mark.timeout(30)
def test_outcomes_on_a_worked_example() -> None:
    # Shards of 23, 8 and 12 rows in batches of 5: 5, 2 and 3 batches (last ones 3, 3, 2 rows).
    rows, batches = np.array([23, 8, 12]), np.array([5, 2, 3])
    truncate = TRUNCATE.epoch_outcome(rows, batches, 5)
    assert truncate.steps == 2
    assert list(truncate.dropped_batches) == [3, 0, 1]
    assert list(truncate.dropped_rows) == [13, 0, 2]
    assert _rounded_percent(truncate.waste_percent, Fraction(100 * 15, 43))
    cycle = CYCLE.epoch_outcome(rows, batches, 5)
    assert cycle.steps == 5
    # Rank 1: a whole second pass (8 rows) and one full batch of a third; rank 2: two batches.
    assert list(cycle.repeated_batches) == [0, 3, 2]
    assert list(cycle.repeated_rows) == [0, 13, 10]
    assert _rounded_percent(cycle.waste_percent, Fraction(100 * 5, 10))
    pad = PAD.epoch_outcome(rows, batches, 5)
    assert pad.steps == 5
    # Rank 1 hands out its last batch (3 rows) 3 more times, rank 2 its last (2 rows) twice.
    assert list(pad.padded_batches) == [0, 3, 2]
    assert list(pad.padded_rows) == [0, 9, 4]
    assert _rounded_percent(pad.waste_percent, Fraction(100 * 5, 15))
    join = JOIN.epoch_outcome(rows, batches, 5)
    assert join.steps == 5
    assert list(join.idle_steps) == [0, 3, 2]
    assert _rounded_percent(join.waste_percent, Fraction(100 * 5, 15))


@pytest.mark.timeout(30)
def test_outcomes_with_no_rows_waste_nothing() -> None:
    rows, batches = np.array([0, 0]), np.array([0, 0])
    for mode in MODES.values():
        outcome = mode.epoch_outcome(rows, batches, 4)
        assert outcome.steps == 0
        assert outcome.waste_percent == 0.0


@pytest.mark.timeout(30)
def test_cycle_repeats_no_rows_of_an_empty_shard_and_cannot_run() -> None:
    outcome = CYCLE.epoch_outcome(np.array([10, 0]), np.array([3, 0]), 4)
    assert list(outcome.repeated_rows) == [0, 0]
    runnable, note = CYCLE.note_with_empty_ranks("1", outcome.steps)
    assert not runnable
    assert "rank(s) 1" in note
    assert CYCLE.note_with_empty_ranks("0, 1", 0)[0]
    assert TRUNCATE.note_with_empty_ranks("1", 0) == (
        True,
        "rank(s) 1 have no batch: the epoch has 0 steps, all rows dropped",
    )
    assert JOIN.note_with_empty_ranks("2", 5)[0]
    assert PAD.note_with_empty_ranks("1", 3) == (
        True,
        "rank(s) 1 have no batch: they pad with another rank's first",
    )
    padded = PAD.epoch_outcome(np.array([10, 0]), np.array([3, 0]), 4)
    assert list(padded.padded_rows) == [0, 12]  # 3 copies of rank 0's first batch


# --- the registry, check and mode_named -----------------------------------------------------


@pytest.mark.timeout(30)
def test_registry_names_and_flags() -> None:
    assert list(MODES) == ["truncate", "cycle", "pad", "join", "share"]
    assert [mode.after_own_data for mode in MODES.values()] == [
        "stop",
        "restart",
        "pad",
        "stop",
        "share",
    ]
    assert [name for name, mode in MODES.items() if mode.hands_over] == ["share"]
    assert [name for name, mode in MODES.items() if not mode.shares_steps] == ["join"]
    assert all(mode.name == name for name, mode in MODES.items())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["truncate", "cycle", "pad", "share"])
def test_check_refuses_joinables_outside_join(mode: str) -> None:
    MODES[mode].check(steps_per_epoch=None, has_joinables=False)
    if mode != "share":
        MODES[mode].check(steps_per_epoch=7, has_joinables=False)
    with pytest.raises(ValueError, match=f"only used in join mode, not in '{mode}'"):
        MODES[mode].check(steps_per_epoch=None, has_joinables=True)


@pytest.mark.timeout(30)
def test_check_join_needs_joinables_and_no_steps_per_epoch() -> None:
    JOIN.check(steps_per_epoch=None, has_joinables=True)
    with pytest.raises(ValueError, match="takes no steps_per_epoch"):
        JOIN.check(steps_per_epoch=5, has_joinables=True)
    with pytest.raises(ValueError, match="takes no steps_per_epoch"):
        JOIN.check(steps_per_epoch=5, has_joinables=False)
    with pytest.raises(ValueError, match=r"needs joinables=\[ddp_model"):
        JOIN.check(steps_per_epoch=None, has_joinables=False)


@pytest.mark.timeout(30)
def test_mode_named() -> None:
    for name, mode in MODES.items():
        assert mode_named(name) is mode
        assert mode_named(mode) is mode
    choices = "choose one of 'truncate', 'cycle', 'pad', 'join', 'share'"
    for wrong, shown in [("wrap", "'wrap'"), ("Cycle", "'Cycle'"), ("", "''"), (None, "None")]:
        with pytest.raises(ValueError) as info:
            mode_named(wrong)  # type: ignore[arg-type]
        assert str(info.value) == f"unknown mode {shown}: {choices}"
