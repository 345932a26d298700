"""One rank's reading of its shard during one epoch: look-ahead buffer, restarts, padding,
failures; and the counts of the batches handed out (:class:`RankCounts`).

The feed reads ahead (up to one window) so that, before a window's agreement, a rank knows
how many batches it can hand out; a source that raises is caught here and reported at the
agreement instead of leaving the other ranks waiting. Past the end of its data a feed that
pads hands out its last batch again, flagged as padding.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import torch

from ddp_even.errors import EvenLoaderError, SourceEndedEarlyError
from ddp_even.sources import ShardPass, ShardSource, count_rows

if TYPE_CHECKING:
    from ddp_even.modes import AfterOwnData
    from ddp_even.sources.base import PassReading

logger = logging.getLogger("ddp_even")

BatchT = TypeVar("BatchT")


class FedBatch(NamedTuple, Generic[BatchT]):
    """A batch read ahead, with where it came from (a tuple: one is made per batch)."""

    batch: BatchT
    # Which pass over the shard it came from: 1 for the rank's own data, more for repeats.
    pass_number: int
    count_samples: Callable[[BatchT], int | None]
    # Handed out past the rank's data (pad): a copy of a batch already handed out.
    padding: bool = False
    # Another rank's, handed to this one (share).
    received: bool = False

    @property
    def repeated(self) -> bool:
        return self.pass_number > 1

    @property
    def own(self) -> bool:
        """From the rank's first pass, handed out for the first time."""
        return self.pass_number == 1 and not self.padding and not self.received


# How an unknown count (None) travels in the gathered int64 vectors.
_UNKNOWN = -1


@dataclass
class RankCounts:
    """One rank's running counts during an epoch, of the batches handed out; every field
    travels as one int64 when the epoch's statistics are gathered (:mod:`ddp_even.runtime.
    stats`)."""

    steps: int = 0
    own_batches: int = 0
    repeated_batches: int = 0
    passes: int = 0
    # None once a batch's size could not be read.
    samples: int | None = 0
    # Rows of the first pass handed out.
    own_samples: int | None = 0
    truncated: bool = False
    # This rank's batches and rows according to a shard plan, when there is one.
    planned_batches: int | None = None
    planned_rows: int | None = None
    # Padding handed out past the rank's data (pad).
    padded_batches: int = 0
    padded_rows: int | None = 0
    # Batches of this rank's shard handed to other ranks, and other ranks' it handed out (share).
    sent_batches: int = 0
    sent_rows: int | None = 0
    received_batches: int = 0
    received_rows: int | None = 0

    def count_sent(self, rows: int | None) -> None:
        self.sent_batches += 1
        self.sent_rows = _add(self.sent_rows, rows)

    def count_batch(
        self, pass_number: int, rows: int | None, padding: bool = False, received: bool = False
    ) -> None:
        self.steps += 1
        if padding:
            self.padded_batches += 1
            self.padded_rows = _add(self.padded_rows, rows)
        elif received:
            self.received_batches += 1
            self.received_rows = _add(self.received_rows, rows)
        elif pass_number > 1:
            self.repeated_batches += 1
        else:
            self.own_batches += 1
            self.own_samples = _add(self.own_samples, rows)
        self.passes = max(self.passes, pass_number)
        self.samples = _add(self.samples, rows)

    def as_vector(self) -> list[int]:
        values = (getattr(self, name) for name in _COLUMNS)
        return [_UNKNOWN if value is None else int(value) for value in values]

    @classmethod
    def columns_of(cls, rows: Sequence[Sequence[int]]) -> dict[str, tuple[int | None, ...]]:
        """Gathered vectors (one per rank) as named per-rank columns, unknowns as None."""
        return {
            name: tuple(None if value == _UNKNOWN else value for value in column)
            for name, column in zip(_COLUMNS, zip(*rows, strict=True), strict=True)
        }


