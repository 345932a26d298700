"""``ShardFeed`` over real sources: read-ahead, restarts, padding, end-of-epoch checks and
failures.

One process, no process group: the feed is what one rank reads; what it must hold is
counted here from the batches the sources were given.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from ddp_even.errors import EvenLoaderError, SourceEndedEarlyError
from ddp_even.runtime.feed import FedBatch, ShardFeed
from ddp_even.sources import ShardPass, ShardSource, as_source
from ddp_even.sources.base import ContinuingStream

# Batches are lists of rows; batch i of a shard holds rows 10*i and 10*i + 1.
SHARD = [[10 * i, 10 * i + 1] for i in range(5)]


class Pulls:
    """A factory whose passes record every batch pulled from them, and how often it ran."""

    def __init__(self, passes: list[list[Any]], fail_after: int | None = None) -> None:
        self.passes = passes
        self.fail_after = fail_after
        self.calls = 0
        self.pulled: list[Any] = []
        self.closed = 0

    def __call__(self) -> Iterator[Any]:
        batches = self.passes[min(self.calls, len(self.passes) - 1)]
        self.calls += 1
        return self._generate(batches)

    def _generate(self, batches: list[Any]) -> Iterator[Any]:
        try:
            for index, batch in enumerate(batches):
                if self.fail_after is not None and index == self.fail_after:
                    raise OSError(f"disk gone at batch {index}")
                self.pulled.append(batch)
                yield batch
        finally:
            self.closed += 1


def _feed(
    source: object, *, restarts: bool = False, steps_capped: bool = False, pads: bool = False
) -> ShardFeed[Any]:
    after_own_data = "restart" if restarts else "pad" if pads else "stop"
    return ShardFeed(as_source(source), after_own_data, steps_capped=steps_capped)


def _take_all(feed: ShardFeed[Any]) -> list[FedBatch[Any]]:
    return [feed.take() for _ in range(feed.buffered)]


# --- read-ahead -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_fill_reads_ahead_exactly_to_the_target() -> None:
    pulls = Pulls([SHARD])
    feed = _feed(pulls)
    feed.fill(3)
    assert pulls.pulled == SHARD[:3]
    assert (feed.buffered, feed.own_buffered, feed.own_read) == (3, 3, 3)
    assert not feed.own_ended
    feed.fill(3)  # already there: reads nothing
    assert pulls.pulled == SHARD[:3]
    first = feed.take()
    assert first.batch == SHARD[0]
    assert first.pass_number == 1
    assert not first.repeated
    assert first.count_samples(first.batch) == 2
    assert feed.buffered == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["list", "factory", "iterator"])
def test_without_restarts_the_feed_stops_at_the_end_of_the_shard(kind: str) -> None:
    source: object = {
        "list": SHARD,
        "factory": lambda: list(SHARD),
        "iterator": iter(SHARD),
    }[kind]
    feed = _feed(source)
    feed.fill(100)
    assert [fed.batch for fed in _take_all(feed)] == SHARD
    assert (feed.own_read, feed.own_ended, feed.passes_started) == (5, True, 1)
    assert feed.failure is None
    assert not feed.empty_shard
    feed.fill(3)
    assert feed.buffered == 0


# --- restarts (cycle) -----------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["list", "factory"])
def test_restarts_start_fresh_passes_until_the_target(kind: str) -> None:
    shard = SHARD[:3]
    pulls = Pulls([shard])
    feed = _feed(shard if kind == "list" else pulls, restarts=True)
    feed.fill(8)
    fed = _take_all(feed)
    assert [item.batch for item in fed] == shard + shard + shard[:2]
    assert [item.pass_number for item in fed] == [1, 1, 1, 2, 2, 2, 3, 3]
    assert [item.repeated for item in fed] == [False] * 3 + [True] * 5
    assert (feed.passes_started, feed.own_read, feed.own_ended) == (3, 3, True)
    if kind == "factory":
        assert pulls.calls == 3
        assert pulls.closed == 2  # the passes that ended; the third is still open
        feed.close()
        assert pulls.closed == 3


@pytest.mark.timeout(30)
def test_own_buffered_counts_only_the_first_pass() -> None:
    feed = _feed(SHARD[:2], restarts=True)
    feed.fill(5)
    assert (feed.buffered, feed.own_buffered) == (5, 2)
    feed.take()
    assert (feed.buffered, feed.own_buffered) == (4, 1)


# --- had_more_own_data ----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_had_more_own_data_when_the_epoch_stopped_mid_shard() -> None:
    pulls = Pulls([SHARD[:3]])
    feed = _feed(pulls)
    feed.fill(2)
    _take_all(feed)
    assert feed.had_more_own_data()
    # It read one batch to tell, and keeps it for whoever reads on.
    assert pulls.pulled == SHARD[:3]
    assert feed.buffered == 1
    assert feed.take().batch == SHARD[2]


@pytest.mark.timeout(30)
def test_had_more_own_data_with_an_own_batch_buffered_reads_nothing() -> None:
    pulls = Pulls([SHARD])
    feed = _feed(pulls)
    feed.fill(2)
    feed.take()
    assert feed.had_more_own_data()
    assert pulls.pulled == SHARD[:2]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("restarts", [False, True])
def test_had_more_own_data_is_false_after_the_whole_shard(restarts: bool) -> None:
    pulls = Pulls([SHARD[:3]])
    feed = _feed(pulls, restarts=restarts)
    feed.fill(3)  # exactly the shard: its end is not seen yet
    assert not feed.own_ended
    _take_all(feed)
    assert not feed.had_more_own_data()
    assert feed.own_ended
    # Checking never starts another pass, not even in cycle mode.
    assert (pulls.calls, feed.passes_started, feed.buffered) == (1, 1, 0)


@pytest.mark.timeout(30)
def test_had_more_own_data_is_false_with_only_repeats_left() -> None:
    feed = _feed(SHARD[:3], restarts=True)
    feed.fill(4)
    for _ in range(3):
        feed.take()
    assert feed.buffered == 1
    assert not feed.had_more_own_data()


@pytest.mark.timeout(30)
def test_had_more_own_data_is_false_after_a_failure() -> None:
    feed = _feed(Pulls([SHARD], fail_after=2))
    feed.fill(5)
    _take_all(feed)
    assert feed.failure is not None
    assert not feed.had_more_own_data()


# --- empty shards ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("restarts", [False, True])
@pytest.mark.parametrize("kind", ["list", "factory", "iterator"])
def test_an_empty_shard_is_told_once_read(kind: str, restarts: bool) -> None:
    source: object = {"list": [], "factory": lambda: [], "iterator": iter([])}[kind]
    feed = _feed(source, restarts=restarts)
    assert not feed.empty_shard  # nothing read yet: not known
    feed.fill(4)
    assert feed.empty_shard
    assert (feed.buffered, feed.own_read, feed.passes_started) == (0, 0, 1)
    assert feed.failure is None
    assert not feed.had_more_own_data()


@pytest.mark.timeout(30)
def test_a_shard_with_batches_is_not_empty() -> None:
    feed = _feed(SHARD[:1])
    feed.fill(4)
    assert feed.own_ended
    assert not feed.empty_shard


# --- failures -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_source_raising_mid_pass_is_kept_and_reading_stops() -> None:
    pulls = Pulls([SHARD], fail_after=2)
    feed = _feed(pulls)
    feed.fill(5)
    assert feed.buffered == 2
    assert isinstance(feed.failure, OSError)
    assert str(feed.failure) == "disk gone at batch 2"
    assert not feed.empty_shard
    feed.fill(5)  # no further reads once failed
    assert (feed.buffered, pulls.pulled) == (2, SHARD[:2])


@pytest.mark.timeout(30)
def test_a_factory_raising_is_kept() -> None:
    def factory() -> list[Any]:
        raise PermissionError("no access to the shard")

    feed = _feed(factory)
    assert feed.first_pass_reading() is None
    assert isinstance(feed.failure, PermissionError)
    feed.fill(3)
    assert (feed.buffered, feed.passes_started, feed.empty_shard) == (0, 0, False)


@pytest.mark.timeout(30)
def test_a_factory_returning_no_iterable_is_kept() -> None:
    feed = _feed(lambda: 42)
    feed.fill(1)
    assert isinstance(feed.failure, TypeError)
    assert "returned int, which is not iterable" in str(feed.failure)


@pytest.mark.timeout(30)
def test_a_second_pass_that_yields_nothing_is_a_failure() -> None:
    pulls = Pulls([SHARD[:2], []])
    feed = _feed(pulls, restarts=True)
    feed.fill(5)
    assert [fed.batch for fed in _take_all(feed)] == SHARD[:2]
    assert isinstance(feed.failure, EvenLoaderError)
    assert "pass 2 over this rank's shard yielded nothing" in str(feed.failure)
    assert "the first pass yielded 2 batch(es)" in str(feed.failure)
    assert pulls.calls == 2


@pytest.mark.timeout(30)
def test_restarting_a_one_shot_iterator_is_a_failure() -> None:
    feed = _feed(iter(SHARD[:2]), restarts=True)
    feed.fill(3)
    assert feed.buffered == 2
    assert isinstance(feed.failure, TypeError)
    assert "one-shot iterator and was already consumed" in str(feed.failure)


# --- take_or_repeat -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_take_or_repeat_hands_out_in_order_then_repeats_the_last_batch() -> None:
    feed = _feed(SHARD[:2])
    assert feed.take_or_repeat().batch == SHARD[0]
    assert feed.take_or_repeat().batch == SHARD[1]
    again = feed.take_or_repeat()
    assert (again.batch, again.repeated) == (SHARD[1], True)
    assert isinstance(feed.failure, EvenLoaderError)
    assert "the source ended before the number of batches" in str(feed.failure)


@pytest.mark.timeout(30)
def test_take_or_repeat_keeps_the_sources_own_exception_for_the_next_check() -> None:
    feed = _feed(Pulls([SHARD], fail_after=1))
    assert feed.take_or_repeat().batch == SHARD[0]
    again = feed.take_or_repeat()
    assert (again.batch, again.repeated) == (SHARD[0], True)
    assert isinstance(feed.failure, OSError)
    assert str(feed.failure) == "disk gone at batch 1"


@pytest.mark.timeout(30)
def test_take_or_repeat_with_nothing_to_repeat_raises_the_failure() -> None:
    feed = _feed(Pulls([SHARD], fail_after=0))
    with pytest.raises(OSError, match="disk gone at batch 0") as info:
        feed.take_or_repeat()
    assert info.value is feed.failure


# --- padding (pad) --------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["list", "factory", "iterator"])
def test_past_its_data_a_padding_feed_hands_out_its_last_batch_again(kind: str) -> None:
    pulls = Pulls([SHARD[:3]])
    source = {"list": SHARD[:3], "factory": pulls, "iterator": iter(SHARD[:3])}[kind]
    feed = _feed(source, pads=True)
    feed.fill(5)
    taken = _take_all(feed)
    assert [fed.batch for fed in taken] == SHARD[:3] + [SHARD[2]] * 2
    assert [fed.padding for fed in taken] == [False] * 3 + [True] * 2
    assert [fed.own for fed in taken] == [True] * 3 + [False] * 2
    assert not any(fed.repeated for fed in taken)
    assert (feed.own_read, feed.passes_started, feed.can_pad) == (3, 1, True)
    assert not feed.had_more_own_data()
    if kind == "factory":
        assert pulls.calls == 1  # padding opens no pass


@pytest.mark.timeout(30)
def test_the_rows_ahead_count_padding_as_none_real() -> None:
    feed = _feed([[1, 2, 3], [4]], pads=True)
    feed.fill(4)
    assert feed.own_buffered == 2
    assert feed.buffered_rows() == [3, 1, 0, 0]
    unknown = _feed([[[1, 2], [3, 4]]], pads=True)  # rows or fields? count_rows cannot tell
    unknown.fill(2)
    assert unknown.buffered_rows() == [None, 0]


@pytest.mark.timeout(30)
def test_an_empty_shard_pads_only_with_a_batch_it_is_given() -> None:
    feed = _feed(lambda: iter([]), pads=True)
    feed.fill(3)
    assert (feed.buffered, feed.empty_shard, feed.can_pad) == (0, True, False)
    assert feed.donation() is None
    feed.pad_with([7, 8], 2)
    feed.fill(3)
    taken = _take_all(feed)
    assert [fed.batch for fed in taken] == [[7, 8]] * 3
    assert all(fed.padding for fed in taken)
    assert [fed.count_samples(fed.batch) for fed in taken] == [2] * 3
    donor = _feed(SHARD, pads=True)
    donor.fill(2)
    assert donor.donation() == (SHARD[0], 2)


@pytest.mark.timeout(30)
def test_a_padding_feed_pads_instead_of_repeating_after_a_failure() -> None:
    feed = _feed(lambda: iter(SHARD[:2]), pads=True)
    feed.promise(len(SHARD))
    taken = [feed.take_or_repeat() for _ in range(4)]
    assert isinstance(feed.failure, SourceEndedEarlyError)
    assert [fed.batch for fed in taken] == SHARD[:2] + [SHARD[1]] * 2
    assert [fed.padding for fed in taken] == [False, False, True, True]
    assert not any(fed.repeated for fed in taken)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("starts_after", [0, 2])
def test_a_first_pass_shorter_than_promised_is_a_failure(starts_after: int) -> None:
    feed = ShardFeed(as_source(lambda: iter(SHARD[starts_after:3])), starts_after=starts_after)
    feed.promise(len(SHARD))
    feed.fill(len(SHARD))
    assert feed.buffered == 3 - starts_after
    assert isinstance(feed.failure, SourceEndedEarlyError)
    assert (feed.failure.read, feed.failure.promised) == (3, len(SHARD))


@pytest.mark.timeout(30)
def test_a_short_first_pass_restarts_in_cycle_unless_it_is_empty() -> None:
    feed = _feed(lambda: iter(SHARD[:3]), restarts=True)
    feed.promise(len(SHARD))
    feed.fill(4)
    assert feed.failure is None, "the statistics count the short pass's rows as lost"
    assert [fed.repeated for fed in _take_all(feed)] == [False] * 3 + [True]
    empty = _feed(lambda: iter([]), restarts=True)
    empty.promise(len(SHARD))
    empty.fill(1)
    assert isinstance(empty.failure, SourceEndedEarlyError)
    assert (empty.failure.read, empty.failure.promised) == (0, len(SHARD))


@pytest.mark.timeout(30)
def test_a_short_pass_the_epoch_did_not_need_is_no_failure() -> None:
    feed = _feed(lambda: iter(SHARD[:3]))
    feed.promise(len(SHARD))
    feed.fill(2)
    _take_all(feed)
    feed.fill(1)
    feed.take()
    assert not feed.had_more_own_data()
    assert feed.failure is None


@pytest.mark.timeout(30)
def test_a_first_pass_as_long_as_promised_restarts_in_cycle() -> None:
    feed = _feed(lambda: iter(SHARD), restarts=True)
    feed.promise(len(SHARD))
    feed.fill(len(SHARD) + 1)
    assert feed.failure is None
    assert [fed.repeated for fed in _take_all(feed)] == [False] * len(SHARD) + [True]


# --- passes that never end, and streams that continue ---------------------------------------


class _Endless(ShardSource[int]):
    """A shard that never ends (as a petastorm reader with ``num_epochs=None``)."""

    @property
    def restartable(self) -> bool:
        return False

    def open_pass(self) -> ShardPass[int]:
        return ShardPass(itertools.count(), endless=True)


@pytest.mark.timeout(30)
def test_an_endless_pass_needs_a_step_cap() -> None:
    uncapped = ShardFeed(_Endless(), steps_capped=False)
    uncapped.fill(2)
    assert isinstance(uncapped.failure, ValueError)
    assert "steps_per_epoch=N" in str(uncapped.failure)
    capped = ShardFeed(_Endless(), steps_capped=True)
    capped.fill(4)
    assert [fed.batch for fed in _take_all(capped)] == [0, 1, 2, 3]


class _Continuing(ShardSource[int]):
    """Each pass continues one stream, as a petastorm reader that never ends does."""

    def __init__(self, batches: Iterator[int]) -> None:
        self._stream = ContinuingStream(batches)

    @property
    def restartable(self) -> bool:
        return False

    def open_pass(self) -> ShardPass[int]:
        return self._stream.resume()


@pytest.mark.timeout(30)
def test_close_gives_unused_batches_back_to_a_continuing_stream() -> None:
    source = _Continuing(iter(range(10)))
    first: ShardFeed[int] = ShardFeed(source, steps_capped=True)
    first.fill(4)
    assert [first.take().batch for _ in range(2)] == [0, 1]
    first.close()
    assert first.buffered == 0
    second: ShardFeed[int] = ShardFeed(source, steps_capped=True)
    second.fill(5)
    # The two read ahead but never handed out come first, then the stream goes on.
    assert [fed.batch for fed in _take_all(second)] == [2, 3, 4, 5, 6]


@pytest.mark.timeout(30)
def test_close_stops_a_generator_pass() -> None:
    pulls = Pulls([SHARD])
    feed = _feed(pulls)
    feed.fill(2)
    feed.close()
    assert (pulls.closed, feed.buffered) == (1, 0)


@pytest.mark.timeout(30)
def test_a_pass_resumed_after_all_its_own_batches_restarts_in_cycle() -> None:
    # A resumed cycle epoch whose rank had handed out its whole shard: its first pass (the rows
    # not yet read) is empty, yet the shard is not, and the next pass repeats it.
    passes = iter([iter([]), iter(SHARD), iter(SHARD)])
    feed = ShardFeed(as_source(lambda: next(passes)), "restart", starts_after=len(SHARD))
    feed.promise(len(SHARD))
    feed.fill(2)
    assert feed.failure is None and not feed.empty_shard
    assert [(fed.batch, fed.repeated) for fed in _take_all(feed)] == [
        (SHARD[0], True),
        (SHARD[1], True),
    ]
