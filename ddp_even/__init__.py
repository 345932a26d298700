"""ddp_even: equal steps on every DDP rank over uneven Petastorm/Parquet shards.

Two names to remember: :class:`EvenLoader` wraps the loader a rank already has;
:class:`EpochStats` says what every rank did in an epoch. The exceptions are raised on every
rank at the same step, instead of a hang; every error ddp_even raises of its own is an
:class:`EvenLoaderError`. A third, :func:`allreduce_hook`, registered on the
DDP model, names a rank that dies inside DDP's own all-reduce of the gradients.

``EvenLoader``, ``EpochStats`` and ``allreduce_hook`` are imported on first use (PEP 562): they
need torch, and ``import ddp_even`` is also the start of the ``ddp-even`` command line, which
plans without torch and starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING

from ddp_even.errors import (
    ConverterDeletedError,
    DatasetError,
    EmptyShardError,
    EvenLoaderError,
    OffPlanError,
    PeerSourceError,
    PeerTimeoutError,
    PlanMismatchError,
    RankMismatchError,
    RowCountMismatchError,
    ShardCoverageError,
    SourceEndedEarlyError,
    StateMismatchError,
    TooFewRowGroupsError,
    TooFewTaskSlotsError,
)

if TYPE_CHECKING:
    from ddp_even.liveness.gradient_hook import allreduce_hook
    from ddp_even.loader import EvenLoader
    from ddp_even.runtime.stats import EpochStats

__all__ = [
    "ConverterDeletedError",
    "DatasetError",
    "EmptyShardError",
    "EpochStats",
    "EvenLoader",
    "EvenLoaderError",
    "OffPlanError",
    "PeerSourceError",
    "PeerTimeoutError",
    "PlanMismatchError",
    "RankMismatchError",
    "RowCountMismatchError",
    "ShardCoverageError",
    "SourceEndedEarlyError",
    "StateMismatchError",
    "TooFewRowGroupsError",
    "TooFewTaskSlotsError",
    "allreduce_hook",
]
# The installed distribution's version: pyproject.toml is the one place it is written.
__version__ = importlib.metadata.version("ddp_even")

# The public names imported on first use, and the module each comes from.
_LAZY = {
    "EvenLoader": "ddp_even.loader",
    "EpochStats": "ddp_even.runtime.stats",
    "allreduce_hook": "ddp_even.liveness.gradient_hook",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'ddp_even' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
