"""Who is alive: the peers' heartbeats read by a rank that waits, judged, and the verdict shared.

A rank reads its peers' heartbeats (``heartbeat.py``) only once a wait in ddp_even has lasted
:data:`QUIET_S`, then about twice a second: nothing on the fast path. What it concludes about a
peer that has not come (:func:`judge`):

* **exited**: its last heartbeat says its process exited or destroyed its process group.
  Named at once.
* **dead**: its process is gone: its PID no longer runs on this host (checked once its
  heartbeat has missed a few beats), or, on another host, a connection to it closed (gloo's
  error) and its heartbeat stopped.
* **stalled**: its heartbeat has shown no change for the loader's ``timeout`` and it is not
  known to be gone: frozen (SIGSTOP, a debugger: the kernel says "stopped" on this host), its
  main thread holding the GIL the whole time, or on another host and cut off.
* **busy** (alive, heartbeat going on) and **unseen** (no heartbeat: it never made an
  ``EvenLoader``): waited for, wherever the peer is, up to the training group's own timeout,
  as DDP's all-reduce would wait; named then, with what it was doing. A main thread deadlocked
  with the GIL released is such a peer: its ``progress`` stands still while its count goes on.

Silences are measured on this rank's clock, from the first time it saw the peer's latest
beat, so no two hosts' clocks are compared. The first rank to give up writes its
:class:`Verdict` on the :class:`Board` (``compare_set``: the first write wins), and every rank
raises the same :class:`~ddp_even.PeerTimeoutError`. The failure paths' verdicts (a failed
collective, a silent store) are ``verdict.py``'s, imported only there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ddp_even.errors import PeerTimeoutError
from ddp_even.liveness.heartbeat import (
    EXITED,
    INSIDE,
    LEFT,
    OUTSIDE,
    WAITING,
    Beat,
    connection_broken,
    default_store,
    heartbeat_key,
    host_token,
    own_connection,
    tcp_store_behind,
)

logger = logging.getLogger("ddp_even")

# What a rank concludes about a peer that did not come.
GONE_EXITED = "exited"
DEAD = "dead"
STALLED = "stalled"
BUSY = "busy"
UNSEEN = "unseen"

# A wait at a collective longer than this watches the peers' heartbeats and, at a control
# collective, is written down once in the store, so that a roll call held by a rank that gives
# up sooner counts this rank as present (``rollcall.py``; gloo does not fail every survivor at
# once when a peer dies). Only waits already this slow pay for it.
QUIET_S = 0.25
# A silence of this many beats makes a reader ask the kernel about a peer on its host.
SILENT_BEATS = 2.5
# The most a question to the store may take (a store whose host is frozen never answers).
_READ_TIMEOUT_S = 1.0
_Answer = TypeVar("_Answer")
_MAX_POLL_S = 0.5
# Gloo's words for a connection whose other end went away.
_CONNECTION_LOST = ("closed by peer", "reset by peer", "broken pipe", "connection refused")


def poll_interval(timeout: float, world_size: int) -> float:
    """How often a waiting rank looks at its peers: more seldom in large jobs (one store)."""
    return min(max(timeout / 6, 0.05), _MAX_POLL_S) * max(1.0, world_size / 64)


def connection_lost(gloo_message: str) -> bool:
    """Whether gloo's error says the other end of a connection went away."""
    lowered = gloo_message.lower()
    return any(words in lowered for words in _CONNECTION_LOST)


@dataclass(frozen=True)
class PeerView:
    """One peer as this process sees it now."""

    rank: int
    # None: no heartbeat (it has not made an EvenLoader yet).
    beat: Beat | None
    # Seconds since its heartbeat last changed, on this process's clock.
    silent_s: float


