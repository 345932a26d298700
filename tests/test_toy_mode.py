"""A mode is one class: one defined here, and nowhere in the package, trains on 2 gloo ranks.

``Capped`` is cycle with a ceiling: short shards start again until the longest ends, but no
epoch takes more than ``LIMIT`` steps. It says what a rank does past its own data and whether
ranks share their steps (the two choices the runtime asks), how many steps the ranks take
(``agreed_steps`` and ``decide``) and what an epoch over known shards does (``epoch_outcome``);
the loader takes the object as its ``mode``. Every epoch shape is used: known lengths (lists),
windows (factories with ``sync_every``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest
import torch

from ddp_even.agreement.wire import Agreement
from ddp_even.modes import AfterOwnData, Mode, ModeStats, WindowDecision
from tests.helpers.scenarios import shard
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.multirank

LIMIT = 5
LENGTHS = (3, 9)


class Capped(Mode):
    """Short shards start again until the longest ends, for at most ``LIMIT`` steps."""

    name: ClassVar[str] = "capped"
    summary: ClassVar[str] = f"shorter shards start over until the longest ends, {LIMIT} at most"
    after_own_data: ClassVar[AfterOwnData] = "restart"
    waste_means: ClassVar[str] = "batches repeated as % of own batches"

    def agreed_steps(
        self, agreement: Agreement, window: int | None, steps_per_epoch: int | None
    ) -> int:
        return agreement.max_own_available

    def decide(
        self,
        agreement: Agreement,
        window: int | None,
        steps_done: int,
        steps_per_epoch: int | None,
    ) -> WindowDecision:
        steps = min(self.agreed_steps(agreement, window, None), LIMIT - steps_done)
        if window is not None:
            steps = min(steps, window)
        last = window is None or steps < window or steps_done + steps >= LIMIT
        return WindowDecision(steps=steps, last=last)

    def epoch_outcome(
        self, rows: npt.NDArray[np.int64], batches: npt.NDArray[np.int64], batch_size: int
    ) -> ModeStats:
        steps = min(int(batches.max()), LIMIT)
        repeated = np.maximum(steps - batches, 0)
        return ModeStats.of(
            self.name, steps, float(repeated.sum()), int(batches.sum()), repeated_batches=repeated
        )

    def note_with_empty_ranks(self, empty_ranks: str, steps: int) -> tuple[bool, str]:
        return False, f"cannot run: rank(s) {empty_ranks} have no batch to repeat"


def _toy_worker(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader

    own = shard(rank, LENGTHS[rank])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: dict[str, Any] = {}
    sources: dict[str, Callable[[], EvenLoader[list[int]]]] = {
        "known lengths": lambda: EvenLoader(own, Capped()),
        "windows": lambda: EvenLoader(lambda: iter(own), Capped(), sync_every=2),
    }
    for shape, make in sources.items():
        loader = make()
        batches = []
        for batch in loader:
            model(torch.tensor([batch], dtype=torch.float32)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            batches.append(batch)
        seen[shape] = {"batches": batches, "stats": loader.stats.as_dict()}
    return seen


@pytest.mark.timeout(120)
def test_a_mode_defined_in_one_class_elsewhere_trains_on_two_ranks() -> None:
    ranks = run_ranks(_toy_worker, len(LENGTHS), timeout=90)
    steps = min(max(LENGTHS), LIMIT)
    for rank, seen in enumerate(ranks):
        own = shard(rank, LENGTHS[rank])
        expected = (own * steps)[:steps]  # restarted past its own data, cut at the ceiling
        for shape, outcome in seen.items():
            assert outcome["batches"] == expected, (rank, shape)
            stats = outcome["stats"]
            assert stats["mode"] == "capped" and stats["steps"] == (steps,) * len(LENGTHS)
            assert stats["repeated_batches"][rank] == max(steps - LENGTHS[rank], 0)
