"""Sources from plain Python: any re-iterable (a list, a torch ``DataLoader``), a one-shot
iterator, or a factory returning a fresh iterable for each pass."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ddp_even.sources.base import ShardPass, ShardSource, registered_source

BatchT = TypeVar("BatchT")


class IterableSource(ShardSource[BatchT]):
    """A list, a ``torch.utils.data.DataLoader``, any re-iterable, or a one-shot iterator."""

    def __init__(self, iterable: Iterable[BatchT]) -> None:
        self._iterable = iterable
        # Told without calling iter(), which would start a DataLoader's worker processes.
        self._one_shot = isinstance(iterable, Iterator)
        self._passes_opened = 0

    @property
    def restartable(self) -> bool:
        return not self._one_shot

    def open_pass(self) -> ShardPass[BatchT]:
        if self._one_shot and self._passes_opened > 0:
            raise TypeError(
                "the source is a one-shot iterator and was already consumed; pass a re-iterable "
                "(a list, a DataLoader) or a factory (lambda: make_loader()) to run more epochs"
            )
        self._passes_opened += 1
        return ShardPass(iter(self._iterable))

    def known_batches(self) -> int | None:
        if isinstance(self._iterable, Sequence):
            return len(self._iterable)
        if isinstance(self._iterable, torch.utils.data.DataLoader) and not isinstance(
            self._iterable.dataset, torch.utils.data.IterableDataset
        ):
            # A map-style dataset's length is exact; an IterableDataset's is only a hint.
            return len(self._iterable)
        return None


class FactorySource(ShardSource[BatchT]):
    """A callable that returns a fresh iterable for one pass over the shard."""

    def __init__(self, factory: Callable[[], Iterable[BatchT]]) -> None:
        self._factory = factory

    @property
    def restartable(self) -> bool:
        return True

    def open_pass(self) -> ShardPass[BatchT]:
        made = self._factory()
        # The factory made it, so the pass owns it and stops it when closed.
        registered = registered_source(made, owned=True)
        if registered is not None:
            opened: ShardPass[Any] = registered.open_pass()
            return opened
        if not isinstance(made, Iterable):
            raise TypeError(
                f"the source factory returned {type(made).__name__}, which is not iterable; "
                "it must return a fresh loader, reader or iterable for one pass"
            )
        return ShardPass(iter(made))
