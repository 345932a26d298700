"""What each rank says before a window of steps, and what all of them hear back.

Two forms travel, because gloo's cost grows with the element count even for tiny messages
(``docs/performance.md``): the short form, one int64 combined by ``all_reduce(BOR)``
(:func:`encode_short`, counts up to :data:`SHORT_MOST` as rows of bits), and the long form, two
int64s combined by one ``all_reduce(MAX)`` (:func:`encode`, fields packed by priority so that
the maximum is lexicographic). Both carry a key of the epoch and the settings: when no rank has
a problem and every rank shares the key, the counts are the fewest available and the most own
batches over all ranks. Anything else sends every rank to the rare error path: the full reports
gathered, and :func:`error_from_reports` turns them into the same exception everywhere. The
bits, and which form when, are in ``docs/design.md`` ("The per-window protocol").

Pure Python and numpy: the transport (``transport.py``) moves the numbers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ddp_even.errors import (
    EmptyShardError,
    EvenLoaderError,
    OffPlanError,
    PeerSourceError,
    RankMismatchError,
)


@dataclass(frozen=True)
class Report:
    """What one rank tells the others before a window of steps."""

    # The rank's global rank (what errors name).
    rank: int
    epoch: int
    # Hash of the settings every rank must share (mode, steps_per_epoch, window, plan).
    fingerprint: int
    # Those settings in words, for the error message when they differ.
    settings: str
    # Batches this rank can hand out in the window (buffered, or known from a length).
    available: int
    # Of those, batches from its first pass over its shard (not repeats).
    own_available: int
    # Its first pass ended without a single batch (reported as a problem in cycle mode).
    empty_shard: bool = False
    # Its source raised; the exception is kept locally and described in ``failure``.
    failed: bool = False
    failure: tuple[str, str] | None = None
    # How its source differs from the shard plan, when it does.
    off_plan: str | None = None
    # Sent in the long form whatever its counts: the first agreement of this rank's epoch (its
    # full key meets whatever the other ranks are doing), or one whose counts may exceed
    # SHORT_MOST on another rank (every rank then sends the long form alike).
    long_form: bool = False

    @property
    def too_many(self) -> bool:
        return max(self.available, self.own_available) > MAX_COUNT

    @property
    def has_problem(self) -> bool:
        return self.failed or self.empty_shard or self.off_plan is not None or self.too_many


@dataclass(frozen=True)
class Agreement:
    """What every rank learns from the reduction: the same values on every rank."""

    # Fewest batches any rank can hand out in the window, and most own batches any rank has.
    min_available: int
    max_own_available: int
    # Some rank reported a problem, or ranks differ in epoch or settings: every rank then
    # gathers the full reports to learn which (the counts are moot).
    has_problem: bool


# The packing of the two int64s: counts in the low bits, the key above them, the problem bit
# on top (bit 63 stays clear, so the numbers stay positive before negation).
_COUNT_BITS = 32
_KEY_BITS = 30
#: The most batches one agreement can carry per rank.
MAX_COUNT = (1 << _COUNT_BITS) - 1
_KEY_MASK = (1 << _KEY_BITS) - 1
_PROBLEM = 1 << (_COUNT_BITS + _KEY_BITS)
# An odd 64-bit multiplier (2**64 / golden ratio): spreads (fingerprint, epoch) over the key.
_MIX = 0x9E3779B97F4A7C15


def key_of(report: Report) -> int:
    """The 30-bit hash of ``(fingerprint, epoch)`` that ranks compare."""
    mixed = ((report.fingerprint * 31 + report.epoch) * _MIX) & 0xFFFF_FFFF_FFFF_FFFF
    return mixed >> (64 - _KEY_BITS)


def encode(report: Report) -> npt.NDArray[np.int64]:
    """The two int64s a rank contributes to the ``all_reduce(MAX)``.

    Example::

        >>> report = Report(0, 0, 1, "s", available=3, own_available=2)
        >>> decode(encode(report))
        Agreement(min_available=3, max_own_available=2, has_problem=False)
    """
    keyed = key_of(report) << _COUNT_BITS
    # A count too large to carry is a problem, reported to every rank (and clamped here).
    available = min(report.available, MAX_COUNT)
    own_available = min(report.own_available, MAX_COUNT)
    return np.array(
        [
            (_PROBLEM if report.has_problem else 0) | keyed | own_available,
            -(keyed | available),
        ],
        dtype=np.int64,
    )


def decode(reduced: Sequence[int]) -> Agreement:
    """What the elementwise maximum of every rank's :func:`encode` says."""
    highest, negated_lowest = (int(value) for value in reduced)
    lowest = -negated_lowest
    highest_key = (highest >> _COUNT_BITS) & _KEY_MASK
    return Agreement(
        min_available=lowest & MAX_COUNT,
        max_own_available=highest & MAX_COUNT,
        has_problem=bool(highest & _PROBLEM) or highest_key != lowest >> _COUNT_BITS,
    )


