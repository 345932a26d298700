"""What each rank did in an epoch: counted locally, gathered once, the same on every rank."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddp_even.protocol import Agreer

logger = logging.getLogger("ddp_even")

_UNKNOWN = -1


@dataclass
class RankCounts:
    """One rank's running counts during an epoch."""

    steps: int = 0
    own_batches: int = 0
    repeated_batches: int = 0
    passes: int = 0
    # None once a batch's size could not be read.
    samples: int | None = 0
    # Rows of the first pass handed out.
    own_samples: int | None = 0
    truncated: bool = False
    # This rank's batches and rows according to a shard plan, when there is one.
    planned_batches: int | None = None
    planned_rows: int | None = None

    def count_batch(self, pass_number: int, rows: int | None) -> None:
        self.steps += 1
        if pass_number > 1:
            self.repeated_batches += 1
        else:
            self.own_batches += 1
            self.own_samples = _add(self.own_samples, rows)
        self.passes = max(self.passes, pass_number)
        self.samples = _add(self.samples, rows)

    def as_vector(self) -> list[int]:
        return [
            self.steps,
            self.own_batches,
            self.repeated_batches,
            self.passes,
            _encode(self.samples),
            _encode(self.own_samples),
            int(self.truncated),
            _encode(self.planned_batches),
            _encode(self.planned_rows),
        ]


def _add(total: int | None, rows: int | None) -> int | None:
    return None if total is None or rows is None else total + rows


def _encode(value: int | None) -> int:
    return _UNKNOWN if value is None else value


def _decode(value: int) -> int | None:
    return None if value == _UNKNOWN else value


@dataclass(frozen=True)
class EpochStats:
    """What every rank did in one epoch; equal on every rank.

    Per-rank fields are tuples indexed by rank.

    Attributes:
        epoch: index of the epoch, counted by the loader from 0.
        mode: ``"truncate"``, ``"cycle"`` or ``"join"``.
        world_size: number of ranks.
        steps: batches each rank yielded.
        own_batches: batches each rank yielded from its first pass over its shard.
        repeated_batches: batches yielded after the shard was started again (cycle).
        passes: how many passes over its shard each rank handed out batches from (1 when
            it had none; a pass started by the read-ahead and never used is not counted).
        samples: rows each rank yielded, or None where a batch's size could not be read.
        truncated: whether each rank still had data when the epoch stopped.
        dropped_batches: batches of its shard each rank did not hand out, known when the loader
            has a shard plan (``EvenLoader(..., plan=...)`` or ``from_parquet``); else None.
        dropped_rows: the same in rows; None without a plan or where a batch's size is unknown.
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
    dropped_batches: tuple[int, ...] | None = None
    dropped_rows: tuple[int, ...] | None = None
    oversampling: float = field(init=False)

    def __post_init__(self) -> None:
        own = sum(self.own_batches)
        object.__setattr__(self, "oversampling", sum(self.repeated_batches) / own if own else 0.0)

    def summary(self) -> str:
        """One line, as logged on rank 0 after each epoch."""
        line = (
            f"epoch {self.epoch} {self.mode} {self.world_size} ranks: {_steps_text(self.steps)}; "
            f"own {_slashed(self.own_batches)}; repeated {_slashed(self.repeated_batches)}; "
            f"oversampling {self.oversampling:.1%}"
        )
        if any(self.truncated):
            cut = ",".join(str(rank) for rank, cut in enumerate(self.truncated) if cut)
            line += f"; truncated ranks {cut}"
        return line

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _slashed(values: tuple[int, ...]) -> str:
    return "/".join(str(value) for value in values)


def _steps_text(steps: tuple[int, ...]) -> str:
    if len(set(steps)) == 1:
        return f"{steps[0]} steps"
    return f"steps {_slashed(steps)}"


def gather_epoch_stats(agreer: Agreer, counts: RankCounts, epoch: int, mode: str) -> EpochStats:
    """Collect every rank's counts with one all-gather that every rank reaches."""
    rows = agreer.gather_counts(counts.as_vector())
    columns = list(zip(*rows, strict=True))
    own_samples = [_decode(value) for value in columns[5]]
    planned_batches = [_decode(value) for value in columns[7]]
    planned_rows = [_decode(value) for value in columns[8]]
    dropped_batches = _shortfall(planned_batches, columns[1])
    dropped_rows = None if dropped_batches is None else _shortfall(planned_rows, own_samples)
    stats = EpochStats(
        epoch=epoch,
        mode=mode,
        world_size=agreer.world_size,
        steps=tuple(columns[0]),
        own_batches=tuple(columns[1]),
        repeated_batches=tuple(columns[2]),
        passes=tuple(columns[3]),
        samples=tuple(_decode(value) for value in columns[4]),
        truncated=tuple(bool(value) for value in columns[6]),
        dropped_batches=dropped_batches,
        dropped_rows=dropped_rows,
    )
    if agreer.rank == 0:
        logger.info("%s", stats.summary())
        for rank in range(agreer.world_size):
            _warn_if_off_plan(
                rank, stats, own_samples[rank], planned_batches[rank], planned_rows[rank]
            )
    return stats


def _shortfall(planned: Sequence[int | None], got: Sequence[int | None]) -> tuple[int, ...] | None:
    """What each rank did not hand out of its plan; None unless every number is known."""
    pairs = list(zip(planned, got, strict=True))
    if any(wanted is None or have is None for wanted, have in pairs):
        return None
    return tuple(
        max(0, wanted - have) for wanted, have in pairs if wanted is not None and have is not None
    )


def _warn_if_off_plan(
    rank: int,
    stats: EpochStats,
    own_rows: int | None,
    planned_batches: int | None,
    planned_rows: int | None,
) -> None:
    """Say loudly when a rank's first pass did not deliver what the Parquet footers promise."""
    if planned_batches is None or planned_rows is None or own_rows is None:
        return
    read_whole_shard = not stats.truncated[rank]
    own_batches = stats.own_batches[rank]
    if read_whole_shard and (own_batches, own_rows) != (planned_batches, planned_rows):
        logger.warning(
            "epoch %d: rank %d read %d batches / %d rows from its shard, but the shard plan "
            "(from the Parquet footers) says %d batches / %d rows: its reader lost or added rows "
            "(petastorm 0.13.x drops row groups; a predicate or transform must not be planned)",
            stats.epoch,
            rank,
            own_batches,
            own_rows,
            planned_batches,
            planned_rows,
        )
    elif own_batches > planned_batches:
        logger.warning(
            "epoch %d: rank %d handed out %d batches of its own shard, more than the %d its "
            "shard plan has",
            stats.epoch,
            rank,
            own_batches,
            planned_batches,
        )
