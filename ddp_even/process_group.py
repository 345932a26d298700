"""Whether this process has torch.distributed's default process group up: the one test every
part of ddp_even asks before it touches a group (torch built without distributed support has
none, and neither has a process that did not call ``init_process_group``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["group_is_up", "training_timeout"]

# A training group's timeout when it cannot be read: torch's default for process groups.
_DEFAULT_TRAINING_TIMEOUT_S = 30 * 60.0


def group_is_up() -> bool:
    """True once ``init_process_group`` has run (and until ``destroy_process_group``).

    Example::

        >>> group_is_up()  # a plain Python process
        False
    """
    return dist.is_available() and dist.is_initialized()


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
