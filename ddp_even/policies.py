"""The three modes, and the one function that decides how many steps every rank takes next."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ddp_even.protocol import Agreement


class Mode(str, enum.Enum):
    """What happens to uneven shards.

    * ``TRUNCATE``: every rank stops at the step where the shortest shard ends.
    * ``CYCLE``: short shards start again until the longest ends (or for exactly
      ``steps_per_epoch`` steps).
    * ``JOIN``: every rank yields all its batches; ranks that finish early shadow the
      others' collectives through :class:`torch.distributed.algorithms.join.Join`.
    """

    TRUNCATE = "truncate"
    CYCLE = "cycle"
    JOIN = "join"

    @classmethod
    def parse(cls, mode: str | Mode) -> Mode:
        try:
            return cls(mode)
        except ValueError:
            choices = ", ".join(repr(member.value) for member in cls)
            raise ValueError(f"unknown mode {mode!r}: choose one of {choices}") from None

    @property
    def restarts_short_shards(self) -> bool:
        return self is Mode.CYCLE


@dataclass(frozen=True)
class WindowDecision:
    """How many batches every rank hands out now, and whether the epoch ends after them."""

    steps: int
    last: bool


def decide_window(
    mode: Mode,
    agreement: Agreement,
    window: int | None,
    steps_done: int,
    steps_per_epoch: int | None,
) -> WindowDecision:
    """Stop or go on: the single place where a mode turns the agreement into steps.

    ``window`` is how many batches each rank offered at most (``None`` when every rank offered
    its whole epoch from a known length). Every rank calls this with the same arguments, so
    every rank takes the same decision.
    """
    if mode is Mode.CYCLE:
        steps = agreement.max_own_available if steps_per_epoch is None else (window or 0)
    else:
        # Join shares no step count across ranks (Join shadows instead); with a single
        # rank it coincides with truncate, which is the only time it comes here.
        steps = agreement.min_available
    if window is not None:
        steps = min(steps, window)
    if steps_per_epoch is not None:
        steps = min(steps, steps_per_epoch - steps_done)
    reached_cap = steps_per_epoch is not None and steps_done + steps >= steps_per_epoch
    last = window is None or steps < window or reached_cap
    return WindowDecision(steps=steps, last=last)
