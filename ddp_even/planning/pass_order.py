"""The order in which a planned reader reads its shard: one pure function, for readers and resumes.

The pyarrow reader reads its row groups in this order, and a resume works out from it which rows
a rank had read after ``step`` steps: the rank's shard in plan order or, with
``shuffle_row_groups`` and a seed, permuted by the epoch's seed (:func:`epoch_seed`). An
unseeded shuffle is drawn afresh each pass, so it has no order to compute.

With ``shuffle_rows`` and a seed the reader permutes a row group's rows (seeded by ``(epoch
seed, row group)``) before a split row group is cut: a
:data:`~ddp_even.planning.sharding.RowRange` counts rows in that order, so the ranges hold
either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddp_even.planning.plans import ShardPlan
from ddp_even.planning.sharding import SHARDINGS, RowRange

__all__ = ["PassOrder", "epoch_seed", "pass_rows"]


def epoch_seed(seed: int | None, epoch: int, rank: int, plan: ShardPlan) -> int | None:
    """The seed of one epoch's reader: the user's, mixed with the epoch (and with the rank when
    every rank reads everything), so epochs differ and a resumed epoch shuffles the same.

    ``"replicate"`` always has one (from seed 0 when none is given), so that every rank reads
    every row group in an order of its own.

    Example:
        >>> from ddp_even.planning import plan_shards
        >>> plan = plan_shards([4, 4], world_size=2, batch_size=2)
        >>> epoch_seed(7, 0, 0, plan) == epoch_seed(7, 0, 1, plan) != epoch_seed(7, 1, 0, plan)
        True
        >>> epoch_seed(None, 0, 0, plan) is None
        True
    """
    if SHARDINGS[plan.sharding].every_rank_reads_everything:
        seed = 0 if seed is None else seed
        return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def pass_rows(plan: ShardPlan, rank: int, sizes: Sequence[int], seed: int | None) -> list[RowRange]:
    """The rows ``rank`` reads in one pass over its shard of ``plan``, in the order it reads them.

    Its row groups in plan order, permuted by ``seed`` when one is given; each row group's
    range (or ranges) as the plan gives them, the whole row group otherwise.

    Example:
        >>> from ddp_even.planning import plan_shards
        >>> plan = plan_shards([3, 3, 3, 3], world_size=2, batch_size=2)
        >>> pass_rows(plan, 0, [3, 3, 3, 3], seed=None)
        [(0, 0, 3), (2, 0, 3)]
        >>> sorted(pass_rows(plan, 0, [3, 3, 3, 3], seed=5)) == pass_rows(plan, 0, [3] * 4, None)
        True
    """
    groups = list(plan.shards[rank])
    if seed is not None:
        groups = [groups[index] for index in np.random.default_rng(seed).permutation(len(groups))]
    ranges: dict[int, list[tuple[int, int]]] = {}
    for group, start, stop in plan.row_ranges_of(rank):
        ranges.setdefault(group, []).append((start, stop))
    return [
        (group, start, stop)
        for group in groups
        for start, stop in ranges.get(group, [(0, sizes[group])])
    ]


@dataclass(frozen=True)
class PassOrder:
    """How a planned reader orders its row groups: the user's ``seed`` and ``shuffle_row_groups``.

    Example:
        >>> from ddp_even.planning import plan_shards
        >>> plan = plan_shards([3, 3, 3, 3], world_size=1, batch_size=2)
        >>> PassOrder().rows(plan, [3] * 4, rank=0, epoch=0)
        [(0, 0, 3), (1, 0, 3), (2, 0, 3), (3, 0, 3)]
        >>> seeded = PassOrder(seed=1, shuffle_row_groups=True)
        >>> seeded.rows(plan, [3] * 4, 0, epoch=0) == seeded.rows(plan, [3] * 4, 0, epoch=0)
        True
    """

    #: The seed given in ``reader_kwargs`` (each epoch mixes it, :func:`epoch_seed`).
    seed: int | None = None
    #: Whether row groups are shuffled (petastorm's ``shuffle_row_groups``, on by default).
    shuffle_row_groups: bool = False

    def is_known(self, plan: ShardPlan) -> bool:
        """Whether the order follows from the plan: no shuffle, or a seeded one."""
        return not self.shuffle_row_groups or self._seeded(plan)

    def _seeded(self, plan: ShardPlan) -> bool:
        """Whether each epoch has a seed (:func:`epoch_seed`): one given, or replicate's own."""
        return self.seed is not None or SHARDINGS[plan.sharding].every_rank_reads_everything

    def why_not_known(self, plan: ShardPlan, shuffle_rows: bool) -> str | None:
        """Why a pass's rows may come in another order than :meth:`rows` and a seeded row
        shuffle say (an unseeded shuffle of row groups or rows), or None.

        Example:
            >>> from ddp_even.planning import plan_shards
            >>> plan = plan_shards([3, 3], world_size=1, batch_size=2)
            >>> print(PassOrder(shuffle_row_groups=True).why_not_known(plan, shuffle_rows=False))
            row groups are shuffled without a seed (pass seed=... in reader_kwargs, or ...
        """
        if not self.is_known(plan):
            return (
                "row groups are shuffled without a seed (pass seed=... in reader_kwargs, or "
                "shuffle_row_groups=False)"
            )
        if shuffle_rows and not self._seeded(plan):
            return (
                "rows are shuffled without a seed (pass seed=... in reader_kwargs, or "
                "shuffle_rows=False)"
            )
        return None

    def rows(self, plan: ShardPlan, sizes: Sequence[int], rank: int, epoch: int) -> list[RowRange]:
        """What :func:`pass_rows` gives for ``rank``'s pass of ``epoch`` over ``plan``.

        Raises ``ValueError`` for an unseeded shuffle, whose order nobody knows in advance.
        """
        if not self.is_known(plan):
            raise ValueError("row groups shuffled without a seed have no order to compute")
        seed = epoch_seed(self.seed, epoch, rank, plan) if self.shuffle_row_groups else None
        return pass_rows(plan, rank, sizes, seed)
