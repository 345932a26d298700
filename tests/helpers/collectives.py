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


def source_checks(steps: int, counted_from: int = 2) -> int:
    """All-reduces an epoch of ``steps`` steps with known lengths starts from step
    ``counted_from`` on: a check of the sources every ``CHECK_EVERY`` steps and one at the last
    step (``AllReduceCounter`` started after the first batch counts from step 2).

    Exact up to ``3 * CHECK_EVERY`` steps of a loader's first epoch: its first two checks are
    ``CHECK_EVERY`` apart, and the spacing after them follows the pace of the steps, as does a
    later epoch's from its start (``runtime/settings.py``).
    """
    from ddp_even.runtime.settings import CHECK_EVERY

    assert steps <= 3 * CHECK_EVERY, f"{steps} steps: the checks after step 48 follow the pace"
    checked = {step for step in range(1, steps + 1) if step % CHECK_EVERY == 0 or step == steps}
    return sum(1 for step in checked if step >= counted_from)
