"""This process's heartbeat: a counter in the job's store, and what the process is doing.

From the first ``EvenLoader`` until exit, a daemon thread writes ``ddp_even/heartbeat/<global
rank>`` in the job's key-value store about once a second (a quarter of the loader's
``timeout`` when that is shorter), as a :class:`Beat`:

* ``count``: the thread's own counter. It goes on while the process lives and its interpreter
  runs; it stops when the process is gone, frozen (SIGSTOP, a debugger), or when its main
  thread holds the GIL without a break.
* ``progress``: a counter the *main* thread advances each time it leaves the loader. A count
  that goes on while the progress stands still is a process alive and busy, or stuck, where
  ``doing`` says.
* ``doing``: where the main thread is (:data:`OUTSIDE` the loader, :data:`INSIDE` it,
  :data:`WAITING` for the others in ddp_even), or that the process :data:`EXITED` or
  :data:`LEFT` its process group; ``seconds``: for how long, on its own clock.
* ``interval``, ``pid`` and ``host``: what a silence means, and what a reader on the same host
  asks the kernel about a silent peer (``peers.py``).

No collective, and nothing on the fast path but two attribute writes per batch
(:data:`presence`). The thread writes on a connection of its own with a short timeout; it stops
when its process group is destroyed (writing :data:`LEFT`) and at interpreter exit (writing
:data:`EXITED`), from an ``atexit`` hook that joins it: a daemon thread coming back from a store
call while the interpreter finalizes would abort the process. The store and its classes are
torch internals (listed in ``agreement/control_group.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from ddp_even.errors import PeerTimeoutError
from ddp_even.process_group import group_is_up

logger = logging.getLogger("ddp_even")

# Where the main thread is, and how the process ended.
OUTSIDE = "outside"
INSIDE = "inside"
WAITING = "waiting"
EXITED = "exited"
LEFT = "left"

# The longest and shortest beat intervals: a quarter of the loader's timeout in between.
_MAX_INTERVAL_S = 1.0
_MIN_INTERVAL_S = 0.05
# The thread's store calls give up after this; joined at exit for a little longer.
_STORE_TIMEOUT_S = 2.0
# A wait between beats that overran by this much: the whole process stood still.
_STOOD_STILL_S = 1.0
THREAD_NAME = "ddp-even-heartbeat"


class Presence:
    """Where this process's main thread is; written by it, read by the heartbeat thread."""

    __slots__ = ("doing", "progress")

    def __init__(self) -> None:
        self.doing = OUTSIDE
        self.progress = 0


#: The one :class:`Presence` of this process (the epoch marks each batch in it).
presence = Presence()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Mark the main thread as waiting for the others in ddp_even while the block runs."""
    previous, presence.doing = presence.doing, WAITING
    try:
        yield
    finally:
        presence.doing = previous


def heartbeat_key(rank: int) -> str:
    """The store key of global rank ``rank``'s heartbeat."""
    return f"ddp_even/heartbeat/{rank}"


def beat_interval(timeout: float) -> float:
    """How often a process beats for a loader whose ``timeout`` is this many seconds."""
    return min(max(timeout / 4, _MIN_INTERVAL_S), _MAX_INTERVAL_S)


@dataclass(frozen=True)
class Beat:
    """One heartbeat, as written to the store."""

    count: int
    progress: int
    doing: str
    # Seconds in ``doing`` when it was written, on the writer's clock.
    in_state_s: float
    interval: float
    pid: int
    host: str

    def encode(self) -> str:
        return (
            f"{self.count} {self.progress} {self.doing} {self.in_state_s:.1f} "
            f"{self.interval:g} {self.pid} {self.host}"
        )

    @classmethod
    def parse(cls, text: str) -> Beat | None:
        """The beat ``text`` holds, or None when it is not one."""
        try:
            count, progress, doing, seconds, interval, pid, host = text.split(" ")
            return cls(
                int(count), int(progress), doing, float(seconds), float(interval), int(pid), host
            )
        except ValueError:
            return None


def host_token() -> str:
    """This host and PID namespace: readers compare it with theirs before looking at a PID."""
    name = socket.gethostname() or "unknown"
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "-"
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "-"
    return "/".join((name, boot, namespace)).replace(" ", "_")


def default_store() -> Any:
    """The job's store, or None without a process group (also while it is being destroyed)."""
    try:
        if not group_is_up():
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # destroyed meanwhile, from another thread
        return None


