"""What each rank did in an epoch: counted locally, gathered once, the same on every rank."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ddp_even.runtime.feed import RankCounts

logger = logging.getLogger("ddp_even")


@dataclass(frozen=True)
class EpochStats:
    """What every rank did in one epoch; equal on every rank.

    Per-rank fields are tuples indexed by rank (in the training group).

    Attributes:
        epoch: index of the epoch, counted by the loader from 0.
        mode: ``"truncate"``, ``"cycle"``, ``"pad"``, ``"join"`` or ``"share"``.
        world_size: number of ranks.
        steps: batches each rank yielded.
        own_batches: batches each rank yielded from its first pass over its shard.
        repeated_batches: batches yielded after the shard was started again (cycle).
        passes: how many passes over its shard each rank handed out batches from (1 when
            it had none; a pass started by the read-ahead and never used is not counted).
        samples: rows each rank yielded (padding included), or None where a batch's size
            could not be read.
        truncated: whether each rank still had data when the epoch stopped.
        padded_batches: padding batches each rank handed out past its data (pad; 0 otherwise).
        padded_rows: the rows of those, or None where a batch's size could not be read.
        sent_batches: batches of its shard each rank handed to another rank (share; 0
            otherwise), and ``sent_rows`` their rows (None where a batch's size is unknown).
        received_batches: other ranks' batches each rank handed out (share; 0 otherwise), and
            ``received_rows`` their rows.
        dropped_batches: batches of its shard each rank did not hand out because the epoch
            stopped first, known when the loader has a shard plan (``EvenLoader(...,
            plan=...)`` or ``from_parquet``); else None.
        dropped_rows: the same in rows; None without a plan or where a batch's size is unknown.
        lost_rows: rows of its plan each rank's source never delivered although it read its
            whole shard (a reader that loses rows); None without a plan.
        sharding: how the loader's shard plan cut the dataset into shards (``"round_robin"``,
            ``"row_groups"``, ``"rows"`` or ``"replicate"``: every rank read every row group,
            in its own order; see :mod:`ddp_even.planning.sharding`), or None without a plan.
            A rest of an epoch re-planned over another number of ranks is cut by ``"rows"``.
        resumed_at_step: the step after which this epoch resumed from a loader state
            (:meth:`EvenLoader.load_state_dict`), or None; every other field counts the whole
            epoch, as if it had not been interrupted (on the same number of ranks).
        resumed_from_world_size: when the epoch resumed on another number of ranks (a planned
            loader re-plans the rows no rank had read over the new ranks), the number it was
            interrupted on; every other field then counts the rest of the epoch, from
            ``resumed_at_step`` on, over this job's ranks. None otherwise.
        oversampling: ``sum(repeated_batches) / sum(own_batches)`` (0.0 without own batches).

    Example::

        >>> from ddp_even import EvenLoader
        >>> loader = EvenLoader([[1, 2], [3, 4]], mode="truncate")
        >>> [batch for batch in loader]
        [[1, 2], [3, 4]]
        >>> loader.stats.steps, loader.stats.samples, loader.stats.oversampling
        ((2,), (4,), 0.0)
    """

    epoch: int
    mode: str
    world_size: int
    steps: tuple[int, ...]
    own_batches: tuple[int, ...]
    repeated_batches: tuple[int, ...]
    passes: tuple[int, ...]
    samples: tuple[int | None, ...]
    truncated: tuple[bool, ...]
    padded_batches: tuple[int, ...]
    padded_rows: tuple[int | None, ...]
    sent_batches: tuple[int, ...]
    sent_rows: tuple[int | None, ...]
    received_batches: tuple[int, ...]
    received_rows: tuple[int | None, ...]
    dropped_batches: tuple[int, ...] | None = None
    dropped_rows: tuple[int, ...] | None = None
    lost_rows: tuple[int, ...] | None = None
    sharding: str | None = None
    resumed_at_step: int | None = None
    resumed_from_world_size: int | None = None
    oversampling: float = field(init=False)

    def __post_init__(self) -> None:
        own = sum(self.own_batches)
        object.__setattr__(self, "oversampling", sum(self.repeated_batches) / own if own else 0.0)

    @property
    def empty_ranks(self) -> tuple[int, ...]:
        """Ranks whose shard had no batch at all this epoch.

        Example::

            >>> from ddp_even import EvenLoader
            >>> loader = EvenLoader([], mode="truncate")
            >>> list(loader), loader.stats.empty_ranks
            ([], (0,))
        """
        return tuple(
            rank
            for rank in range(self.world_size)
            if self.shard_batches[rank] == 0 and not self.truncated[rank]
        )

    @property
    def shard_batches(self) -> tuple[int, ...]:
        """Batches of each rank's shard handed out this epoch, by the rank itself or, in share,
        by the ranks it sent them to (``own_batches + sent_batches``).

        Example::

            >>> from ddp_even import EvenLoader
            >>> loader = EvenLoader([[1, 2], [3]], mode="share")
            >>> list(loader), loader.stats.shard_batches
            ([[1, 2], [3]], (2,))
        """
        return tuple(
            own + sent for own, sent in zip(self.own_batches, self.sent_batches, strict=True)
        )

    @property
    def steps_saved(self) -> int:
        """Steps this epoch took fewer than pad would have on the same shards (share hands
        batches over instead of padding; 0 in the other modes).

        Example::

            >>> from ddp_even import EvenLoader
            >>> loader = EvenLoader([[1, 2], [3]], mode="share")
            >>> list(loader), loader.stats.steps_saved
            ([[1, 2], [3]], 0)
        """
        return max(self.shard_batches) - max(self.steps) if any(self.sent_batches) else 0

    def summary(self) -> str:
        """One line, as logged on rank 0 after each epoch."""
        line = (
            f"epoch {self.epoch} {self.mode} {self.world_size} ranks: {_steps_text(self.steps)}; "
            f"own {_slashed(self.own_batches)}; repeated {_slashed(self.repeated_batches)}; "
            f"oversampling {self.oversampling:.1%}"
        )
        if any(self.truncated):
            cut = [rank for rank, flag in enumerate(self.truncated) if flag]
            line += f"; truncated: {_ranks_phrase(cut)}"
        if any(self.padded_batches):
            line += f"; padded {_slashed(self.padded_batches)}"
            if None not in self.padded_rows:
                line += f" (rows {_slashed(self.padded_rows)})"
        if any(self.sent_batches):
            line += (
                f"; handed over: sent {_slashed(self.sent_batches)}, received "
                f"{_slashed(self.received_batches)} ({self.steps_saved} steps fewer than pad)"
            )
        if self.dropped_batches is not None and any(self.dropped_batches):
            line += f"; dropped batches {_slashed(self.dropped_batches)}"
            if self.dropped_rows is not None:
                line += f" (rows {_slashed(self.dropped_rows)})"
        if self.lost_rows is not None and any(self.lost_rows):
            line += f"; rows lost by the source {_slashed(self.lost_rows)}"
        if self.sharding is not None:
            line += f"; sharding {self.sharding}"
        if self.empty_ranks:
            line += f"; EMPTY: {_ranks_phrase(self.empty_ranks)}"
        if self.resumed_at_step is not None:
            line += f"; resumed after step {self.resumed_at_step}"
        if self.resumed_from_world_size is not None:
            line += f" of {self.resumed_from_world_size} ranks (re-planned: the rest only)"
        return line

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _slashed(values: tuple[int | None, ...]) -> str:
    return "/".join(str(value) for value in values)


def _ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 0`` or ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _steps_text(steps: tuple[int, ...]) -> str:
    if len(set(steps)) == 1:
        return f"{steps[0]} steps"
    return f"steps {_slashed(steps)}"


class CountsGatherer(Protocol):
    """The part of the agreement transport the statistics need."""

    rank: int
    world_size: int
    global_ranks: tuple[int, ...]

    def gather_counts(self, counts: list[int]) -> list[list[int]]: ...


def gather_epoch_stats(
    agreer: CountsGatherer,
    counts: RankCounts,
    epoch: int,
    mode: str,
    sharding: str | None = None,
    resumed_at_step: int | None = None,
    resumed_from_world_size: int | None = None,
) -> EpochStats:
    """Collect every rank's counts with one all-gather that every rank reaches."""
    columns = RankCounts.columns_of(agreer.gather_counts(counts.as_vector()))
    truncated = tuple(bool(value) for value in columns["truncated"])
    own_batches = _known(columns["own_batches"])
    planned_batches, planned_rows = columns["planned_batches"], columns["planned_rows"]
    # What each rank read of its shard: handed out itself, or sent to another rank (share).
    shard_batches = tuple(
        own + sent for own, sent in zip(own_batches, _known(columns["sent_batches"]), strict=True)
    )
    shard_rows = tuple(
        None if own is None or sent is None else own + sent
        for own, sent in zip(columns["own_samples"], columns["sent_rows"], strict=True)
    )
    dropped_batches = dropped_rows = lost_rows = None
    if None not in planned_batches:
        dropped_batches, _ = _short_of_plan(planned_batches, shard_batches, truncated)
        if None not in planned_rows and None not in shard_rows:
            dropped_rows, lost_rows = _short_of_plan(planned_rows, shard_rows, truncated)
    gathered: dict[str, Any] = {
        name: column for name, column in columns.items() if name in _GATHERED_AS_THEY_ARE
    }
    stats = EpochStats(
        epoch=epoch,
        mode=mode,
        world_size=agreer.world_size,
        truncated=truncated,
        dropped_batches=dropped_batches,
        dropped_rows=dropped_rows,
        lost_rows=lost_rows,
        sharding=sharding,
        resumed_at_step=resumed_at_step,
        resumed_from_world_size=resumed_from_world_size,
        **gathered,
    )
    if agreer.rank == 0:
        _log(stats, agreer.global_ranks, shard_rows, planned_batches, planned_rows)
    return stats


