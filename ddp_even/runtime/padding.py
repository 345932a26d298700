"""Pad mode at run time: each step's real rows, the batch weight, and padding for an empty shard
(docs/design.md, "Pad's real rows" and "Pad's empty shards").

**The weight.** DDP averages the gradients of the ``W`` ranks. A rank whose batch at a step has
``n`` real rows (0 for padding), out of ``N`` real rows over all ranks at that step, multiplies
its mean loss by ``n * W / N``; the averaged gradient is then
``(1 / W) * sum over ranks of (n * W / N) * (1 / n) * sum of its rows' gradients``, the gradient
of the mean loss over the step's ``N`` real rows, as one process computing all of them would.
With a shard plan every rank works out every rank's rows at every step (:class:`PlannedRows`);
without one, each window's agreement comes with an ``all_reduce(SUM)`` of the window's real
rows per step (:class:`PadWeights`). A rank with an empty shard pads with a copy of the lowest
other rank's first batch (:func:`share_padding`).
"""

from __future__ import annotations

import bisect
import io
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ddp_even.agreement.wire import Agreement, Report
from ddp_even.errors import EmptyShardError
from ddp_even.runtime.feed import ShardFeed, compacted

if TYPE_CHECKING:
    from ddp_even.agreement.transport import Agreer, Pending
    from ddp_even.planning.plans import ShardPlan

logger = logging.getLogger("ddp_even")

__all__ = [
    "PadWeights",
    "PlannedRows",
    "batch_weight",
    "rows_to_sum",
    "share_padding",
    "summed_rows",
]

# A rank whose batch's rows cannot be told adds this to the step's sum: a sum this large says
# "unknown" (no batch has 2**40 rows, and fewer than 2**22 ranks add it).
_UNKNOWN_ROWS = 1 << 40


def batch_weight(own_rows: int | None, total_rows: int | None, world_size: int) -> float | None:
    """``own_rows * world_size / total_rows``; 0 when no rank has a real row; None if unknown.

    Example::

        >>> batch_weight(8, 20, world_size=4)  # 8 of the step's 20 real rows, on 4 ranks
        1.6
        >>> batch_weight(0, 20, 4), batch_weight(None, 20, 4)
        (0.0, None)
    """
    if own_rows is None or total_rows is None:
        return None
    return own_rows * world_size / total_rows if total_rows else 0.0


class PlannedRows:
    """Every rank's real rows at every step of a plan's epoch: ``batch_size`` rows per batch,
    a short last one, none past the rank's data.

    Example::

        >>> from ddp_even.planning import plan_shards
        >>> rows = PlannedRows(plan_shards([20, 7, 12], world_size=3, batch_size=8))
        >>> [rows.of(rank, 2) for rank in range(3)], rows.total(0), rows.total(1), rows.total(2)
        ([4, 0, 0], 23, 12, 4)
    """

    def __init__(self, plan: ShardPlan) -> None:
        self._plan = plan
        batches = plan.batches_per_rank
        self._batch_size = plan.batch_size
        # Ranks by their batch count, so that a step's full batches are one bisection away.
        self._sorted_batches = sorted(batches)
        self._last_rows_at: dict[int, int] = {}
        for rank, count in enumerate(batches):
            if count:
                last = plan.rows_per_rank[rank] - (count - 1) * plan.batch_size
                self._last_rows_at[count - 1] = self._last_rows_at.get(count - 1, 0) + last

    def of(self, rank: int, step: int) -> int:
        """Real rows of ``rank``'s batch at ``step`` (counted from 0)."""
        count = self._plan.batches_per_rank[rank]
        if step < count - 1:
            return self._batch_size
        if step == count - 1:
            return self._plan.rows_per_rank[rank] - step * self._batch_size
        return 0

    def total(self, step: int) -> int:
        """Real rows over all ranks at ``step``."""
        # Ranks with more than step + 1 batches hand out a full batch at this step.
        full = len(self._sorted_batches) - bisect.bisect_right(self._sorted_batches, step + 1)
        return full * self._batch_size + self._last_rows_at.get(step, 0)


def rows_to_sum(rows: Sequence[int | None], window: int) -> list[int]:
    """A rank's real rows for each of the ``window`` steps ahead (those it did not buffer: 0),
    as the sum over ranks takes them.

    Example::

        >>> summed_rows([a + b for a, b in zip(rows_to_sum([8, 3], 3), rows_to_sum([8, None], 3))])
        [16, None, 0]
    """
    ahead = [_UNKNOWN_ROWS if count is None else count for count in rows[:window]]
    return ahead + [0] * (window - len(ahead))


