"""The share shape of an epoch: ranks that still have data hand batches to those that ran out.

Before each window of ``sync_every`` steps every rank reads ahead (:func:`~ddp_even.share_plan.
fill_targets`: a window while every shard goes on, more on the ranks still reading once others
ran out), and tells the others, with the window's agreement, how many batches of its own it
holds and whether its shard has ended: an ``all_reduce(SUM)`` of one pair of counts per rank,
started beside the agreement (after the epoch's first, as pad's sums, so that it never pairs
with another rank's other collective). From those counts every rank plans the same window
(:func:`~ddp_even.share_plan.plan_window`): who hands out whose batch at each step. A rank with
extra batches sends them all at once when the window is planned, over ddp_even's group
(:class:`~ddp_even.runtime.handover.Handover`), so that they travel while the window's first
steps train; a rank takes a batch sent to it at the step it hands it out.

Every batch is handed out once. The epoch's last step may hold padding on the ranks with the
fewest batches (a copy of their last batch, ``loader.padding`` True, weight 0), and the real
batches at that step weigh ``W / real batches`` so that the averaged gradient is their mean.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from ddp_even.runtime.epochs import last_batch
from ddp_even.runtime.feed import FedBatch
from ddp_even.share_plan import Slot, WindowPlan, fill_targets, plan_window

if TYPE_CHECKING:
    from ddp_even.agreement.pending import Pending, PendingAgreement
    from ddp_even.agreement.wire import Report
    from ddp_even.runtime.epochs import EpochRun
    from ddp_even.runtime.handover import Handover

BatchT = TypeVar("BatchT")

logger = logging.getLogger("ddp_even")

__all__ = ["run_share"]


def run_share(run: EpochRun[BatchT]) -> Generator[BatchT, None, None]:
    """Hand out one rank's epoch in windows of shared batches (several ranks)."""
    from ddp_even.runtime.handover import Handover

    return _SharedWindows(run, Handover(run.agreer)).batches()