_COLUMNS = tuple(counted.name for counted in dataclasses.fields(RankCounts))


def _add(total: int | None, rows: int | None) -> int | None:
    return None if total is None or rows is None else total + rows


def compacted(batch: Any) -> Any:
    """``batch`` holding only its own rows: each tensor that is a view of a larger one (a slice
    of a row group's column) copied, in dicts, lists and tuples alike; anything else as it is.

    Padding is kept for the rest of the epoch, and sent whole to a rank with an empty shard
    (``torch.save`` writes a view's whole storage): a view would hold, and send, its row group.

    Example:
        >>> column = torch.arange(1000)
        >>> kept = compacted({"id": column[:4], "name": ["a", "b", "c", "d"]})
        >>> kept["id"].untyped_storage().nbytes(), kept["name"]
        (32, ['a', 'b', 'c', 'd'])
    """
    if isinstance(batch, torch.Tensor):
        own_bytes = batch.numel() * batch.element_size()
        return batch.clone() if batch.untyped_storage().nbytes() > own_bytes else batch
    if isinstance(batch, dict):
        return type(batch)((name, compacted(value)) for name, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(compacted(value) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(compacted(value) for value in batch)
    return batch


def _few(indices: list[int]) -> str:
    return f"{indices[:8]}{'...' if len(indices) > 8 else ''}"


class _ShardEnded(Exception):
    pass


class ShardFeed(Generic[BatchT]):
    """Batches of one rank's shard for one epoch, read ahead into a buffer.

    ``after_own_data`` (the mode's): past the end of the shard's first pass, read nothing more
    (``"stop"``), start a fresh pass (``"restart"``), or hand out its last batch again as
    padding (``"pad"``). ``steps_capped``: the epoch has ``steps_per_epoch``, so a pass that
    never ends is fine.
    """

    def __init__(
        self,
        source: ShardSource[BatchT],
        after_own_data: AfterOwnData = "stop",
        *,
        steps_capped: bool = False,
        starts_after: int = 0,
    ) -> None:
        self._source = source
        self._restarts = after_own_data == "restart"
        self._steps_capped = steps_capped
        self._pads = after_own_data == "pad"
        # What padding hands out (pads): the last own batch read, or one given by a peer.
        self._padding: FedBatch[BatchT] | None = None
        # Whether _padding holds its own rows (copied out of its row group's columns).
        self._padding_compacted = False
        self._pass: ShardPass[BatchT] | None = None
        # Passes started; at the end of a cycle epoch the last one may go unused, since
        # ranks read ahead before they know that the epoch ends.
        self.passes_started = 0
        self._batches_in_pass = 0
        self._buffer: deque[FedBatch[BatchT]] = deque()
        # Batches read from the first pass so far, and whether that pass has ended.
        self.own_read = 0
        self.own_ended = False
        # The exception the source raised, kept until every rank has heard of it.
        self.failure: BaseException | None = None
        # Batches of the shard before the first pass's start (a resumed epoch's pass that
        # starts at the saved step): a first pass with nothing left is then no empty shard.
        self._starts_after = starts_after
        # Batches the first pass yields, when a length or a shard plan says so.
        self._promised: int | None = None
        # The batch last handed out by take_or_repeat.
        self._last: FedBatch[BatchT] | None = None
        # What the first pass reads, once it is open, where its source can tell.
        self.reading: PassReading | None = None
        # Pad: the shard's first batch, which a rank with an empty shard pads with.
        self._first_own: FedBatch[BatchT] | None = None
        # How the last pass opened counts a batch's rows (share counts the batches it
        # receives with it).
        self.count_samples: Callable[[BatchT], int | None] = count_rows

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def own_buffered(self) -> int:
        return sum(1 for item in self._buffer if item.own)

    @property
    def empty_shard(self) -> bool:
        return self.own_ended and self.own_read == 0 and self._starts_after == 0

    @property
    def _has_own_data(self) -> bool:
        """Whether the shard holds a batch (a restart then has something to repeat)."""
        return self.own_read > 0 or self._starts_after > 0

    @property
    def can_pad(self) -> bool:
        """Whether there is a batch to pad with (pads)."""
        return self._padding is not None

    def donation(self) -> tuple[BatchT, int | None] | None:
        """The shard's first batch and its rows, for a peer with nothing to pad with (also in
        a resumed epoch, which read it again before its resume point)."""
        first = self._first_own or (self._buffer[0] if self._buffer else None)
        return None if first is None else (first.batch, first.count_samples(first.batch))

    def pad_with(self, batch: BatchT, rows: int | None) -> None:
        """Pad with ``batch`` (of ``rows`` rows), a peer's: this rank has no batch of its own."""
        self._padding = FedBatch(compacted(batch), 1, lambda _batch: rows, padding=True)
        self._padding_compacted = True

    def buffered_rows(self) -> list[int | None]:
        """Per buffered batch, in order, its real rows: 0 for padding, None where unknown."""
        return [0 if fed.padding else fed.count_samples(fed.batch) for fed in self._buffer]

    def first_pass_reading(self) -> PassReading | None:
        """Open the first pass now (nothing read) and say what it reads, where it can tell."""
        if self._pass is None and self.passes_started == 0 and self.failure is None:
            try:
                self._open_pass(may_restart=False)
            except Exception as error:  # reported at the agreement, as any source failure
                self.failure = error
        return self.reading

    def differs_from(self, planned: Sequence[int]) -> str | None:
        """How the first pass's row groups differ from ``planned``, when the source can tell."""
        reading = self.first_pass_reading()
        if reading is None or reading.row_groups == frozenset(planned):
            return None
        read, ours = _few(sorted(reading.row_groups)), _few(sorted(planned))
        return f"it reads row groups {read}, its shard of the plan is {ours}"

    def promise(self, own_batches: int) -> None:
        """The shard has ``own_batches`` batches (a length or a shard plan says so): a first pass
        that ends sooner fails with :class:`~ddp_even.SourceEndedEarlyError`."""
        self._promised = own_batches - self._starts_after

    def fill(self, target: int) -> None:
        """Read until ``target`` batches are buffered, the shard ends, or the source raises."""
        while len(self._buffer) < target and self.failure is None:
            try:
                self._buffer.append(self._read_one())
            except _ShardEnded:
                return
            except Exception as error:  # any failure of user code must reach every rank
                logger.debug("the data source raised %r", error)
                self.failure = error

    def take(self) -> FedBatch[BatchT]:
        """The oldest buffered batch, out of the buffer (an agreement has counted it)."""
        return self._buffer.popleft()

    def take_or_repeat(self) -> FedBatch[BatchT]:
        """The next batch, where no agreement comes before each step (known lengths).

        Once the source has failed or ended early, the batch last handed out comes again as a
        repeat, so that this rank keeps stepping with the others until the next check tells
        every rank (``failure`` holds the error until then).
        """
        self.fill(1)
        if self._buffer:
            self._last = self._buffer.popleft()
            return self._last
        if self.failure is None:
            self.failure = EvenLoaderError(
                "the source ended before the number of batches its length (or shard plan) "
                "promised; set sync_every=1 (or more) so that ranks agree as they go instead "
                "of trusting the length"
            )
        if self._last is None:
            # Nothing to repeat. Not reached by the loader: an epoch with known lengths reads
            # its first batch before its agreement, which reports a failure there.
            raise self.failure
        if self._pads:
            return self._last._replace(padding=True)
        return self._last._replace(pass_number=max(self._last.pass_number, 2))

    def had_more_own_data(self) -> bool:
        """Whether the first pass still had batches when the epoch stopped (reads one to check)."""
        if any(item.own for item in self._buffer):
            return True
        if self.own_ended or self.failure is not None or self.passes_started != 1:
            return False
        try:
            self._buffer.append(self._read_one(may_restart=False))
        except (_ShardEnded, SourceEndedEarlyError):
            return False  # a short pass the epoch did not need: the statistics count its loss
        except Exception as error:
            logger.warning("reading past the end of the epoch raised %r", error)
            return False
        return True

    def close(self) -> None:
        if self._pass is not None:
            # A source that continues across epochs keeps what was read but not handed out.
            self._pass.give_back(
                [
                    fed.batch
                    for fed in self._buffer
                    if fed.pass_number == self.passes_started and not fed.padding
                ]
            )
            self._pass.close()
            self._pass = None
        self._buffer.clear()

    def _read_one(self, may_restart: bool = True) -> FedBatch[BatchT]:
        """The next batch; past the first pass (a restart, padding) only if ``may_restart``."""
        while True:
            if self._pass is None:
                if self._pads and self.own_ended and may_restart and self._padding is not None:
                    return self._padding_to_hand_out()
                self._open_pass(may_restart)
            assert self._pass is not None
            try:
                batch = next(self._pass.batches)
            except StopIteration:
                self._end_pass()
                continue
            self._batches_in_pass += 1
            if self.passes_started == 1:
                self.own_read += 1
            fed = FedBatch(batch, self.passes_started, self._pass.count_samples)
            if self._pads:
                self._padding = fed._replace(padding=True)
                self._padding_compacted = False
                if self.own_read == 1 and self.passes_started == 1 and not self._starts_after:
                    # Kept all epoch for a peer with an empty shard: its own rows only.
                    self._first_own = fed._replace(batch=compacted(fed.batch))
            return fed

    def _padding_to_hand_out(self) -> FedBatch[BatchT]:
        """The padding batch, holding its own rows only (copied once): it is kept for the
        rest of the epoch, and a view would keep its whole row group alive."""
        assert self._padding is not None
        if not self._padding_compacted:
            self._padding = self._padding._replace(batch=compacted(self._padding.batch))
            self._padding_compacted = True
        return self._padding

    def _open_pass(self, may_restart: bool) -> None:
        restart_allowed = may_restart and self._restarts and self._has_own_data
        if self.passes_started >= 1 and not restart_allowed:
            raise _ShardEnded
        opened = self._source.open_pass()
        if opened.endless and not self._steps_capped:
            opened.close()
            raise ValueError(
                "the petastorm reader has num_epochs=None, so a pass over it never ends and "
                "neither would the epoch: pass steps_per_epoch=N to EvenLoader (each epoch then "
                "takes N steps and the next continues the reader), or build the reader with "
                "num_epochs=1"
            )
        self._pass = opened
        self.count_samples = opened.count_samples
        if self.passes_started == 0:
            self.reading = opened.reading
        self.passes_started += 1
        self._batches_in_pass = 0
        logger.debug("pass %d over this rank's shard opened", self.passes_started)

    def _end_pass(self) -> None:
        assert self._pass is not None
        self._pass.close()
        self._pass = None
        logger.debug(
            "pass %d over this rank's shard ended after %d batch(es)",
            self.passes_started,
            self._batches_in_pass,
        )
        if self.passes_started == 1:
            self.own_ended = True
            promised, before = self._promised or 0, self._starts_after
            # A pass that restarts (cycle) goes on after a short first pass, which the epoch's
            # statistics count as lost rows; one that cannot leaves the epoch short of steps.
            if self.own_read < promised and (not self._restarts or not self._has_own_data):
                raise SourceEndedEarlyError(before + self.own_read, before + promised)
        elif self._batches_in_pass == 0:
            raise EvenLoaderError(
                f"pass {self.passes_started} over this rank's shard yielded nothing although the "
                f"first pass yielded {self.own_read} batch(es): the source must give the same "
                "data on every pass to be cycled"
            )
