"""The modes, one class each in :data:`MODES`: a mode's argument checks (``check``), its two
choices past a rank's own data (``after_own_data``, ``shares_steps``: the runtime asks these,
never which mode it is), ``decide`` (stop or go on, pure and the same on every rank) and its
plan arithmetic (``steps_per_rank``, ``epoch_outcome``). Adding a mode is one class here (and
its tests). Nothing here imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from ddp_even.agreement.wire import Agreement
from ddp_even.mode_stats import ModeStats

__all__ = ["MODES", "AfterOwnData", "Mode", "ModeStats", "WindowDecision", "mode_named"]

#: What a rank hands out once its own data ran out, while the epoch goes on: nothing more
#: (``"stop"``), batches of a fresh pass over its shard (``"restart"``), its last batch
#: again, flagged as padding of weight 0 (``"pad"``), or batches other ranks hand it
#: (``"share"``).
AfterOwnData = Literal["stop", "restart", "pad", "share"]


@dataclass(frozen=True)
class WindowDecision:
    """How many batches every rank hands out now, and whether the epoch ends after them."""

    steps: int
    last: bool


class Mode(ABC):
    """One way of making uneven shards take equal steps (see :data:`MODES`)."""

    name: ClassVar[str]
    #: What happens, in one sentence (tables and docs).
    summary: ClassVar[str]
    #: What a rank hands out once its own data ran out while the epoch goes on.
    after_own_data: ClassVar[AfterOwnData] = "stop"
    #: Every rank takes the epoch's steps; False: each rank hands out all its own batches and
    #: the ranks that run out shadow the others' collectives (torch ``Join``).
    shares_steps: ClassVar[bool] = True
    #: What ``waste_percent`` measures.
    waste_means: ClassVar[str]

    @property
    def goes_past_own_data(self) -> bool:
        """Whether a rank hands out batches past its own data (repeats or padding), which
        need a batch of its own to copy (one it reads again when an epoch resumes)."""
        return self.after_own_data != "stop"

    @property
    def hands_over(self) -> bool:
        """Whether ranks past their data hand out batches the others send them (share): the
        epoch then agrees window by window, every rank's counts beside each agreement."""
        return self.after_own_data == "share"

    @property
    def weighs_batches(self) -> bool:
        """Whether each batch's loss weight needs every rank's real rows at its step (padding
        weighs 0, so the real rows' mean loss needs them): a plan, or a sum per step."""
        return self.after_own_data == "pad"

    def needs_a_batch(self, has_padding: bool) -> bool:
        """Whether a rank whose shard has no batch at all is a problem the ranks must settle
        before the first step: one that restarts has nothing to repeat (cycle), one that pads
        nothing to pad with unless a peer gave it a batch (``has_padding``)."""
        return self.after_own_data == "restart" or (
            self.after_own_data == "pad" and not has_padding
        )

    def fixes_steps(self, steps_per_epoch: int | None) -> bool:
        """Whether every rank takes exactly ``steps_per_epoch`` steps of real batches (restarting
        its shard past its own data), so that the epoch needs no agreement on lengths. Pad fills
        them too, but its weights need every rank's real rows at each step."""
        return steps_per_epoch is not None and self.after_own_data == "restart"

    def check(self, *, steps_per_epoch: int | None, has_joinables: bool) -> None:
        """Raise ``ValueError`` for arguments this mode cannot honour."""
        if has_joinables:
            raise ValueError(f"joinables are only used in join mode, not in {self.name!r}")

    def agreed_steps(
        self, agreement: Agreement, window: int | None, steps_per_epoch: int | None
    ) -> int:
        """Steps every rank may take from what every rank offered, before the caps: where the
        shortest shard ends for a mode that stops with its data (join decides here only with a
        single rank, where it is truncate); otherwise every rank fills its window (repeats,
        padding), so the most own batches any rank has decide, unless ``steps_per_epoch`` fixes
        the count."""
        if self.after_own_data == "stop":
            return agreement.min_available
        if steps_per_epoch is not None:
            # The step count is fixed; a window of None here means the whole epoch.
            return window if window is not None else steps_per_epoch
        return agreement.max_own_available

    def decide(
        self,
        agreement: Agreement,
        window: int | None,
        steps_done: int,
        steps_per_epoch: int | None,
    ) -> WindowDecision:
        """Stop or go on: how many steps every rank takes next, and whether the epoch ends.

        ``window`` is the most batches each rank offered (``None`` when every rank offered its
        whole epoch from a known length). Every rank calls this with the same arguments.

        Example::

            >>> from ddp_even.agreement.wire import Agreement
            >>> offered = Agreement(min_available=2, max_own_available=3, has_problem=False)
            >>> MODES["truncate"].decide(offered, window=3, steps_done=0, steps_per_epoch=None)
            WindowDecision(steps=2, last=True)
            >>> MODES["cycle"].decide(offered, window=3, steps_done=0, steps_per_epoch=None)
            WindowDecision(steps=3, last=False)
        """
        steps = self.agreed_steps(agreement, window, steps_per_epoch)
        if window is not None:
            steps = min(steps, window)
        if steps_per_epoch is not None:
            steps = min(steps, steps_per_epoch - steps_done)
        reached_cap = steps_per_epoch is not None and steps_done + steps >= steps_per_epoch
        last = window is None or steps < window or reached_cap
        return WindowDecision(steps=steps, last=last)

    def steps_per_rank(
        self, batches_per_rank: Sequence[int], steps_per_epoch: int | None = None
    ) -> tuple[int, ...]:
        """Each rank's steps in an epoch when every rank's batch count is known.

        Example::

            >>> MODES["truncate"].steps_per_rank([7, 4]), MODES["join"].steps_per_rank([7, 4])
            ((4, 4), (7, 4))
        """
        everyone = Agreement(
            min_available=min(batches_per_rank),
            max_own_available=max(batches_per_rank),
            has_problem=False,
        )
        steps = self.decide(everyone, steps_per_epoch, 0, steps_per_epoch).steps
        return (steps,) * len(batches_per_rank)

    @abstractmethod
    def epoch_outcome(
        self, rows: npt.NDArray[np.int64], batches: npt.NDArray[np.int64], batch_size: int
    ) -> ModeStats:
        """The epoch over shards of ``rows`` rows in ``batches`` batches (one per rank)."""

    @abstractmethod
    def note_with_empty_ranks(self, empty_ranks: str, steps: int) -> tuple[bool, str]:
        """``(runnable, note)`` when the ranks named in ``empty_ranks`` have no batch."""


