"""The agreement: what each rank says before a window of steps, and what all of them hear back.

Every rank sends two int64s; a single ``all_reduce(MAX)`` combines them. Two, because gloo's
cost grows with the element count (measured here, 2 ranks: 9 int64s cost 2-4x what 1 or 2
do; ``benchmarks/bench_agreement.py`` prints it). Each int64 packs fields in order of
priority, so the maximum of the packed numbers is the maximum of the first field, then of
the next among the ranks that share the first, and so on:

* ``(problem, key, own_available)``: whether any rank has a problem, then the largest
  ``key`` (a hash of the epoch and the settings), then the most own batches among the ranks
  with that key;
* ``-(key, available)``: the smallest key, then the fewest batches among the ranks with it.

When no rank has a problem and the largest key equals the smallest, every rank has the same
key, so the counts are the maximum and minimum over all ranks. Anything else (a rank whose
source raised, an empty shard in cycle mode, ranks in different epochs or with different
settings) sends every rank to the rare error path, which gathers the full reports with one
more collective that every rank enters, because every rank saw the same result.

When a collective fails (a peer died: gloo says "connection closed/reset by peer"; a peer
stalled: gloo says "timed out waiting ... ms"), gloo never says *which* peer. The ranks then
hold a roll call in the job's key-value store (see :class:`_RollCall`): nothing is written
on the fast path, one key per rank when a wait is slow or has failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ddp_even.errors import EvenLoaderError, PeerTimeoutError, RankMismatchError

logger = logging.getLogger("ddp_even")


@dataclass(frozen=True)
class Report:
    """What one rank tells the others before a window of steps."""

    rank: int
    epoch: int
    # Hash of the settings every rank must share (mode, steps_per_epoch, window).
    fingerprint: int
    # Those settings in words, for the error message when they differ.
    settings: str
    # Batches this rank can hand out in the window (buffered, or known from a length).
    available: int
    # Of those, batches from its first pass over its shard (not repeats).
    own_available: int
    # Its first pass ended without a single batch.
    empty_shard: bool = False
    # Its source raised; the exception is kept locally and described in ``failure``.
    failed: bool = False
    failure: tuple[str, str] | None = None


@dataclass(frozen=True)
class Agreement:
    """What every rank learns from the reduction: the same values on every rank."""

    # Fewest batches any rank can hand out in the window, and most own batches any rank has.
    min_available: int
    max_own_available: int
    # Some rank's source failed, its shard is empty (cycle), or ranks differ in epoch or
    # settings: every rank then gathers the full reports to learn which (counts are moot).
    has_problem: bool


# The packing of the two int64s: counts in the low bits, the key above them, the problem bit
# on top (bit 63 stays clear, so the numbers stay positive before negation).
_COUNT_BITS = 32
_KEY_BITS = 30
_MAX_COUNT = (1 << _COUNT_BITS) - 1
_KEY_MASK = (1 << _KEY_BITS) - 1
_PROBLEM = 1 << (_COUNT_BITS + _KEY_BITS)
# An odd 64-bit multiplier (2**64 / golden ratio): spreads (fingerprint, epoch) over the key.
_MIX = 0x9E3779B97F4A7C15


def _key(report: Report) -> int:
    mixed = ((report.fingerprint * 31 + report.epoch) * _MIX) & 0xFFFF_FFFF_FFFF_FFFF
    return mixed >> (64 - _KEY_BITS)


def _encode(report: Report) -> torch.Tensor:
    if report.available > _MAX_COUNT:
        raise EvenLoaderError(
            f"{report.available} batches in one agreement is more than the {_MAX_COUNT} "
            "the agreement can carry; set sync_every to agree on fewer at a time"
        )
    problem = report.failed or report.empty_shard
    keyed = _key(report) << _COUNT_BITS
    # Through numpy: a third of torch.tensor(list)'s cost, and this runs every window.
    packed = np.array(
        [
            (_PROBLEM if problem else 0) | keyed | report.own_available,
            -(keyed | report.available),
        ],
        dtype=np.int64,
    )
    return torch.from_numpy(packed)


def _decode(reduced: torch.Tensor) -> Agreement:
    highest, negated_lowest = reduced.tolist()
    lowest = -negated_lowest
    highest_key = (highest >> _COUNT_BITS) & _KEY_MASK
    return Agreement(
        min_available=lowest & _MAX_COUNT,
        max_own_available=highest & _MAX_COUNT,
        has_problem=bool(highest & _PROBLEM) or highest_key != lowest >> _COUNT_BITS,
    )


class PendingAgreement(Protocol):
    """An agreement that was started; ``wait`` returns its result."""

    def wait(self) -> Agreement: ...


class Agreer(Protocol):
    """Runs agreements among the ranks of one training group."""

    rank: int
    world_size: int

    def start(self, report: Report) -> PendingAgreement:
        """Send ``report`` without blocking; every rank must start the same agreements."""
        ...

    def gather_reports(self, report: Report) -> list[Report]:
        """Every rank's full report, in rank order (used on the rare error paths)."""
        ...

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        """Every rank's ``counts`` vector (same length everywhere), in rank order."""
        ...


