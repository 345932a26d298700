"""How agreements travel: async collectives on a CPU gloo group of ddp_even's own.

The group is our own so that control messages never queue behind gradient buckets and never
touch a GPU stream. Its gloo timeout is the training group's own (at least the loader's
``timeout``), so an agreement started ahead of time survives any pause a rank makes that the
training collectives survive (a checkpoint, an evaluation, a slow set-up).

A wait that lasts longer than a quarter of a second watches the peers' heartbeats
(``liveness.py``): a peer that shows no sign of life for the loader's ``timeout``, or whose
process is gone, is named at once on every rank; a live peer is waited for, wherever it is, until
gloo's own timeout ends the collective. A collective that fails does not say which peer was
missing; ``rollcall.py`` finds out, and :meth:`CollectiveAgreer.failure` turns its answer into the
error every rank raises, naming global ranks. The first rank to decide writes its verdict to the
store; the others raise the same error.

The group itself, created once per training group and released with it, is
``control_group.py``'s.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from ddp_even.agreement.control_group import (
    channel_for,
    control_group_for,
    release_orphaned,
    training_timeout,
)
from ddp_even.agreement.pending import Done, InFlight, Pending, PendingAgreement, TwoForms
from ddp_even.agreement.wire import (
    Agreement,
    Report,
    agree_alone,
    asks_for_long,
    decode,
    decode_short,
    encode,
    encode_short,
    report_bytes,
    report_from_bytes,
)
from ddp_even.errors import EvenLoaderError, PeerTimeoutError, RankMismatchError
from ddp_even.liveness.heartbeat import start_heartbeat, waiting
from ddp_even.liveness.peers import current_watch, lost_peers, poll_interval
from ddp_even.liveness.rollcall import (
    AGREEMENT,
    HANDOVER,
    PADDING,
    QUIET_S,
    REPORTS,
    ROWS,
    STATISTICS,
    WHAT,
    RollCall,
    Ticket,
)
from ddp_even.liveness.verdict import (
    Board,
    Verdict,
    gloo_words,
    stood_still,
    store_host_gone,
    store_silence,
    verdict_on,
    verdict_on_missing,
)
from ddp_even.process_group import group_is_up

logger = logging.getLogger("ddp_even")

T = TypeVar("T")


def agreer_for(group: dist.ProcessGroup | None, timeout: float | None) -> Agreer:
    """This process's agreer in ``group`` (the world by default): over ddp_even's control group
    of it, whose creation is a collective every rank must reach; a solo one without a process
    group or with one rank. ``timeout`` bounds each wait (None: the group's own timeout)."""
    if not group_is_up() or dist.get_world_size(group) == 1:
        return SoloAgreer()
    if timeout is None:
        timeout = training_timeout(group)
    start_heartbeat(timeout)
    return CollectiveAgreer(control_group_for(group, timeout), float(timeout))


class Agreer(Protocol):
    """Runs agreements among the ranks of one training group."""

    #: This process's rank in the group, and the group's size.
    rank: int
    world_size: int
    #: The global rank of each group rank (what errors name).
    global_ranks: tuple[int, ...]

    def start(self, report: Report) -> PendingAgreement:
        """Send ``report`` without blocking; every rank must start the same agreements and
        wait for each of them (its long form may start only then)."""
        ...

    def gather_reports(self, report: Report) -> list[Report]:
        """Every rank's full report, in rank order (used on the rare error paths)."""
        ...

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        """Every rank's ``counts`` vector (same length everywhere), in rank order."""
        ...

    def start_sum(self, values: Sequence[int]) -> Pending[list[int]]:
        """Sum ``values`` (the same length on every rank) over the ranks, without blocking."""
        ...

    def broadcast_bytes(self, payload: bytes | None, source: int) -> bytes:
        """Rank ``source``'s ``payload`` (None: nothing to send, which every rank gets as
        ``b""``), on every rank."""
        ...


class SoloAgreer:
    """The agreement of a single process: no collective, the same decisions."""

    rank = 0
    world_size = 1
    global_ranks: tuple[int, ...] = (0,)

    def start(self, report: Report) -> PendingAgreement:
        return Done(agree_alone(report))

    def gather_reports(self, report: Report) -> list[Report]:
        return [report]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        return [list(counts)]

    def start_sum(self, values: Sequence[int]) -> Pending[list[int]]:
        return Done(list(values))

    def broadcast_bytes(self, payload: bytes | None, source: int) -> bytes:
        return payload or b""


class CollectiveAgreer:
    """Agreements over a dedicated CPU gloo group spanning the training group's ranks."""

    def __init__(self, control_group: dist.ProcessGroup, timeout: float) -> None:
        self.rank = dist.get_rank(control_group)
        self.world_size = dist.get_world_size(control_group)
        self.global_ranks = tuple(dist.get_process_group_ranks(control_group))
        #: How long a peer may show no sign of life (the loader's ``timeout``).
        self.timeout = timeout
        # How long gloo waits for a live peer: the training group's own timeout, or more.
        self._gloo_timeout = training_timeout(control_group)
        self._channel = channel_for(control_group)
        hosts_store = dist.get_rank() == 0
        self._roll_call = RollCall(
            control_group.group_name, self.rank, self.world_size, hosts_store=hosts_store
        )
        self._roll_call.register()
        self._quiet = datetime.timedelta(seconds=min(QUIET_S, timeout / 4))
        self._poll = datetime.timedelta(seconds=poll_interval(timeout, self.world_size))
        self._watch = current_watch()
        self._board = Board(
            self._watch, f"ddp_even/{control_group.group_name}/", dist.get_rank(), hosts_store
        )
        self._peers = [rank for rank in self.global_ranks if rank != dist.get_rank()]
        # A loader let go of after its training group was destroyed lets that control group go.
        weakref.finalize(self, release_orphaned, True).atexit = False

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
        word = encode_short(report)
        # torch.full, not torch.tensor([word]): a third of the cost, paid at every step.
        short = self._all_reduce(
            torch.full((1,), word, dtype=torch.int64), dist.ReduceOp.BOR, _decode_one_word
        )
        start_long = functools.partial(self._start_long, report)
        return TwoForms(short, start_long() if asks_for_long(word) else None, start_long)

    def _start_long(self, report: Report) -> Pending[Agreement]:
        return self._all_reduce(torch.from_numpy(encode(report)), dist.ReduceOp.MAX, decode)

    def start_sum(self, values: Sequence[int]) -> Pending[list[int]]:
        buffer = torch.tensor(list(values), dtype=torch.int64)
        return self._all_reduce(buffer, dist.ReduceOp.SUM, list, what=ROWS)

    def _all_reduce(
        self,
        buffer: torch.Tensor,
        op: dist.ReduceOp.RedOpType,
        read: Callable[[list[int]], T],
        what: str = AGREEMENT,
    ) -> InFlight[T]:
        ticket = self._ticket(what)
        work = dist.all_reduce(buffer, op=op, group=self.group, async_op=True)
        self._channel.track(work)
        return InFlight(self, work, buffer, ticket, read)

    def broadcast_bytes(self, payload: bytes | None, source: int) -> bytes:
        # The size first, so that every rank knows what to receive (0: nothing follows).
        sending = self.rank == source and payload is not None
        size = torch.tensor([len(payload) if sending and payload else 0], dtype=torch.int64)
        self._broadcast(size, source)
        if int(size.item()) == 0:
            return b""
        if sending and payload:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(buffer, source)
        return bytes(buffer.numpy())

    def _broadcast(self, buffer: torch.Tensor, source: int) -> None:
        ticket = self._ticket(PADDING)
        work = dist.broadcast(
            buffer, src=self.global_ranks[source], group=self.group, async_op=True
        )
        self._channel.track(work)
        self.await_work(work, ticket)

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

    def handover_group(self) -> dist.ProcessGroup:
        """ddp_even's second gloo group over these ranks, made as the control group is (a
        collective: every rank asks at the same point), on which batches are handed over."""
        return control_group_for(self._channel.training_group, self.timeout, purpose=HANDOVER)

    def await_peer(self, work: Any, peer: int) -> None:
        """Wait for a point-to-point ``work`` with group rank ``peer`` as for a collective.

        Only the two ranks take part, and ranks issue different numbers of them: its ticket
        keeps the last control collective's number (the sequence stays the same on every rank),
        nothing is written for a roll call, and a failure names ``peer`` without one.
        """
        self.await_work(work, Ticket(self._channel.issued, time.time(), HANDOVER), peer)

    def await_work(self, work: Any, ticket: Ticket, peer: int | None = None) -> None:
        """Wait for a started collective while every peer that has not come lives.

        The first, short wait costs what a plain ``wait()`` costs; only a wait that outlasts
        it writes this rank's presence to the store and watches the peers' heartbeats
        (:meth:`_wait_watching`). A collective that fails becomes an :class:`EvenLoaderError`.

        A wait that gives up does not cancel the collective: it can complete a moment later,
        for every rank, before this rank looks at it again (a busy machine can take that long
        to run this thread again). So what the work ended in decides, never the wait that gave
        up: a rank that raised while its peers carried on would leave them waiting for it in
        the training's next collective.
        """
        try:
            work.wait(self._quiet)
        except RuntimeError as error:
            if not work.is_completed():
                self._wait_watching(work, ticket, peer)
                return
            if not _succeeded(work):
                raise self.failure(error, ticket, peer) from error
        if ticket.since_previous >= self.timeout / 2:
            # Away long enough for the others to have given up on this rank: its collective
            # may have completed only because it finally joined theirs, after they raised.
            self._raise_if_given_up()

    def _wait_watching(self, work: Any, ticket: Ticket, peer: int | None) -> None:
        """Wait on, looking at the peers between slices of waiting, until the work completes,
        fails, or a peer is lost (here or on another rank)."""
        if peer is None:
            self._roll_call.mark_waiting(ticket)
        with waiting():
            while True:
                try:
                    work.wait(self._poll)
                    break
                except RuntimeError as error:
                    if work.is_completed():
                        if _succeeded(work):
                            break
                        raise self.failure(error, ticket, peer) from error
                verdict = self._look_around(ticket)
                if verdict is not None and not _succeeded(work):
                    raise self._decide(verdict)
        # Completed, after a long wait: did the others give up meanwhile?
        self._raise_if_given_up()

    def _look_around(self, ticket: Ticket) -> Verdict | None:
        """A reason to stop: another rank's verdict, or peers lost; None while all may come."""
        verdict = self._board.read()
        if verdict is not None:
            return verdict
        what = WHAT.get(ticket.what, ticket.what)
        views = self._watch.look(self._peers)
        if views is None:
            return store_silence(self._watch, by=self._me, timeout=self.timeout, what=what)
        lost = lost_peers(views, self.timeout)
        if not lost:
            return None
        return verdict_on(views, lost, by=self._me, timeout=self.timeout, what=what)

    def _decide(self, verdict: Verdict) -> EvenLoaderError:
        """Publish ``verdict`` (unless another rank's stands already); the error to raise."""
        if verdict.by == self._me:
            verdict = self._board.publish(verdict)
        logger.debug("control collective given up: %s", verdict)
        return self._board.adopt(verdict, self.world_size)

    def _raise_if_given_up(self) -> None:
        verdict = self._board.read()
        if verdict is not None:
            raise self._decide(verdict)

    @property
    def _me(self) -> int:
        return self.global_ranks[self.rank]

    def failure(
        self, error: RuntimeError, ticket: Ticket, peer: int | None = None
    ) -> EvenLoaderError:
        """The error every rank raises when a control collective (or a point-to-point one
        with ``peer``) failed: who is missing."""
        verdict = self._board.read()
        if verdict is not None:
            return self._decide(verdict)
        what = WHAT.get(ticket.what, ticket.what)
        if late := stood_still(ticket, str(error), by=self._me, timeout=self.timeout, what=what):
            return late
        if peer is not None:
            return self._decide(self._missing([self.global_ranks[peer]], error, what))
        attendance = self._roll_call.attendance(ticket)
        logger.debug("control collective %s failed: %s (%s)", ticket, error, attendance)
        gloo = f"gloo: {gloo_words(str(error))}"
        kinds = {what for what in attendance.doing.values() if what in WHAT}
        doing = {self.global_ranks[rank]: what for rank, what in attendance.doing.items()}
        if not attendance.missing and len(kinds) > 1:
            return RankMismatchError(
                "ranks are not running the same loop: they reached the same point in "
                f"different collectives ({_describe(doing)}). Did some ranks "
                "leave an epoch early (a break, or an exception caught inside the loop, on "
                f"some ranks only)? Every rank must stop at the same step. {gloo}"
            )
        if attendance.unknown_because is not None:
            why = (attendance.unknown_because, self.global_ranks, self._me, self.timeout, what)
            lost = store_host_gone(self._watch, str(error), *why)
            if lost is not None:
                return self._decide(lost)
        if attendance.unknown_because is not None or not attendance.missing:
            detail = gloo
            if attendance.unknown_because is not None:
                detail += f"; which ranks did not answer is unknown: {attendance.unknown_because}"
            else:
                detail += (
                    "; every rank reached this collective, some only after this rank had "
                    "stopped waiting: a peer was late, not gone"
                )
            return PeerTimeoutError(
                tuple(self.global_ranks[rank] for rank in attendance.missing),
                self.timeout,
                detail,
                rank=self._me,
                late=attendance.late,
                what=what,
            )
        missing = [self.global_ranks[rank] for rank in attendance.missing]
        if attendance.late:
            return PeerTimeoutError(
                tuple(missing), self.timeout, gloo, rank=self._me, late=True, what=what
            )
        return self._decide(self._missing(missing, error, what))

    def _missing(self, missing: list[int], error: RuntimeError, what: str) -> Verdict:
        return verdict_on_missing(
            self._watch,
            missing,
            str(error),
            by=self._me,
            timeout=self.timeout,
            gloo_timeout=self._gloo_timeout,
            what=what,
        )


def _decode_one_word(reduced: list[int]) -> Agreement | None:
    return decode_short(reduced[0])


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
