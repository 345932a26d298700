"""How agreements travel: async collectives on a CPU gloo group of ddp_even's own.

The group is our own so that control messages never queue behind gradient buckets and never
touch a GPU stream. Its gloo timeout is the training group's own (at least the loader's
``timeout``), so an agreement started ahead of time survives any pause a rank makes between
steps (a checkpoint, an evaluation) that the training collectives survive. The loader's
``timeout`` counts only the time a rank itself waits for an agreement: each wait has its own
deadline, measured from when the wait began.

A failed or timed-out collective does not say which peer was missing; ``rollcall.py`` finds
out, and :meth:`CollectiveAgreer.failure` turns its answer into the error every rank raises,
naming global ranks.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddp_even.agreement.rollcall import (
    AGREEMENT,
    QUIET_S,
    REPORTS,
    STATISTICS,
    WHAT,
    RollCall,
    Ticket,
)
from ddp_even.agreement.wire import (
    Agreement,
    Report,
    decode,
    encode,
    report_bytes,
    report_from_bytes,
)
from ddp_even.errors import EvenLoaderError, PeerTimeoutError, RankMismatchError

logger = logging.getLogger("ddp_even")

# The gloo timeout of a control group when the training group's cannot be read: torch's
# default for process groups.
_DEFAULT_TRAINING_TIMEOUT_S = 30 * 60.0


class PendingAgreement(Protocol):
    """An agreement that was started; ``wait`` returns its result."""

    def wait(self) -> Agreement: ...


class Agreer(Protocol):
    """Runs agreements among the ranks of one training group."""

    #: This process's rank in the group, and the group's size.
    rank: int
    world_size: int
    #: The global rank of each group rank (what errors name).
    global_ranks: tuple[int, ...]

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
    global_ranks: tuple[int, ...] = (0,)

    def start(self, report: Report) -> PendingAgreement:
        return _Done(decode(encode(report).tolist()))

    def gather_reports(self, report: Report) -> list[Report]:
        return [report]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        return [list(counts)]


class _InFlight:
    def __init__(
        self, agreer: CollectiveAgreer, work: Any, buffer: torch.Tensor, ticket: Ticket
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
            self._result = decode(self._buffer.tolist())
        return self._result


class CollectiveAgreer:
    """Agreements over a dedicated CPU gloo group spanning the training group's ranks."""

    def __init__(self, control_group: dist.ProcessGroup, timeout: float) -> None:
        self.group = control_group
        self.rank = dist.get_rank(control_group)
        self.world_size = dist.get_world_size(control_group)
        self.global_ranks = tuple(dist.get_process_group_ranks(control_group))
        self.timeout = timeout
        self._channel = _channel_for(control_group)
        self._roll_call = RollCall(
            control_group.group_name, self.rank, self.world_size, hosts_store=dist.get_rank() == 0
        )
        self._roll_call.register()
        self._quiet = min(QUIET_S, timeout / 4)

    def start(self, report: Report) -> PendingAgreement:
        buffer = torch.from_numpy(encode(report))
        ticket = self._ticket(AGREEMENT)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return _InFlight(self, work, buffer, ticket)

    def gather_reports(self, report: Report) -> list[Report]:
        # Fixed-size buffers in one async all-gather, so that the wait has this rank's own
        # deadline (all_gather_object blocks, for the group's long timeout).
        local = torch.from_numpy(report_bytes(report))
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        ticket = self._ticket(REPORTS)
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        self.await_work(work, ticket)
        return [report_from_bytes(tensor.numpy()) for tensor in gathered]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        local = torch.tensor(counts, dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        ticket = self._ticket(STATISTICS)
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        self.await_work(work, ticket)
        return [tensor.tolist() for tensor in gathered]

    def _ticket(self, what: str) -> Ticket:
        sequence, since_previous = self._channel.next_collective()
        return Ticket(sequence, time.time(), what, since_previous)

    def await_work(self, work: Any, ticket: Ticket) -> None:
        """Wait for a started collective, at most ``timeout`` seconds from now.

        The first, short wait costs what a plain ``wait()`` costs; only a wait that outlasts
        it writes this rank's presence to the store before waiting on. A collective that
        fails, or is still incomplete at the deadline, becomes an :class:`EvenLoaderError`.
        """
        began = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self._quiet))
        except RuntimeError as error:
            if work.is_completed():  # failed, not slow
                raise self.failure(error, ticket) from error
            # Only slow so far: say so, and wait on until this wait's own deadline.
            self._roll_call.mark_waiting(ticket)
            remaining = max(self.timeout - (time.monotonic() - began), 0.001)
            try:
                work.wait(datetime.timedelta(seconds=remaining))
            except RuntimeError as later_error:
                raise self.failure(later_error, ticket) from later_error
        if ticket.since_previous >= self.timeout and self._roll_call.gave_up_on(ticket):
            raise PeerTimeoutError(
                (self.global_ranks[self.rank],),
                self.timeout,
                "the others raised PeerTimeoutError naming this rank",
                rank=self.global_ranks[self.rank],
                late=True,
            )

    def failure(self, error: RuntimeError, ticket: Ticket) -> EvenLoaderError:
        """The error every rank raises when a control collective failed: who is missing."""
        attendance = self._roll_call.attendance(ticket)
        logger.debug("control collective %s failed: %s (%s)", ticket, error, attendance)
        gloo = f"gloo: {_gloo_words(str(error))}"
        kinds = {what for what in attendance.doing.values() if what in WHAT}
        doing = {self.global_ranks[rank]: what for rank, what in attendance.doing.items()}
        if not attendance.missing and len(kinds) > 1:
            return RankMismatchError(
                "ranks are not running the same loop: they reached the same point in "
                f"different collectives ({_describe(doing)}). Did some ranks "
                "leave an epoch early (a break, or an exception caught inside the loop, on "
                f"some ranks only)? Every rank must stop at the same step. {gloo}"
            )
        detail = gloo
        if attendance.unknown_because is not None:
            detail += f"; which ranks did not answer is unknown: {attendance.unknown_because}"
        elif not attendance.missing:
            detail += (
                "; every rank reached this collective, some only after this rank had stopped "
                "waiting: a peer was late (slow or paused inside the loader), not gone"
            )
        return PeerTimeoutError(
            tuple(self.global_ranks[rank] for rank in attendance.missing),
            self.timeout,
            detail,
            rank=self.global_ranks[self.rank],
            late=attendance.late,
        )


