"""Share mode's arithmetic: which batch every rank hands out at every step of a window, from
every rank's held batches and whether its shard ended, the same on every rank, so that every
rank decides the same without another message (docs/design.md, "When each mode stops", share).
Nothing here imports torch.

Example::

    >>> window = plan_window([3, 0], ended=[False, True], handed_out_before=True, window=2)
    >>> window.steps, window.last, window.slots[1]
    (1, False, (Slot(giver=0, index=1, padding=False),))
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Slot", "WindowPlan", "fill_targets", "handed_out_in", "plan_window", "planned_windows"]


@dataclass(frozen=True)
class Slot:
    """The batch a rank hands out at one step: the ``index``-th batch ``giver`` held when the
    window was planned (the rank itself, or a rank that sends it), or padding (weight 0)."""

    giver: int
    index: int
    padding: bool = False


@dataclass(frozen=True)
class WindowPlan:
    """A window of share: its steps, whether it ends the epoch, each rank's batch at each step
    (``slots[rank][step]``), and how many of each rank's held batches it uses: its oldest
    ``used[rank]``, every one the window hands out or sends (a padding donor's too)."""

    steps: int
    last: bool
    slots: tuple[tuple[Slot, ...], ...]
    used: tuple[int, ...]
    # Ranks whose last step is padding (the epoch's last window only).
    padded: int = 0

    def sends(self, giver: int) -> list[tuple[int, int, bool]]:
        """``(receiver, index, padding)`` for each batch ``giver`` sends, in the order the
        receiver takes them (a receiver takes a pair's batches in the order they are sent).

        Example::

            >>> plan_window([4, 0, 0], [True] * 3, False, window=4).sends(0)
            [(1, 2, False), (2, 3, False)]
        """
        return [
            (receiver, slot.index, slot.padding)
            for receiver, slots in enumerate(self.slots)
            for slot in slots
            if slot.giver == giver and receiver != giver
        ]

    def padding_weight(self, step: int) -> float:
        """The loss weight of a real batch at ``step``: ``W / real batches`` at a step with
        padding (so that the averaged gradient is the real batches' mean), 1 elsewhere.

        Example::

            >>> plan_window([3, 0], [True, True], False, window=4).padding_weight(1)
            2.0
        """
        if not self.padded or step != self.steps - 1:
            return 1.0
        return len(self.slots) / (len(self.slots) - self.padded)


def fill_targets(ended: Sequence[bool], window: int) -> list[int]:
    """How many batches each rank reads ahead for a window: ``window`` while every shard goes
    on; once some have ended, the ranks whose shard goes on share ``W * window`` between them.

    Example::

        >>> fill_targets([False, True, True, False], window=2)
        [4, 0, 0, 4]
    """
    going_on = sum(1 for done in ended if not done)
    share = math.ceil(len(ended) * window / going_on) if going_on else 0
    return [0 if done else max(window, share) for done in ended]


def plan_window(
    buffered: Sequence[int], ended: Sequence[bool], handed_out_before: bool, window: int
) -> WindowPlan:
    """The next window from every rank's held batches (``buffered``) and whether its shard
    ended; the same on every rank. ``handed_out_before``: the epoch has taken steps, so every
    rank has a batch of its own to copy as padding.

    A window of 0 steps happens while the ranks still reading have not yet read enough to
    feed every rank a step: the next window's :func:`fill_targets` read more.

    Example::

        >>> plan = plan_window([4, 1, 0], [True] * 3, handed_out_before=False, window=4)
        >>> plan.steps, plan.last, plan.used
        (2, True, (4, 1, 0))
        >>> for slots in plan.slots:
        ...     print([(slot.giver, slot.index, slot.padding) for slot in slots])
        [(0, 0, False), (0, 1, False)]
        [(1, 0, False), (0, 2, False)]
        [(0, 3, False), (2, -1, True)]
    """
    world_size, total = len(buffered), sum(buffered)
    everyone_ended = all(ended)
    steps = min(window, math.ceil(total / world_size) if everyone_ended else total // world_size)
    last = everyone_ended and steps * world_size >= total
    padded = world_size * steps - total if last else 0
    quotas = [steps] * world_size
    if padded:
        # The ranks that hold the fewest batches take the padding (ties: the highest ranks).
        by_fewest = sorted(range(world_size), key=lambda rank: (buffered[rank], -rank))
        for rank in by_fewest[:padded]:
            quotas[rank] = steps - 1
    own = [min(count, quota) for count, quota in zip(buffered, quotas, strict=True)]
    # The extra batches, oldest first, of each giver in rank order.
    extras = [
        (giver, index)
        for giver in range(world_size)
        for index in range(own[giver], buffered[giver])
    ]
    extras.reverse()
    slots: list[tuple[Slot, ...]] = []
    used = list(own)
    for rank in range(world_size):
        mine = [Slot(rank, index) for index in range(own[rank])]
        while len(mine) < quotas[rank]:
            giver, index = extras.pop()
            mine.append(Slot(giver, index))
            used[giver] += 1
        if quotas[rank] < steps:
            mine.append(_padding_for(rank, mine, handed_out_before, buffered))
        slots.append(tuple(mine))
    return WindowPlan(steps, last, tuple(slots), tuple(used), padded)


def _padding_for(
    rank: int, mine: list[Slot], handed_out_before: bool, buffered: Sequence[int]
) -> Slot:
    """The padding of a rank at the last step: a copy of the batch it handed out last
    (``index`` -1), or, when it never had one, of a batch the lowest rank holding one sends."""
    if mine or handed_out_before:
        return Slot(rank, -1, padding=True)
    donor = next(giver for giver, count in enumerate(buffered) if count)
    return Slot(donor, 0, padding=True)


def planned_windows(
    batches: Sequence[int], window: int, ends_known: bool
) -> Iterator[tuple[WindowPlan, list[deque[int]]]]:
    """The windows an epoch of share plans where rank ``r``'s shard yields ``batches[r]``
    batches, each with the indices in its shard of the batches every rank held when it was
    planned (valid until the next window is asked for: not copied, since the runtime asks for
    one a window): every rank reads as the runtime does (up to each window's
    :func:`fill_targets`) without reading. ``ends_known``: a shard ends with its last batch
    (its length is known), not when a read finds nothing more.

    Example::

        >>> [plan.steps for plan, _ in planned_windows([4, 1], window=1, ends_known=True)]
        [1, 1, 1]
        >>> [[list(mine) for mine in held] for _, held in planned_windows([4, 1], 1, False)][:2]
        [[[0], [0]], [[1], []]]
    """
    world_size = len(batches)
    read = [0] * world_size
    ended = [False] * world_size
    held: list[deque[int]] = [deque() for _ in range(world_size)]
    handed_out_before = False
    while True:
        for rank, target in enumerate(fill_targets(ended, window)):
            while len(held[rank]) < target and not ended[rank]:
                if read[rank] == batches[rank]:
                    ended[rank] = True
                else:
                    held[rank].append(read[rank])
                    read[rank] += 1
            ended[rank] = ended[rank] or (ends_known and read[rank] == batches[rank])
        plan = plan_window([len(mine) for mine in held], ended, handed_out_before, window)
        yield plan, held
        if plan.last:
            return
        for rank, used in enumerate(plan.used):
            for _ in range(used):
                held[rank].popleft()
        handed_out_before = handed_out_before or plan.steps > 0


def handed_out_in(
    batches: Sequence[int], window: int, steps: int, ends_known: bool
) -> list[list[int]]:
    """Which batches of each rank's shard (their indices in it, sorted) an epoch of share hands
    out, not as padding, in its first ``steps`` steps (:func:`planned_windows`).

    Example::

        >>> handed_out_in([4, 1], window=1, steps=2, ends_known=False)
        [[0, 1, 2], [0]]
    """
    handed: list[list[int]] = [[] for _ in batches]
    planned = 0
    for plan, held in planned_windows(batches, window, ends_known):
        if planned >= steps:
            break
        for slots in plan.slots:
            for slot in slots[: steps - planned]:
                if not slot.padding:
                    handed[slot.giver].append(held[slot.giver][slot.index])
        planned += plan.steps
    return [sorted(mine) for mine in handed]
