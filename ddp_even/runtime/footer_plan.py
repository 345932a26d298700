"""The usual petastorm loop's batch counts, from its Parquet footers, agreed by every rank.

A petastorm loader sharded with ``cur_shard``/``shard_count`` reads rows that follow from the
footers when nothing drops rows (:func:`ddp_even.petastorm.sources.round_robin_plan` says
when). Each rank works that plan out from its own reader; whether the epoch then runs with
known lengths (one agreement, no collective between steps) or agrees as it goes must be one
decision for every rank: a rank with the plan and a rank without would wait in different
collectives. So the ranks compare what they worked out, in one agreement before the first
step: the plan is used when every rank has the same one, and otherwise every rank agrees as it
goes (a rank whose source failed meanwhile stops every rank, as at any agreement). The plan
is worked out again at every epoch's start, so lengths are never reused from a dataset that
has changed since.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from ddp_even.agreement.transport import Agreer
from ddp_even.agreement.wire import Report, error_from_reports
from ddp_even.planning.provenance import Provenance
from ddp_even.runtime.feed import ShardFeed

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan
    from ddp_even.runtime.settings import Settings

logger = logging.getLogger("ddp_even")

# Marks this agreement, so that it never pairs with another kind unnoticed.
_FOOTERS = 0x0F0F_0F0F_0F0F


class FooterPlan:
    """A loader's plan worked out from the footers, again at every epoch's start (a dataset
    rewritten between epochs is planned anew, never trusted from an earlier epoch), with every
    rank whatever its source (a rank whose source failed reports it here)."""

    def __init__(self) -> None:
        self.plan: ShardPlan | None = None

    def settle(self, feed: ShardFeed[Any], agreer: Agreer, settings: Settings, epoch: int) -> None:
        before, self.plan = self.plan, agreed_footer_plan(feed, agreer, settings, epoch)
        if before is not None and self.plan is not None and _digest(before) != _digest(self.plan):
            logger.info(
                "ddp_even: epoch %d: the Parquet footers changed since the last epoch; batches "
                "per rank now %s",
                epoch,
                "/".join(map(str, self.plan.batches_per_rank)),
            )

    @property
    def provenance(self) -> Provenance | None:
        """What the lengths follow from (a saved state is checked against it), once known."""
        plan = self.plan
        if plan is None:
            return None
        return Provenance.of(
            batch_size=plan.batch_size, rows_per_rank=plan.rows_per_rank, sharding=plan.sharding
        )


def agreed_footer_plan(
    feed: ShardFeed[Any], agreer: Agreer, settings: Settings, epoch: int
) -> ShardPlan | None:
    """The plan every rank worked out from its footers, or None when any rank has another.

    ``settings`` are the loader's (the same on every rank); ``feed`` opens its first pass here.
    """
    local = feed.first_pass_plan(agreer.rank, agreer.world_size)
    digest = 0 if local is None else _digest(local)
    failure = feed.failure
    prefix = f"{settings.description}; footer plan"
    report = Report(
        rank=agreer.global_ranks[agreer.rank],
        epoch=epoch,
        fingerprint=settings.fingerprint ^ _FOOTERS ^ digest,
        settings=f"{prefix} {digest:014x}" if digest else f"{prefix} none",
        available=int(local is not None),
        own_available=int(local is not None),
        failed=failure is not None,
        failure=None if failure is None else (type(failure).__name__, str(failure)),
        long_form=True,
    )
    agreement = agreer.start(report).wait()
    if not agreement.has_problem:
        # Every rank sent the same key: the same plan, or none on every rank.
        logger.debug("the same footer plan on every rank:%s", report.settings.removeprefix(prefix))
        return local
    reports = agreer.gather_reports(report)
    if any(peer.epoch != epoch or not peer.settings.startswith(prefix) for peer in reports):
        raise error_from_reports(reports, failure, 0)  # ranks not in the same loop
    if any(peer.failed for peer in reports):
        # Ranks in this agreement differ only by the plan they worked out: as one loop.
        same_loop = [dataclasses.replace(peer, fingerprint=0) for peer in reports]
        raise error_from_reports(same_loop, failure, 0)
    plans = "; ".join(f"rank {peer.rank}:{peer.settings.removeprefix(prefix)}" for peer in reports)
    if agreer.rank == 0:
        logger.warning(
            "ddp_even: the ranks worked out different batch counts from the Parquet footers "
            "(%s): every rank agrees at each step instead",
            plans,
        )
    logger.debug("footer plans differ (%s): no known lengths", plans)
    return None


def _digest(plan: ShardPlan) -> int:
    """56 bits naming the plan's every rank's batches and rows, and its sharding."""
    identity = (plan.sharding, plan.batch_size, plan.batches_per_rank, plan.rows_per_rank)
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big") or 1
