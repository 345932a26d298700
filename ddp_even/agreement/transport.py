"""How agreements travel: async collectives on ddp_even's own CPU gloo group
(``control_group.py``), each waited for while the peers live (``CollectiveAgreer.await_work``),
a failed one turned into the error every rank raises (``liveness/verdict.py``).

An agreement starts as the short form's all-reduce (``wire.py``); when any rank needs the long
form, it starts it at once and the others when they wait (:class:`TwoForms`), so the ranks
make the same collectives in the same order whichever forms they sent (``docs/design.md``,
"Which form").
"""

from __future__ import annotations

import datetime
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from ddp_even.agreement.control_group import channel_for, control_group_for, release_orphaned
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
from ddp_even.errors import EvenLoaderError
from ddp_even.liveness.heartbeat import start_heartbeat, waiting
from ddp_even.liveness.peers import (
    QUIET_S,
    Board,
    Verdict,
    current_watch,
    lost_peers,
    poll_interval,
    verdict_on,
)
from ddp_even.liveness.rollcall import (
    AGREEMENT,
    HANDOVER,
    PADDING,
    REPORTS,
    ROWS,
    STATISTICS,
    WHAT,
    RollCall,
    Ticket,
)
from ddp_even.process_group import group_is_up, training_timeout

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """A control collective that was started; ``wait`` returns its result."""

    def wait(self) -> T_co: ...

    def finish_started(self) -> None:
        """Wait for what was started, starting nothing more (a loop left early)."""
        ...


PendingAgreement = Pending[Agreement]


@dataclass(frozen=True)
class Done(Generic[T]):
    """A result known without a collective (a single rank)."""

    result: T

    def wait(self) -> T:
        return self.result

    def finish_started(self) -> None:
        pass


class InFlight(Generic[T]):
    """One started collective: waited for under the agreer's deadlines, read once."""

    def __init__(
        self,
        agreer: CollectiveAgreer,
        work: Any,
        buffer: torch.Tensor,
        ticket: Ticket,
        read: Callable[[list[int]], T],
    ) -> None:
        self._agreer = agreer
        self._work = work
        self._buffer = buffer
        self._ticket = ticket
        self._read = read
        self._waited = False
        self._result: T
        self._failure: EvenLoaderError | None = None

    def wait(self) -> T:
        if self._failure is not None:
            # Waited once already (e.g. again in a ``finally``): the same error, at once.
            raise self._failure
        if not self._waited:
            try:
                self._agreer.await_work(self._work, self._ticket)
            except EvenLoaderError as error:
                self._failure = error
                raise
            self._result = self._read(self._buffer.tolist())
            self._waited = True
        return self._result

    def finish_started(self) -> None:
        self.wait()


class TwoForms:
    """An agreement in flight: its short form, and its long form once any rank needs it."""

    def __init__(
        self,
        short: Pending[Agreement | None],
        long: Pending[Agreement] | None,
        start_long: Callable[[], Pending[Agreement]],
    ) -> None:
        self._short = short
        self._long = long
        self._start_long = start_long

    def wait(self) -> Agreement:
        agreement = self._short.wait()
        if agreement is not None:
            return agreement
        if self._long is None:
            # Another rank sent the long form: this rank joins it.
            self._long = self._start_long()
        return self._long.wait()

    def finish_started(self) -> None:
        self._short.wait()
        if self._long is not None:
            self._long.wait()


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
            control_group.group_name, self.rank, self.world_size, hosts_store
        )
        self._quiet = datetime.timedelta(seconds=min(QUIET_S, timeout / 4))
        self._poll = datetime.timedelta(seconds=poll_interval(timeout, self.world_size))
        self._watch = current_watch()
        prefix = f"ddp_even/{control_group.group_name}/"
        self._board = Board(self._watch, prefix, dist.get_rank(), hosts_store)
        self._peers = [rank for rank in self.global_ranks if rank != self._board.rank]
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
        ticket = self._channel.ticket(what)
        work = dist.all_reduce(buffer, op=op, group=self.group, async_op=True)
        self._channel.track(work)
        return InFlight(self, work, buffer, ticket, read)

    def broadcast_bytes(self, payload: bytes | None, source: int) -> bytes:
        # The size first, so that every rank knows what to receive (0: nothing follows).
        sent = payload if self.rank == source and payload else b""
        size = torch.tensor([len(sent)], dtype=torch.int64)
        self._broadcast(size, source)
        count = int(size.item())
        if count == 0:
            return b""
        if sent:
            buffer = torch.frombuffer(bytearray(sent), dtype=torch.uint8)
        else:
            buffer = torch.empty(count, dtype=torch.uint8)
        self._broadcast(buffer, source)
        return bytes(buffer.numpy())

    def _broadcast(self, buffer: torch.Tensor, source: int) -> None:
        ticket = self._channel.ticket(PADDING)
        source = self.global_ranks[source]
        work = dist.broadcast(buffer, src=source, group=self.group, async_op=True)
        self._channel.track(work)
        self.await_work(work, ticket)

    def gather_reports(self, report: Report) -> list[Report]:
        # Fixed-size buffers in one async all-gather, so that the wait has this rank's own
        # deadline (all_gather_object blocks, for the group's long timeout).
        gathered = self._all_gather(torch.from_numpy(report_bytes(report)), REPORTS)
        return [report_from_bytes(tensor.numpy()) for tensor in gathered]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        gathered = self._all_gather(torch.tensor(counts, dtype=torch.int64), STATISTICS)
        return [tensor.tolist() for tensor in gathered]

    def _all_gather(self, local: torch.Tensor, what: str) -> list[torch.Tensor]:
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        ticket = self._channel.ticket(what)
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        self._channel.track(work)
        self.await_work(work, ticket)
        return gathered

    def handover_group(self) -> dist.ProcessGroup:
        """ddp_even's second gloo group over these ranks, made as the control group is (a
        collective: every rank asks at the same point), on which batches are handed over."""
        return control_group_for(self._channel.training_group, self.timeout, purpose=HANDOVER)

    def await_peer(self, work: Any, peer: int) -> None:
        """Wait for a point-to-point ``work`` with group rank ``peer`` as for a collective.
        Ranks issue different numbers of them: its ticket keeps the last control collective's
        number, nothing is written for a roll call, and a failure names ``peer`` without one."""
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
                    raise self._board.decide(verdict, self.world_size)
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
            from ddp_even.liveness.verdict import store_silence

            return store_silence(self._watch, by=self._board.rank, timeout=self.timeout, what=what)
        lost = lost_peers(views, self.timeout)
        if not lost:
            return None
        return verdict_on(views, lost, by=self._board.rank, timeout=self.timeout, what=what)

    def _raise_if_given_up(self) -> None:
        verdict = self._board.read()
        if verdict is not None:
            raise self._board.decide(verdict, self.world_size)

    def failure(
        self, error: RuntimeError, ticket: Ticket, peer: int | None = None
    ) -> EvenLoaderError:
        """The error every rank raises when a control collective (or a point-to-point one
        with ``peer``) failed: who is missing."""
        from ddp_even.liveness.verdict import collective_failure

        return collective_failure(
            error,
            ticket,
            self._board,
            self._roll_call,
            self.global_ranks,
            timeout=self.timeout,
            gloo_timeout=self._gloo_timeout,
            peer=peer,
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
