"""The verdicts of the failure paths: a control collective that failed (the ranks a roll call
found missing, judged), a store that stopped answering, this rank's own standstill. Imported
only there: a rank that never meets a failure never loads this module.

A store that does not answer is not a dead or frozen host by itself: on a machine whose cores
are all taken, the store's serving thread (one thread of global rank 0's process under
``env://``, ``tcp://`` and ``torch.multiprocessing.spawn``) may wait seconds for a core while its
process runs. On this host the kernel says which (:func:`store_server_state`): the process is
read from its heartbeat's PID when one was seen, otherwise found as the owner of the socket
listening on the store's port (``/proc/net/tcp``, ``/proc/<pid>/fd``); none listening: gone.
Elsewhere nothing is known but the store's own answers (a late one is a sign of life,
``Watch``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from ddp_even.errors import EvenLoaderError, PeerTimeoutError, RankMismatchError
from ddp_even.liveness.heartbeat import own_lateness, tcp_store_behind
from ddp_even.liveness.peers import (
    BUSY,
    DEAD,
    STALLED,
    UNSEEN,
    Board,
    PeerView,
    Verdict,
    Watch,
    connection_lost,
    describe,
    judge,
    pid_state,
    process_state,
    store_host,
    verdict_on,
)
from ddp_even.liveness.rollcall import WHAT, RollCall, Ticket

logger = logging.getLogger("ddp_even")

# TCP state "listening" in /proc/net/tcp.
_LISTEN = "0A"
# Per (host, port): whether it is this host; the PID of the process serving it here.
_local: dict[tuple[str, int], bool] = {}
_servers: dict[tuple[str, int], int | None] = {}


def collective_failure(
    error: RuntimeError,
    ticket: Ticket,
    board: Board,
    roll_call: RollCall,
    global_ranks: Sequence[int],
    *,
    timeout: float,
    gloo_timeout: float,
    peer: int | None = None,
) -> EvenLoaderError:
    """The error every rank raises when a control collective on ``board``'s group (or a
    point-to-point one with group rank ``peer``) failed: who is missing, by global rank."""
    me, size = board.rank, len(global_ranks)

    def missing_verdict(missing: list[int]) -> Verdict:
        return verdict_on_missing(
            board.watch,
            missing,
            str(error),
            by=me,
            timeout=timeout,
            gloo_timeout=gloo_timeout,
            what=what,
        )

    verdict = board.read()
    if verdict is not None:
        return board.decide(verdict, size)
    what = WHAT.get(ticket.what, ticket.what)
    since = ticket.started - ticket.since_previous
    if late := own_lateness(since, timeout, what, gloo=gloo_words(str(error))):
        return late
    if peer is not None:
        return board.decide(missing_verdict([global_ranks[peer]]), size)
    attendance = roll_call.attendance(ticket)
    logger.debug("control collective %s failed: %s (%s)", ticket, error, attendance)
    gloo = f"gloo: {gloo_words(str(error))}"
    kinds = {what for what in attendance.doing.values() if what in WHAT}
    doing = {global_ranks[rank]: what for rank, what in attendance.doing.items()}
    if not attendance.missing and len(kinds) > 1:
        return RankMismatchError(
            "ranks are not running the same loop: they reached the same point in "
            f"different collectives ({_describe(doing)}). Did some ranks "
            "leave an epoch early (a break, or an exception caught inside the loop, on "
            f"some ranks only)? Every rank must stop at the same step. {gloo}"
        )
    if attendance.unknown_because is not None:
        why = (attendance.unknown_because, global_ranks, me, timeout, what)
        lost = store_host_gone(board.watch, str(error), *why)
        if lost is not None:
            return board.decide(lost, size)
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
            tuple(global_ranks[rank] for rank in attendance.missing),
            timeout,
            detail,
            rank=me,
            late=attendance.late,
            what=what,
        )
    missing = [global_ranks[rank] for rank in attendance.missing]
    if attendance.late:
        return PeerTimeoutError(tuple(missing), timeout, gloo, rank=me, late=True, what=what)
    return board.decide(missing_verdict(missing), size)


def _describe(doing: dict[int, str]) -> str:
    by_kind: dict[str, list[int]] = {}
    for rank, what in sorted(doing.items()):
        by_kind.setdefault(what, []).append(rank)
    return "; ".join(
        f"rank(s) {', '.join(map(str, ranks))}: {WHAT.get(what, what)}"
        for what, ranks in by_kind.items()
    )


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
    gone = refused or process == "gone"
    silence = (
        f"the job's store did not answer for {silent_s:.1f} s (timeout {timeout:g} s; "
        f"{type(error).__name__}: {error})"
    )
    missing = () if host is None or host == by else (host,)
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
        detail = (
            f"{silence}, not within the training group's timeout ({patience:g} s), while the "
            "process that serves it ran"
        )
        return Verdict(by, missing, dict.fromkeys(missing, BUSY), patience, what, detail)
    state = DEAD if gone else STALLED
    beat = None if host is None else watch.last_beat(host)
    if host is None:
        detail = f"{silence}: its host is {state}"
    elif beat is None:
        detail = f"{silence}: rank {host}, which hosts it, is {state}"
    else:
        view = PeerView(host, beat, silent_s)
        detail = f"{silence}; rank {host} hosts it: {describe(view, state, timeout)}"
    return Verdict(by, missing, dict.fromkeys(missing, state), timeout, what, detail)


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


def gloo_words(message: str) -> str:
    """Gloo's message without its source location prefix and sign-off."""
    words = message.split("] ", 1)[-1] if message.startswith("[") else message
    return words.split(" GLHF!", 1)[0].strip()


def store_server_state(watch: Watch, host: int | None, me: int) -> str | None:
    """``"gone"``, ``"stopped"`` or ``"running"`` for the process serving the job's store, or
    None when this host cannot tell (a store on another host, or of another kind).

    ``host`` is the global rank that hosts it (``store_host()``), ``me`` this rank: a store
    served by this very process runs whenever this code does.
    """
    if host is not None and host == me:
        return "running"
    beat = None if host is None else watch.last_beat(host)
    if beat is not None:
        return process_state(beat)
    tcp_store = tcp_store_behind(watch.origin)
    if tcp_store is None:
        return None
    key = (str(tcp_store.host), int(tcp_store.port))
    if key not in _local:
        _local[key] = _is_local(key[0])
    if not _local[key]:
        return None
    sockets = _listening(key[1])
    if not sockets:
        return "gone"  # nothing listens on the port of a store served here
    if _servers.get(key) is None:
        _servers[key] = _owner(sockets)
    pid = _servers[key]
    return None if pid is None else pid_state(pid)


def _is_local(host: str) -> bool:
    """Whether ``host`` names this machine (only names that need no lookup are tried)."""
    if host in ("localhost", socket.gethostname()):
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))  # succeeds only for an address of this machine
    except OSError:
        return False
    return True


def _listening(port: int) -> set[str]:
    """The sockets listening on ``port`` here, as ``/proc/<pid>/fd`` names them."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                listening = len(fields) > 9 and fields[3] == _LISTEN
                if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    sockets.add(f"socket:[{fields[9]}]")
    return sockets


def _owner(sockets: set[str]) -> int | None:
    """The PID of a process holding one of ``sockets`` (None when none can be read)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in sockets:
                        return int(entry.name)
    return None