@dataclass(frozen=True)
class _Done:
    agreement: Agreement

    def wait(self) -> Agreement:
        return self.agreement


class SoloAgreer:
    """The agreement of a single process: no collective, the same decisions."""

    rank = 0
    world_size = 1

    def start(self, report: Report) -> PendingAgreement:
        return _Done(_decode(_encode(report)))

    def gather_reports(self, report: Report) -> list[Report]:
        return [report]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        return [list(counts)]


# What each control collective is, in words, for the error when ranks are in different ones.
_AGREEMENT = "agreement"
_REPORTS = "reports"
_STATISTICS = "statistics"
_WHAT = {
    _AGREEMENT: "a step agreement",
    _REPORTS: "the gather of error reports",
    _STATISTICS: "the end-of-epoch statistics gather",
}


@dataclass(frozen=True)
class _Ticket:
    """One control collective as this rank issued it."""

    # Its place in the sequence of control collectives on the group: the same on every rank.
    sequence: int
    # time.time() when this rank started it.
    started: float
    what: str


class _InFlight:
    def __init__(
        self, agreer: CollectiveAgreer, work: Any, buffer: torch.Tensor, ticket: _Ticket
    ) -> None:
        self._agreer = agreer
        self._work = work
        self._buffer = buffer
        self._ticket = ticket
        self._result: Agreement | None = None
        self._failure: EvenLoaderError | None = None

    def wait(self) -> Agreement:
        if self._failure is not None:
            # Waited once already (e.g. again in a ``finally``): the same error, at once.
            raise self._failure
        if self._result is None:
            try:
                self._agreer.await_work(self._work, self._ticket)
            except EvenLoaderError as error:
                self._failure = error
                raise
            self._result = _decode(self._buffer)
        return self._result


# A wait at a control collective longer than this is written down in the store, once per
# wait, so that a roll call held by a rank that gives up sooner counts this rank as present
# (gloo does not fail every survivor at once when a peer dies: one waiting on another
# survivor fails only when that one leaves, or at the timeout). A store write costs about
# what an agreement costs, and only waits already this slow pay it.
_QUIET_S = 0.25
# On a failure, how long a rank waits for the others to check in before naming the absent:
# well past _QUIET_S, so that every rank waiting at the collective has had time to say so.
_ROLL_CALL_S = 1.5
# The most a roll call waits on the store itself (a store whose host is stopped never
# answers); past it the missing ranks are reported as unknown.
_STORE_ANSWER_S = 3.0
_POLL_S = 0.05


@dataclass(frozen=True)
class _Attendance:
    """What a roll call found out about one failed control collective."""

    # Ranks that never reached the collective, in rank order.
    missing: tuple[int, ...]
    # This rank reached it after every other rank had given up waiting for it.
    late: bool = False
    # Why the store could not say, when it could not.
    unknown_because: str | None = None
    # For each rank that reached it: which collective it issued there (``_WHAT`` keys).
    doing: dict[int, str] = dataclasses.field(default_factory=dict)


