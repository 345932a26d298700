"""ddp_even's own CPU gloo group per training group: created once, shared, released with it.

The group is ddp_even's so that control messages never queue behind gradient buckets and never
touch a GPU stream. Its gloo timeout is the training group's own (at least the loader's
``timeout``), so an agreement started ahead of time survives any pause a rank makes between
steps that the training collectives survive.

Creating it is two waits for the other ranks, the meeting in the store and gloo's rendezvous,
both decided by liveness, not patience: a live rank is waited for up to the training group's
timeout, one that dies or freezes is named within the loader's ``timeout`` by every rank.

Lifetime: a gloo worker thread lets go of a collective's tensors only after the collective
has completed, and letting go of a tensor that Python also holds takes the GIL. A control
group is therefore released once its training group is destroyed, and at the latest at
interpreter exit, before finalization: a gloo thread that asks for the GIL then is ended by
CPython inside a C++ destructor, and the process aborts ("terminate called without an active
exception") after its work is done. See ``_release``.

Torch internals relied on (torch 2.13; each guarded, with a fallback where one exists;
``tests/test_clean_exit.py`` fails first if any of them changes):

* ``ProcessGroup._get_backend(device).options._timeout``: the training group's timeout
  (``process_group.training_timeout``; torch's default of 30 minutes when unreadable);
* ``distributed_c10d._world.pg_map``: whether torch still knows a group, i.e. it was not
  destroyed (:func:`_registered`; assumed alive when unreadable);
* ``distributed_c10d._get_default_store()``: the job's store, where ranks meet, beat and hold
  their roll calls (``heartbeat.default_store``);
* ``torch._C._distributed_c10d``'s ``PrefixStore`` and ``TCPStore`` (``heartbeat.py``: a prefix
  store's ``underlying_store``, a TCP store's ``host`` and ``port``), imported from where their
  type information is.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ddp_even.errors import EvenLoaderError
from ddp_even.liveness.heartbeat import own_lateness, start_heartbeat, waiting
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
    watch_from_now,
)
from ddp_even.liveness.rollcall import Ticket, finish_roll_calls
from ddp_even.process_group import group_is_up, training_timeout

logger = logging.getLogger("ddp_even")


class Channel:
    """One control group of this process: the group, the count of control collectives issued on
    it, and those not yet seen complete; shared by every loader on the group. The group is held
    here only (agreers reach it through the channel), so that ``_release`` can let it go while
    loaders are still alive."""

    def __init__(self, group: dist.ProcessGroup, training_group: Any = None) -> None:
        # None once released.
        self.group: dist.ProcessGroup | None = group
        # The group it serves (None for one made elsewhere): destroying it ends this one.
        self.training_group = training_group
        self.issued = 0
        self._previous = time.monotonic()
        self._running: list[Any] = []

    def ticket(self, what: str) -> Ticket:
        """The next control collective's ticket: its sequence number, and seconds since the
        previous one started."""
        now = time.monotonic()
        since_previous, self._previous = now - self._previous, now
        self.issued += 1
        return Ticket(self.issued, time.time(), what, since_previous)

    def track(self, work: Any) -> None:
        """Keep ``work`` until it is seen complete: ``_release`` needs to know it is."""
        # At most the one or two collectives of a window are running: a short list to scan.
        self._running = [running for running in self._running if not running.is_completed()]
        self._running.append(work)

    def busy(self) -> bool:
        """Whether a collective issued here is still running (a peer stalled past a deadline)."""
        return not all(work.is_completed() for work in self._running)


# By group name (what ``tests/helpers/scenarios.py`` counts collectives over).
_channels: dict[str, Channel] = {}


def channel_for(control_group: dist.ProcessGroup) -> Channel:
    channel = _channels.get(control_group.group_name)
    if channel is None or channel.group is not control_group:
        # A group made elsewhere, or a name reused after the world was made again.
        channel = _channels[control_group.group_name] = Channel(control_group)
    return channel


# By training group, gloo timeout and purpose (control messages, or batches handed over).
_control_groups: dict[tuple[Any, float, str], Channel] = {}
# Control groups created so far per training group: names each creation's rendezvous.
_creations: dict[Any, int] = {}
# Groups released while a collective was still running on them (see ``_release``).
_left_running: list[dist.ProcessGroup] = []
_release_at_exit_registered = False


def start_heartbeat_for(group: dist.ProcessGroup | None, timeout: float | None) -> None:
    """Say that this process lives (``heartbeat.py``), beating often enough for ``timeout``
    (None: the training group's timeout), from the first loader until exit."""
    if group_is_up() and dist.get_world_size(group) > 1:
        start_heartbeat(training_timeout(group) if timeout is None else timeout)
        watch_from_now()


def control_group_for(
    training_group: dist.ProcessGroup | None, timeout: float, purpose: str = "control"
) -> dist.ProcessGroup:
    """The gloo group ddp_even talks on for ``training_group``, created once and cached.

    Another ``purpose`` gets a group of its own, made and released the same way: batches
    handed over (``runtime/handover.py``) would hold up the control messages queued behind
    them on the same connection.

    Creating it is a collective over the training group's ranks, so every rank must reach this
    call; ``EvenLoader`` does so at the start of its first epoch. The ranks first meet in the
    store (:func:`meet_before_creating`), so that gloo's rendezvous (:func:`create`) runs only
    once every rank is there.
    """
    release_orphaned()
    group: Any = training_group if training_group is not None else dist.group.WORLD
    gloo_timeout = max(timeout, training_timeout(group))
    key = (group, gloo_timeout, purpose)
    channel = _control_groups.get(key)
    if channel is None or channel.group is None:
        ranks = dist.get_process_group_ranks(group)
        creation = _creations.get(group, 0)
        _creations[group] = creation + 1
        meeting = f"ddp_even/meet/{group.group_name}/{creation}/"
        meet_before_creating(meeting, ranks, timeout, gloo_timeout)
        control_group = create(meeting, ranks, timeout, gloo_timeout)
        channel = Channel(control_group, group)
        _control_groups[key] = _channels[control_group.group_name] = channel
        _register_release_at_exit()
        logger.debug("created a gloo %s group over ranks %s", purpose, ranks)
    assert channel.group is not None
    return channel.group


def release_orphaned(collecting: bool = False) -> None:
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
    """Release every control group of this process; runs at interpreter exit, before
    finalizing: the last moment gloo's worker threads can be joined safely."""
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


def _release(key: tuple[Any, float, str]) -> None:
    """Forget one control group, and join its gloo threads by dropping the last reference:
    torch's destructor runs with the GIL released, lets the queue run dry and joins them. A
    group with a collective still running (a peer stalled past a deadline) cannot be joined
    without waiting for that peer: it is kept until the process ends."""
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
    if group is None or not group_is_up():
        return False
    # Private, and the only place that says so for a group other than the world.
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return True if pg_map is None else group in pg_map


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
            rank for rank, key in zip(ranks, keys, strict=True) if not _all_there(watch, [key])
        ]
        states = {rank: BUSY if views[rank].beat is not None else UNSEEN for rank in absent}
        verdict = verdict_on(views, states, by=me, timeout=gloo_timeout, what=_MEETING)
        detail = (
            f"not within the training group's timeout ({gloo_timeout:g} s): {verdict.detail}. "
            f"Did they never start iterating an EvenLoader? {_ONE_LOOP}"
        )
        return dataclasses.replace(verdict, detail=detail)

    here = False
    with waiting():
        while True:
            # Said again until the store answers: its host may be frozen at this moment.
            here = here or _said(watch, f"{meeting}{me}", "here")
            if here and _all_there(watch, keys):
                return
            verdict = _read_or_find(board, why_not_all_here, began_wall, timeout, _MEETING)
            if verdict is not None:
                raise board.adopt(verdict, len(ranks))
            time.sleep(poll)


