"""Epoch statistics without a process group: a gatherer of our own answers ``gather_counts``.

``CountsGatherer`` is ddp_even's own protocol (the transport implements it); the fake here
hands every rank's vector back as an all-gather would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_even.runtime.stats import EpochStats, RankCounts, gather_epoch_stats

COLUMNS = (
    "steps",
    "own_batches",
    "repeated_batches",
    "passes",
    "samples",
    "own_samples",
    "truncated",
    "planned_batches",
    "planned_rows",
    "padded_batches",
    "padded_rows",
    "sent_batches",
    "sent_rows",
    "received_batches",
    "received_rows",
)


@dataclass
class Gatherer:
    """Every rank's counts, as ``rank`` would receive them from the all-gather."""

    rank: int
    others: dict[int, RankCounts]
    global_ranks: tuple[int, ...] = ()
    world_size: int = field(init=False)
    sent: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.world_size = len(self.others) + 1
        if not self.global_ranks:
            self.global_ranks = tuple(range(self.world_size))

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        self.sent.append(counts)
        return [
            counts if rank == self.rank else self.others[rank].as_vector()
            for rank in range(self.world_size)
        ]


def _gathered(
    counts: list[RankCounts],
    mode: str = "cycle",
    epoch: int = 3,
    rank: int = 0,
    global_ranks: tuple[int, ...] = (),
    sharding: str | None = None,
) -> EpochStats:
    others = {index: one for index, one in enumerate(counts) if index != rank}
    gatherer = Gatherer(rank, others, global_ranks)
    return gather_epoch_stats(gatherer, counts[rank], epoch, mode, sharding)


# --- RankCounts -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_count_batch_splits_own_and_repeated() -> None:
    counts = RankCounts()
    for pass_number, rows in [(1, 8), (1, 8), (1, 3), (2, 8), (3, 8)]:
        counts.count_batch(pass_number, rows)
    assert (counts.steps, counts.own_batches, counts.repeated_batches) == (5, 3, 2)
    assert (counts.passes, counts.samples, counts.own_samples) == (3, 35, 19)
    counts.count_batch(2, None)  # a repeat of unknown size: the total is unknown from now on
    assert (counts.samples, counts.own_samples) == (None, 19)
    counts.count_batch(2, 8)
    assert counts.samples is None


@pytest.mark.timeout(30)
def test_count_batch_counts_padding_apart_from_own_and_repeated() -> None:
    counts = RankCounts()
    for rows, padding in [(8, False), (3, False), (3, True), (3, True)]:
        counts.count_batch(1, rows, padding)
    assert (counts.steps, counts.own_batches, counts.repeated_batches) == (4, 2, 0)
    assert (counts.padded_batches, counts.padded_rows) == (2, 6)
    assert (counts.samples, counts.own_samples, counts.passes) == (17, 11, 1)
    counts.count_batch(1, None, padding=True)
    assert (counts.padded_batches, counts.padded_rows, counts.own_samples) == (3, None, 11)


@pytest.mark.timeout(30)
def test_vectors_and_columns_of_a_worked_example() -> None:
    first = RankCounts(steps=4, own_batches=4, passes=1, samples=30, own_samples=30)
    second = RankCounts(
        steps=4,
        own_batches=2,
        repeated_batches=2,
        passes=2,
        samples=None,
        own_samples=None,
        truncated=True,
        planned_batches=7,
        planned_rows=50,
    )
    assert first.as_vector() == [4, 4, 0, 1, 30, 30, 0, -1, -1, 0, 0, 0, 0, 0, 0]
    assert second.as_vector() == [4, 2, 2, 2, -1, -1, 1, 7, 50, 0, 0, 0, 0, 0, 0]
    columns = RankCounts.columns_of([first.as_vector(), second.as_vector()])
    assert tuple(columns) == COLUMNS
    assert columns["own_batches"] == (4, 2)
    assert columns["samples"] == (30, None)
    assert columns["truncated"] == (0, 1)
    assert columns["planned_rows"] == (None, 50)


counts_st = st.builds(
    RankCounts,
    steps=st.integers(0, 2**40),
    own_batches=st.integers(0, 2**40),
    repeated_batches=st.integers(0, 2**40),
    passes=st.integers(0, 100),
    samples=st.none() | st.integers(0, 2**62),
    own_samples=st.none() | st.integers(0, 2**62),
    truncated=st.booleans(),
    planned_batches=st.none() | st.integers(0, 2**40),
    planned_rows=st.none() | st.integers(0, 2**62),
    padded_batches=st.integers(0, 2**40),
    padded_rows=st.none() | st.integers(0, 2**62),
    sent_batches=st.integers(0, 2**40),
    sent_rows=st.none() | st.integers(0, 2**62),
    received_batches=st.integers(0, 2**40),
    received_rows=st.none() | st.integers(0, 2**62),
)


