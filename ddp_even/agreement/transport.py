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

Lifetime: a gloo worker thread lets go of a collective's tensors only after the collective
has completed, and letting go of a tensor that Python also holds takes the GIL. A control
group is therefore released (its gloo threads joined, with the GIL free for them) once its
training group is destroyed, and at the latest when the interpreter exits, before it
finalizes: a gloo thread that asks for the GIL during finalization is ended by CPython inside
a C++ destructor, and the whole process aborts ("terminate called without an active
exception") after its work is done. See ``_release``.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import time
import weakref
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
    finish_roll_calls,
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
        # A loader let go of after its training group was destroyed lets that control group go.
        weakref.finalize(self, _release_orphaned, True).atexit = False

    @property
    def group(self) -> dist.ProcessGroup:
        """The control group; reached through the channel, so that releasing it lets it go."""
        group = self._channel.group
        if group is None:
            raise EvenLoaderError(
                "this EvenLoader's process group was destroyed (destroy_process_group), and "
                "ddp_even released its control group with it: make a new EvenLoader after "
                "init_process_group"
            )
        return group

    def start(self, report: Report) -> PendingAgreement:
        buffer = torch.from_numpy(encode(report))
        ticket = self._ticket(AGREEMENT)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._channel.track(work)
        return _InFlight(self, work, buffer, ticket)

    def gather_reports(self, report: Report) -> list[Report]:
        # Fixed-size buffers in one async all-gather, so that the wait has this rank's own
        # deadline (all_gather_object blocks, for the group's long timeout).
        local = torch.from_numpy(report_bytes(report))
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        ticket = self._ticket(REPORTS)
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        self._channel.track(work)
        self.await_work(work, ticket)
        return [report_from_bytes(tensor.numpy()) for tensor in gathered]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        local = torch.tensor(counts, dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        ticket = self._ticket(STATISTICS)
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        self._channel.track(work)
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

        A wait that gives up does not cancel the collective: it can complete a moment later,
        for every rank, before this rank looks at it again (a busy machine can take that long
        to run this thread again). So what the work ended in decides, never the wait that gave
        up: a rank that raised while its peers carried on would leave them waiting for it in
        the training's next collective.
        """
        began = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self._quiet))
        except RuntimeError as error:
            if not work.is_completed():
                # Only slow so far: say so, and wait on until this wait's own deadline.
                self._roll_call.mark_waiting(ticket)
                remaining = max(self.timeout - (time.monotonic() - began), 0.001)
                try:
                    work.wait(datetime.timedelta(seconds=remaining))
                except RuntimeError as later_error:
                    if not _succeeded(work):
                        raise self.failure(later_error, ticket) from later_error
            elif not _succeeded(work):
                raise self.failure(error, ticket) from error
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


def _succeeded(work: Any) -> bool:
    """Whether a collective whose wait raised has completed without an error after all."""
    if not work.is_completed():
        return False
    try:
        work.wait(_AT_ONCE)  # a completed work returns at once, or raises what it failed with
    except RuntimeError:
        return False
    return True


_AT_ONCE = datetime.timedelta(milliseconds=1)


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
    """One control group of this process: the group, the count of control collectives issued on
    it, and those not yet seen complete.

    Shared by every loader on the group, since all of them take turns on the same wire. The
    group is held here only (agreers reach it through the channel), so that ``_release`` can
    let it go while loaders are still alive.
    """

    def __init__(self, group: dist.ProcessGroup, training_group: Any = None) -> None:
        # None once released.
        self.group: dist.ProcessGroup | None = group
        # The group it serves (None for one made elsewhere): destroying it ends this one.
        self.training_group = training_group
        self.issued = 0
        self._previous = time.monotonic()
        self._running: list[Any] = []

    def next_collective(self) -> tuple[int, float]:
        """The next sequence number, and seconds since the previous collective started."""
        now = time.monotonic()
        since_previous, self._previous = now - self._previous, now
        self.issued += 1
        return self.issued, since_previous

    def track(self, work: Any) -> None:
        """Keep ``work`` until it is seen complete: ``_release`` needs to know it is."""
        # At most the one or two collectives of a window are running: a short list to scan.
        self._running = [running for running in self._running if not running.is_completed()]
        self._running.append(work)

    def busy(self) -> bool:
        """Whether a collective issued here is still running (a peer stalled past a deadline)."""
        return not all(work.is_completed() for work in self._running)


# By group name (what ``tests/helpers/scenarios.py`` counts collectives over).
_channels: dict[str, _Channel] = {}


def _channel_for(control_group: dist.ProcessGroup) -> _Channel:
    channel = _channels.get(control_group.group_name)
    if channel is None or channel.group is not control_group:
        # A group made elsewhere, or a name reused after the world was made again.
        channel = _channels[control_group.group_name] = _Channel(control_group)
    return channel


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


_control_groups: dict[tuple[Any, float], _Channel] = {}
# Control groups created so far per training group: names each creation's rendezvous.
_creations: dict[Any, int] = {}
_RENDEZVOUS_POLL_S = 0.05
# Groups released while a collective was still running on them (see ``_release``).
_left_running: list[dist.ProcessGroup] = []
_release_at_exit_registered = False


def control_group_for(
    training_group: dist.ProcessGroup | None, timeout: float
) -> dist.ProcessGroup:
    """The gloo group ddp_even talks on for ``training_group``, created once and cached.

    Creating it is a collective over the training group's ranks, so every rank must reach this
    call; ``EvenLoader`` does so at the start of its first epoch. Before creating it, the ranks
    meet in the store for at most ``timeout`` seconds, so that a rank that never starts the
    loader (a loop run on rank 0 only) is named instead of failing deep inside torch.
    """
    _release_orphaned()
    group = training_group if training_group is not None else dist.group.WORLD
    gloo_timeout = max(timeout, training_timeout(group))
    key = (group, gloo_timeout)
    channel = _control_groups.get(key)
    if channel is None or channel.group is None:
        ranks = dist.get_process_group_ranks(group)
        _meet_before_creating(group, ranks, timeout)
        control_group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=gloo_timeout),
            use_local_synchronization=True,
        )
        channel = _Channel(control_group, group)
        _control_groups[key] = _channels[control_group.group_name] = channel
        _register_release_at_exit()
        logger.debug("created a gloo control group over ranks %s", ranks)
    assert channel.group is not None
    return channel.group


def _release_orphaned(collecting: bool = False) -> None:
    """Release the control groups whose training group was destroyed.

    Torch has no hook for ``destroy_process_group``, so this runs where ddp_even next gets
    control: a loader created (or garbage-collected) afterwards, and interpreter exit. From the
    garbage collector (``collecting``), which may run in the middle of torch's own bookkeeping,
    a control group torch still has registered (its training group was a subgroup) is left for
    later rather than unregistered there.
    """
    for key, channel in list(_control_groups.items()):
        if _registered(channel.training_group):
            continue
        if collecting and _registered(channel.group):
            continue
        _release(key)


def _release_all_at_exit() -> None:
    """Release every control group of this process; runs at interpreter exit.

    ``atexit`` runs before the interpreter starts finalizing, while other threads can still
    take the GIL: the last moment gloo's worker threads can be joined safely.
    """
    finish_roll_calls()
    for key in list(_control_groups):
        try:
            _release(key)
        except Exception as error:  # never fail an exit; the process ends as it did before
            logger.debug("could not release a control group at exit: %r", error)
    # Torch's own groups have the same hazard (a DDP model left in a reference cycle holds the
    # destroyed training group past destroy_process_group): collected here, their gloo
    # threads are joined now rather than during finalization.
    gc.collect()


def _register_release_at_exit() -> None:
    global _release_at_exit_registered
    if not _release_at_exit_registered:
        atexit.register(_release_all_at_exit)
        _release_at_exit_registered = True


def _release(key: tuple[Any, float]) -> None:
    """Forget one control group, and join its gloo threads by dropping the last reference.

    A gloo worker thread drops a collective, and with it the collective's tensors, only after
    it has completed it (the wait has already returned), and dropping a tensor that Python
    also holds takes the GIL. Torch's process group destructor runs with the GIL released: it
    lets the queue run dry and joins those threads, which take the GIL and finish. A group
    with a collective still running (a peer stalled past a deadline) cannot be joined without
    waiting for that peer: it is kept, as it was before, until the process ends.
    """
    channel = _control_groups.pop(key, None)
    if channel is None:  # released meanwhile (a loader's finalizer, run by the collector)
        return
    group, channel.group, channel.training_group = channel.group, None, None
    if not any(other[0] is key[0] for other in _control_groups):
        _creations.pop(key[0], None)
    if group is None:
        return
    if _channels.get(group.group_name) is channel:
        del _channels[group.group_name]
    if channel.busy():
        logger.debug("control group %s still has a collective running; kept", group.group_name)
        _left_running.append(group)
        return
    channel._running.clear()
    if _registered(group):
        dist.destroy_process_group(group)
    logger.debug("releasing control group %s", group.group_name)
    del group  # the last reference: torch's destructor joins the gloo threads here


def _registered(group: Any) -> bool:
    """Whether torch still knows ``group``, i.e. it was not destroyed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return False
    # Private, and the only place that says so for a group other than the world.
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return True if pg_map is None else group in pg_map


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