def _answered(watch: Watch, question: Callable[[Any], bool]) -> bool:
    """Whether the store answered ``question``, and with True."""
    try:
        return watch.ask(question)
    except Exception:  # the store did not answer: the next look says why
        return False


def _said(watch: Watch, key: str, value: str) -> bool:
    """Whether the store took ``value`` for ``key``."""

    def say(store: Any) -> bool:
        store.set(key, value)
        return True

    return _answered(watch, say)


def _all_there(watch: Watch, keys: list[str]) -> bool:
    """Whether the store answered that it holds every one of ``keys``."""
    return _answered(watch, lambda store: bool(store.check(keys)))


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
    if began_wall is not None and (late := own_lateness(began_wall, timeout, what)):
        raise late
    return None if verdict is None else board.publish(verdict)


def create(meeting: str, ranks: Sequence[int], timeout: float, gloo_timeout: float) -> Any:
    """``dist.new_group`` once every rank has met, in a thread of its own under the training
    group's timeout, while this thread reads the peers' heartbeats as any wait in ddp_even
    does; a live peer is waited for, and said so in the log after ``timeout``."""
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

    with waiting():
        while True:
            joined_at = time.monotonic()
            creator.join(poll)
            # This thread overslept by the timeout: this process stood still (SIGSTOP), seen
            # before its heartbeat thread has had the chance to say so.
            overslept = time.monotonic() - joined_at - poll
            if late := own_lateness(began_wall, timeout, _CREATING, overslept=overslept):
                raise late
            if not creator.is_alive():
                if failed:
                    error = failed[0]
                    raise _creation_failure(
                        board, look, len(ranks), timeout, gloo_timeout, error
                    ) from error
                said_done = said_done or _said(watch, f"{meeting}created/{me}", "created")
                if said_done and _all_there(watch, done_keys):
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