# One clone at a time: each lends the job's store a timeout of its own for its connect.
_clone_lock = threading.Lock()
# How long one try to connect to the store waits: milliseconds while its server answers at
# once, seconds while it waits for a core (32 ranks and a busy loop on 2 cores). A try that
# times out is no failure: the caller tries again (the next beat, the next question) for as
# long as the server lives; one whose process is gone is refused at once.
_CONNECT_S = 2.0
# The thread is joined at exit for as long as a store call or a connect (torch tries twice).
_JOIN_AT_EXIT_S = max(_STORE_TIMEOUT_S, 2 * _CONNECT_S) + 1.0


def own_connection(store: Any, timeout_s: float) -> Any:
    """A connection of one's own to ``store`` whose calls give up after ``timeout_s``; the
    job's own connection where the store type cannot be cloned.

    Raises the connect's error (``OSError``, ``ConnectionRefusedError`` once the server's
    process is gone, or ``DistNetworkError``) when the server does not answer within
    :data:`_CONNECT_S`; the callers try again while it lives. A clone would connect with the
    timeout of the store it is cloned from (30 minutes by default), and ``PrefixStore`` does not
    say its prefix, so a plain TCP connect first finds the server listening, then the job's
    store lends the try's timeout for the clone's connect.
    """
    tcp_store = tcp_store_behind(store)
    if tcp_store is not None:
        socket.create_connection((tcp_store.host, tcp_store.port), timeout=_CONNECT_S).close()
    with _clone_lock:
        previous = store.timeout
        store.set_timeout(datetime.timedelta(seconds=_CONNECT_S))
        try:
            connection = store.clone()
        except dist.DistNetworkError:
            raise
        except Exception:  # a store type without clone
            logger.debug("the default store cannot be cloned; sharing the job's connection")
            return store
        finally:
            store.set_timeout(previous)
    connection.set_timeout(datetime.timedelta(seconds=timeout_s))
    return connection


def connection_broken(error: BaseException) -> bool:
    """Whether ``error`` ended a connection to the store: it is dropped, and the next use
    connects again (torch logs every request sent on a broken connection, with its stack;
    a refused connect logs nothing)."""
    return isinstance(error, (OSError, dist.DistNetworkError))


def tcp_store_behind(store: Any) -> TCPStore | None:
    """The TCP store under ``store``'s prefixes; None for stores of other kinds."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, TCPStore) else None


class _Beater(threading.Thread):
    """The thread that beats for this process into one process group's store."""

    def __init__(self, origin: Any, rank: int, timeout: float) -> None:
        super().__init__(name=THREAD_NAME, daemon=True)
        # The default store it beats into: when torch no longer has it, the group is gone.
        self.origin = origin
        # The shortest ``timeout`` of the loaders it beats for, and the interval that gives.
        self.timeout = timeout
        self.interval = beat_interval(timeout)
        self._key = heartbeat_key(rank)
        self._host = host_token()
        self._stopping = threading.Event()
        self._last_words = EXITED
        self._count = 0
        self._state = (presence.doing, presence.progress)
        self._since = time.monotonic()
        # When its wait between beats began (None while it beats): overdue while this process
        # stands still.
        self.waiting_since: float | None = None
        # This process's last standstill: (time.time() when it ended, its seconds).
        self.stood_still: tuple[float, float] | None = None
        # Its own connection, with its own timeout: the job's store is shared. None while
        # the store's server does not answer; each beat tries again.
        self._store: Any = None
        with contextlib.suppress(Exception):
            self._store = own_connection(origin, _STORE_TIMEOUT_S)

    @property
    def connected(self) -> bool:
        return self._store is not None

    def beat(self, doing: str | None = None) -> None:
        """Write one heartbeat (``doing`` overrides what the main thread says)."""
        now = time.monotonic()
        state = (presence.doing, presence.progress)
        if state != self._state:
            self._state, self._since = state, now
        self._count += 1
        beat = Beat(
            self._count,
            state[1],
            doing or state[0],
            now - self._since,
            self.interval,
            os.getpid(),
            self._host,
        )
        try:
            if self._store is None:
                self._store = own_connection(self.origin, _STORE_TIMEOUT_S)
            self._store.set(self._key, beat.encode())
        except Exception as error:  # a store gone or slow: the next beat tries again
            logger.debug("heartbeat not written: %r", error)
            if connection_broken(error):
                self._store = None

    def run(self) -> None:
        while True:
            began = self.waiting_since = time.monotonic()
            stopping = self._stopping.wait(self.interval)
            self.waiting_since = None
            if stopping:
                break
            # A wait on an event overruns by seconds only when no thread of this process ran:
            # frozen (SIGSTOP, a debugger) or a main thread holding the GIL.
            waited = time.monotonic() - began
            if waited > self.interval + _STOOD_STILL_S:
                self.stood_still = (time.time(), waited)
            if default_store() is not self.origin:
                self.beat(LEFT)
                return
            self.beat()
        self.beat(self._last_words)

    def stop(self, last_words: str, wait_s: float) -> None:
        self._last_words = last_words
        self._stopping.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(wait_s)
            if self.is_alive():
                logger.debug("the heartbeat thread is still in a store call")


