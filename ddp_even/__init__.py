"""ddp_even: equal steps on every DDP rank over uneven Petastorm/Parquet shards.

Two names to remember: :class:`EvenLoader` wraps the loader a rank already has;
:class:`EpochStats` says what every rank did in an epoch. The exceptions are raised on every
rank at the same step, instead of a hang.
"""

from ddp_even.errors import (
    EmptyShardError,
    EvenLoaderError,
    OffPlanError,
    PeerSourceError,
    PeerTimeoutError,
    RankMismatchError,
    SourceEndedEarlyError,
)
from ddp_even.loader import EvenLoader
from ddp_even.runtime.stats import EpochStats

__all__ = [
    "EmptyShardError",
    "EpochStats",
    "EvenLoader",
    "EvenLoaderError",
    "OffPlanError",
    "PeerSourceError",
    "PeerTimeoutError",
    "RankMismatchError",
    "SourceEndedEarlyError",
]
__version__ = "0.2.0"