class Truncate(Mode):
    """Every rank stops at the step where the shortest shard ends."""

    name = "truncate"
    summary = "ranks stop together when the shortest shard ends"
    waste_means = "rows dropped as % of all rows"

    def epoch_outcome(
        self, rows: npt.NDArray[np.int64], batches: npt.NDArray[np.int64], batch_size: int
    ) -> ModeStats:
        steps = int(batches.min())
        # The first `steps` batches are full unless they are all the rank has.
        dropped_rows = rows - np.minimum(rows, steps * batch_size)
        return ModeStats.of(
            self.name,
            steps,
            float(dropped_rows.sum()),
            int(rows.sum()),
            dropped_batches=batches - steps,
            dropped_rows=dropped_rows,
        )

    def note_with_empty_ranks(self, empty_ranks: str, steps: int) -> tuple[bool, str]:
        return True, f"rank(s) {empty_ranks} have no batch: the epoch has 0 steps, all rows dropped"


class Cycle(Mode):
    """Short shards start again until the longest ends (or for exactly ``steps_per_epoch``)."""

    name = "cycle"
    summary = "shorter shards start over until the longest ends"
    after_own_data = "restart"
    # In batches, as EpochStats.oversampling counts what a loop hands out (its rows may be
    # unknown): one over-sampling figure in the plan, the statistics and the logs.
    waste_means = "batches repeated as % of the ranks' own batches (over-sampling)"

    def epoch_outcome(
        self, rows: npt.NDArray[np.int64], batches: npt.NDArray[np.int64], batch_size: int
    ) -> ModeStats:
        steps = int(batches.max())
        repeated_batches = steps - batches
        # Repeats come from fresh passes: whole passes (all rows), then the first, full
        # batches of one more pass. A rank without batches repeats nothing (cycle cannot run).
        whole_passes, extra_batches = np.divmod(repeated_batches, np.maximum(batches, 1))
        repeated_rows = np.where(batches > 0, whole_passes * rows + extra_batches * batch_size, 0)
        return ModeStats.of(
            self.name,
            steps,
            float(repeated_batches.sum()),
            int(batches.sum()),
            repeated_batches=repeated_batches,
            repeated_rows=repeated_rows,
        )

    def note_with_empty_ranks(self, empty_ranks: str, steps: int) -> tuple[bool, str]:
        if steps == 0:
            return True, "no rank has a batch: the epoch has 0 steps"
        return False, f"cannot run: rank(s) {empty_ranks} have no batch to repeat"


class Pad(Mode):
    """Every rank takes as many steps as the longest shard (or ``steps_per_epoch``); ranks whose
    data ran out hand out padding: their last batch again, flagged, of weight 0."""

    name = "pad"
    summary = "ranks whose data ran out hand out padding (weight 0) until the longest ends"
    after_own_data = "pad"
    waste_means = "padded rank-steps as % of rank-steps"

    def epoch_outcome(
        self, rows: npt.NDArray[np.int64], batches: npt.NDArray[np.int64], batch_size: int
    ) -> ModeStats:
        steps = int(batches.max())
        padded = steps - batches
        # A padding batch is the rank's last batch again; a rank without one pads with a copy
        # of the first batch of the lowest rank that has one.
        last_rows = rows - np.maximum(batches - 1, 0) * batch_size
        donors = np.flatnonzero(batches > 0)
        donated = min(batch_size, int(rows[donors[0]])) if donors.size else 0
        padded_rows = padded * np.where(batches > 0, last_rows, donated)
        return ModeStats.of(
            self.name,
            steps,
            float(padded.sum()),
            steps * len(batches),
            padded_batches=padded,
            padded_rows=padded_rows,
        )

    def note_with_empty_ranks(self, empty_ranks: str, steps: int) -> tuple[bool, str]:
        if steps == 0:
            return True, "no rank has a batch: the epoch has 0 steps"
        return True, f"rank(s) {empty_ranks} have no batch: they pad with another rank's first"


