"""The creation of ddp_even's control group: the ranks meet in the store, then gloo's rendezvous.

Both are waits for the other ranks, and both are decided by liveness, not patience: a rank
that is absent, or slow to connect, is waited for while its heartbeat (or, on this host, its
process) says it lives, up to the training group's timeout; one that dies or freezes is named
within the loader's ``timeout`` by every rank (``liveness/``). ``control_group.py`` caches
what this makes.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ddp_even.errors import EvenLoaderError, PeerTimeoutError
from ddp_even.liveness.heartbeat import stood_still_since, waiting
from ddp_even.liveness.peers import (
    BUSY,
    UNSEEN,
    Board,
    PeerView,
    Verdict,
    Watch,
    current_watch,
    lost_peers,
    poll_interval,
    verdict_on,
)

__all__ = ["create", "meet_before_creating"]

logger = logging.getLogger("ddp_even")


# What the ranks meet for, in the words of an error.
_MEETING = "ddp_even's first meeting (each rank's first epoch, before ddp_even's group exists)"
_ONE_LOOP = (
    "every rank of the training group must iterate the loader at the same point; to loop on "
    "some ranks only (evaluation on rank 0), iterate the underlying loader there"
)
_CREATING = "the creation of ddp_even's group, after every rank had met"
# The thread that runs gloo's rendezvous (:func:`create`).
_CREATOR = "ddp-even-create-group"


def meet_before_creating(
    meeting: str, ranks: Sequence[int], timeout: float, gloo_timeout: float
) -> None:
    """Wait in the store until every rank is here, for as long as the absent ones live.

    A peer that shows no sign of life for ``timeout`` (or exited) is named at once; a live one,
    or one with no heartbeat yet (it has not made its ``EvenLoader``: a long set-up), is waited
    for up to the training group's timeout, as DDP's first all-reduce would wait for it.
    """
    me = dist.get_rank()
    watch = current_watch()
    board = Board(watch, meeting, me, hosts_store=me == 0)
    keys = [f"{meeting}{rank}" for rank in ranks]
    others = [rank for rank in ranks if rank != me]
    poll = poll_interval(timeout, len(ranks))
    began, began_wall = time.monotonic(), time.time()

    def why_not_all_here() -> Verdict | None:
        verdict, views = _look_for_lost(watch, others, me, timeout, gloo_timeout, _MEETING)
        if views is None or verdict is not None or time.monotonic() - began < gloo_timeout:
            return verdict
        absent = [
            rank
            for rank, key in zip(ranks, keys, strict=True)
            if not _answered(watch, functools.partial(_holds, key=key))
        ]
        states = {rank: BUSY if views[rank].beat is not None else UNSEEN for rank in absent}
        verdict = verdict_on(views, states, by=me, timeout=gloo_timeout, what=_MEETING)
        detail = (
            f"not within the training group's timeout ({gloo_timeout:g} s): {verdict.detail}. "
            f"Did they never start iterating an EvenLoader? {_ONE_LOOP}"
        )
        return dataclasses.replace(verdict, detail=detail)

    def say_here(store: Any) -> bool:
        store.set(f"{meeting}{me}", "here")
        return True

    here = False
    with waiting():
        while True:
            # Said again until the store answers: its host may be frozen at this moment.
            here = here or _answered(watch, say_here)
            if here and _answered(watch, lambda store: bool(store.check(keys))):
                return
            verdict = _read_or_find(board, why_not_all_here, began_wall, timeout, _MEETING)
            if verdict is not None:
                raise board.adopt(verdict, len(ranks))
            time.sleep(poll)


def _holds(store: Any, key: str) -> bool:
    return bool(store.check([key]))


def _answered(watch: Watch, question: Callable[[Any], bool]) -> bool:
    """Whether the store answered ``question``, and with True."""
    try:
        return watch.ask(question)
    except Exception:  # the store did not answer: the next look says why
        return False


def _look_for_lost(
    watch: Watch, others: list[int], me: int, timeout: float, gloo_timeout: float, what: str
) -> tuple[Verdict | None, dict[int, PeerView] | None]:
    """The verdict on the peers lost now, or on a store silent past ``timeout`` whose host is
    lost (a busy one is waited for up to ``gloo_timeout``); and the views it came from."""
    views = watch.look(others)
    if views is None:
        from ddp_even.liveness.verdict import store_silence

        verdict = store_silence(watch, by=me, timeout=timeout, what=what, patience=gloo_timeout)
        return verdict, None
    lost = lost_peers(views, timeout)
    return (verdict_on(views, lost, by=me, timeout=timeout, what=what) if lost else None), views


def _read_or_find(
    board: Board,
    find: Callable[[], Verdict | None],
    began_wall: float | None,
    timeout: float,
    what: str,
) -> Verdict | None:
    """Another rank's verdict, or this rank's own found by ``find()`` and published; first
    raising this rank's own lateness when it stood still since ``began_wall`` (after the look:
    a process frozen during it finds out before it judges)."""
    verdict = board.read()
    if verdict is not None:
        return verdict
    verdict = find()
    if began_wall is not None:
        late_here(began_wall, timeout, what)
    return None if verdict is None else board.publish(verdict)


def create(meeting: str, ranks: Sequence[int], timeout: float, gloo_timeout: float) -> Any:
    """``dist.new_group`` once every rank has met, waited for while every rank lives.

    Gloo's rendezvous connects every pair of ranks (W(W - 1)/2 connections): seconds for 64
    processes sharing 2 cores, and no sign of any peer's death. It runs in a thread of its own
    under the training group's timeout, the one deadline for a live peer, while this thread
    reads the peers' heartbeats as any wait in ddp_even does: a peer that dies or freezes
    meanwhile is named within ``timeout`` (and the creating thread left to gloo's timeout or
    the process's exit), a live one is waited for, and said so in the log after ``timeout``.
    """
    created: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            created.append(
                dist.new_group(
                    ranks=ranks,
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=gloo_timeout),
                    use_local_synchronization=True,
                )
            )
        except BaseException as error:  # raised by the waiting thread, with ddp_even's words
            failed.append(error)

    # Taken before the thread starts: a process frozen from then on stood still in creation.
    began, began_wall = time.monotonic(), time.time()
    creator = threading.Thread(target=run, name=_CREATOR, daemon=True)
    creator.start()
    me = dist.get_rank()
    watch = current_watch()
    board = Board(watch, meeting, me, hosts_store=me == 0)
    others = [rank for rank in ranks if rank != me]
    poll = poll_interval(timeout, len(ranks))
    # Each rank says when its group is made, and leaves only once every rank's is: until then
    # a verdict is on this meeting's board, where every rank reads it.
    done_keys = [f"{meeting}created/{rank}" for rank in ranks]
    said_done = said_slow = False

    def look() -> Verdict | None:
        return _look_for_lost(watch, others, me, timeout, gloo_timeout, _CREATING)[0]

    def say_done(store: Any) -> bool:
        store.set(f"{meeting}created/{me}", "created")
        return True

    with waiting():
        while True:
            joined_at = time.monotonic()
            creator.join(poll)
            # This thread overslept by the timeout: this process stood still (SIGSTOP), seen
            # before its heartbeat thread has had the chance to say so.
            late_here(began_wall, timeout, _CREATING, time.monotonic() - joined_at - poll)
            if not creator.is_alive():
                if failed:
                    error = failed[0]
                    raise _creation_failure(
                        board, look, len(ranks), timeout, gloo_timeout, error
                    ) from error
                said_done = said_done or _answered(watch, say_done)
                if said_done and _answered(watch, lambda store: bool(store.check(done_keys))):
                    break
                time.sleep(poll)
            verdict = _read_or_find(board, look, began_wall, timeout, _CREATING)
            if verdict is not None:
                logger.debug("gave up creating ddp_even's group: %s", verdict)
                raise board.adopt(verdict, len(ranks))
            if not said_slow and time.monotonic() - began >= timeout:
                said_slow = True
                logger.info(
                    "creating ddp_even's gloo group over %d ranks has taken %.1f s, every rank "
                    "alive: waiting for it (up to the training group's timeout, %g s)",
                    len(ranks),
                    time.monotonic() - began,
                    gloo_timeout,
                )
    logger.debug("ddp_even's group created in %.2f s", time.monotonic() - began)
    return created[0]


def late_here(since: float, timeout: float, what: str, overslept: float = 0.0) -> None:
    """Raise ``PeerTimeoutError(late=True)`` naming this rank when its own process stood still
    for ``timeout`` or more since ``since`` (a ``time.time()``; or the caller's own wait
    ``overslept`` that long): the others gave up on it, and the store that would tell it so
    may have left with them."""
    seconds = max(stood_still_since(since), overslept)
    if seconds >= timeout:
        me = dist.get_rank()
        detail = (
            f"this rank's process stood still for {seconds:.1f} s (SIGSTOP, a debugger, or its "
            "main thread holding the GIL), longer than the timeout"
        )
        raise PeerTimeoutError((me,), timeout, detail, rank=me, late=True, what=what)


def _creation_failure(
    board: Board,
    look: Callable[[], Verdict | None],
    group_size: int,
    timeout: float,
    gloo_timeout: float,
    error: BaseException,
) -> EvenLoaderError:
    """ddp_even's error for a failed gloo rendezvous: the ranks lost since the meeting."""
    words = f"gloo: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    # Their silence counts from when this rank first saw it: watch for up to ``timeout``.
    deadline = time.monotonic() + timeout + 1.0
    while time.monotonic() < deadline:
        verdict = _read_or_find(board, look, None, timeout, _CREATING)
        if verdict is not None:
            return board.adopt(verdict, group_size)
        time.sleep(poll_interval(timeout, group_size))
    return EvenLoaderError(
        f"ddp_even could not create its gloo group within {gloo_timeout:g} s although every rank "
        f"had met and none is known to be lost since ({words})"
    )