#: The largest count the short form carries.
SHORT_MOST = 16
# Its bits, from the lowest: ``available <= i`` and ``own_available > i`` for i < SHORT_MOST,
# the short key and its complement, the problem bit, the long bit (bit 63 stays clear).
_ROW_MASK = (1 << SHORT_MOST) - 1
_SHORT_KEY_BITS = 14
_SHORT_KEY_MASK = (1 << _SHORT_KEY_BITS) - 1
_SHORT_KEY_SHIFT = 2 * SHORT_MOST
_SHORT_NOT_KEY_SHIFT = _SHORT_KEY_SHIFT + _SHORT_KEY_BITS
_SHORT_PROBLEM = 1 << (_SHORT_NOT_KEY_SHIFT + _SHORT_KEY_BITS)
_SHORT_LONG = _SHORT_PROBLEM << 1


def encode_short(report: Report) -> int:
    """The int64 a rank contributes to the ``all_reduce(BOR)`` every agreement starts with.

    Example::

        >>> a = Report(0, 0, 1, "s", available=3, own_available=2)
        >>> b = Report(1, 0, 1, "s", available=5, own_available=5)
        >>> decode_short(encode_short(a) | encode_short(b))
        Agreement(min_available=3, max_own_available=5, has_problem=False)
        >>> decode_short(encode_short(Report(0, 0, 1, "s", available=17, own_available=17)))
    """
    if report.long_form or max(report.available, report.own_available) > SHORT_MOST:
        return _SHORT_LONG
    short_key = short_key_of(report)
    return (
        (_SHORT_PROBLEM if report.has_problem else 0)
        | (~short_key & _SHORT_KEY_MASK) << _SHORT_NOT_KEY_SHIFT
        | short_key << _SHORT_KEY_SHIFT
        | ((1 << report.own_available) - 1) << SHORT_MOST
        | (_ROW_MASK & ~((1 << report.available) - 1))
    )


def short_key_of(report: Report) -> int:
    """The short form's key: the leading 14 bits of :func:`key_of`. Two loops share one about
    once in 16,384 pairs; the long form that opens every epoch tells them apart there."""
    return key_of(report) >> (_KEY_BITS - _SHORT_KEY_BITS)


def asks_for_long(word: int) -> bool:
    """Whether this short form (one rank's, or the OR of every rank's) asks for the long one."""
    return bool(word & _SHORT_LONG)


def decode_short(reduced: int) -> Agreement | None:
    """What the bitwise OR of every rank's :func:`encode_short` says; None when some rank
    needs the long form (:func:`encode`), which every rank then sends."""
    if asks_for_long(reduced):
        return None
    at_most = reduced & _ROW_MASK
    # The lowest ``available <= i`` any rank set is the fewest; none set: every rank had all.
    fewest = (at_most & -at_most).bit_length() - 1 if at_most else SHORT_MOST
    keys = (reduced >> _SHORT_KEY_SHIFT) & _SHORT_KEY_MASK
    not_keys = (reduced >> _SHORT_NOT_KEY_SHIFT) & _SHORT_KEY_MASK
    return Agreement(
        min_available=fewest,
        max_own_available=((reduced >> SHORT_MOST) & _ROW_MASK).bit_length(),
        has_problem=bool(reduced & _SHORT_PROBLEM) or bool(keys & not_keys),
    )


