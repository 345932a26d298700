"""Whether this process has torch.distributed's default process group up: the one test every
part of ddp_even asks before it touches a group (torch built without distributed support has
none, and neither has a process that did not call ``init_process_group``)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["group_is_up"]


def group_is_up() -> bool:
    """True once ``init_process_group`` has run (and until ``destroy_process_group``).

    Example::

        >>> group_is_up()  # a plain Python process
        False
    """
    return dist.is_available() and dist.is_initialized()
