"""Where batches come from: :func:`as_source` turns what the user passed into a shard source.

``base.py`` defines passes and sources and the registry of kinds; ``iterables.py`` holds the
plain-Python kinds (factories may return a context manager: each pass enters and exits it).
Petastorm's loaders, readers and Spark converter are :mod:`ddp_even.petastorm`'s: registered
here by class name, each imported (with petastorm) on first sight; nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ddp_even.sources.base import (
    PlannedSource,
    ShardPass,
    ShardSource,
    count_rows,
    registered_source,
)
from ddp_even.sources.iterables import FactorySource, IterableSource, is_context_manager

__all__ = [
    "PlannedSource",
    "ShardPass",
    "ShardSource",
    "as_source",
    "count_rows",
]


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
    if is_context_manager(source):
        raise TypeError(
            f"{type(source).__name__} is a context manager, which serves one pass: pass a "
            "factory that makes a fresh one per pass instead, e.g. lambda: "
            "converter.make_torch_dataloader(batch_size=64, num_epochs=1, cur_shard=rank, "
            "shard_count=world_size); each pass enters it and exits it when it ends"
        )
    raise TypeError(
        f"cannot read batches from {type(source).__name__}: pass a petastorm DataLoader or "
        "reader, an iterable (list, torch DataLoader), or a factory returning one"
    )