class Watch:
    """This process's view of its peers' heartbeats, kept between waits."""

    def __init__(self, origin: Any) -> None:
        self.origin = origin
        self._store: Any = None
        # Per peer: its latest heartbeat text, and when this process first saw it.
        self._seen: dict[int, tuple[str, float]] = {}
        # When the store stopped answering (None while it answers), and how.
        self.store_failing_since: float | None = None
        self.store_error: BaseException | None = None
        # A question to the store still waiting for its answer (see :meth:`ask`).
        self._unanswered: threading.Thread | None = None
        # When the store last answered a question, late ones included (monotonic clock).
        self._answered_at = 0.0
        # The silence (its start) already said busy in the log.
        self.said_busy: float | None = None

    @property
    def store(self) -> Any:
        """This watch's own connection to the store, with a short timeout of its own: opened
        when the loader is made (:func:`watch_from_now`), then by each question until the
        store's server answers; raises what :func:`own_connection` raises."""
        if self._store is None:
            self._store = own_connection(self.origin, _READ_TIMEOUT_S)
        return self._store

    def ask(self, question: Callable[[Any], _Answer]) -> _Answer:
        """``question(store)`` on this watch's own connection, given up after a second.

        Asked from a daemon thread: a TCPStore client waits for its server's answer without a
        limit (its timeout bounds waits for keys, not a server frozen by SIGSTOP). While an
        earlier question is unanswered, the next fails at once instead of queueing behind it.
        Raises ``TimeoutError`` when the store does not answer, or the store's own error.
        """
        if self._unanswered is not None and self._unanswered.is_alive():
            raise TimeoutError("the job's store has not answered an earlier question yet")
        answers: list[_Answer] = []
        errors: list[Exception] = []
        asked_at = time.monotonic()

        def ask_now() -> None:
            try:
                answers.append(question(self.store))
                # An answer, even one that came too late for its question, is a sign of life.
                self._answered_at = time.monotonic()
            except Exception as error:
                errors.append(error)

        thread = threading.Thread(target=ask_now, name="ddp-even-store-question", daemon=True)
        thread.start()
        thread.join(_READ_TIMEOUT_S)
        if thread.is_alive():
            self._unanswered = thread
            errors.append(TimeoutError(f"the job's store did not answer in {_READ_TIMEOUT_S:g} s"))
        if errors:
            # A question still waiting holds its connection, which is slow, not broken: a new
            # one would cost the store a connect (and, in torch's server, a reverse DNS lookup
            # of the client) just when it is short of time, and every waiting rank would ask.
            if not thread.is_alive() and connection_broken(errors[0]):
                self._store = None
            if self.store_failing_since is None:
                # Silent since the question went unanswered, not since its wait ran out.
                self.store_failing_since, self.store_error = asked_at, errors[0]
            elif connection_lost(str(errors[0])):
                # Once a broken connection is dropped, a refused connect says the server's
                # process is gone, where the first error may only say that an answer was cut.
                self.store_error = errors[0]
            raise errors[0]
        self.store_failing_since = self.store_error = None
        return answers[0]

    def silent_since(self) -> float | None:
        """Since when the store has not answered (None while it answers): from the first
        question it left unanswered, or its last answer to an earlier one when that came
        later (a busy store answers late, and lives)."""
        since = self.store_failing_since
        return None if since is None else max(since, self._answered_at)

    def look(self, ranks: Sequence[int]) -> dict[int, PeerView] | None:
        """The peers' latest heartbeats; None when the store did not answer."""
        keys = [heartbeat_key(rank) for rank in ranks]
        try:
            values = self.ask(lambda store: _read_heartbeats(store, keys))
        except Exception:  # recorded: store_failing_since
            return None
        now = time.monotonic()
        views = {}
        for rank, value in zip(ranks, values, strict=True):
            if value is None:
                views[rank] = PeerView(rank, None, 0.0)
                continue
            text = value.decode(errors="replace")
            previous = self._seen.get(rank)
            if previous is None or previous[0] != text:
                previous = self._seen[rank] = (text, now)
            views[rank] = PeerView(rank, Beat.parse(text), now - previous[1])
        return views

    def last_beat(self, rank: int) -> Beat | None:
        """The last heartbeat seen of ``rank``, however old."""
        seen = self._seen.get(rank)
        return None if seen is None else Beat.parse(seen[0])


