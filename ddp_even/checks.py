"""Argument checks shared by the loader and the planner, with messages that say what to do."""

from __future__ import annotations

import math

import numpy as np


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
