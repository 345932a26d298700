"""Whether this process has torch.distributed's default process group up: the one test every
part of ddp_even asks before it touches a group (torch built without distributed support has
none, and neither has a process that did not call ``init_process_group``); and this process's
rank and world size in a group, ``(0, 1)`` without one."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["group_is_up", "rank_and_world_size"]


def group_is_up() -> bool:
    """True once ``init_process_group`` has run (and until ``destroy_process_group``).

    Example::

        >>> group_is_up()  # a plain Python process
        False
    """
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank in ``group`` (the world by default) and its size; ``(0, 1)`` without
    a process group."""
    if group_is_up():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1
