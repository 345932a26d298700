"""The readers of planned rows, by name: what ``EvenLoader.from_parquet(..., engine=...)`` reads
a rank's shard with.

* ``"petastorm"``: petastorm's own readers and loaders (:mod:`ddp_even.petastorm.readers`),
  Unischema datasets, ``transform_spec`` and its row loader included; needs the petastorm extra
  (pyarrow < 15, numpy < 2);
* ``"arrow"``: pyarrow alone (:mod:`ddp_even.arrow.passes`), on today's numpy and pyarrow.

Each engine's module has a ``make_shard_factory`` of the same signature, returning ``(plan,
factory)``; a third engine is one module and one line here.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, get_args

from ddp_even.names import Engine

__all__ = ["ENGINES", "default_engine", "shard_factory_maker"]

#: Each engine's module, imported when it is chosen.
ENGINES: dict[str, str] = {
    "petastorm": "ddp_even.petastorm.readers",
    "arrow": "ddp_even.arrow.passes",
}
assert set(ENGINES) == set(get_args(Engine)), "names.Engine lists every engine"


def default_engine() -> Engine:
    """``"petastorm"`` where it is installed, ``"arrow"`` otherwise.

    Example:
        >>> default_engine() in ENGINES
        True
    """
    return "petastorm" if importlib.util.find_spec("petastorm") is not None else "arrow"


def shard_factory_maker(engine: Engine | None) -> Callable[..., Any]:
    """``make_shard_factory`` of ``engine`` (the default when None); ``ValueError`` naming the
    engines for an unknown one, ``ImportError`` saying what to install for a missing one.

    Example:
        >>> shard_factory_maker("arrow").__module__
        'ddp_even.arrow.passes'
    """
    chosen = default_engine() if engine is None else engine
    if chosen not in ENGINES:
        raise ValueError(
            f"unknown engine {chosen!r}: choose one of {', '.join(map(repr, ENGINES))}"
        )
    if chosen == "petastorm" and importlib.util.find_spec("petastorm") is None:
        raise ImportError(
            "engine='petastorm' needs petastorm: pip install 'ddp_even[petastorm]' (pyarrow < "
            "15, numpy < 2), or read with pyarrow alone: engine='arrow'"
        )
    maker: Callable[..., Any] = importlib.import_module(ENGINES[chosen]).make_shard_factory
    return maker