def agree_alone(report: Report) -> Agreement:
    """The agreement of a single rank: the same forms as among several, with no collective."""
    agreement = decode_short(encode_short(report))
    return decode(encode(report).tolist()) if agreement is None else agreement


# A full report travels as this many bytes of JSON (zero-padded); a long failure message is
# shortened to fit.
_REPORT_BYTES = 2048


def report_bytes(report: Report) -> npt.NDArray[np.uint8]:
    """``report`` as a fixed-size byte array, for the all-gather of full reports.

    Example::

        >>> report = Report(1, 0, 7, "mode=cycle", 3, 3, failed=True, failure=("OSError", "x"))
        >>> report_from_bytes(report_bytes(report)) == report
        True
    """
    fields = dataclasses.asdict(report)
    text = json.dumps(fields).encode()
    if len(text) > _REPORT_BYTES and report.failure is not None:
        error_type, message = report.failure

        def shortened(kept: int) -> bytes:
            fields["failure"] = (error_type, message[:kept] + "...")
            return json.dumps(fields).encode()

        # The longest start of the message that fits (escapes make bytes outnumber characters).
        fits, too_long = 0, len(message)
        while too_long - fits > 1:
            middle = (fits + too_long) // 2
            if len(shortened(middle)) <= _REPORT_BYTES:
                fits = middle
            else:
                too_long = middle
        text = shortened(fits)[:_REPORT_BYTES]
    packed = np.zeros(_REPORT_BYTES, dtype=np.uint8)
    packed[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    return packed


def report_from_bytes(packed: npt.NDArray[np.uint8]) -> Report:
    """The report :func:`report_bytes` packed."""
    fields = json.loads(packed.tobytes().rstrip(b"\0").decode())
    if fields["failure"] is not None:
        fields["failure"] = tuple(fields["failure"])
    return Report(**fields)


def error_from_reports(
    reports: Sequence[Report], own_failure: BaseException | None, steps_done: int
) -> BaseException:
    """The exception every rank raises for the problem the full reports show.

    Every rank computes it from the same reports, so every rank raises the same error, except
    that a rank whose own source failed re-raises its own exception (``own_failure``).
    """
    if len({(peer.epoch, peer.fingerprint) for peer in reports}) > 1:
        described = "; ".join(
            f"rank {peer.rank}: epoch {peer.epoch}, {peer.settings}" for peer in reports
        )
        return RankMismatchError(
            "ranks are not running the same loop; construct EvenLoader with the same mode, "
            "steps_per_epoch, sync_every and plan on every rank and iterate it once per epoch "
            f"everywhere ({described})"
        )
    too_many = [peer for peer in reports if peer.too_many]
    if too_many:
        described = ", ".join(f"rank {peer.rank}: {peer.available}" for peer in too_many)
        return EvenLoaderError(
            f"more batches in one agreement than the {MAX_COUNT} it can carry ({described}); "
            "set sync_every to agree on fewer at a time"
        )
    failed = [peer for peer in reports if peer.failed]
    if failed:
        if own_failure is not None:
            return own_failure
        first_failed = failed[0]
        assert first_failed.failure is not None
        return PeerSourceError(first_failed.rank, *first_failed.failure, step=steps_done)
    off_plan = [peer for peer in reports if peer.off_plan is not None]
    if off_plan:
        return OffPlanError({peer.rank: str(peer.off_plan) for peer in off_plan})
    return EmptyShardError(tuple(peer.rank for peer in reports if peer.empty_shard))
