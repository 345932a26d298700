"""The one place that decides how an epoch runs, from the mode and what is known of the shards.

An epoch has one of three shapes, and every rank must take the same one (ranks of two shapes
would wait in different collectives):

* **known lengths** (:func:`~ddp_even.runtime.epochs.run_known_lengths`): every rank's batch
  count is known before the first step (a shard plan, the footers of the usual petastorm loop,
  a list's length), or the mode fixes the step count (:meth:`~ddp_even.modes.Mode.fixes_steps`):
  one agreement, then only overlapped checks of the sources;
* **join** (:func:`~ddp_even.runtime.join.run_join`): the mode does not share steps
  (``shares_steps`` False) and there are several ranks;
* **windows** (:func:`~ddp_even.runtime.epochs.run_windows`): otherwise, and whenever the user
  set ``sync_every``, or the mode weighs batches without a plan (pad: each step's real rows
  over all ranks are summed with each window's agreement).

:func:`settle_epoch` decides it (after the ranks' first passes are checked and, where they
may, agree on the plan their footers give: :mod:`ddp_even.runtime.first_pass`), and
:func:`run_epoch` runs it. Nothing else reads the mode's choices to pick a shape.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ddp_even.checks import check_world_size
from ddp_even.runtime.epochs import EpochRun, run_known_lengths, run_windows
from ddp_even.runtime.feed import RankCounts

if TYPE_CHECKING:
    from torch.distributed.algorithms.join import Joinable

    from ddp_even.agreement.transport import Agreer
    from ddp_even.planning.plans import ShardPlan
    from ddp_even.runtime.feed import ShardFeed
    from ddp_even.runtime.iteration import BatchMarks
    from ddp_even.runtime.settings import Settings
    from ddp_even.runtime.stats import EpochStats
    from ddp_even.sources import ShardSource

BatchT = TypeVar("BatchT")

logger = logging.getLogger("ddp_even")

__all__ = ["EpochStart", "FooterPlan", "run_epoch", "settle_epoch"]


class FooterPlan:
    """The plan a loader's footers give (:mod:`ddp_even.runtime.first_pass`), worked out again
    at every epoch's start (a dataset rewritten between epochs is planned anew, never trusted
    from an earlier epoch), with every rank whatever its source (a rank whose source failed
    reports it there)."""

    def __init__(self) -> None:
        self.plan: ShardPlan | None = None

    def settle(
        self,
        feed: ShardFeed[Any],
        agreer: Agreer,
        settings: Settings,
        epoch: int,
        wants_plan: bool,
    ) -> None:
        """Check what the ranks' first passes read and, if ``wants_plan``, agree on the plan
        their footers give (None when any rank has another, or none)."""
        from ddp_even.runtime.first_pass import agreed_first_pass, plan_digest

        before = self.plan
        self.plan = agreed_first_pass(feed, agreer, settings, epoch, wants_plan)
        if (
            before is not None
            and self.plan is not None
            and plan_digest(before) != plan_digest(self.plan)
        ):
            logger.info(
                "ddp_even: epoch %d: the Parquet footers changed since the last epoch; batches "
                "per rank now %s",
                epoch,
                "/".join(map(str, self.plan.batches_per_rank)),
            )


@dataclass(frozen=True)
class EpochStart:
    """What an epoch reads, and where it starts: its source from the start, or where a loaded
    state resumes it (:func:`ddp_even.resume.state.resumed_start`)."""

    source: ShardSource[Any]
    # The plan the epoch runs on instead of the loader's (a re-planned rest), if any.
    plan: ShardPlan | None = None
    # The plan of the rank's first pass when it differs (its rows not yet read), if any.
    first_pass: ShardPlan | None = None
    # The step every rank agrees to resume after, with the rows of the batches before it
    # that the first pass starts after (None: unknown); None when it resumes elastically.
    step: int | None = None
    skipped: Sequence[int | None] = ()
    # (step, world size) the state was saved at, for an elastic resume.
    resumed_from: tuple[int, int] | None = None
    # The state, when what it follows from is to be checked once the epoch's plan is settled.
    unchecked: Mapping[str, Any] | None = None
    strict: bool = True
    # Why a pass of a planned reader may read the rows before the step in another order.
    out_of_order: str | None = None

    @property
    def resumes(self) -> bool:
        """Whether the epoch starts part-way, from a loaded state."""
        return self.step is not None or self.resumed_from is not None


def settle_epoch(
    configured: Settings,
    *,
    epoch: int,
    agreer: Agreer,
    start: EpochStart,
    feed: ShardFeed[BatchT],
    footer_plan: FooterPlan,
    previous: EpochRun[Any] | None,
    mark: Callable[[BatchMarks], None],
    record: Callable[[EpochStats], None],
) -> EpochRun[BatchT]:
    """The epoch's run, in its shape: ``configured`` are the loader's settings (its
    ``sync_every`` as given, its plan if it has one); ``footer_plan`` checks what the ranks'
    first passes read and works out a plan from their footers where none is given;
    ``previous`` is the loader's last epoch (its checks' spacing goes on)."""
    mode, steps_per_epoch = configured.mode, configured.steps_per_epoch
    rank, counts = agreer.rank, RankCounts()
    known_batches = start.source.known_batches()
    fixed_steps = mode.fixes_steps(steps_per_epoch)
    agrees_as_it_goes = configured.sync_every is not None or not mode.shares_steps
    wants_plan = not (agrees_as_it_goes or fixed_steps)
    # Sources whose passes tell what they read (petastorm's) are checked every epoch.
    unplanned = configured.plan is None and known_batches is None
    if unplanned and (wants_plan or feed.first_pass_reading() is not None):
        unwindowed = dataclasses.replace(configured, plan=None)
        footer_plan.settle(feed, agreer, unwindowed, epoch, wants_plan)
    plan = start.plan or configured.plan or (footer_plan.plan if wants_plan else None)
    if plan is not None:
        check_world_size(plan.world_size, agreer.world_size)
        known_batches = counts.planned_batches = plan.batches_per_rank[rank]
        counts.planned_rows = plan.rows_per_rank[rank]
    if agrees_as_it_goes or (mode.weighs_batches and plan is None):
        # An explicit window, a mode whose ranks take their own steps (join), and one whose
        # weights need each step's real rows over all ranks without a plan agree as they go.
        known_batches, fixed_steps = None, False
    whole_epoch = known_batches is not None or fixed_steps
    if known_batches is not None:
        feed.promise(known_batches)
    settings = dataclasses.replace(
        configured, sync_every=None if whole_epoch else (configured.sync_every or 1), plan=plan
    )
    if whole_epoch and previous is not None and not start.resumes:
        settings = dataclasses.replace(settings, check_spacing=previous.agreed_check_spacing)
    run: EpochRun[BatchT] = EpochRun(
        settings=settings,
        agreer=agreer,
        feed=feed,
        epoch=epoch,
        counts=counts,
        mark=mark,
        record=record,
        known_batches=known_batches,
    )
    if plan is not None:
        run.off_plan = feed.differs_from((start.first_pass or plan).shards[rank])
    if start.resumed_from is not None:
        run.resumed_at, run.resumed_from_world_size = start.resumed_from
    return run


def run_epoch(run: EpochRun[BatchT], joinables: Sequence[Joinable]) -> Iterator[BatchT]:
    """The epoch in its shape: known lengths (no window), join (several ranks), or windows."""
    if run.settings.sync_every is None:
        return run_known_lengths(run, run.known_batches)
    if not run.settings.mode.shares_steps and run.agreer.world_size > 1:
        from ddp_even.runtime.join import run_join

        return run_join(run, joinables)
    return run_windows(run)