# The counts an epoch's statistics carry as every rank counted them, by the same names.
_GATHERED_AS_THEY_ARE = {
    counted.name for counted in dataclasses.fields(RankCounts) if counted.name != "truncated"
} & {stat.name for stat in dataclasses.fields(EpochStats)}


def _short_of_plan(
    planned: tuple[int | None, ...], got: tuple[int | None, ...], truncated: tuple[bool, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank, what the plan had beyond what was handed out: ``(dropped, lost)``.

    The shortfall of a rank the epoch cut off was dropped; that of a rank that read its whole
    shard was lost by its source.
    """
    short = [max(0, want - have) for want, have in zip(_known(planned), _known(got), strict=True)]
    dropped = tuple(gap if cut else 0 for gap, cut in zip(short, truncated, strict=True))
    lost = tuple(0 if cut else gap for gap, cut in zip(short, truncated, strict=True))
    return dropped, lost


def _known(column: tuple[int | None, ...]) -> tuple[int, ...]:
    return tuple(0 if value is None else value for value in column)


def _log(
    stats: EpochStats,
    global_ranks: tuple[int, ...],
    shard_rows: tuple[int | None, ...],
    planned_batches: tuple[int | None, ...],
    planned_rows: tuple[int | None, ...],
) -> None:
    logger.info("%s", stats.summary())
    # The rest of an epoch re-planned on another number of ranks: a rank with none of it left
    # is expected (the epoch was resumed at or near its end), not an empty shard.
    if stats.empty_ranks and stats.resumed_from_world_size is None:
        logger.warning(
            "epoch %d: rank(s) %s had no batch at all (an empty shard: a predicate, drop_last "
            "or fewer row groups than ranks)%s",
            stats.epoch,
            ", ".join(str(global_ranks[rank]) for rank in stats.empty_ranks),
            "; truncate ran 0 steps on every rank" if stats.mode == "truncate" else "",
        )
    # Loudly where a rank's first pass did not deliver what the Parquet footers promise.
    for rank, global_rank in enumerate(global_ranks):
        batches, rows = stats.shard_batches[rank], shard_rows[rank]
        planned, planned_in_rows = planned_batches[rank], planned_rows[rank]
        if planned is None or planned_in_rows is None or rows is None:
            continue
        if not stats.truncated[rank] and (batches, rows) != (planned, planned_in_rows):
            logger.warning(
                "epoch %d: rank %d read %d batches / %d rows from its shard, but the shard plan "
                "(from the Parquet footers) says %d batches / %d rows: its reader lost or added "
                "rows (petastorm 0.13.x drops row groups; a predicate or transform must not be "
                "planned)",
                stats.epoch,
                global_rank,
                batches,
                rows,
                planned,
                planned_in_rows,
            )
        elif batches > planned:
            logger.warning(
                "epoch %d: rank %d handed out %d batches of its own shard, more than the %d its "
                "shard plan has",
                stats.epoch,
                global_rank,
                batches,
                planned,
            )
