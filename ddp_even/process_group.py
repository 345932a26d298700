"""Whether this process has torch.distributed's default process group up: the one test every
part of ddp_even asks before it touches a group (torch built without distributed support has
none, and neither has a process that did not call ``init_process_group``); and this process's
rank and world size in a group, ``(0, 1)`` without one; the training group's timeout."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["group_is_up", "rank_and_world_size", "training_timeout"]

# A training group's timeout when it cannot be read: torch's default for process groups.
_DEFAULT_TRAINING_TIMEOUT_S = 30 * 60.0


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


def training_timeout(training_group: dist.ProcessGroup | None) -> float:
    """The training group's collective timeout in seconds (torch's default when unreadable)."""
    group: Any = training_group if training_group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            return float(backend.options._timeout.total_seconds())
        except Exception:  # private API, or no backend for this device: try the next
            continue
    return _DEFAULT_TRAINING_TIMEOUT_S
