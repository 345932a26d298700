"""Exceptions ddp_even raises on every rank at the same step, instead of hanging."""

from __future__ import annotations


class EvenLoaderError(RuntimeError):
    """Base class: something made the ranks unable to agree on the next step."""


class PeerSourceError(EvenLoaderError):
    """Another rank's data source raised; this rank stops at the same step.

    The rank whose source failed re-raises its own exception instead.
    """

    def __init__(self, failed_rank: int, error_type: str, error_message: str, step: int) -> None:
        self.failed_rank = failed_rank
        self.error_type = error_type
        self.error_message = error_message
        self.step = step
        super().__init__(
            f"rank {failed_rank}'s data source raised {error_type}: {error_message} "
            f"(before step {step}); every rank stops here"
        )


class EmptyShardError(EvenLoaderError):
    """Cycle mode was asked to wrap around a shard that yields no batch at all."""

    def __init__(self, empty_ranks: tuple[int, ...]) -> None:
        self.empty_ranks = empty_ranks
        names = ", ".join(str(rank) for rank in empty_ranks)
        super().__init__(
            f"cycle mode cannot wrap around an empty shard: rank(s) {names} have no batch. "
            "Give every rank at least one row group (fewer ranks, smaller row groups, or a "
            "balanced plan), or use mode='truncate' or mode='join'"
        )


class RankMismatchError(EvenLoaderError):
    """Ranks were set up differently (mode, steps_per_epoch, window) or are in different epochs."""


class PeerTimeoutError(EvenLoaderError):
    """Some ranks did not reach the agreement within the loader's timeout (dead or stalled)."""

    def __init__(self, missing_ranks: tuple[int, ...], timeout: float, detail: str) -> None:
        self.missing_ranks = missing_ranks
        self.timeout = timeout
        names = ", ".join(str(rank) for rank in missing_ranks) or "unknown"
        super().__init__(
            f"rank(s) {names} did not answer the step agreement within {timeout:g} s "
            f"(dead or stalled): {detail}"
        )
