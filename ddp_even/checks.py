"""Argument checks shared by the loader and the planner, with messages that say what to do."""

from __future__ import annotations

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
