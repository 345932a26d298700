"""A wait at an agreement that gives up never decides alone: the collective's outcome does.

``work.wait(timeout)`` raising does not cancel a gloo collective; it can complete for every
rank a moment later, before the waiting thread runs again (a busy machine can take a tenth of
a second to schedule it). A rank that then raised on its own would leave its peers waiting in
the training's next collective: the hang found by the soak (``scripts/soak.py``). Two real gloo
ranks; the second arrives after the first's wait gave up, and the first looks at its work only
once the collective has completed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.spawn import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.in_memory]


class _LooksLate:
    """A real gloo work whose waiting thread runs again only once the collective completed."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: Any) -> Any:
        try:
            return self._work.wait(timeout)
        except RuntimeError:
            while not self._work.is_completed():
                time.sleep(0.01)
            raise

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


def _late_peer(rank: int, world_size: int, timeout: float, late_s: float) -> list[int]:
    from ddp_even.agreement.transport import CollectiveAgreer, control_group_for
    from ddp_even.liveness.rollcall import AGREEMENT, Ticket

    agreer = CollectiveAgreer(control_group_for(None, timeout), timeout)
    buffer = torch.full((2,), rank + 1, dtype=torch.int64)
    if rank == 1:
        time.sleep(late_s)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=agreer.group, async_op=True)
    agreer.await_work(_LooksLate(work), Ticket(1, time.time(), AGREEMENT))
    return [int(value) for value in buffer]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("timeout", "late_s"),
    [(30.0, 0.6), (0.5, 1.0)],
    ids=["after-the-short-wait", "after-the-deadline"],
)
def test_a_collective_that_completes_after_the_wait_gave_up_is_not_a_failure(
    timeout: float, late_s: float
) -> None:
    assert run_ranks(_late_peer, 2, timeout, late_s, timeout=60) == [[2, 2], [2, 2]]
