"""The share shape of an epoch: ranks that still have data hand batches to those that ran out
(docs/design.md, "When each mode stops", share).

With known lengths and no ``sync_every`` the whole hand-over is planned before the first step
(:func:`~ddp_even.share_plan.planned_windows`), and only spaced-out checks of the sources
follow. Otherwise every rank reads ahead (:func:`~ddp_even.share_plan.fill_targets`), agrees,
and plans the same window from every rank's counts (:func:`~ddp_even.share_plan.plan_window`);
the counts are summed after the agreement only where a rank's differ from what the last plan
lets every rank expect (its shard ended: at most once a rank and epoch). Windows are planned one
ahead of the one handed out, so that a window's batches travel
(:class:`~ddp_even.runtime.handover.Handover`) while the window before it trains.

Every batch is handed out once. The epoch's last step may hold padding on the ranks with the
fewest batches (a copy of their last batch, ``loader.padding`` True, weight 0), and the real
batches at that step weigh ``W / real batches`` so that the averaged gradient is their mean.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from ddp_even.runtime.epochs import last_batch
from ddp_even.runtime.feed import FedBatch
from ddp_even.runtime.settings import CheckSchedule
from ddp_even.share_plan import Slot, WindowPlan, fill_targets, plan_window, planned_windows

if TYPE_CHECKING:
    from ddp_even.agreement.transport import PendingAgreement
    from ddp_even.agreement.wire import Report
    from ddp_even.runtime.epochs import EpochRun
    from ddp_even.runtime.handover import Handover, Incoming

BatchT = TypeVar("BatchT")

logger = logging.getLogger("ddp_even")

__all__ = ["run_share"]


def run_share(run: EpochRun[BatchT]) -> Generator[BatchT, None, None]:
    """Hand out one rank's epoch in windows of shared batches (several ranks)."""
    from ddp_even.agreement.transport import CollectiveAgreer
    from ddp_even.runtime.handover import Handover

    assert isinstance(run.agreer, CollectiveAgreer)  # several ranks
    return _SharedWindows(run, Handover(run.agreer)).batches()


@dataclass
class _Window(Generic[BatchT]):
    """A planned window on this rank: the plan, the batches it took from its buffer (by their
    index there), and, by step, the batches other ranks send it."""

    plan: WindowPlan
    kept: list[FedBatch[BatchT]]
    incoming: dict[int, Incoming]


