"""The names ``mode=`` and ``sharding=`` take, as ``Literal`` types that IDEs complete.

Their registries (:data:`ddp_even.modes.MODES`, :data:`ddp_even.planning.sharding.SHARDINGS`)
hold what each name does and are checked against these lists (in ``sharding.py`` and
``tests/test_unit_modes.py``). They live apart from the registries, which import numpy, so
that the ``ddp-even`` command line can offer the choices without importing it.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["ModeName", "Sharding"]

#: The modes, as ``EvenLoader(mode=...)`` takes them (see :mod:`ddp_even.modes`).
ModeName = Literal["truncate", "cycle", "pad", "join", "share"]

#: The shardings, as ``sharding=`` takes them (see :mod:`ddp_even.planning.sharding`).
Sharding = Literal["round_robin", "row_groups", "rows", "replicate"]
