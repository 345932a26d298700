"""Every epoch's start, with every rank: what the ranks' first passes read, and the batch counts
their Parquet footers give.

**What the ranks read.** A petastorm reader the user built reads the row groups its
``cur_shard``/``shard_count`` give it, and nothing in petastorm checks that the ranks' shards
fit together. Each rank opens its first pass (nothing is read yet) and describes its row groups
as :func:`~ddp_even.planning.coverage.reading_described` does, in words every rank shares
exactly when the ranks read the dataset once between them (or each all of it). The words ride
in the epoch's first agreement: when every rank sent the same, nothing more is sent; otherwise
the ranks gather their row groups and every rank raises the same
:class:`~ddp_even.ShardCoverageError` before the first step, naming the row groups no rank
reads or several do.

**The batch counts.** A petastorm loader sharded with ``cur_shard``/``shard_count`` reads rows
that follow from the footers when nothing drops rows
(:func:`ddp_even.petastorm.reading.round_robin_plan` says when). Whether the epoch then runs
with known lengths (one agreement; between steps only spaced-out checks) or agrees as it goes
must be one decision for every rank: a rank with the plan and a rank without would wait in different
collectives. So the same agreement compares the plans the ranks worked out: the plan is used
when every rank has the same one, and otherwise every rank agrees as it goes. It is worked
out again at every epoch's start, so lengths are never reused from a dataset that has changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from ddp_even.agreement.transport import Agreer
from ddp_even.agreement.wire import Report, error_from_reports
from ddp_even.errors import RankMismatchError, ShardCoverageError
from ddp_even.planning.coverage import coverage_problem, reading_described
from ddp_even.runtime.feed import ShardFeed

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan
    from ddp_even.runtime.settings import Settings
    from ddp_even.sources.base import PassReading

logger = logging.getLogger("ddp_even")

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
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big") or 1
