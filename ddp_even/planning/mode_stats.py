"""What one mode does to every rank in one epoch of a plan: :class:`ModeStats`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModeStats"]


@dataclass(frozen=True)
class ModeStats:
    """One mode's epoch for every rank: steps, and what each rank drops, repeats, pads or waits.

    Per-rank fields are tuples indexed by rank. ``waste_percent`` is, per mode: rows dropped
    (truncate) or rows repeated (cycle) as a share of all rows, and for pad and join the share
    of rank-steps spent on padding or waiting.

    Example:
        >>> from ddp_even.planning import plan_shards
        >>> stats = plan_shards([30, 10], world_size=2, batch_size=10).stats("truncate")
        >>> stats.steps, stats.dropped_batches, stats.dropped_rows
        (1, (2, 0), (20, 0))
    """

    #: The mode's name (a key of :data:`ddp_even.modes.MODES`).
    mode: str
    #: Steps every rank takes in one epoch.
    steps: int
    #: Batches (and their rows) a rank never yields in the epoch (truncate).
    dropped_batches: tuple[int, ...]
    dropped_rows: tuple[int, ...]
    #: Batches (and their rows) a rank yields a second time or more (cycle).
    repeated_batches: tuple[int, ...]
    repeated_rows: tuple[int, ...]
    #: Steps a rank spends joined, with no batch of its own (join).
    idle_steps: tuple[int, ...]
    #: Padding batches (and their rows) a rank hands out past its data (pad).
    padded_batches: tuple[int, ...]
    padded_rows: tuple[int, ...]
    #: Share wasted, in percent (see the class docstring).
    waste_percent: float
    #: False when the mode cannot run this epoch; ``note`` says why.
    runnable: bool
    #: One sentence on what happens, for people.
    note: str

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
            "dropped_batches": list(self.dropped_batches),
            "dropped_rows": list(self.dropped_rows),
            "repeated_batches": list(self.repeated_batches),
            "repeated_rows": list(self.repeated_rows),
            "idle_steps": list(self.idle_steps),
            "padded_batches": list(self.padded_batches),
            "padded_rows": list(self.padded_rows),
        }
