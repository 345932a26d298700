"""Where batches come from: :func:`as_source` turns what the user passed into a shard source.

``base.py`` defines passes and sources and the registry of kinds; ``iterables.py`` holds the
plain-Python kinds; ``petastorm.py`` (the only runtime module that imports petastorm) holds
petastorm's loaders and readers, registered by class name and imported on first sight.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ddp_even.sources.base import ShardPass, ShardSource, count_rows, registered_source
from ddp_even.sources.iterables import FactorySource, IterableSource

__all__ = ["ShardPass", "ShardSource", "as_source", "count_rows"]


def as_source(source: object) -> ShardSource[Any]:
    """Wrap what the user passed; raise ``TypeError`` saying what is accepted otherwise.

    Example::

        >>> type(as_source([[1], [2]])).__name__, type(as_source(lambda: [[1]])).__name__
        ('IterableSource', 'FactorySource')
    """
    if isinstance(source, ShardSource):
        return source
    registered = registered_source(source, owned=False)
    if registered is not None:
        return registered
    if isinstance(source, str | bytes):
        raise TypeError(
            "a string is not a data source; for a dataset URL use "
            "EvenLoader.from_parquet(url, batch_size=...)"
        )
    if isinstance(source, Iterable):
        return IterableSource(source)
    if callable(source):
        return FactorySource(source)
    raise TypeError(
        f"cannot read batches from {type(source).__name__}: pass a petastorm DataLoader or "
        "reader, an iterable (list, torch DataLoader), or a factory returning one"
    )
