"""ddp_even's own CPU gloo group per training group: created once, shared, released with it.

The group is ddp_even's so that control messages never queue behind gradient buckets and never
touch a GPU stream. Its gloo timeout is the training group's own (at least the loader's
``timeout``), so an agreement started ahead of time survives any pause a rank makes between
steps that the training collectives survive.

Lifetime: a gloo worker thread lets go of a collective's tensors only after the collective
has completed, and letting go of a tensor that Python also holds takes the GIL. A control
group is therefore released (its gloo threads joined, with the GIL free for them) once its
training group is destroyed, and at the latest when the interpreter exits, before it
finalizes: a gloo thread that asks for the GIL during finalization is ended by CPython inside
a C++ destructor, and the whole process aborts ("terminate called without an active
exception") after its work is done. See ``_release``.

Torch internals relied on (torch 2.13; each guarded, with a fallback where one exists):

* ``ProcessGroup._get_backend(device).options._timeout``: the training group's timeout
  (:func:`training_timeout`; torch's default of 30 minutes when unreadable);
* ``distributed_c10d._world.pg_map``: whether torch still knows a group, i.e. it was not
  destroyed (:func:`_registered`; assumed alive when unreadable);
* ``distributed_c10d._get_default_store()``: the job's store, where ranks meet before the
  group is created (:func:`_meet_before_creating`), write their heartbeats
  (``heartbeat.default_store``) and hold their roll calls (``rollcall.py``);
* ``ProcessGroup._get_backend(device)._set_default_timeout``: the group is created with a
  short timeout of ddp_even's own, then given the training group's (:func:`_create`; created
  with the training group's timeout when ``_set_default_timeout`` is missing);
* ``torch._C._distributed_c10d``'s ``ProcessGroupGloo`` (here), ``PrefixStore`` and
  ``TCPStore`` (``liveness/heartbeat.py``: a prefix store's ``underlying_store``, a TCP
  store's ``host`` and ``port``): the classes ``torch.distributed`` re-exports, imported from
  where their type information is.

``tests/test_clean_exit.py`` fails first if any of them changes.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from ddp_even.errors import EvenLoaderError
from ddp_even.liveness.heartbeat import start_heartbeat, waiting
from ddp_even.liveness.peers import (
    BUSY,
    UNSEEN,
    Watch,
    current_watch,
    lost_peers,
    poll_interval,
    watch_from_now,
)
from ddp_even.liveness.rollcall import finish_roll_calls
from ddp_even.liveness.verdict import Board, Verdict, store_silence, verdict_on
from ddp_even.process_group import group_is_up

__all__ = ["Channel", "channel_for", "control_group_for", "release_orphaned", "training_timeout"]

logger = logging.getLogger("ddp_even")

# The gloo timeout of a control group when the training group's cannot be read: torch's
# default for process groups.
_DEFAULT_TRAINING_TIMEOUT_S = 30 * 60.0


class Channel:
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
_channels: dict[str, Channel] = {}


def channel_for(control_group: dist.ProcessGroup) -> Channel:
    channel = _channels.get(control_group.group_name)
    if channel is None or channel.group is not control_group:
        # A group made elsewhere, or a name reused after the world was made again.
        channel = _channels[control_group.group_name] = Channel(control_group)
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


_control_groups: dict[tuple[Any, float], Channel] = {}
# Control groups created so far per training group: names each creation's rendezvous.
_creations: dict[Any, int] = {}
_RENDEZVOUS_POLL_S = 0.05
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
    training_group: dist.ProcessGroup | None, timeout: float
) -> dist.ProcessGroup:
    """The gloo group ddp_even talks on for ``training_group``, created once and cached.

    Creating it is a collective over the training group's ranks, so every rank must reach this
    call; ``EvenLoader`` does so at the start of its first epoch. The ranks first meet in the
    store (:func:`_meet_before_creating`), where a rank that comes late is waited for while it
    lives, so that gloo's rendezvous runs only once every rank is there, under a deadline of
    ddp_even's own (:func:`_create`).
    """
    release_orphaned()
    group: Any = training_group if training_group is not None else dist.group.WORLD
    gloo_timeout = max(timeout, training_timeout(group))
    key = (group, gloo_timeout)
    channel = _control_groups.get(key)
    if channel is None or channel.group is None:
        ranks = dist.get_process_group_ranks(group)
        creation = _creations.get(group, 0)
        _creations[group] = creation + 1
        meeting = f"ddp_even/meet/{group.group_name}/{creation}/"
        _meet_before_creating(meeting, ranks, timeout, gloo_timeout)
        control_group = _create(meeting, ranks, timeout, gloo_timeout)
        channel = Channel(control_group, group)
        _control_groups[key] = _channels[control_group.group_name] = channel
        _register_release_at_exit()
        logger.debug("created a gloo control group over ranks %s", ranks)
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
# The shortest deadline of gloo's rendezvous once every rank has met (connecting a few sockets).
_CREATION_MIN_S = 5.0


def _meet_before_creating(
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
    began = time.monotonic()

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
            verdict = board.read()
            if verdict is None:
                verdict = _why_not_all_here(
                    watch, keys, ranks, others, began, timeout, gloo_timeout
                )
                if verdict is not None:
                    verdict = board.publish(verdict)
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


def _why_not_all_here(
    watch: Watch,
    keys: list[str],
    ranks: Sequence[int],
    others: list[int],
    began: float,
    timeout: float,
    gloo_timeout: float,
) -> Verdict | None:
    me = dist.get_rank()
    views = watch.look(others)
    if views is None:
        return store_silence(watch, by=me, timeout=timeout, what=_MEETING)
    lost = lost_peers(views, timeout)
    if lost:
        return verdict_on(views, lost, by=me, timeout=timeout, what=_MEETING)
    if time.monotonic() - began < gloo_timeout:
        return None
    absent = [
        rank
        for rank, key in zip(ranks, keys, strict=True)
        if not _answered(watch, functools.partial(_holds, key=key))
    ]
    states = {rank: BUSY if views[rank].beat is not None else UNSEEN for rank in absent}
    verdict = verdict_on(views, states, by=me, timeout=gloo_timeout, what=_MEETING)
    return Verdict(
        me,
        verdict.missing,
        verdict.states,
        gloo_timeout,
        _MEETING,
        f"not within the training group's timeout ({gloo_timeout:g} s): {verdict.detail}. "
        f"Did they never start iterating an EvenLoader? {_ONE_LOOP}",
    )


def _create(meeting: str, ranks: Sequence[int], timeout: float, gloo_timeout: float) -> Any:
    """``dist.new_group`` once every rank has met, under ddp_even's deadline, not gloo's.

    Gloo's rendezvous waits for every rank for the group's timeout. Every rank is known to be
    here, so the group is created with a short one (``timeout``, at least
    :data:`_CREATION_MIN_S`), which only a rank lost in between can outlast, and is then given
    the training group's, which its collectives need to wait for a live peer.
    """
    settable = hasattr(ProcessGroupGloo, "_set_default_timeout")
    creating = max(timeout, _CREATION_MIN_S) if settable else gloo_timeout
    try:
        group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=creating),
            use_local_synchronization=True,
        )
    except Exception as error:  # gloo's raw error: which rank was lost?
        raise _creation_failure(meeting, ranks, timeout, creating, error) from error
    if settable:
        backend = group._get_backend(torch.device("cpu"))
        backend._set_default_timeout(datetime.timedelta(seconds=gloo_timeout))
    return group


def _creation_failure(
    meeting: str, ranks: Sequence[int], timeout: float, creating: float, error: Exception
) -> EvenLoaderError:
    """ddp_even's error for a failed gloo rendezvous: the ranks lost since the meeting."""
    me = dist.get_rank()
    watch = current_watch()
    board = Board(watch, meeting, me, hosts_store=me == 0)
    others = [rank for rank in ranks if rank != me]
    words = f"gloo: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    what = "the creation of ddp_even's group, after every rank had met"
    # Their silence counts from when this rank first saw it: watch for up to ``timeout``.
    deadline = time.monotonic() + timeout + 1.0
    while time.monotonic() < deadline:
        verdict = board.read()
        if verdict is None:
            views = watch.look(others)
            lost = {} if views is None else lost_peers(views, timeout)
            if views is not None and lost:
                verdict = board.publish(verdict_on(views, lost, by=me, timeout=timeout, what=what))
            elif views is None:
                verdict = store_silence(watch, by=me, timeout=timeout, what=what)
        if verdict is not None:
            return board.adopt(verdict, len(ranks))
        time.sleep(poll_interval(timeout, len(ranks)))
    return EvenLoaderError(
        f"ddp_even could not create its gloo group within {creating:g} s although every rank "
        f"had met and none is known to be lost since ({words})"
    )