def _describe(doing: dict[int, str]) -> str:
    by_kind: dict[str, list[int]] = {}
    for rank, what in sorted(doing.items()):
        by_kind.setdefault(what, []).append(rank)
    return "; ".join(
        f"rank(s) {', '.join(map(str, ranks))}: {WHAT.get(what, what)}"
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
        self._previous = time.monotonic()

    def next_collective(self) -> tuple[int, float]:
        """The next sequence number, and seconds since the previous collective started."""
        now = time.monotonic()
        since_previous, self._previous = now - self._previous, now
        self.issued += 1
        return self.issued, since_previous


_channels: dict[str, _Channel] = {}


def _channel_for(control_group: dist.ProcessGroup) -> _Channel:
    return _channels.setdefault(control_group.group_name, _Channel())


def training_timeout(training_group: dist.ProcessGroup | None) -> float:
    """The training group's collective timeout in seconds (torch's default when unreadable)."""
    group: Any = training_group if training_group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            return float(backend.options._timeout.total_seconds())
        except Exception:  # private API, or no backend for this device: try the next
            continue
    return _DEFAULT_TRAINING_TIMEOUT_S


_control_groups: dict[tuple[Any, float], dist.ProcessGroup] = {}
# Control groups created so far per training group: names each creation's rendezvous.
_creations: dict[Any, int] = {}
_RENDEZVOUS_POLL_S = 0.05


def control_group_for(
    training_group: dist.ProcessGroup | None, timeout: float
) -> dist.ProcessGroup:
    """The gloo group ddp_even talks on for ``training_group``, created once and cached.

    Creating it is a collective over the training group's ranks, so every rank must reach this
    call; ``EvenLoader`` does so at the start of its first epoch. Before creating it, the ranks
    meet in the store for at most ``timeout`` seconds, so that a rank that never starts the
    loader (a loop run on rank 0 only) is named instead of failing deep inside torch.
    """
    group = training_group if training_group is not None else dist.group.WORLD
    gloo_timeout = max(timeout, training_timeout(group))
    key = (group, gloo_timeout)
    if key not in _control_groups:
        ranks = dist.get_process_group_ranks(group)
        _meet_before_creating(group, ranks, timeout)
        _control_groups[key] = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=gloo_timeout),
            use_local_synchronization=True,
        )
        logger.debug("created a gloo control group over ranks %s", ranks)
    return _control_groups[key]


def _meet_before_creating(group: Any, ranks: Sequence[int], timeout: float) -> None:
    creation = _creations.get(group, 0)
    _creations[group] = creation + 1
    store: Any = dist.distributed_c10d._get_default_store()
    prefix = f"ddp_even/meet/{group.group_name}/{creation}/"
    store.set(f"{prefix}{dist.get_rank()}", "here")
    keys = [f"{prefix}{rank}" for rank in ranks]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() >= deadline:
            absent = [rank for rank, key in zip(ranks, keys, strict=True) if not store.check([key])]
            raise EvenLoaderError(
                f"rank(s) {', '.join(map(str, absent))} never started iterating an EvenLoader "
                f"within {timeout:g} s while rank {dist.get_rank()} waited for them: every rank "
                "of the training group must iterate the loader at the same point. To loop on "
                "some ranks only (evaluation on rank 0), iterate the underlying loader there, "
                "not an EvenLoader"
            )
        time.sleep(_RENDEZVOUS_POLL_S)