class _RollCall:
    """Which ranks reached a control collective, told through the job's key-value store.

    Every control collective has a sequence number, the same on every rank (gloo needs every
    rank to issue them in the same order anyway). A rank writes ``waiting/<rank>`` when its
    wait at collective ``N`` has lasted ``_QUIET_S`` (so never on the fast path) and
    ``gave_up/<rank>`` when collective ``N`` failed, each as ``"N <time> <what>"``. A rank
    whose collective ``N`` failed then waits up to ``_ROLL_CALL_S`` for every rank to show
    ``N`` in one of its keys; those that do not are the dead or stalled ones. Ranks alive but
    slower to notice check in either way: by their ``waiting`` key if they were already
    waiting (a stalled peer), or by their ``gave_up`` key within the roll call (a dead peer
    makes every waiting rank fail at once). A rank that finds every other rank already gave
    up before it even started the collective was itself the stalled one. Ranks that all
    reached ``N`` but issued different collectives there are not running the same loop.

    Keys are overwritten, so the store holds two per rank, written once up front so that a
    roll call reads them all in one request (hundreds of ranks may hold it at once). Store
    calls on the failure path run in daemon threads joined with a time limit: a store that
    does not answer cannot hang the job.
    """

    def __init__(self, group_name: str, rank: int, world_size: int) -> None:
        self._prefix = f"ddp_even/{group_name}/"
        self._rank = rank
        self._world_size = world_size
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._marker: threading.Thread | None = None
        self._keys = [
            f"{self._prefix}{kind}/{rank}"
            for rank in range(world_size)
            for kind in ("waiting", "gave_up")
        ]

    def register(self) -> None:
        """Write this rank's two records once (when its loader first meets the others)."""
        try:
            self._open_store().multi_set(
                [f"{self._prefix}waiting/{self._rank}", f"{self._prefix}gave_up/{self._rank}"],
                [_NO_RECORD, _NO_RECORD],
            )
        except Exception as error:  # the roll call then reads key by key
            logger.debug("could not register with the store: %r", error)

    def mark_waiting(self, ticket: _Ticket) -> None:
        """Record, without blocking, that this rank is waiting at ``ticket``'s collective."""
        if self._marker is not None and self._marker.is_alive():
            return  # the store is slow; the previous mark is still on its way
        self._marker = threading.Thread(
            target=self._set_quietly,
            args=(f"waiting/{self._rank}", _record(ticket, ticket.started)),
            name="ddp-even-roll-call",
            daemon=True,
        )
        self._marker.start()

    def attendance(self, ticket: _Ticket) -> _Attendance:
        """Check in as having given up at ``ticket``; say who never reached it."""
        found: list[_Attendance] = []
        failure: list[BaseException] = []

        def call() -> None:
            try:
                found.append(self._hold(ticket))
            except Exception as error:  # any store failure: report the ranks as unknown
                failure.append(error)

        thread = threading.Thread(target=call, name="ddp-even-roll-call", daemon=True)
        thread.start()
        thread.join(_ROLL_CALL_S + _STORE_ANSWER_S)
        if found:
            return found[0]
        why = (
            f"the store failed: {type(failure[0]).__name__}: {failure[0]}"
            if failure
            else f"the store did not answer within {_STORE_ANSWER_S:g} s"
        )
        return _Attendance(missing=(), unknown_because=why)

    def _hold(self, ticket: _Ticket) -> _Attendance:
        store = self._open_store()
        store.set(f"{self._prefix}gave_up/{self._rank}", _record(ticket, time.time()))
        others = [rank for rank in range(self._world_size) if rank != self._rank]
        deadline = time.monotonic() + _ROLL_CALL_S
        first_look = True
        while True:
            doing, gave_up = self._read(store, ticket.sequence)
            if (
                first_look
                and others
                and all(gave_up.get(r, ticket.started) < ticket.started for r in others)
            ):
                # Every other rank had stopped waiting before this rank even got here.
                return _Attendance(missing=(self._rank,), late=True, doing=doing)
            first_look = False
            missing = tuple(rank for rank in others if rank not in doing)
            if not missing or time.monotonic() >= deadline:
                return _Attendance(missing=missing, doing=doing)
            # Every waiting rank polls the one store: fewer polls each in a large job.
            time.sleep(_POLL_S * max(1.0, self._world_size / 16))

    def _read(self, store: Any, sequence: int) -> tuple[dict[int, str], dict[int, float]]:
        """What each rank that reached ``sequence`` did there; when those that gave up did."""
        if store.check(self._keys):
            values = [value.decode() for value in store.multi_get(self._keys)]
        else:  # a rank that never registered (it died first): key by key
            values = [
                store.get(key).decode() if store.check([key]) else _NO_RECORD for key in self._keys
            ]
        doing: dict[int, str] = {}
        gave_up: dict[int, float] = {}
        for index, value in enumerate(values):
            rank, kind = divmod(index, 2)
            words, at, what = value.split()
            number = int(words)
            if number >= sequence:
                doing[rank] = what if number == sequence else "later"
            elif kind == 1 and number == sequence - 1:
                # A peer dying inside a collective can let it complete on some ranks and fail
                # on others: those gave up one collective earlier, alive all the same.
                doing.setdefault(rank, "earlier")
            if kind == 1 and number == sequence:
                gave_up[rank] = float(at)
        return doing, gave_up

    def _open_store(self) -> Any:
        with self._store_lock:
            if self._store is None:
                store: Any = dist.distributed_c10d._get_default_store()
                try:
                    # Our own connection, with our own timeout: the job's store is shared.
                    store = store.clone()
                    store.set_timeout(datetime.timedelta(seconds=_STORE_ANSWER_S))
                except Exception:  # a store type without clone: use the shared one as it is
                    logger.debug("the default store cannot be cloned; sharing it")
                self._store = store
            return self._store

    def _set_quietly(self, key: str, value: str) -> None:
        try:
            self._open_store().set(f"{self._prefix}{key}", value)
        except Exception as error:
            logger.debug("could not write %s to the store: %r", key, error)