class JoinMode(Mode):
    """Every rank hands out all its batches; ranks that finish early shadow the others."""

    name = "join"
    summary = "ranks that run out wait for the others"
    shares_steps = False
    waste_means = "idle rank-steps as % of rank-steps"

    def check(self, *, steps_per_epoch: int | None, has_joinables: bool) -> None:
        if steps_per_epoch is not None:
            raise ValueError(
                "join mode yields every batch of every rank, so it takes no steps_per_epoch; "
                "use mode='truncate' or mode='cycle' for a fixed number of steps"
            )
        if not has_joinables:
            raise ValueError(
                "join mode needs joinables=[ddp_model, ...]: the DDP model (and e.g. a "
                "ZeroRedundancyOptimizer) whose all-reduces ranks that finish early shadow"
            )

    def steps_per_rank(
        self, batches_per_rank: Sequence[int], steps_per_epoch: int | None = None
    ) -> tuple[int, ...]:
        return tuple(batches_per_rank)

    def epoch_outcome(
        self, rows: npt.NDArray[np.int64], batches: npt.NDArray[np.int64], batch_size: int
    ) -> ModeStats:
        steps = int(batches.max())
        idle = steps - batches
        return ModeStats.of(
            self.name, steps, float(idle.sum()), steps * len(batches), idle_steps=idle
        )

    def note_with_empty_ranks(self, empty_ranks: str, steps: int) -> tuple[bool, str]:
        return True, f"rank(s) {empty_ranks} have no batch and join at once"


class Share(Mode):
    """Ranks that still have data hand batches to the ranks that ran out: every rank takes
    ``ceil(B / W)`` steps (``B`` batches over ``W`` ranks), every batch is handed out once, and
    only the last step holds padding (weight 0) on the ranks with the fewest batches
    (:mod:`ddp_even.share_plan`)."""

    name = "share"
    summary = "ranks with data left hand batches to those that ran out: every row once"
    after_own_data = "share"
    waste_means = "padded rank-steps as % of rank-steps"

    def check(self, *, steps_per_epoch: int | None, has_joinables: bool) -> None:
        super().check(steps_per_epoch=steps_per_epoch, has_joinables=has_joinables)
        if steps_per_epoch is not None:
            raise ValueError(
                "share mode hands out every batch once, so it takes no steps_per_epoch; use "
                "mode='cycle' or mode='pad' for a fixed number of steps"
            )

    def steps_per_rank(
        self, batches_per_rank: Sequence[int], steps_per_epoch: int | None = None
    ) -> tuple[int, ...]:
        ranks = len(batches_per_rank)
        return (-(-sum(batches_per_rank) // ranks),) * ranks

    def epoch_outcome(
        self, rows: npt.NDArray[np.int64], batches: npt.NDArray[np.int64], batch_size: int
    ) -> ModeStats:
        from ddp_even.share_plan import plan_window  # share's arithmetic, only where it runs

        counts = [int(count) for count in batches]
        steps = self.steps_per_rank(counts)[0]
        window = plan_window(counts, [True] * len(counts), False, steps)
        padded = np.array([int(any(slot.padding for slot in slots)) for slots in window.slots])
        own = np.minimum(batches, steps - padded)
        # A padding batch copies a full batch (the last one handed out, where it is not the
        # shard's short last batch; an approximation the plan cannot refine).
        return ModeStats.of(
            self.name,
            steps,
            float(padded.sum()),
            steps * len(counts),
            padded_batches=padded,
            padded_rows=padded * np.minimum(batch_size, rows.max(initial=0)),
            sent_batches=batches - own,
            received_batches=steps - padded - own,
        )

    def note_with_empty_ranks(self, empty_ranks: str, steps: int) -> tuple[bool, str]:
        if steps == 0:
            return True, "no rank has a batch: the epoch has 0 steps"
        return True, f"rank(s) {empty_ranks} have no batch: the others hand them theirs"


#: Every mode by name, in the order tables list them.
MODES: dict[str, Mode] = {
    mode.name: mode for mode in (Truncate(), Cycle(), Pad(), JoinMode(), Share())
}


def mode_named(mode: str | Mode) -> Mode:
    """The mode called ``mode``; ``ValueError`` naming the choices otherwise.

    Example::

        >>> mode_named("cycle").after_own_data
        'restart'
        >>> mode_named("wrap")
        Traceback (most recent call last):
        ...
        ValueError: unknown mode 'wrap': choose one of 'truncate', 'cycle', 'pad', 'join', 'share'
    """
    if isinstance(mode, Mode):
        return mode
    if isinstance(mode, str) and mode in MODES:
        return MODES[mode]
    choices = ", ".join(repr(name) for name in MODES)
    raise ValueError(f"unknown mode {mode!r}: choose one of {choices}")
