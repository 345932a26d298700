"""The one place that decides how an epoch runs, from the mode and what is known of the shards
(:func:`settle_epoch`), and runs it (:func:`run_epoch`): nothing else reads the mode's choices to
pick a shape, and every rank takes the same one (ranks of two shapes would wait in different
collectives). The shapes are docs/design.md's "How an epoch runs".

Every epoch's start, with every rank, checks what the ranks' first passes read and works out
the batch counts their Parquet footers give (:func:`agreed_first_pass`): a reader's row groups
(``cur_shard``/``shard_count``) that do not cover the dataset once between the ranks raise the
same :class:`~ddp_even.ShardCoverageError` on every rank before the first step, and a footer
plan is used only when every rank worked out the same one (docs/design.md, "What ddp_even
trusts").
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ddp_even.agreement.wire import Report, error_from_reports
from ddp_even.checks import check_world_size
from ddp_even.errors import RankMismatchError, ShardCoverageError
from ddp_even.runtime.epochs import EpochRun
from ddp_even.runtime.feed import RankCounts

if TYPE_CHECKING:
    from torch.distributed.algorithms.join import Joinable

    from ddp_even.agreement.transport import Agreer
    from ddp_even.planning.plans import ShardPlan
    from ddp_even.runtime.feed import ShardFeed
    from ddp_even.runtime.iteration import HandedOut
    from ddp_even.runtime.settings import Settings
    from ddp_even.runtime.stats import EpochStats
    from ddp_even.sources import ShardSource
    from ddp_even.sources.base import PassReading

BatchT = TypeVar("BatchT")

logger = logging.getLogger("ddp_even")

__all__ = ["EpochStart", "LoaderPlan", "run_epoch", "settle_epoch"]


class LoaderPlan:
    """Which plan a loader's epochs run on, decided here alone: the loader's own (``given``:
    ``plan=``, or its planned reader's), else the one its footers give
    (:func:`agreed_first_pass`), worked out again at every epoch's start (a dataset rewritten
    between epochs is planned anew, never trusted from an earlier epoch), with every rank
    whatever its source (a rank whose source failed reports it there). A resumed epoch's
    re-planned rest takes the place of either (:attr:`EpochStart.plan`)."""

    def __init__(self, given: ShardPlan | None) -> None:
        self.given = given
        self.footers: ShardPlan | None = None

    @property
    def current(self) -> ShardPlan | None:
        """The plan the loader's epochs run on, if any (``len(loader)`` counts its steps)."""
        return self.given or self.footers

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
        before = self.footers
        self.footers = agreed_first_pass(feed, agreer, settings, epoch, wants_plan)
        if (
            before is not None
            and self.footers is not None
            and plan_digest(before) != plan_digest(self.footers)
        ):
            logger.info(
                "ddp_even: epoch %d: the Parquet footers changed since the last epoch; batches "
                "per rank now %s",
                epoch,
                "/".join(map(str, self.footers.batches_per_rank)),
            )


# Marks this agreement, so that it never pairs with another kind unnoticed.
_FIRST_PASS = 0x0F0F_0F0F_0F0F
# What a rank whose source cannot tell its row groups says of them.
_UNTOLD = "row groups it cannot tell"


def agreed_first_pass(
    feed: ShardFeed[Any], agreer: Agreer, settings: Settings, epoch: int, wants_plan: bool
) -> ShardPlan | None:
    """Raise :class:`~ddp_even.ShardCoverageError` on every rank when the first passes do not
    read the dataset once between them; the plan every rank worked out from its footers, or
    None when any rank has another (or ``wants_plan`` is False).

    ``settings`` are the loader's (the same on every rank); ``feed`` opens its first pass here.
    """
    from ddp_even.planning.coverage import reading_described

    reading = feed.first_pass_reading()
    local, described = None, _UNTOLD
    if reading is not None:
        try:
            if wants_plan:
                local = reading.plan_for(agreer.rank, agreer.world_size)
            described = reading_described(
                reading.row_groups,
                reading.dataset_row_groups(),
                agreer.rank,
                agreer.world_size,
                reading.selects(),
            )
        except Exception as error:  # reported at the agreement, as any source failure
            feed.failure = feed.failure or error
    digest = 0 if local is None else plan_digest(local)
    failure = feed.failure
    prefix = f"{settings.description}; first pass"
    plan_words = f"footer plan {digest:014x}" if digest else "no footer plan"
    report = Report(
        rank=agreer.global_ranks[agreer.rank],
        epoch=epoch,
        fingerprint=settings.fingerprint ^ _FIRST_PASS ^ digest ^ _hashed(described),
        settings=f"{prefix} reads {described}; {plan_words}",
        available=int(local is not None),
        own_available=int(local is not None),
        failed=failure is not None,
        failure=None if failure is None else (type(failure).__name__, str(failure)),
        long_form=True,
    )
    agreement = agreer.start(report).wait()
    if not agreement.has_problem:
        # Every rank sent the same key: the same reading and plan, or none on every rank.
        logger.debug("the same first pass on every rank:%s", report.settings.removeprefix(prefix))
        return local
    reports = agreer.gather_reports(report)
    if any(peer.epoch != epoch or not peer.settings.startswith(prefix) for peer in reports):
        raise error_from_reports(reports, failure, 0)  # ranks not in the same loop
    if any(peer.failed for peer in reports):
        # Ranks in this agreement differ only by what they read: as one loop.
        same_loop = [dataclasses.replace(peer, fingerprint=0) for peer in reports]
        raise error_from_reports(same_loop, failure, 0)
    readings = {peer.settings.removeprefix(prefix).split(";")[0] for peer in reports}
    plans = "; ".join(f"rank {peer.rank}:{peer.settings.removeprefix(prefix)}" for peer in reports)
    if len(readings) > 1:
        # Raises on every rank, unless the ranks read the dataset once between them after all
        # (every rank the same part of it, which no rank can tell alone).
        _check_coverage(agreer, reading)
    elif agreer.rank == 0 and wants_plan:
        logger.warning(
            "ddp_even: the ranks worked out different batch counts from the Parquet footers "
            "(%s): every rank agrees at each step instead",
            plans,
        )
    logger.debug("first passes differ (%s): no known lengths", plans)
    return None


