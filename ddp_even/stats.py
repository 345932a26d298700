"""What each rank did in an epoch: counted locally, gathered once, the same on every rank."""

from __future__ import annotations

import dataclasses
import logging
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
    truncated: bool = False

    def count_batch(self, pass_number: int, rows: int | None) -> None:
        self.steps += 1
        if pass_number > 1:
            self.repeated_batches += 1
        else:
            self.own_batches += 1
        self.passes = max(self.passes, pass_number)
        self.samples = None if self.samples is None or rows is None else self.samples + rows

    def as_vector(self) -> list[int]:
        samples = _UNKNOWN if self.samples is None else self.samples
        return [
            self.steps,
            self.own_batches,
            self.repeated_batches,
            self.passes,
            samples,
            int(self.truncated),
        ]


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
    stats = EpochStats(
        epoch=epoch,
        mode=mode,
        world_size=agreer.world_size,
        steps=tuple(columns[0]),
        own_batches=tuple(columns[1]),
        repeated_batches=tuple(columns[2]),
        passes=tuple(columns[3]),
        samples=tuple(None if value == _UNKNOWN else value for value in columns[4]),
        truncated=tuple(bool(value) for value in columns[5]),
    )
    if agreer.rank == 0:
        logger.info("%s", stats.summary())
    return stats
