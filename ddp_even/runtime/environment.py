"""Where the loader runs, beyond its arguments: the process's rank, a trainer, a launcher.

Relies on one CPython private: ``sys._getframe``, to see whether Lightning's fit loop called
(``refuse_join_inside_lightning``; the frames of every Python, tested by
``tests/test_lightning.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import TYPE_CHECKING

import torch.distributed as dist

from ddp_even.errors import EvenLoaderError
from ddp_even.process_group import group_is_up

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan

logger = logging.getLogger("ddp_even")


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank in ``group`` (the world by default) and its size; ``(0, 1)`` without
    a process group."""
    if group_is_up():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def check_world_size(plan: ShardPlan, world_size: int) -> None:
    """``ValueError`` when ``plan`` is for another number of ranks than ``world_size``."""
    if plan.world_size != world_size:
        raise ValueError(
            f"the shard plan is for {plan.world_size} ranks but the process group has "
            f"{world_size}; plan with world_size={world_size}"
        )


def refuse_join_inside_lightning() -> None:
    """Join mode cannot work inside Lightning's fit loop: fail at once, on every rank.

    Lightning makes a collective of its own at every step, which torch's ``Join`` cannot
    shadow; every rank runs this check at the same point, so every rank raises.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("lightning.pytorch.", "pytorch_lightning.")):
            raise EvenLoaderError(
                "join mode cannot run inside a Lightning Trainer: Lightning makes a collective "
                "of its own at every step (it broadcasts a stop signal), which torch's Join "
                "cannot shadow for the ranks that ran out, so the job would hang. Use "
                "mode='pad' (every row once, as join) or mode='truncate' or mode='cycle' under "
                "Lightning"
            )
        frame = frame.f_back


def warn_if_launched_without_a_group() -> None:
    """A launcher said several processes, but no process group joins them: say how to fix it."""
    launched = os.environ.get("WORLD_SIZE", "1")
    # Said by the process the launcher numbered 0: every process would say the same.
    if launched.isdigit() and int(launched) > 1 and os.environ.get("RANK", "0") == "0":
        logger.warning(
            "WORLD_SIZE=%s but no torch.distributed process group is initialized: every "
            "process runs its own step count and nothing is kept even. Call "
            "torch.distributed.init_process_group() before iterating the EvenLoader",
            launched,
        )