_beater: _Beater | None = None
_lock = threading.Lock()
_stop_at_exit_registered = False


def start_heartbeat(timeout: float) -> None:
    """Beat for this process from now until exit (or until its process group is destroyed).

    Idempotent; a loader with a shorter ``timeout`` than those before makes the beats more
    frequent. Without a process group, or with one rank, there is no one to beat for.
    """
    global _beater, _stop_at_exit_registered
    store = default_store()
    if store is None or dist.get_world_size() == 1:
        return
    with _lock:
        beater = _beater
        if beater is not None and beater.origin is store and beater.is_alive():
            beater.timeout = min(beater.timeout, timeout)
            beater.interval = beat_interval(beater.timeout)
            return
        if beater is not None:
            beater.stop(LEFT, _JOIN_AT_EXIT_S)  # a process group made again: beat into the new one
        beater = _beater = _Beater(store, dist.get_rank(), timeout)
        # The first beat before this returns, so that every rank that reaches the others has
        # one; a store that did not answer the connect is left to the thread's next beats.
        if beater.connected:
            beater.beat()
        beater.start()
        if not _stop_at_exit_registered:
            atexit.register(_stop_at_exit)
            _stop_at_exit_registered = True
    logger.debug("heartbeat every %.2f s into the job's store", beater.interval)


def loader_timeout() -> float | None:
    """The shortest ``timeout`` of this process's loaders, while it beats (None otherwise)."""
    beater = _beater
    if beater is None or beater.origin is not default_store() or not beater.is_alive():
        return None
    return beater.timeout


def stood_still_since(since: float) -> float:
    """How long this process last stood still, when that ended after ``since`` (a
    ``time.time()``): no thread of it ran (frozen by SIGSTOP or a debugger, or its main thread
    held the GIL), as its heartbeat thread saw from a wait that overran, or sees now from
    the wait it has not yet woken from (a process just continued runs its threads in any
    order); 0.0 otherwise."""
    beater = _beater
    if beater is None:
        return 0.0
    waiting_since = beater.waiting_since
    overdue = 0.0 if waiting_since is None else time.monotonic() - waiting_since - beater.interval
    if overdue > _STOOD_STILL_S:
        return overdue
    stood_still = beater.stood_still
    if stood_still is None or stood_still[0] < since:
        return 0.0
    return stood_still[1]


def own_lateness(
    since: float, timeout: float, what: str, *, overslept: float = 0.0, gloo: str | None = None
) -> PeerTimeoutError | None:
    """``PeerTimeoutError(late=True)`` naming this rank when its own process stood still for
    ``timeout`` or more since ``since`` (a ``time.time()``; or the caller's own wait
    ``overslept`` that long): the others gave up on it, and the store that would tell it so
    may have left with them. None otherwise; ``gloo``: gloo's words, when a collective failed."""
    seconds = max(stood_still_since(since), overslept)
    if seconds < timeout:
        return None
    me = dist.get_rank()
    detail = (
        f"this rank's process stood still for {seconds:.1f} s (SIGSTOP, a debugger, or its "
        "main thread holding the GIL), longer than the timeout"
    )
    if gloo is not None:
        detail += f"; gloo: {gloo}"
    return PeerTimeoutError((me,), timeout, detail, rank=me, late=True, what=what)


def _stop_at_exit() -> None:
    """Say this process exited, and join the thread before the interpreter finalizes."""
    beater = _beater
    if beater is not None:
        beater.stop(EXITED, _JOIN_AT_EXIT_S)
