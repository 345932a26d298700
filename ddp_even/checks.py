"""Argument checks shared by the loader and the planner, with messages that say what to do.

The planner (and with it the ``ddp-even`` command line) runs without torch, so the check that
needs torch's types imports it when called.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch.distributed.algorithms.join import Joinable

logger = logging.getLogger("ddp_even")


def check_positive_int(name: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is an int, ``ValueError`` unless it is at least 1.

    Example::

        >>> check_positive_int("batch_size", 0)
        Traceback (most recent call last):
        ...
        ValueError: batch_size must be at least 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def check_timeout(timeout: object) -> None:
    """Raise ``ValueError`` unless ``timeout`` is None or a finite positive number of seconds.

    Example::

        >>> check_timeout(0)
        Traceback (most recent call last):
        ...
        ValueError: timeout must be a finite positive number of seconds (or None: the ...
    """
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"timeout must be a finite positive number of seconds (or None: the training "
            f"group's own timeout), got {timeout!r}"
        )


def checked_loader_arguments(
    *,
    steps_per_epoch: object,
    sync_every: object,
    timeout: object,
    group: object,
    joinables: Iterable[Any],
    plan: object,
) -> tuple[Joinable, ...]:
    """Every ``EvenLoader`` argument that needs no mode to check; the joinables as a tuple.
    Only the loader calls it, after importing torch."""
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Joinable

    for name, value in (("steps_per_epoch", steps_per_epoch), ("sync_every", sync_every)):
        if value is not None:
            check_positive_int(name, value)
    check_timeout(timeout)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got {group!r}")
    if plan is not None and not hasattr(plan, "batches_per_rank"):
        raise TypeError(f"plan must be a ddp_even.planning.ShardPlan, got {type(plan).__name__}")
    checked = tuple(joinables)
    for joinable in checked:
        if not isinstance(joinable, Joinable):
            raise TypeError(
                f"joinables must be torch Joinable objects (a DDP model, a "
                f"ZeroRedundancyOptimizer), got {type(joinable).__name__}: join mode shadows "
                "DDP's all-reduces; with FSDP, tensor parallelism or a device mesh use pad "
                "(every row once) or cycle"
            )
    return checked


def check_world_size(planned: int, world_size: int) -> None:
    """``ValueError`` when a shard plan for ``planned`` ranks is used on ``world_size``."""
    if planned != world_size:
        raise ValueError(
            f"the shard plan is for {planned} ranks but the process group has "
            f"{world_size}; plan with world_size={world_size}"
        )


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


def taken_once(name: str, argument: Any, reader_options: dict[str, Any]) -> Any:
    """An argument that may also come in ``reader_kwargs`` (petastorm's place for it), taken out
    of them; ``ValueError`` when it is given both ways.

    Example:
        >>> options = {"seed": 1, "predicate": "p"}
        >>> taken_once("predicate", None, options), options
        ('p', {'seed': 1})
    """
    in_reader_options = reader_options.pop(name, None)
    if argument is not None and in_reader_options is not None:
        raise ValueError(f"{name} is given twice: pass it once, as an argument or in reader_kwargs")
    return argument if argument is not None else in_reader_options
