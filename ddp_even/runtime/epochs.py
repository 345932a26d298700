"""How one epoch runs on one rank: :class:`EpochRun`, its windows and its whole-epoch shape
(docs/design.md, "How an epoch runs"; which shape an epoch takes is
:mod:`ddp_even.runtime.epoch_shape`'s decision). Each shape is a generator that hands out the
feed's batches straight to the loader's epoch, and whatever ends it closes the epoch
(:meth:`EpochRun.close`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from ddp_even.agreement.transport import Agreer, PendingAgreement
from ddp_even.agreement.wire import SHORT_MOST, Agreement, Report, error_from_reports
from ddp_even.errors import EmptyShardError, RankMismatchError
from ddp_even.runtime.feed import FedBatch, RankCounts, ShardFeed
from ddp_even.runtime.iteration import BatchMarks, HandedOut
from ddp_even.runtime.settings import LARGEST_PROPOSAL, CheckSchedule, Settings

if TYPE_CHECKING:
    from ddp_even.runtime.padding import PadWeights
    from ddp_even.runtime.stats import EpochStats

logger = logging.getLogger("ddp_even")

BatchT = TypeVar("BatchT")


@dataclass
class EpochRun(Generic[BatchT]):
    """Everything one rank's epoch needs: who to agree with, what to read, how to hand out."""

    settings: Settings
    agreer: Agreer
    feed: ShardFeed[BatchT]
    epoch: int
    counts: RankCounts
    # The loader's account of what each batch handed out is (a repeat, padding, its weight).
    handed_out: HandedOut
    # Keeps the gathered statistics of a finished epoch.
    record: Callable[[EpochStats], None]
    # This rank's batch count known up front (a length or a plan) when the epoch trusts it.
    known_batches: int | None = None
    # Where this rank's source differs from its shard of the plan, when it does.
    off_plan: str | None = None
    steps_done: int = 0
    # The epoch's step count, once it is known up front (known lengths).
    agreed_steps: int | None = None
    # The step this epoch resumed after (from a loader state), agreed by every rank.
    resumed_at: int | None = None
    # The number of ranks the epoch was interrupted on, when it resumed on another number.
    resumed_from_world_size: int | None = None
    finished: bool = False
    # A check of the sources (known lengths) started and not yet waited for.
    pending_check: tuple[Report, PendingAgreement] | None = None
    # Pad: each step's loss weight (a mode that weighs its batches; None in the others).
    pad_weights: PadWeights | None = None
    # Known lengths: the spacing the epoch's last check agreed, once it is settled (what the
    # next epoch's checks start at).
    agreed_check_spacing: int = 0

    def __post_init__(self) -> None:
        if self.settings.mode.weighs_batches:
            from ddp_even.runtime.padding import PadWeights

            self.pad_weights = PadWeights(self.agreer, self.settings.plan)

    def hand_out(self, fed: FedBatch[BatchT], weight: float = 1.0) -> BatchT:
        """``fed``'s batch, counted and marked; ``weight`` is its loss weight where the mode's
        run works it out (share), unless it is padding or pad weighs it."""
        step = self.counts.steps
        rows = fed.count_samples(fed.batch)
        self.counts.count_batch(fed.pass_number, rows, fed.padding, fed.received)
        marked: float | None = weight
        if fed.padding:
            marked = 0.0
        elif self.pad_weights is not None:
            marked = self.pad_weights.weight(step, rows)
        self.handed_out.add(BatchMarks(step, fed.repeated, fed.padding, marked))
        return fed.batch

    def close(self) -> None:
        """Whatever ends the epoch (its end, a ``break``, an error), in the shape's ``finally``:
        complete what every rank started (a check of the sources, pad's sum), and close what
        the feed opened (a reader left running at exit aborts the process)."""
        if self.pending_check is not None:
            self.pending_check[1].finish_started()
            self.pending_check = None
        if self.pad_weights is not None:
            self.pad_weights.finish_started()
        self.handed_out.epoch_ended()
        self.feed.close()

    def finish(self, had_more_own_data: bool) -> None:
        """Gather the statistics; called at a point every rank reaches."""
        from ddp_even.runtime.stats import gather_epoch_stats

        self.agreed_check_spacing = self.settle_check() or 0
        self.counts.truncated = had_more_own_data
        # A rank that handed out nothing still started its source once.
        self.counts.passes = max(self.counts.passes, min(self.feed.passes_started, 1))
        self.finished = True
        plan = self.settings.plan
        self.record(
            gather_epoch_stats(
                self.agreer,
                self.counts,
                self.epoch,
                self.settings.mode.name,
                None if plan is None else plan.sharding,
                self.resumed_at,
                self.resumed_from_world_size,
            )
        )

    def resume_after(
        self,
        saved_step: int,
        skipped: Sequence[int | None] = (),
        out_of_order: str | None = None,
    ) -> None:
        """Continue this epoch after the step a loader state was saved at.

        Every rank first agrees on the step (one agreement under a key of its own): in
        truncate and cycle every rank must have saved at the same step; in join a rank that had
        already run out saved earlier, and the latest step counts. Then each rank counts the
        batches it handed out before that step (all of its shard if it ran out), so that the
        epoch's statistics are the uninterrupted run's: ``skipped`` gives the rows of those its
        source already starts after (a planned reader started at the saved position), the
        rest are read again; where the source or ``out_of_order`` (a planned reader's) says
        that a pass may read them in another order, rank 0 warns.
        """
        report = dataclasses.replace(
            self.report(saved_step, saved_step, shard_is_empty=False),
            fingerprint=self.settings.fingerprint ^ _RESUMING,
            settings=f"{self.settings.description}, resuming after step {saved_step}",
        )
        agreement = self.agree(report)
        step = agreement.max_own_available
        if agreement.min_available != step and self.settings.mode.shares_steps:
            raise RankMismatchError(
                "the ranks' loader states were saved at different steps "
                f"({agreement.min_available} to {step}) of epoch {self.epoch}: load on every "
                "rank the states saved at the same step"
            )
        for rows in skipped:
            self.counts.count_batch(1, rows)
        unrepeatable = None
        if len(skipped) < step:
            # Why the first pass may not yield the batches an earlier pass did, where it can tell.
            reading = self.feed.first_pass_reading()
            unrepeatable = (None if reading is None else reading.unrepeatable()) or out_of_order
        if unrepeatable is not None and self.agreer.rank == 0:
            logger.warning(
                "ddp_even: epoch %d resumes by reading again what was handed out before step %d, "
                "but %s: the rest of the epoch is not the interrupted run's. For an exact "
                "resume, read with a seed: EvenLoader.from_parquet(..., reader_kwargs={'seed': "
                "7}), or shuffle_row_groups=False (and workers_count=1 with petastorm) "
                "(docs/resume.md)",
                self.epoch,
                step,
                unrepeatable,
            )
        if not (self.settings.mode.hands_over and self.agreer.world_size > 1):
            # The share shape runs its steps before the resume point again itself.
            self._count_again_up_to(step)
        self.steps_done = self.resumed_at = step
        # Once for the job, on rank 0; each rank's own count in its debug log.
        logger.log(
            logging.INFO if self.agreer.rank == 0 else logging.DEBUG,
            "epoch %d resumes after step %d: read %d batch(es) of this rank's source again to "
            "get there",
            self.epoch,
            step,
            self.counts.steps - len(skipped),
        )

    def _count_again_up_to(self, step: int) -> None:
        """Count this rank's batches before ``step`` of a resumed epoch as the uninterrupted
        epoch handed them out, reading them again (padding past its data, in pad)."""
        while self.counts.steps < step:
            self.feed.fill(1)
            if not self.feed.buffered:
                # A rank that ran out (join); one with an empty shard, in pad, before the
                # agreement that gives it a batch to pad with (check()); a failure the next
                # agreement reports.
                break
            fed = self.feed.take()
            self.counts.count_batch(fed.pass_number, fed.count_samples(fed.batch), fed.padding)

    def report(
        self, available: int, own_available: int, shard_is_empty: bool, most: int | None = None
    ) -> Report:
        """This rank's report; ``most`` bounds the counts any rank sends with it (None: any)."""
        opens_epoch = self.steps_done == (self.resumed_at or 0)
        failure = self.feed.failure
        mode = self.settings.mode
        needs_a_batch = mode.needs_a_batch(self.feed.can_pad)
        return Report(
            rank=self.agreer.global_ranks[self.agreer.rank],
            epoch=self.epoch,
            fingerprint=self.settings.fingerprint,
            settings=self.settings.description,
            available=available,
            own_available=own_available,
            empty_shard=needs_a_batch and shard_is_empty,
            failed=failure is not None,
            failure=None if failure is None else (type(failure).__name__, str(failure)),
            off_plan=self.off_plan,
            long_form=opens_epoch or most is None or most > SHORT_MOST,
        )

    def report_buffered(self, most: int | None = None) -> Report:
        """This rank's report of the batches it has read ahead."""
        return self.report(self.feed.buffered, self.feed.own_buffered, self.feed.empty_shard, most)

    def offer_buffered(self, window: int) -> tuple[Report, PendingAgreement]:
        self.feed.fill(window)
        report = self.report_buffered(most=window)
        pending = self.agreer.start(report)
        if self.pad_weights is not None:
            self.pad_weights.offered(self.feed, window)
        return report, pending

    def agree(self, report: Report) -> Agreement:
        """Agree with every rank on ``report``, waited here, its problems raised (:meth:`check`)."""
        return self.check(report, self.agreer.start(report).wait())

    def check(self, report: Report, agreement: Agreement) -> Agreement:
        """Raise the same error on every rank when the agreement carries a problem; in pad, give
        ranks with an empty shard a batch to pad with instead (the agreement it carries)."""
        if not agreement.has_problem:
            return agreement
        reports = self.agreer.gather_reports(report)
        error = error_from_reports(reports, self.feed.failure, self.steps_done)
        if isinstance(error, EmptyShardError) and self.settings.mode.after_own_data == "pad":
            from ddp_even.runtime.padding import share_padding

            fixed_steps = self.settings.steps_per_epoch is not None
            agreement = share_padding(self.agreer, self.feed, reports, fixed_steps)
            # A resumed epoch's steps before its resume point were padding on this rank too.
            self._count_again_up_to(self.steps_done)
            return agreement
        logger.debug(
            "epoch %d, after %d step(s): every rank raises %r", self.epoch, self.steps_done, error
        )
        raise error

    def start_check(self, proposal: int) -> None:
        """Tell every rank, without waiting, whether this rank's source failed or ran short, and
        its ``proposal`` for a later check's spacing (:class:`~ddp_even.runtime.settings.
        CheckSchedule`)."""
        report = dataclasses.replace(
            self.report(proposal, 0, shard_is_empty=False, most=LARGEST_PROPOSAL),
            fingerprint=self.settings.fingerprint ^ _CHECKING,
            settings=f"{self.settings.description}, checking the sources",
        )
        self.pending_check = (report, self.agreer.start(report))

    def settle_check(self) -> int | None:
        """Wait for the check started last, raising on every rank what it found; the smallest
        proposal the ranks made with it, or None when no check was in flight."""
        if self.pending_check is None:
            return None
        report, pending = self.pending_check
        self.pending_check = None
        return self.check(report, pending.wait()).min_available

    def check_sources_at(self, schedule: CheckSchedule, step: int) -> None:
        """Settle the check of the sources started last and start the next, at ``step``: the
        steps since have hidden the previous one's wait, and every rank checks at this step."""
        agreed = self.settle_check()
        self.start_check(schedule.proposal(step))
        schedule.checked(step, agreed)

    def agree_on_lengths(self) -> Agreement:
        """Known lengths: the epoch's one agreement, on this rank's batch count (None: its
        window's, when only the step count is fixed). The first batch is read before it, so
        that a source that fails or has nothing is reported to every rank before the first
        step."""
        own_batches = self.known_batches
        if own_batches is None or own_batches > 0:
            self.feed.fill(1)
        if own_batches is None:
            report = self.report_buffered()
        else:
            report = self.report(own_batches, own_batches, shard_is_empty=own_batches == 0)
        return self.agree(report)

    def windows(self) -> Generator[BatchT, None, None]:
        """Agree once per window of ``sync_every`` batches, the next window's agreement started
        before the current window's last batch is handed out."""
        pending: PendingAgreement | None = None
        try:
            window = self.settings.window(self.steps_done)
            assert window is not None
            report, pending = self.offer_buffered(window)
            while pending is not None:
                agreement = pending.wait()
                pending = None
                agreement = self.check(report, agreement)
                # A rank given a batch to pad with at this agreement fills its window with it.
                self.feed.fill(window)
                decision = self.settings.mode.decide(
                    agreement, window, self.steps_done, self.settings.steps_per_epoch
                )
                if self.pad_weights is not None:
                    self.pad_weights.settle(self.feed, window, self.counts.steps)
                self.steps_done += decision.steps
                for remaining in reversed(range(decision.steps)):
                    # Out of the buffer as handed out: a batch the consumer is done with is not
                    # held here, and the buffer is empty when the next window fills it.
                    fed = self.feed.take()
                    if remaining == 0 and not decision.last:
                        window = self.settings.window(self.steps_done)
                        assert window is not None
                        report, pending = self.offer_buffered(window)
                    if remaining == 0 and decision.last:
                        yield from last_batch(self, self.hand_out(fed), self.feed.had_more_own_data)
                        return
                    yield self.hand_out(fed)
                if decision.last:
                    self.finish(self.feed.had_more_own_data())
                    return
        finally:
            # Every rank started it, so it completes; waiting leaves nothing in flight when the
            # consumer stops early on every rank.
            if pending is not None:
                pending.finish_started()
            self.close()

    def known_lengths(self) -> Generator[BatchT, None, None]:
        """One agreement (:meth:`agree_on_lengths`), then the whole epoch, checking the sources
        on a :class:`CheckSchedule`. A rank whose source fails or runs short hands out its last
        batch again until the check that reports it is settled, where every rank raises.
        """
        try:
            own_batches = self.known_batches
            # The whole epoch's steps, also when it resumes part-way.
            decision = self.settings.mode.decide(
                self.agree_on_lengths(), self.settings.window(0), 0, self.settings.steps_per_epoch
            )
            self.agreed_steps = decision.steps
            logger.debug(
                "epoch %d: %d steps agreed for the whole epoch (this rank: %s own batches)",
                self.epoch,
                decision.steps,
                "unknown" if own_batches is None else own_batches,
            )

            def had_more_own_data() -> bool:
                if own_batches is None:
                    return self.feed.had_more_own_data()
                # A pass that ended early (a reader losing rows) was not cut by the epoch.
                return not self.feed.own_ended and own_batches > self.counts.own_batches

            schedule = CheckSchedule.after(self.steps_done, self.settings.check_spacing)
            for step in range(self.steps_done + 1, decision.steps + 1):
                self.steps_done += 1
                batch = self.hand_out(self.feed.take_or_repeat())
                if step == schedule.next_step or step == decision.steps:
                    self.check_sources_at(schedule, step)
                if step == decision.steps:
                    yield from last_batch(self, batch, had_more_own_data)
                    return
                yield batch
            self.finish(had_more_own_data())
        finally:
            self.close()


# Marks the checks of the sources, so that they never pair with an ordinary agreement.
_CHECKING = 0x3C3C_3C3C_3C3C


# Marks the agreement on the step to resume after, so that it never pairs with an ordinary one.
_RESUMING = 0x5E5E_5E5E_5E5E


def last_batch(
    run: EpochRun[BatchT], batch: BatchT, had_more_own_data: Callable[[], bool]
) -> Iterator[BatchT]:
    """Hand out the epoch's last batch; the epoch is complete even if no one asks for more.

    A trainer that knows ``len(loader)`` (Lightning) stops asking after the last batch and
    closes the epoch at its next ``iter()``, the same point on every rank: the statistics are
    gathered there, with the collective every rank makes at that point.
    """
    try:
        yield batch
    except GeneratorExit:
        if not sys.is_finalizing():
            run.finish(had_more_own_data())
        raise
    run.finish(had_more_own_data())