def summed_rows(totals: Sequence[int]) -> list[int | None]:
    """Each step's real rows over all ranks, from the sum of :func:`rows_to_sum`; None where
    some rank could not tell its batch's rows."""
    return [None if total >= _UNKNOWN_ROWS else total for total in totals]


class PadWeights:
    """Each step's loss weight in one pad epoch: every rank's real rows at every step from the
    plan (:class:`PlannedRows`), or, without one, the real rows over all ranks at each step of
    the current window, summed with its agreement."""

    def __init__(self, agreer: Agreer, plan: ShardPlan | None) -> None:
        self._agreer = agreer
        self._planned = None if plan is None else PlannedRows(plan)
        # Without a plan: the current window's sums, from the step ``_window_start``, and the
        # sum for the next window once every rank is known to start it.
        self._window_rows: list[int | None] = []
        self._window_start = 0
        self._pending: Pending[list[int]] | None = None
        self._sums_ahead = False

    def weight(self, step: int, rows: int | None) -> float | None:
        """The weight of this rank's batch of ``rows`` real rows handed out at ``step``."""
        world_size = self._agreer.world_size
        planned = self._planned
        if planned is not None:
            own = planned.of(self._agreer.rank, step)
            return batch_weight(own, planned.total(step), world_size)
        return batch_weight(rows, self._window_rows[step - self._window_start], world_size)

    def offered(self, feed: ShardFeed[Any], window: int) -> None:
        """A window's agreement was started: its sum starts beside it (after the first)."""
        if self._sums_ahead:
            self._pending = self._start_sum(feed, window)

    def settle(self, feed: ShardFeed[Any], window: int, first_step: int) -> None:
        """Without a plan: the real rows over all ranks at each step of the window agreed,
        which starts at ``first_step``."""
        if self._planned is not None:
            return
        if self._pending is None:
            # The epoch's first window: its agreement showed that every rank runs this loop,
            # so every rank starts this sum, and from now on with each agreement.
            self._pending = self._start_sum(feed, window)
            self._sums_ahead = True
        pending, self._pending = self._pending, None
        self._window_rows = summed_rows(pending.wait())
        self._window_start = first_step

    def finish_started(self) -> None:
        """Wait for a sum in flight (every rank started it) when the epoch stops early."""
        if self._pending is not None:
            self._pending.finish_started()

    def _start_sum(self, feed: ShardFeed[Any], window: int) -> Pending[list[int]]:
        return self._agreer.start_sum(rows_to_sum(feed.buffered_rows(), window))


def share_padding(
    agreer: Agreer, feed: ShardFeed[Any], reports: Sequence[Report], fixed_steps: bool
) -> Agreement:
    """Give every rank without a batch a copy of the lowest other rank's first batch.

    Called on every rank with the same ``reports`` (gathered because some rank's shard is
    empty, nothing else being wrong); returns the agreement they carry. When no rank has a
    batch the epoch has no step, unless ``steps_per_epoch`` fixes its steps (``fixed_steps``):
    then every rank raises :class:`~ddp_even.EmptyShardError`.
    """
    donors = [index for index, peer in enumerate(reports) if peer.available > 0]
    if not donors and fixed_steps:
        raise EmptyShardError(
            tuple(peer.rank for peer in reports),
            "no rank has a batch, and steps_per_epoch asks for steps",
        )
    if donors:
        donor = donors[0]
        payload = _saved(feed.donation()) if agreer.rank == donor else None
        received = agreer.broadcast_bytes(payload, donor)
        if not received:
            raise EmptyShardError(
                tuple(peer.rank for peer in reports if peer.empty_shard),
                f"rank {reports[donor].rank}'s first batch cannot be sent to pad them "
                "(torch.save failed there; its log says why)",
            )
        if not feed.can_pad:
            batch, rows = torch.load(io.BytesIO(received), map_location="cpu", weights_only=False)
            feed.pad_with(batch, rows)
            logger.info(
                "this rank's shard is empty: it pads with a copy of rank %d's first batch",
                reports[donor].rank,
            )
    return Agreement(
        min_available=min(peer.available for peer in reports),
        max_own_available=max(peer.own_available for peer in reports),
        has_problem=False,
    )


def _saved(donation: tuple[Any, int | None] | None) -> bytes | None:
    if donation is None:
        return None
    buffer = io.BytesIO()
    try:
        torch.save((compacted(donation[0]), donation[1]), buffer)
    except Exception as error:  # any object a loader yields; every rank raises the same
        logger.warning("the first batch cannot be sent as padding to an empty rank: %r", error)
        return None
    return buffer.getvalue()
