"""Counting the collectives ddp_even starts while an epoch runs (in a rank's process)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import ddp_even.agreement.transport


class AllReduceCounter:
    """Counts the all-reduces ddp_even starts (its only per-step collective) between
    :meth:`start` and :meth:`stop`; started after the first step, it counts what runs between
    steps."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = dist.all_reduce

    def _counting(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._real(*args, **kwargs)

    def start(self) -> None:
        ddp_even.agreement.transport.dist.all_reduce = self._counting  # type: ignore[attr-defined]

    def stop(self) -> None:
        ddp_even.agreement.transport.dist.all_reduce = self._real  # type: ignore[attr-defined]