def _read_heartbeats(store: Any, keys: list[str]) -> list[bytes | None]:
    if store.check(keys):  # one request, and multi_get would wait for a missing key
        return list(store.multi_get(keys))
    return [store.get(key) if store.check([key]) else None for key in keys]


_watch: Watch | None = None


def watch_from_now() -> None:
    """Connect the current process group's watch now, while the store's host is alive: a
    question like any other, so that a connect the store does not answer starts its silence."""
    if default_store() is not None:
        try:
            current_watch().ask(lambda store: None)
        except Exception as error:  # recorded: store_failing_since
            logger.debug("the job's store does not answer a new connection: %r", error)


def current_watch() -> Watch:
    """The watch over the current process group's heartbeats."""
    global _watch
    store = default_store()
    if _watch is None or _watch.origin is not store:
        _watch = Watch(store)
    return _watch


def process_state(beat: Beat) -> str | None:
    """``"gone"``, ``"stopped"`` or ``"running"`` for a peer on this host; None elsewhere."""
    if beat.host != host_token():
        return None
    return pid_state(beat.pid)


def pid_state(pid: int) -> str | None:
    """``"gone"``, ``"stopped"`` or ``"running"`` (also sleeping: alive, not frozen) for a
    process of this host; None when the kernel does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return _exists(pid)
    state = stat.rsplit(")", 1)[-1].split()[0]
    if state in ("Z", "X"):
        return "gone"
    return "stopped" if state in ("T", "t") else "running"


def _exists(pid: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except OSError:
        return None
    return "running"


def judge(view: PeerView, timeout: float, *, connection_lost: bool = False) -> str | None:
    """Whether the peer is lost (:data:`GONE_EXITED`, :data:`DEAD`, :data:`STALLED`), or None
    while it may still come (alive, or never seen: waited for up to the training timeout)."""
    beat = view.beat
    if beat is None:
        return None
    if beat.doing in (EXITED, LEFT):
        return GONE_EXITED
    missed = SILENT_BEATS * beat.interval
    if view.silent_s < missed:
        return None
    process = process_state(beat)
    if process == "gone":
        return DEAD
    if view.silent_s < max(timeout, missed):
        return None
    return DEAD if connection_lost and process is None else STALLED


def describe(view: PeerView, state: str, timeout: float) -> str:
    """What became of a peer, in words, for an error."""
    rank, beat = view.rank, view.beat
    if beat is None:
        return f"rank {rank} never made an EvenLoader (no heartbeat)"
    said = f"its last heartbeat said: {_doing(beat)}"
    if state == GONE_EXITED:
        if beat.doing == LEFT:
            return f"rank {rank} destroyed its process group (destroy_process_group)"
        return f"rank {rank} exited (its process ended; its last heartbeat said so)"
    if state == DEAD:
        return f"rank {rank} is dead: its process is gone ({_where(beat)}); {said}"
    if state == STALLED:
        process = process_state(beat)
        why = {
            "stopped": "its process is stopped (SIGSTOP, a debugger)",
            "running": "its process runs but its heartbeat does not (a main thread holding "
            "the GIL?)",
        }.get(process or "", f"frozen, dead or cut off ({_where(beat)})")
        return (
            f"rank {rank} is stalled: no sign of life for {view.silent_s:.1f} s (timeout "
            f"{timeout:g} s): {why}; {said}"
        )
    return f"rank {rank} is alive (its heartbeat goes on): {_doing(beat)}"


def _where(beat: Beat) -> str:
    host = beat.host.split("/", 1)[0]
    return f"pid {beat.pid} on {'this host' if beat.host == host_token() else host}"


def _doing(beat: Beat) -> str:
    if beat.doing == OUTSIDE and beat.progress == 0:
        return f"outside the loader, not iterating yet, for {beat.in_state_s:.1f} s"
    words = {
        OUTSIDE: "outside the loader (a training step, an evaluation, a checkpoint, or stuck "
        "there)",
        INSIDE: "inside the loader (reading its source)",
        WAITING: "waiting for the others in ddp_even",
    }.get(beat.doing, beat.doing)
    return f"{words} for {beat.in_state_s:.1f} s, after {beat.progress} batch(es)"


def store_host() -> int | None:
    """The global rank whose process hosts the job's store, when that is known.

    A TCP store is hosted by global rank 0 under ``env://``, ``tcp://`` and
    ``torch.multiprocessing.spawn``; torchrun's own agent hosts it when
    ``TORCHELASTIC_USE_AGENT_STORE`` says so; a file store has no host.
    """
    if tcp_store_behind(default_store()) is None:
        return None
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def lost_peers(
    views: Mapping[int, PeerView], timeout: float, *, connection_lost: bool = False
) -> dict[int, str]:
    """The peers :func:`judge` finds lost, with their state."""
    states = {
        rank: judge(view, timeout, connection_lost=connection_lost) for rank, view in views.items()
    }
    return {rank: state for rank, state in states.items() if state is not None}


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
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, text: str) -> Verdict:
        fields = json.loads(text)
        fields["missing"] = tuple(fields["missing"])
        fields["states"] = {int(rank): state for rank, state in fields["states"].items()}
        return cls(**fields)


class Board:
    """Where the ranks of one meeting, control group or gradient all-reduce share a verdict."""

    def __init__(self, watch: Watch, prefix: str, rank: int, hosts_store: bool) -> None:
        self.watch = watch
        self._key = f"{prefix}verdict"
        self._acknowledged = f"{prefix}verdict-read"
        # This process's global rank.
        self.rank = rank
        self._hosts_store = hosts_store

    def read(self) -> Verdict | None:
        """The verdict, if a rank wrote one (None too when the store cannot say)."""
        key = self._key
        try:
            stored = self.watch.ask(lambda store: store.get(key) if store.check([key]) else None)
        except Exception as error:
            logger.debug("could not read the verdict: %r", error)
            return None
        return None if stored is None else Verdict.decode(stored.decode())

    def publish(self, verdict: Verdict) -> Verdict:
        """Write ``verdict`` unless a rank wrote one first; the one that stands."""
        try:
            key, text = self._key, verdict.encode()
            stored = self.watch.ask(lambda store: store.compare_set(key, "", text))
            return Verdict.decode(stored.decode())
        except Exception as error:  # no store: this rank's own verdict, unshared
            logger.debug("could not publish the verdict: %r", error)
            return verdict

    def decide(self, verdict: Verdict, group_size: int) -> PeerTimeoutError:
        """Publish ``verdict`` when it is this rank's own (unless another rank's stands
        already), then :meth:`adopt` the one that stands."""
        if verdict.by == self.rank:
            verdict = self.publish(verdict)
        logger.debug("%s given up: %s", verdict.what, verdict)
        return self.adopt(verdict, group_size)

    def adopt(self, verdict: Verdict, group_size: int) -> PeerTimeoutError:
        """The error this rank raises (``late`` when it is one of the missing); the store's
        host first waits, briefly, for the others.

        The store usually lives in global rank 0's process: it waits until every rank that is
        not missing has read the verdict (each says so), or about a second and a half, so that
        raising and exiting does not take the store away from them.
        """
        try:
            acknowledged = self._acknowledged
            count = self.watch.ask(lambda store: store.add(acknowledged, 1))
            expected = group_size - len(verdict.missing)
            deadline = time.monotonic() + 1.5
            while self._hosts_store and count < expected and time.monotonic() < deadline:
                time.sleep(0.05)
                count = self.watch.ask(lambda store: store.add(acknowledged, 0))
        except Exception as error:
            logger.debug("could not acknowledge the verdict: %r", error)
        return PeerTimeoutError(
            verdict.missing,
            verdict.timeout,
            verdict.detail,
            rank=self.rank,
            late=self.rank in verdict.missing,
            states=verdict.states,
            what=verdict.what,
        )


def verdict_on(
    views: Mapping[int, PeerView], states: Mapping[int, str], *, by: int, timeout: float, what: str
) -> Verdict:
    """The verdict naming ``states``' ranks, described from their views."""
    missing = tuple(sorted(states))
    detail = "; ".join(describe(views[rank], states[rank], timeout) for rank in missing)
    return Verdict(by, missing, dict(states), timeout, what, detail)