@pytest.mark.timeout(30)
@given(st.lists(counts_st, min_size=1, max_size=5))
def test_columns_of_the_vectors_give_back_every_count(ranks: list[RankCounts]) -> None:
    vectors = [counts.as_vector() for counts in ranks]
    assert all(len(vector) == len(COLUMNS) for vector in vectors)
    columns = RankCounts.columns_of(vectors)
    assert tuple(columns) == COLUMNS
    for name in COLUMNS:
        expected = tuple(getattr(counts, name) for counts in ranks)
        assert columns[name] == expected, name


@pytest.mark.timeout(30)
def test_columns_of_refuses_ragged_vectors() -> None:
    with pytest.raises(ValueError):
        RankCounts.columns_of([[1] * len(COLUMNS), [1] * (len(COLUMNS) - 1)])


# --- gather_epoch_stats ---------------------------------------------------------------------


def _planned_cycle_epoch() -> list[RankCounts]:
    """Cycle with steps_per_epoch=5 and a shard plan of 8, 3 and 5 batches of 8 rows.

    Rank 0 is cut after 5 of its 8 batches; rank 1 repeats 2 batches; rank 2's source lost
    a row group (4 of its 5 planned batches, 30 of 36 rows) and repeats 1 batch.
    """
    return [
        RankCounts(5, 5, 0, 1, 40, 40, True, planned_batches=8, planned_rows=64),
        RankCounts(5, 3, 2, 2, 38, 22, False, planned_batches=3, planned_rows=22),
        RankCounts(5, 4, 1, 2, 38, 30, False, planned_batches=5, planned_rows=36),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_gathered_stats_are_the_same_on_every_rank(rank: int) -> None:
    stats = _gathered(_planned_cycle_epoch(), rank=rank)
    assert stats == EpochStats(
        epoch=3,
        mode="cycle",
        world_size=3,
        steps=(5, 5, 5),
        own_batches=(5, 3, 4),
        repeated_batches=(0, 2, 1),
        passes=(1, 2, 2),
        samples=(40, 38, 38),
        truncated=(True, False, False),
        padded_batches=(0, 0, 0),
        padded_rows=(0, 0, 0),
        sent_batches=(0, 0, 0),
        sent_rows=(0, 0, 0),
        received_batches=(0, 0, 0),
        received_rows=(0, 0, 0),
        dropped_batches=(3, 0, 0),
        dropped_rows=(24, 0, 0),
        lost_rows=(0, 0, 6),
    )
    assert stats.oversampling == pytest.approx(3 / 12)
    assert stats.empty_ranks == ()


@pytest.mark.timeout(30)
def test_the_gatherer_receives_this_ranks_vector_once() -> None:
    counts = _planned_cycle_epoch()
    gatherer = Gatherer(1, {0: counts[0], 2: counts[2]})
    gather_epoch_stats(gatherer, counts[1], 0, "cycle")
    assert gatherer.sent == [[5, 3, 2, 2, 38, 22, 0, 3, 22, 0, 0, 0, 0, 0, 0]]


@pytest.mark.timeout(30)
def test_without_a_plan_nothing_is_dropped_or_lost() -> None:
    counts = [RankCounts(4, 4, 0, 1, 16, 16, True), RankCounts(4, 4, 0, 1, 13, 13, False)]
    stats = _gathered(counts, mode="truncate")
    assert (stats.dropped_batches, stats.dropped_rows, stats.lost_rows) == (None, None, None)
    assert stats.oversampling == 0.0


@pytest.mark.timeout(30)
def test_a_plan_missing_on_one_rank_is_no_plan() -> None:
    counts = _planned_cycle_epoch()
    counts[2].planned_batches = None
    stats = _gathered(counts)
    assert (stats.dropped_batches, stats.dropped_rows, stats.lost_rows) == (None, None, None)


@pytest.mark.timeout(30)
def test_unknown_rows_leave_only_the_batches_known() -> None:
    counts = _planned_cycle_epoch()
    counts[1].planned_rows = None
    stats = _gathered(counts)
    assert stats.dropped_batches == (3, 0, 0)
    assert (stats.dropped_rows, stats.lost_rows) == (None, None)

    counts = _planned_cycle_epoch()
    counts[0].own_samples = counts[0].samples = None  # a batch of unknown size on rank 0
    stats = _gathered(counts)
    assert stats.samples == (None, 38, 38)
    assert stats.dropped_batches == (3, 0, 0)
    assert (stats.dropped_rows, stats.lost_rows) == (None, None)


@pytest.mark.timeout(30)
def test_more_than_planned_is_neither_dropped_nor_lost() -> None:
    counts = [RankCounts(6, 6, 0, 1, 48, 48, False, planned_batches=5, planned_rows=40)]
    stats = _gathered(counts, mode="truncate")
    assert (stats.dropped_batches, stats.dropped_rows, stats.lost_rows) == ((0,), (0,), (0,))


# --- summary and empty ranks ----------------------------------------------------------------


@pytest.mark.timeout(30)
def test_summary_of_a_planned_cycle_epoch() -> None:
    stats = _gathered(_planned_cycle_epoch(), sharding="row_groups")
    assert stats.sharding == "row_groups"
    assert stats.summary() == (
        "epoch 3 cycle 3 ranks: 5 steps; own 5/3/4; repeated 0/2/1; oversampling 25.0%; "
        "truncated: rank 0; dropped batches 3/0/0 (rows 24/0/0); rows lost by the source 0/0/6; "
        "sharding row_groups"
    )


@pytest.mark.timeout(30)
def test_summary_of_a_join_epoch_with_an_empty_rank() -> None:
    counts = [
        RankCounts(6, 6, 0, 1, 48, 48, False),
        RankCounts(0, 0, 0, 1, 0, 0, False),
        RankCounts(2, 2, 0, 1, 16, 16, False),
    ]
    stats = _gathered(counts, mode="join", epoch=0)
    assert stats.empty_ranks == (1,)
    assert stats.summary() == (
        "epoch 0 join 3 ranks: steps 6/0/2; own 6/0/2; repeated 0/0/0; oversampling 0.0%; "
        "EMPTY: rank 1"
    )


@pytest.mark.timeout(30)
def test_summary_of_a_pad_epoch_with_an_empty_rank() -> None:
    # Pad over shards of 5, 0 and 2 batches of 8 rows (rank 2's last batch has 3 rows): rank 1
    # pads with a copy of rank 0's first batch, rank 2 with its own last.
    counts = [
        RankCounts(5, 5, 0, 1, 40, 40, False),
        RankCounts(5, 0, 0, 1, 40, 0, False, padded_batches=5, padded_rows=40),
        RankCounts(5, 2, 0, 1, 20, 11, False, padded_batches=3, padded_rows=9),
    ]
    stats = _gathered(counts, mode="pad", epoch=0)
    assert (stats.padded_batches, stats.padded_rows) == ((0, 5, 3), (0, 40, 9))
    assert stats.empty_ranks == (1,)
    assert stats.summary() == (
        "epoch 0 pad 3 ranks: 5 steps; own 5/0/2; repeated 0/0/0; oversampling 0.0%; "
        "padded 0/5/3 (rows 0/40/9); EMPTY: rank 1"
    )


@pytest.mark.timeout(30)
def test_a_truncated_rank_without_own_batches_is_not_empty() -> None:
    # Truncate over a shortest shard of 0 batches: every rank takes 0 steps; rank 0 had data.
    counts = [RankCounts(0, 0, 0, 1, 0, 0, True), RankCounts(0, 0, 0, 1, 0, 0, False)]
    stats = _gathered(counts, mode="truncate", epoch=1)
    assert stats.empty_ranks == (1,)
    assert stats.summary() == (
        "epoch 1 truncate 2 ranks: 0 steps; own 0/0; repeated 0/0; oversampling 0.0%; "
        "truncated: rank 0; EMPTY: rank 1"
    )


# --- what rank 0 logs -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_rank_0_logs_the_summary_and_warns_by_global_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counts = _planned_cycle_epoch()
    counts[1] = RankCounts(0, 0, 0, 1, 0, 0, False, planned_batches=0, planned_rows=0)
    with caplog.at_level(logging.INFO, logger="ddp_even"):
        stats = _gathered(counts, global_ranks=(4, 5, 6))
    messages = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert messages[0] == ("INFO", stats.summary())
    warnings = [message for level, message in messages if level == "WARNING"]
    assert len(warnings) == 2
    assert warnings[0].startswith("epoch 3: rank(s) 5 had no batch at all")
    # Rank 2 (global 6) read its whole shard but 4 batches / 30 rows of the planned 5 / 36.
    assert warnings[1].startswith(
        "epoch 3: rank 6 read 4 batches / 30 rows from its shard, but the shard plan "
        "(from the Parquet footers) says 5 batches / 36 rows"
    )


@pytest.mark.timeout(30)
def test_a_rank_with_nothing_left_of_an_elastic_rest_is_no_empty_shard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The rest of an epoch re-planned on another number of ranks, resumed at its end: a rank
    with none of it left has no batch, and that is expected, not an empty shard."""
    counts = _planned_cycle_epoch()
    counts[1] = RankCounts(0, 0, 0, 1, 0, 0, False, planned_batches=0, planned_rows=0)
    others = {index: one for index, one in enumerate(counts) if index != 0}
    for resumed_from, warned in ((None, True), (3, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ddp_even"):
            gather_epoch_stats(
                Gatherer(0, others), counts[0], 3, "cycle", resumed_from_world_size=resumed_from
            )
        empty = [r for r in caplog.records if "had no batch at all" in r.getMessage()]
        assert bool(empty) is warned, resumed_from


@pytest.mark.timeout(30)
def test_only_rank_0_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="ddp_even"):
        _gathered(_planned_cycle_epoch(), rank=1)
    assert caplog.records == []