def _record(ticket: _Ticket, at: float) -> str:
    """``"<sequence> <time> <what>"``: where a rank was, since when, doing what."""
    return f"{ticket.sequence} {at!r} {ticket.what}"


# A rank's record before it reached any control collective (sequences start at 1).
_NO_RECORD = "0 0.0 none"


class CollectiveAgreer:
    """Agreements over a dedicated CPU gloo group spanning the training group's ranks.

    The group is our own so that control messages never queue behind gradient buckets, never
    touch a GPU stream, and time out after ``timeout`` seconds instead of the training group's
    30 minutes.
    """

    def __init__(self, control_group: dist.ProcessGroup, timeout: float) -> None:
        self.group = control_group
        self.rank = dist.get_rank(control_group)
        self.world_size = dist.get_world_size(control_group)
        self.timeout = timeout
        self._channel = _channel_for(control_group)
        self._roll_call = _RollCall(control_group.group_name, self.rank, self.world_size)
        self._roll_call.register()
        self._quiet = datetime.timedelta(seconds=min(_QUIET_S, timeout / 4))

    def start(self, report: Report) -> PendingAgreement:
        buffer = _encode(report)
        ticket = self._ticket(_AGREEMENT)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return _InFlight(self, work, buffer, ticket)

    def gather_reports(self, report: Report) -> list[Report]:
        gathered: list[Any] = [None] * self.world_size
        ticket = self._ticket(_REPORTS)
        try:
            dist.all_gather_object(gathered, dataclasses.asdict(report), group=self.group)
        except RuntimeError as error:
            raise self.failure(error, ticket) from error
        return [Report(**fields) for fields in gathered]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        local = torch.tensor(counts, dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        ticket = self._ticket(_STATISTICS)
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        self.await_work(work, ticket)
        return [tensor.tolist() for tensor in gathered]

    def _ticket(self, what: str) -> _Ticket:
        return _Ticket(self._channel.next_sequence(), time.time(), what)

    def await_work(self, work: Any, ticket: _Ticket) -> None:
        """Wait for a started collective; a failure becomes an :class:`EvenLoaderError`.

        The first, short wait costs what a plain ``wait()`` costs; only a wait that outlasts
        it writes this rank's presence to the store before waiting on.
        """
        try:
            work.wait(self._quiet)
            return
        except RuntimeError:
            if not work.is_completed():  # only slow, not failed: say so, and wait on
                self._roll_call.mark_waiting(ticket)
        try:
            work.wait()
        except RuntimeError as error:
            raise self.failure(error, ticket) from error

    def failure(self, error: RuntimeError, ticket: _Ticket) -> EvenLoaderError:
        """The error every rank raises when a control collective failed: who is missing."""
        attendance = self._roll_call.attendance(ticket)
        logger.debug("control collective %s failed: %s (%s)", ticket, error, attendance)
        gloo = f"gloo: {_gloo_words(str(error))}"
        kinds = {what for what in attendance.doing.values() if what in _WHAT}
        if not attendance.missing and len(kinds) > 1:
            return RankMismatchError(
                "ranks are not running the same loop: they reached the same point in "
                f"different collectives ({_describe(attendance.doing)}). Did some ranks "
                "leave an epoch early (a break, or an exception caught inside the loop, on "
                f"some ranks only)? Every rank must stop at the same step. {gloo}"
            )
        detail = gloo
        if attendance.unknown_because is not None:
            detail += f"; which ranks did not answer is unknown: {attendance.unknown_because}"
        elif not attendance.missing:
            detail += "; every rank reached this agreement, so the connection itself failed"
        return PeerTimeoutError(
            attendance.missing, self.timeout, detail, rank=self.rank, late=attendance.late
        )


def _describe(doing: dict[int, str]) -> str:
    by_kind: dict[str, list[int]] = {}
    for rank, what in sorted(doing.items()):
        by_kind.setdefault(what, []).append(rank)
    return "; ".join(
        f"rank(s) {', '.join(map(str, ranks))}: {_WHAT.get(what, what)}"
        for what, ranks in by_kind.items()
    )


def _gloo_words(message: str) -> str:
    """Gloo's message without its source location prefix and sign-off."""
    words = message.split("] ", 1)[-1] if message.startswith("[") else message
    return words.split(" GLHF!", 1)[0].strip()


class _Channel:
    """The count of control collectives issued on one control group by this process.

    Shared by every loader on the group, since all of them take turns on the same wire.
    """

    def __init__(self) -> None:
        self.issued = 0

    def next_sequence(self) -> int:
        self.issued += 1
        return self.issued


_channels: dict[str, _Channel] = {}


def _channel_for(control_group: dist.ProcessGroup) -> _Channel:
    return _channels.setdefault(control_group.group_name, _Channel())


_control_groups: dict[tuple[Any, float], dist.ProcessGroup] = {}


def control_group_for(
    training_group: dist.ProcessGroup | None, timeout: float
) -> dist.ProcessGroup:
    """The gloo group ddp_even talks on for ``training_group``, created once and cached.

    Creating it is a collective over the training group's ranks, so every rank must reach this
    call; ``EvenLoader`` does so at the start of its first epoch, a point every rank reaches.
    """
    group = training_group if training_group is not None else dist.group.WORLD
    key = (group, timeout)
    if key not in _control_groups:
        ranks = dist.get_process_group_ranks(group)
        _control_groups[key] = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout),
            use_local_synchronization=True,
        )
        logger.debug("created a gloo control group over ranks %s", ranks)
    return _control_groups[key]