class _SharedWindows(Generic[BatchT]):
    """One rank's share epoch: its windows' offers, plans, sends and batches."""

    def __init__(self, run: EpochRun[BatchT], handover: Handover) -> None:
        self.run = run
        self.handover = handover
        self.rank, self.world_size = run.agreer.rank, run.agreer.world_size
        # What every rank knows of every rank after the last plan: whether its shard ended, and
        # how many of its batches it holds that no planned window takes.
        self.ended = [False] * self.world_size
        self.left = [0] * self.world_size
        # The batches every rank is expected to hold for the offer in flight.
        self.expected = [0] * self.world_size
        # The offer in flight: this rank's report and its agreement, or, where the lengths are
        # known, the next window's plan.
        self.offer: tuple[Report, PendingAgreement] | WindowPlan | None = None
        # Known lengths: the epoch's windows, with the batches every rank holds for each.
        self.known: Iterator[tuple[WindowPlan, list[deque[int]]]] | None = None
        self.last_planned = False
        # The windows planned and not handed out, the one being handed out first.
        self.windows: deque[_Window[BatchT]] = deque()
        # The batch this rank handed out last, which it copies when it pads.
        self.last: FedBatch[BatchT] | None = None

    def batches(self) -> Generator[BatchT, None, None]:
        """The epoch's batches. An epoch resumed after step ``t`` runs its first ``t`` steps
        again without handing them out (every rank reads, plans, sends and receives as it did
        the first time), so that it goes on exactly where it was cut, also in the middle of a
        hand-over, and its statistics count the whole epoch."""
        run = self.run
        resume_at, run.steps_done = run.steps_done, 0
        stepped = 0
        schedule: CheckSchedule | None = None
        try:
            if run.known_batches is not None:
                self.plan_epoch()
                schedule = CheckSchedule.after(resume_at, run.settings.check_spacing)
            self.start_offer()
            while True:
                self.plan_ahead()
                if not self.windows:  # no rank had a batch
                    run.finish(had_more_own_data=False)
                    return
                window = self.windows[0]
                plan = window.plan
                # The epoch's last window is the last planned, or the one before a last plan of
                # no steps (where a shard's end was found only after its last batch was read):
                # either way the only one left. Its last batch completes the epoch.
                last_window = self.last_planned and len(self.windows) == 1
                for step, slot in enumerate(plan.slots[self.rank]):
                    fed = self.take(window, step, slot)
                    ends_window = step == plan.steps - 1
                    if ends_window and not self.last_planned:
                        self.start_offer()
                    ends_epoch = ends_window and last_window
                    if ends_epoch:
                        self.handover.finish()
                    stepped += 1
                    if stepped <= resume_at:
                        rows = fed.count_samples(fed.batch)
                        run.counts.count_batch(fed.pass_number, rows, fed.padding, fed.received)
                        if ends_epoch:
                            run.finish(had_more_own_data=False)
                        continue
                    if schedule is not None and stepped in (schedule.next_step, run.agreed_steps):
                        run.check_sources_at(schedule, stepped)
                    batch = run.hand_out(fed, plan.padding_weight(step))
                    if ends_epoch:
                        yield from last_batch(run, batch, run.feed.had_more_own_data)
                        return
                    yield batch
                self.windows.popleft()
                if last_window:
                    return
        except GeneratorExit:
            self.stop()
            raise
        finally:
            self.close()

    def plan_ahead(self) -> None:
        """Settle the offers in flight until the window after the one to hand out next is
        planned (or the epoch's last is), starting offers as needed."""
        while self.offer is not None:
            plan = self.settle_offer()
            self.last_planned = plan.last
            if plan.steps:
                self.windows.append(self.exchange(plan))
            if not plan.last and len(self.windows) < 2:
                self.start_offer()

    def plan_epoch(self) -> None:
        """Known lengths: agree once (the first batch read before, so that a source that fails
        or has nothing is reported to every rank before the first step), learn every rank's
        batch count (the plan's, or summed), and plan the epoch's windows from them."""
        run = self.run
        assert run.known_batches is not None
        run.agree_on_lengths()
        if run.settings.plan is not None:
            batches = list(run.settings.plan.batches_per_rank)
        else:
            batches = [count for (count,) in run.agreer.gather_counts([run.known_batches])]
        run.agreed_steps = math.ceil(sum(batches) / self.world_size)
        self.known = planned_windows(batches, run.settings.sync_every or 1, ends_known=True)
        logger.debug(
            "epoch %d: share planned for the whole epoch: %d steps, batches per rank %s",
            run.epoch,
            run.agreed_steps,
            "/".join(map(str, batches)),
        )

    def start_offer(self) -> None:
        """Read ahead for the next window and start its agreement (known lengths: read what the
        window's plan counts on)."""
        run, feed = self.run, self.run.feed
        if self.known is not None:
            plan, held = next(self.known)
            feed.fill(len(held[self.rank]))
            self.offer = plan
            return
        window = run.settings.window(run.steps_done)
        assert window is not None
        targets = fill_targets(self.ended, window)
        feed.fill(targets[self.rank])
        self.expected = [
            left if ended else max(left, target)
            for left, ended, target in zip(self.left, self.ended, targets, strict=True)
        ]
        unexpected = (feed.buffered, feed.own_ended) != (
            self.expected[self.rank],
            self.ended[self.rank],
        )
        # The report's second count is 1 where this rank's counts are not what every rank
        # expects: the agreement's maximum of it then tells every rank to add the counts up.
        report = run.report(feed.buffered, int(unexpected), shard_is_empty=False, most=max(targets))
        self.offer = (report, run.agreer.start(report))

    def settle_offer(self) -> WindowPlan:
        """Wait for the offer in flight (raising on every rank what it found) and plan the
        window from every rank's counts."""
        assert self.offer is not None
        offer, self.offer = self.offer, None
        run = self.run
        if isinstance(offer, WindowPlan):
            run.steps_done += offer.steps
            return offer
        report, pending = offer
        agreement = run.check(report, pending.wait())
        buffered, ended = self.expected, self.ended
        if agreement.max_own_available:
            counts = [0] * (2 * self.world_size)
            counts[2 * self.rank] = run.feed.buffered
            counts[2 * self.rank + 1] = int(run.feed.own_ended)
            summed = run.agreer.start_sum(counts).wait()
            buffered, ended = summed[0::2], [bool(flag) for flag in summed[1::2]]
        window = run.settings.window(run.steps_done)
        assert window is not None
        plan = plan_window(buffered, ended, run.steps_done > 0, window)
        run.steps_done += plan.steps
        self.ended = ended
        self.left = [held - used for held, used in zip(buffered, plan.used, strict=True)]
        return plan

    def exchange(self, plan: WindowPlan) -> _Window[BatchT]:
        """Take the batches the window uses out of the buffer, send the others' to them, and
        start receiving this rank's from the others."""
        feed, counts = self.run.feed, self.run.counts
        # Every rank took the batches of the window two plans before this one before it started
        # the agreement that planned this one.
        self.handover.release_received()
        kept = [feed.take_or_repeat() for _ in range(plan.used[self.rank])]
        for receiver, index, padding in plan.sends(self.rank):
            fed = kept[index]
            self.handover.send(fed.batch, receiver)
            if not padding:
                counts.count_sent(fed.count_samples(fed.batch))
        # By giver, the steps whose batches it sends this rank, received in that order.
        steps_of: dict[int, list[int]] = {}
        for step, slot in enumerate(plan.slots[self.rank]):
            if slot.giver != self.rank:
                steps_of.setdefault(slot.giver, []).append(step)
        incoming: dict[int, Incoming] = {}
        for giver, steps in steps_of.items():
            incoming.update(zip(steps, self.handover.expect(giver, len(steps)), strict=True))
        return _Window(plan, kept, incoming)

    def take(self, window: _Window[BatchT], step: int, slot: Slot) -> FedBatch[BatchT]:
        """The batch this rank hands out at a step of the window: its own, one another rank
        sent, or padding."""
        if slot.giver == self.rank:
            fed = self.last if slot.index < 0 else window.kept[slot.index]
            assert fed is not None
        else:
            batch = self.handover.collect(window.incoming.pop(step))
            fed = FedBatch(batch, 1, self.run.feed.count_samples, received=True)
        if slot.padding:
            fed = fed._replace(padding=True)
        self.last = fed
        return fed

    def stop(self) -> None:
        """The consumer stopped early, on every rank: take the batches sent to this rank and
        not handed out, and wait until this rank's have arrived."""
        for window in self.windows:
            for incoming in window.incoming.values():
                self.handover.collect(incoming)
        self.handover.finish()

    def close(self) -> None:
        """Whatever ends the epoch: complete the offer and the check every rank started, close
        the feed."""
        if isinstance(self.offer, tuple):
            self.offer[1].finish_started()
        self.run.close()
