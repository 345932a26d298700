"""The readers of planned rows a behavioural test runs against (``from_parquet(engine=...)``).

``ENGINES`` parametrizes a test over both; petastorm's is marked ``petastorm``, which the lane
without petastorm (numpy 2, pyarrow 26) deselects. ``reader_options`` keeps of petastorm's
reader options those the pyarrow reader takes too (its pool settings are petastorm's alone).
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["ENGINES", "reader_options"]

ENGINES = [pytest.param("petastorm", marks=pytest.mark.petastorm), "arrow"]

_PETASTORM_POOL = {"reader_pool_type", "workers_count", "results_queue_size"}


def reader_options(engine: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as ``engine`` takes them."""
    if engine == "petastorm":
        return dict(options)
    return {name: value for name, value in options.items() if name not in _PETASTORM_POOL}
