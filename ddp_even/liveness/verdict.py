"""The verdict: why the ranks stop, written once to the store and raised by every rank.

The first rank to give up on a peer (``liveness.py`` judges it lost, the store stops answering,
or a control collective fails) writes its :class:`Verdict` under the meeting's or control
group's prefix; first write wins (``compare_set``), so every rank raises the same
:class:`~ddp_even.PeerTimeoutError`, naming the same global ranks with the same states, as soon
as it reads it. The rank whose process hosts the store waits, briefly, for the others to read
it before it raises (:meth:`Board.adopt`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddp_even.errors import PeerTimeoutError
from ddp_even.liveness.heartbeat import stood_still_since
from ddp_even.liveness.peers import (
    BUSY,
    DEAD,
    STALLED,
    UNSEEN,
    PeerView,
    Watch,
    connection_lost,
    describe,
    judge,
    process_state,
    store_host,
)
from ddp_even.liveness.rollcall import Ticket
from ddp_even.liveness.store_server import store_server_state

logger = logging.getLogger("ddp_even")


@dataclass(frozen=True)
class Verdict:
    """Why the ranks stop: the first rank to give up writes it, every rank raises it."""

    # The global rank that wrote it.
    by: int
    missing: tuple[int, ...]
    states: Mapping[int, str]
    # The deadline that applied: the loader's timeout, or the training group's.
    timeout: float
    # What the missing ranks did not answer, in words.
    what: str
    detail: str

    def encode(self) -> str:
        return json.dumps(
            {
                "by": self.by,
                "missing": list(self.missing),
                "states": {str(rank): state for rank, state in self.states.items()},
                "timeout": self.timeout,
                "what": self.what,
                "detail": self.detail,
            }
        )

    @classmethod
    def decode(cls, text: str) -> Verdict:
        fields = json.loads(text)
        return cls(
            fields["by"],
            tuple(fields["missing"]),
            {int(rank): state for rank, state in fields["states"].items()},
            fields["timeout"],
            fields["what"],
            fields["detail"],
        )

    def error(self, rank: int) -> PeerTimeoutError:
        """The error ``rank`` raises: naming itself, ``late``, if it is one of the missing."""
        return PeerTimeoutError(
            self.missing,
            self.timeout,
            self.detail,
            rank=rank,
            late=rank in self.missing,
            states=self.states,
            what=self.what,
        )


class Board:
    """Where the ranks of one meeting or control group read and write their verdict."""

    def __init__(self, watch: Watch, prefix: str, rank: int, hosts_store: bool) -> None:
        self._watch = watch
        self._key = f"{prefix}verdict"
        self._acknowledged = f"{prefix}verdict-read"
        self._rank = rank
        self._hosts_store = hosts_store

    def read(self) -> Verdict | None:
        """The verdict, if a rank wrote one (None too when the store cannot say)."""
        key = self._key
        try:
            stored = self._watch.ask(lambda store: store.get(key) if store.check([key]) else None)
        except Exception as error:
            logger.debug("could not read the verdict: %r", error)
            return None
        return None if stored is None else Verdict.decode(stored.decode())

    def publish(self, verdict: Verdict) -> Verdict:
        """Write ``verdict`` unless a rank wrote one first; the one that stands."""
        try:
            key, text = self._key, verdict.encode()
            stored = self._watch.ask(lambda store: store.compare_set(key, "", text))
            return Verdict.decode(stored.decode())
        except Exception as error:  # no store: this rank's own verdict, unshared
            logger.debug("could not publish the verdict: %r", error)
            return verdict

    def adopt(self, verdict: Verdict, group_size: int) -> PeerTimeoutError:
        """The error this rank raises; the store's host first waits, briefly, for the others.

        The store usually lives in global rank 0's process: it waits until every rank that is
        not missing has read the verdict (each says so), or about a second and a half, so that
        raising and exiting does not take the store away from them.
        """
        try:
            acknowledged = self._acknowledged
            count = self._watch.ask(lambda store: store.add(acknowledged, 1))
            expected = group_size - len(verdict.missing)
            deadline = time.monotonic() + 1.5
            while self._hosts_store and count < expected and time.monotonic() < deadline:
                time.sleep(0.05)
                count = self._watch.ask(lambda store: store.add(acknowledged, 0))
        except Exception as error:
            logger.debug("could not acknowledge the verdict: %r", error)
        return verdict.error(self._rank)


def verdict_on(
    views: Mapping[int, PeerView], states: Mapping[int, str], *, by: int, timeout: float, what: str
) -> Verdict:
    """The verdict naming ``states``' ranks, described from their views."""
    missing = tuple(sorted(states))
    detail = "; ".join(describe(views[rank], states[rank], timeout) for rank in missing)
    return Verdict(by, missing, dict(states), timeout, what, detail)


