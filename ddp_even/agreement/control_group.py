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
  (``process_group.training_timeout``; torch's default of 30 minutes when unreadable);
* ``distributed_c10d._world.pg_map``: whether torch still knows a group, i.e. it was not
  destroyed (:func:`_registered`; assumed alive when unreadable);
* ``distributed_c10d._get_default_store()``: the job's store, where ranks meet before the
  group is created (``creation.meet_before_creating``), write their heartbeats
  (``heartbeat.default_store``) and hold their roll calls (``rollcall.py``);
* ``torch._C._distributed_c10d``'s ``PrefixStore`` and ``TCPStore``
  (``liveness/heartbeat.py``: a prefix store's ``underlying_store``, a TCP store's ``host``
  and ``port``): the classes ``torch.distributed`` re-exports, imported from where their type
  information is.

The group is created (gloo's rendezvous, ``dist.new_group``) in a thread of its own, under the
training group's timeout, while the calling thread watches the peers' heartbeats
(``creation.create``): nothing but a lost peer ends it sooner.

``tests/test_clean_exit.py`` fails first if any of them changes.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from typing import Any

import torch.distributed as dist

from ddp_even.agreement.creation import create, meet_before_creating
from ddp_even.liveness.heartbeat import start_heartbeat
from ddp_even.liveness.peers import (
    watch_from_now,
)
from ddp_even.liveness.rollcall import Ticket, finish_roll_calls
from ddp_even.process_group import group_is_up, training_timeout

__all__ = ["Channel", "channel_for", "control_group_for", "release_orphaned", "training_timeout"]

logger = logging.getLogger("ddp_even")


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
    training_group: dist.ProcessGroup | None, timeout: float, purpose: str = "control"
) -> dist.ProcessGroup:
    """The gloo group ddp_even talks on for ``training_group``, created once and cached.

    Another ``purpose`` gets a group of its own, made and released the same way: batches
    handed over (``runtime/handover.py``) would hold up the control messages queued behind
    them on the same connection.

    Creating it is a collective over the training group's ranks, so every rank must reach this
    call; ``EvenLoader`` does so at the start of its first epoch. The ranks first meet in the
    store (``creation.meet_before_creating``), where a rank that comes late is waited for while it
    lives, so that gloo's rendezvous runs only once every rank is there, waited for while
    every rank lives (``creation.create``).
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


def _release(key: tuple[Any, float, str]) -> None:
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
