"""What one mode's epoch over known shards does on each rank: :class:`ModeStats`, as
:meth:`ddp_even.modes.Mode.epoch_outcome` works it out and ``ddp-even plan`` prints it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["ModeStats"]


@dataclass(frozen=True)
class ModeStats:
    """One mode's epoch over known shards: steps, and what each rank drops, repeats, pads or
    waits (tuples indexed by rank; zeros where the mode does none of it).

    ``waste_percent`` is, per mode: rows dropped (truncate) or batches repeated (cycle) as a
    share of the epoch's own, and for pad and join the share of rank-steps spent on padding or
    waiting. ``runnable`` and ``note`` say, for people, whether and how the epoch runs
    (:meth:`ddp_even.planning.ShardPlan.stats` fills them from the plan).

    Example:
        >>> from ddp_even.planning import plan_shards
        >>> stats = plan_shards([30, 10], world_size=2, batch_size=10).stats("truncate")
        >>> stats.steps, stats.dropped_batches, stats.dropped_rows
        (1, (2, 0), (20, 0))
    """

    mode: str
    steps: int
    waste_percent: float
    dropped_batches: tuple[int, ...]
    dropped_rows: tuple[int, ...]
    repeated_batches: tuple[int, ...]
    repeated_rows: tuple[int, ...]
    idle_steps: tuple[int, ...]
    padded_batches: tuple[int, ...]
    padded_rows: tuple[int, ...]
    sent_batches: tuple[int, ...]
    received_batches: tuple[int, ...]
    runnable: bool = True
    note: str = ""

    @classmethod
    def of(
        cls, mode: str, steps: int, waste: float, whole: int, **per_rank: npt.NDArray[np.int64]
    ) -> ModeStats:
        """``mode``'s epoch wasting ``waste`` of ``whole``, with the per-rank arrays given."""
        zeros = np.zeros(len(next(iter(per_rank.values()))), np.int64)
        counted: dict[str, Any] = {
            name: tuple(int(value) for value in per_rank.get(name, zeros)) for name in _PER_RANK
        }
        return cls(mode, steps, round(100.0 * waste / max(whole, 1), 3), **counted)

    @property
    def total_dropped_rows(self) -> int:
        """Rows no rank yields this epoch.

        Example:
            >>> from ddp_even.planning import plan_shards
            >>> plan = plan_shards([30, 10], world_size=2, batch_size=10)
            >>> plan.stats("truncate").total_dropped_rows
            20
        """
        return sum(self.dropped_rows)

    @property
    def total_repeated_rows(self) -> int:
        """Rows yielded more than once this epoch.

        Example:
            >>> from ddp_even.planning import plan_shards
            >>> plan = plan_shards([30, 10], world_size=2, batch_size=10)
            >>> plan.stats("cycle").total_repeated_rows
            20
        """
        return sum(self.repeated_rows)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), as ``ddp-even plan --json`` prints it."""
        return {
            "steps": self.steps,
            "runnable": self.runnable,
            "note": self.note,
            "waste_percent": self.waste_percent,
            **{name: list(getattr(self, name)) for name in _PER_RANK},
        }


_PER_RANK = (
    "dropped_batches",
    "dropped_rows",
    "repeated_batches",
    "repeated_rows",
    "idle_steps",
    "padded_batches",
    "padded_rows",
    "sent_batches",
    "received_batches",
)
