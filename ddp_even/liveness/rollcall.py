"""Which ranks reached a failed control collective, told through the job's key-value store.

Gloo never says *which* peer a failed collective was waiting for. Every control collective has
a sequence number, the same on every rank (:class:`Ticket`). A rank writes ``waiting/<rank>``
when its wait at collective ``N`` has lasted ``QUIET_S`` (so never on the fast path) and
``gave_up/<rank>`` when collective ``N`` failed, each as ``"N <time> <what>"``. A rank whose
collective ``N`` failed then waits up to ``_ROLL_CALL_S`` for every rank to show ``N`` in one of
its keys; those that do not are the dead or stalled ones. Ranks alive but slower to notice check
in either way: by their ``waiting`` key if they were already waiting (a stalled peer), or by
their ``gave_up`` key within the roll call (a dead peer makes every waiting rank fail at once).
A rank that finds every other rank already gave up before it even started the collective was
itself the stalled one. Ranks that all reached ``N`` but issued different collectives there are
not running the same loop. The store's host (usually global rank 0) waits, briefly, for the
others to finish their roll call before it raises and its process may end.

The store holds three keys per rank, overwritten, written once up front (a rank that never
reached collective 1 is missing at collective 1), so that a roll call reads them all in one
request. Store calls on the failure path run in daemon threads joined with a time limit; at
exit, ``finish_roll_calls`` waits a bounded time for those still in a store call (one that
comes back while the interpreter finalizes aborts the process).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddp_even.liveness.heartbeat import default_store, own_connection

logger = logging.getLogger("ddp_even")

# What each control collective is, in words, for the error when ranks are in different ones.
AGREEMENT = "agreement"
REPORTS = "reports"
STATISTICS = "statistics"
ROWS = "rows"
PADDING = "padding"
HANDOVER = "handover"
WHAT = {
    AGREEMENT: "a step agreement",
    REPORTS: "the gather of error reports",
    STATISTICS: "the end-of-epoch statistics gather",
    ROWS: "the sum of a window's real rows (pad)",
    PADDING: "the copy of a batch for a rank with nothing to pad with (pad)",
    HANDOVER: "the hand-over of a batch from one rank to another (share)",
}

# On a failure, how long a rank waits for the others to check in before naming the absent:
# well past ``peers.QUIET_S``, so that every rank waiting at the collective has said so.
_ROLL_CALL_S = 1.5
# The most a roll call waits on the store itself (a store whose host is stopped never
# answers); past it the missing ranks are reported as unknown.
_STORE_ANSWER_S = 3.0
_POLL_S = 0.05
# The name of every thread a roll call starts (``finish_roll_calls`` finds them by it).
_THREAD_NAME = "ddp-even-roll-call"
# A rank's record before it reached any control collective (sequences start at 1); -1 so that
# it never passes for "gave up one collective earlier" at collective 1.
_NO_RECORD = "-1 0.0 none"


@dataclass(frozen=True)
class Ticket:
    """One control collective as this rank issued it."""

    # Its place in the sequence of control collectives on the group: the same on every rank.
    sequence: int
    # time.time() when this rank started it.
    started: float
    what: str
    # Seconds since this rank started its previous control collective on the group.
    since_previous: float = 0.0


@dataclass(frozen=True)
class Attendance:
    """What a roll call found out about one failed control collective (group ranks)."""

    # Ranks that never reached the collective, in rank order.
    missing: tuple[int, ...]
    # This rank reached it after every other rank had given up waiting for it.
    late: bool = False
    # Why the store could not say, when it could not.
    unknown_because: str | None = None
    # For each rank that reached it: which collective it issued there (``WHAT`` keys).
    doing: dict[int, str] = dataclasses.field(default_factory=dict)


class RollCall:
    """The roll call of one control group; ranks here are the group's ranks."""

    def __init__(self, group_name: str, rank: int, world_size: int, hosts_store: bool) -> None:
        self._prefix = f"ddp_even/{group_name}/"
        self._rank = rank
        self._world_size = world_size
        self._hosts_store = hosts_store
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._marker: threading.Thread | None = None
        self._keys = [
            f"{self._prefix}{kind}/{rank}"
            for rank in range(world_size)
            for kind in ("waiting", "gave_up")
        ]
        # This rank's records, written once up front.
        kinds = ("waiting", "gave_up", "done")
        try:
            self._open_store().multi_set(
                [f"{self._prefix}{kind}/{self._rank}" for kind in kinds],
                [_NO_RECORD] * len(kinds),
            )
        except Exception as error:  # the roll call then reads key by key
            logger.debug("could not register with the store: %r", error)

    def mark_waiting(self, ticket: Ticket) -> None:
        """Record, without blocking, that this rank is waiting at ``ticket``'s collective."""
        if self._marker is not None and self._marker.is_alive():
            return  # the store is slow; the previous mark is still on its way
        self._marker = threading.Thread(
            target=self._set_quietly,
            args=(f"waiting/{self._rank}", _record(ticket, ticket.started)),
            name=_THREAD_NAME,
            daemon=True,
        )
        self._marker.start()

    def attendance(self, ticket: Ticket) -> Attendance:
        """Check in as having given up at ``ticket``; say who never reached it."""
        found: list[Attendance] = []
        failure: list[BaseException] = []

        def call() -> None:
            try:
                found.append(self._hold(ticket))
            except Exception as error:  # any store failure: report the ranks as unknown
                failure.append(error)

        thread = threading.Thread(target=call, name=_THREAD_NAME, daemon=True)
        thread.start()
        thread.join(2 * _ROLL_CALL_S + _STORE_ANSWER_S)
        if found:
            return found[0]
        why = (
            f"the store failed: {type(failure[0]).__name__}: {failure[0]}"
            if failure
            else f"the store did not answer within {_STORE_ANSWER_S:g} s"
        )
        return Attendance(missing=(), unknown_because=why)

    def _hold(self, ticket: Ticket) -> Attendance:
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
                return Attendance(missing=(self._rank,), late=True, doing=doing)
            first_look = False
            missing = tuple(rank for rank in others if rank not in doing)
            if not missing or time.monotonic() >= deadline:
                break
            # Every waiting rank polls the one store: fewer polls each in a large job.
            time.sleep(_POLL_S * max(1.0, self._world_size / 16))
        store.set(f"{self._prefix}done/{self._rank}", _record(ticket, time.time()))
        if self._hosts_store:
            self._wait_for_the_others_to_finish(store, ticket, [r for r in doing if r in others])
        return Attendance(missing=missing, doing=doing)

    def _wait_for_the_others_to_finish(
        self, store: Any, ticket: Ticket, present: Sequence[int]
    ) -> None:
        """Keep the store up until every rank that reached the collective has its answer."""
        deadline = time.monotonic() + _ROLL_CALL_S
        keys = [f"{self._prefix}done/{rank}" for rank in present]
        while keys and time.monotonic() < deadline:
            values = [_sequence_of(value.decode()) for value in store.multi_get(keys)]
            keys = [key for key, seen in zip(keys, values, strict=True) if seen < ticket.sequence]
            if keys:
                time.sleep(_POLL_S)

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
            number = _sequence_of(value)
            _, at, what = value.split()
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
                self._store = own_connection(default_store(), _STORE_ANSWER_S)
            return self._store

    def _set_quietly(self, key: str, value: str) -> None:
        try:
            self._open_store().set(f"{self._prefix}{key}", value)
        except Exception as error:
            logger.debug("could not write %s to the store: %r", key, error)


def finish_roll_calls(limit_s: float = _STORE_ANSWER_S + 1.0) -> None:
    """Wait, ``limit_s`` at most in all, for roll-call threads still in a store call.

    Called at interpreter exit, before finalization: each store call of a roll call gives up
    within ``_STORE_ANSWER_S`` (a store that could not be given that timeout excepted).
    """
    deadline = time.monotonic() + limit_s
    for thread in threading.enumerate():
        if thread.name == _THREAD_NAME and thread is not threading.current_thread():
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                logger.debug("a roll call is still waiting for the store at exit")


def _record(ticket: Ticket, at: float) -> str:
    """``"<sequence> <time> <what>"``: where a rank was, since when, doing what."""
    return f"{ticket.sequence} {at!r} {ticket.what}"


def _sequence_of(record: str) -> int:
    return int(record.split(maxsplit=1)[0])