class _SharedWindows(Generic[BatchT]):
    """One rank's share epoch: its windows' offers, plans, sends and batches."""

    def __init__(self, run: EpochRun[BatchT], handover: Handover) -> None:
        self.run = run
        self.handover = handover
        self.rank, self.world_size = run.agreer.rank, run.agreer.world_size
        # Whether every shard went on at the last plan (the next window's read-ahead follows).
        self.ended = [False] * self.world_size
        # The offer in flight: this rank's report, its agreement, and the counts' sum (None
        # until the epoch's first agreement showed that every rank runs this loop).
        self.offer: tuple[Report, PendingAgreement, Pending[list[int]] | None] | None = None
        # The batch this rank handed out last, which it copies when it pads.
        self.last: FedBatch[BatchT] | None = None
        # The batches still to come from other ranks in the current window, by giver.
        self.expected: dict[int, int] = {}

    def batches(self) -> Generator[BatchT, None, None]:
        """The epoch's batches. An epoch resumed after step ``t`` runs its first ``t`` steps
        again without handing them out (every rank reads, plans, sends and receives as it did
        the first time), so that it goes on exactly where it was cut, also in the middle of a
        hand-over, and its statistics count the whole epoch."""
        run = self.run
        resume_at, run.steps_done = run.steps_done, 0
        try:
            self.start_offer(counts_ahead=False)
            while self.offer is not None:
                plan, window_start = self.settle_offer(), run.steps_done
                kept = self.send_extras(plan)
                run.steps_done += plan.steps
                for step, slot in enumerate(plan.slots[self.rank]):
                    fed = self.take(slot, kept)
                    ends_window, ends_epoch = step == plan.steps - 1, plan.last
                    if ends_window and not ends_epoch:
                        self.start_offer(counts_ahead=True)
                    if ends_window and ends_epoch:
                        self.handover.finish()
                    if window_start + step < resume_at:
                        rows = fed.count_samples(fed.batch)
                        run.counts.count_batch(fed.pass_number, rows, fed.padding, fed.received)
                        if ends_window and ends_epoch:
                            run.finish(had_more_own_data=False)
                        continue
                    batch = run.hand_out(fed, plan.padding_weight(step))
                    if ends_window and ends_epoch:
                        yield from last_batch(run, batch, lambda: False)
                        return
                    yield batch
                if plan.last:
                    if plan.steps == 0:  # no rank had a batch
                        run.finish(had_more_own_data=False)
                    return
                if plan.steps == 0:
                    self.start_offer(counts_ahead=True)
        except GeneratorExit:
            self.stop()
            raise
        finally:
            self.close()

    def start_offer(self, counts_ahead: bool) -> None:
        """Read ahead for the next window and start its agreement (and its counts' sum)."""
        run, feed = self.run, self.run.feed
        window = run.settings.window(run.steps_done)
        assert window is not None
        targets = fill_targets(self.ended, window)
        feed.fill(targets[self.rank])
        report = run.report(feed.buffered, feed.buffered, shard_is_empty=False, most=max(targets))
        pending = run.agreer.start(report)
        self.offer = (report, pending, self.start_counts() if counts_ahead else None)

    def start_counts(self) -> Pending[list[int]]:
        counts = [0] * (2 * self.world_size)
        counts[2 * self.rank] = self.run.feed.buffered
        counts[2 * self.rank + 1] = int(self.run.feed.own_ended)
        return self.run.agreer.start_sum(counts)

    def settle_offer(self) -> WindowPlan:
        """Wait for the offer in flight (raising on every rank what it found) and plan the
        window from every rank's counts."""
        assert self.offer is not None
        report, pending, counts = self.offer
        self.offer = None
        self.run.check(report, pending.wait())
        summed = (counts or self.start_counts()).wait()
        buffered, ended = summed[0::2], [bool(flag) for flag in summed[1::2]]
        self.ended = ended
        window = self.run.settings.window(self.run.steps_done)
        assert window is not None
        return plan_window(buffered, ended, self.run.steps_done > 0, window)

    def send_extras(self, plan: WindowPlan) -> list[FedBatch[BatchT]]:
        """Take the batches the window uses out of the buffer, send the others' to them, and
        return this rank's (by their index in the buffer)."""
        # The previous window's batches were all taken (each rank started this window's
        # agreement after its last step), so this returns at once and lets them go: the
        # Handover holds what it sent until finish(), a whole epoch's worth otherwise.
        self.handover.finish()
        feed, counts = self.run.feed, self.run.counts
        sends = plan.sends(self.rank)
        taken = max([plan.used[self.rank]] + [index + 1 for _, index, _ in sends])
        kept = [feed.take() for _ in range(taken)]
        for receiver, index, padding in sends:
            fed = kept[index]
            self.handover.send(fed.batch, receiver)
            if not padding:
                counts.count_sent(fed.count_samples(fed.batch))
        self.expected = _expected_from(plan, self.rank)
        return kept

    def take(self, slot: Slot, kept: Sequence[FedBatch[BatchT]]) -> FedBatch[BatchT]:
        """The batch this rank hands out at a step of the window: its own, one another rank
        sent, or padding."""
        if slot.giver == self.rank:
            fed = self.last if slot.index < 0 else kept[slot.index]
            assert fed is not None
        else:
            self.expected[slot.giver] -= 1
            batch = self.handover.receive(slot.giver)
            fed = FedBatch(batch, 1, self.run.feed.count_samples, received=True)
        if slot.padding:
            fed = fed._replace(padding=True)
        self.last = fed
        return fed

    def stop(self) -> None:
        """The consumer stopped early, on every rank: take the batches sent to this rank and
        not handed out, and wait until this rank's have arrived."""
        for giver, count in self.expected.items():
            for _ in range(count):
                self.handover.receive(giver)
        self.handover.finish()

    def close(self) -> None:
        """Whatever ends the epoch: complete the offer every rank started, close the feed."""
        if self.offer is not None:
            _, pending, counts = self.offer
            pending.finish_started()
            if counts is not None:
                counts.finish_started()
        self.run.close()


def _expected_from(plan: WindowPlan, rank: int) -> dict[int, int]:
    """How many batches each other rank sends this one in the window."""
    expected: dict[int, int] = {}
    for slot in plan.slots[rank]:
        if slot.giver != rank:
            expected[slot.giver] = expected.get(slot.giver, 0) + 1
    return expected