def _check_coverage(agreer: Agreer, reading: PassReading | None) -> None:
    """Gather every rank's row groups and raise the same error on every rank when they do not
    read the dataset once between them (a collective every rank reaches: every rank saw the
    same readings differ)."""
    from ddp_even.planning.coverage import coverage_problem

    row_groups = sorted(reading.row_groups) if reading is not None else []
    told = [
        len(row_groups),
        -1 if reading is None else reading.dataset_row_groups(),
        int(reading is not None and reading.selects()),
    ]
    everyone = agreer.gather_counts(told)
    longest = max(count for count, _, _ in everyone)
    if longest == 0:
        gathered: list[list[int]] = [[] for _ in everyone]
    else:
        gathered = agreer.gather_counts(row_groups + [-1] * (longest - len(row_groups)))
    sizes = {size for _, size, _ in everyone}
    if -1 in sizes:
        logger.debug("some rank cannot tell its row groups: the coverage is not checked")
        return
    if len(sizes) > 1:
        ranks = zip(agreer.global_ranks, everyone, strict=True)
        described = ", ".join(f"rank {rank}: {size}" for rank, (_, size, _) in ranks)
        raise RankMismatchError(
            "the ranks' readers read datasets with different numbers of row groups "
            f"({described}): give every rank's reader the same dataset"
        )
    problem = coverage_problem(
        [frozenset(index for index in indices if index >= 0) for indices in gathered],
        sizes.pop(),
        any(selects for _, _, selects in everyone),
        agreer.global_ranks,
    )
    if problem is not None:
        raise ShardCoverageError(*problem)


def _hashed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def plan_digest(plan: ShardPlan) -> int:
    """56 bits naming the plan's every rank's batches and rows, and its sharding."""
    identity = (plan.sharding, plan.batch_size, plan.batches_per_rank, plan.rows_per_rank)
    return _hashed(repr(identity)) or 1


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
    loader_plan: LoaderPlan,
    previous: EpochRun[Any] | None,
    handed_out: HandedOut,
    record: Callable[[EpochStats], None],
) -> EpochRun[BatchT]:
    """The epoch's run, in its shape: ``configured`` are the loader's settings (its
    ``sync_every`` as given, its plan if it has one); ``loader_plan`` checks what the ranks'
    first passes read and works out a plan from their footers where none is given;
    ``previous`` is the loader's last epoch (its checks' spacing goes on)."""
    mode, steps_per_epoch = configured.mode, configured.steps_per_epoch
    rank, counts = agreer.rank, RankCounts()
    known_batches = start.source.known_batches()
    fixed_steps = mode.fixes_steps(steps_per_epoch)
    # Share plans its whole hand-over from known lengths on several ranks (one rank has no one
    # to hand batches to, and agrees as it goes).
    agrees_as_it_goes = (
        configured.sync_every is not None
        or not mode.shares_steps
        or (mode.hands_over and agreer.world_size == 1)
    )
    wants_plan = not (agrees_as_it_goes or fixed_steps)
    # Sources whose passes tell what they read (petastorm's) are checked every epoch.
    unplanned = loader_plan.given is None and known_batches is None
    if unplanned and (wants_plan or feed.first_pass_reading() is not None):
        loader_plan.settle(feed, agreer, configured, epoch, wants_plan)
    plan = start.plan or loader_plan.current
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
        handed_out=handed_out,
        record=record,
        known_batches=known_batches,
    )
    if plan is not None:
        run.off_plan = feed.differs_from((start.first_pass or plan).shards[rank])
    if start.resumed_from is not None:
        run.resumed_at, run.resumed_from_world_size = start.resumed_from
    return run


def run_epoch(
    run: EpochRun[BatchT], joinables: Sequence[Joinable]
) -> Generator[BatchT, None, None]:
    """The epoch in its shape: share (several ranks), known lengths (no window), join (several
    ranks), or windows."""
    several_ranks = run.agreer.world_size > 1
    if run.settings.mode.hands_over and several_ranks:
        from ddp_even.runtime.share import run_share

        return run_share(run)
    if run.settings.sync_every is None:
        return run.known_lengths()
    if not run.settings.mode.shares_steps and several_ranks:
        from ddp_even.runtime.join import run_join

        return run_join(run, joinables)
    return run.windows()