def store_silence(
    watch: Watch, *, by: int, timeout: float, what: str, patience: float | None = None
) -> Verdict | None:
    """A verdict once the store has not answered for ``timeout`` and its host is lost: its
    host rank is named, stalled or dead (at once when it refused and the kernel says its
    process is gone).

    A store whose serving process runs (on this host the kernel says so) is busy, not lost: it
    is waited for, said in the log once its silence passes ``timeout``, and named ``busy`` only
    past ``patience`` (the training group's timeout; None: never here, the caller's own wait
    ends). Elsewhere only the store's own answers say that it lives (a late one counts).
    """
    since = watch.silent_since()
    if since is None:
        return None
    silent_s = time.monotonic() - since
    host = store_host()
    error = watch.store_error
    refused = error is not None and connection_lost(str(error))
    # Refused by a store served here whose process is gone: nothing will answer again.
    process = store_server_state(watch, host, by) if refused or silent_s >= timeout else None
    if silent_s < timeout and process != "gone":
        return None
    beat = None if host is None else watch.last_beat(host)
    gone = refused or process == "gone"
    silence = (
        f"the job's store did not answer for {silent_s:.1f} s (timeout {timeout:g} s; "
        f"{type(error).__name__}: {error})"
    )
    if not gone and process == "running":
        if patience is None or silent_s < patience:
            if watch.said_busy != since:
                watch.said_busy = since
                logger.warning(
                    "%s, but the process that serves it runs (busy: a machine short of CPU?); "
                    "waiting for it, as for any live peer",
                    silence,
                )
            return None
        state = BUSY
    else:
        state = DEAD if gone else STALLED
    if state == BUSY:
        detail = (
            f"{silence}, not within the training group's timeout ({patience:g} s), while the "
            "process that serves it ran"
        )
    elif host is None:
        detail = f"{silence}: its host is {state}"
    elif beat is None:
        detail = f"{silence}: rank {host}, which hosts it, is {state}"
    else:
        detail = f"{silence}; rank {host} hosts it: " + describe(
            PeerView(host, beat, silent_s), state, timeout
        )
    missing = () if host is None or host == by else (host,)
    applied = patience if state == BUSY and patience is not None else timeout
    return Verdict(by, missing, {rank: state for rank in missing}, applied, what, detail)


def verdict_on_missing(
    watch: Watch,
    missing: Sequence[int],
    gloo_message: str,
    *,
    by: int,
    timeout: float,
    gloo_timeout: float,
    what: str,
) -> Verdict:
    """Why the ranks a roll call found missing from a failed collective did not come.

    Each is judged from its heartbeat; one still alive (``busy``) or never seen (``unseen``)
    was waited for until gloo's own timeout, the training group's, which the error then quotes.
    """
    lost = connection_lost(gloo_message)
    views = watch.look(list(missing)) or {}
    states = {}
    living = []
    for rank in missing:
        view = views.get(rank)
        state = None if view is None else judge(view, timeout, connection_lost=lost)
        process = None if view is None or view.beat is None else process_state(view.beat)
        if state is None and lost and process == "gone":
            state = DEAD  # killed a moment ago: its heartbeat has not missed a beat yet
        if state is None and lost and process == "running":
            # Alive on this host, only slow to check in (a busy machine): not the one whose
            # connection closed.
            living.append(rank)
        if state is None:
            alive = view is not None and view.beat is not None
            state = DEAD if lost else BUSY if alive else UNSEEN if view else STALLED
        states[rank] = state
    if living and len(living) < len(missing):
        missing = [rank for rank in missing if rank not in living]
        states = {rank: states[rank] for rank in missing}
    timed_out = not lost and any(state in (BUSY, UNSEEN) for state in states.values())
    applied = gloo_timeout if timed_out else timeout
    if views:
        detail = verdict_on(views, states, by=by, timeout=applied, what=what).detail
    else:
        detail = ", ".join(f"rank {rank} is {states[rank]}" for rank in missing)
    if timed_out:
        detail = (
            f"not within the training group's timeout ({applied:g} s), which gloo applies: {detail}"
        )
    words = gloo_words(gloo_message)
    return Verdict(by, tuple(missing), states, applied, what, f"{detail}; gloo: {words}")


def store_host_gone(
    watch: Watch,
    gloo_message: str,
    unknown_because: str,
    ranks: Sequence[int],
    by: int,
    timeout: float,
    what: str,
) -> Verdict | None:
    """The verdict when the store stopped answering and gloo's connection to a peer closed: the
    rank whose process hosted the store is dead (None when no rank of ``ranks`` hosts it, or
    this one does, or gloo does not say that a connection closed, or the kernel says that the
    store's process is still here: busy, the closed connection another peer's)."""
    host = store_host()
    if host is None or host == by or host not in ranks or not connection_lost(gloo_message):
        return None
    if store_server_state(watch, host, by) in ("running", "stopped"):
        return None
    detail = (
        f"rank {host} is dead: the job's store, which its process hosted, stopped answering "
        f"({unknown_because}) and gloo's connection to it closed; gloo: {gloo_words(gloo_message)}"
    )
    return Verdict(by, (host,), {host: DEAD}, timeout, what, detail)


def stood_still(
    ticket: Ticket, gloo_message: str, *, by: int, timeout: float, what: str
) -> PeerTimeoutError | None:
    """The error of a rank whose own process stood still for ``timeout`` or more since its
    previous control collective (None otherwise): the others gave up on it, and when it hosts
    the store their verdict could not reach it."""
    seconds = stood_still_since(ticket.started - ticket.since_previous)
    if seconds < timeout:
        return None
    detail = (
        f"this rank's process stood still for {seconds:.1f} s (SIGSTOP, a debugger, or its "
        f"main thread holding the GIL), longer than the timeout; gloo: {gloo_words(gloo_message)}"
    )
    return PeerTimeoutError((by,), timeout, detail, rank=by, late=True, what=what)


def gloo_words(message: str) -> str:
    """Gloo's message without its source location prefix and sign-off."""
    words = message.split("] ", 1)[-1] if message.startswith("[") else message
    return words.split(" GLHF!", 1)[0].strip()
