"""Random small delays for the soak (``scripts/soak.py``); nothing at all in ordinary runs.

The soak sets ``DDP_EVEN_SOAK_SEED``; a scenario then pauses at random between steps
(:func:`pause`) and inside its sources (:func:`jittered`), so that every repetition meets the
threads of petastorm, gloo and ddp_even in another interleaving. Without the variable both are
free: the ordinary test run is unchanged.

The delays are drawn from a generator seeded by the soak seed and the rank, so a run that hung
can be repeated with its seed (the soak prints it).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

#: The variable the soak sets, to an int.
SEED_VARIABLE = "DDP_EVEN_SOAK_SEED"
#: Set by ``tests/helpers/spawn.py`` in each rank, so that each rank draws its own delays.
RANK_VARIABLE = "DDP_EVEN_TEST_RANK"
# The longest pause: long enough to reorder threads, short enough for hundreds of runs.
_LONGEST_S = 0.004
# How often a pause point pauses.
_CHANCE = 0.3

_random: random.Random | None = None


def active() -> bool:
    """Whether this process runs under the soak."""
    return SEED_VARIABLE in os.environ


def _generator() -> random.Random | None:
    global _random
    if _random is None and active():
        rank = os.environ.get(RANK_VARIABLE, str(os.getpid()))
        _random = random.Random(f"{os.environ[SEED_VARIABLE]}/{rank}")
    return _random


def pause() -> None:
    """Sleep a random few milliseconds, sometimes (under the soak only)."""
    generator = _generator()
    if generator is not None and generator.random() < _CHANCE:
        time.sleep(generator.uniform(0.0, _LONGEST_S))


def jittered(items: Iterable[T]) -> Iterator[T]:
    """``items``, pausing at random before each one (under the soak only)."""
    if not active():
        yield from items
        return
    for item in items:
        pause()
        yield item
