"""What a rank reads from: any iterable, a one-shot iterator, or a factory, as passes over a shard.

Petastorm loaders and readers need care on a second pass; that lives in ``petastorm_sources``,
imported only when such an object is seen.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch

logger = logging.getLogger("ddp_even")

BatchT = TypeVar("BatchT")


class ShardPass(Generic[BatchT]):
    """One pass over a rank's shard: an iterator that must be closed when done with."""

    def __init__(
        self,
        batches: Iterator[BatchT],
        on_close: Callable[[], None] | None = None,
        count_samples: Callable[[BatchT], int | None] | None = None,
    ) -> None:
        self._batches = batches
        self._on_close = on_close
        # Rows in a batch, or None where the batch's size cannot be read.
        self.count_samples: Callable[[BatchT], int | None] = count_samples or leading_dimension
        self.finished = False

    def __iter__(self) -> Iterator[BatchT]:
        return self

    def __next__(self) -> BatchT:
        try:
            return next(self._batches)
        except StopIteration:
            self.finished = True
            raise

    def close(self) -> None:
        close_generator = getattr(self._batches, "close", None)
        if callable(close_generator):
            close_generator()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


class ShardSource(ABC, Generic[BatchT]):
    """A rank's shard, able to start passes over it."""

    @property
    @abstractmethod
    def restartable(self) -> bool:
        """Whether a second pass can be started (cycle mode and later epochs need it)."""

    @abstractmethod
    def open_pass(self) -> ShardPass[BatchT]:
        """Start a fresh pass over the shard."""

    def known_batches(self) -> int | None:
        """The number of batches a pass yields, when the source can be trusted to know it."""
        return None


def leading_dimension(batch: Any) -> int | None:
    """The batch size of a tensor or array, a dict of them, a tuple of them ``(x, y)``, or
    a list of rows."""
    if isinstance(batch, torch.Tensor | np.ndarray):
        return int(batch.shape[0]) if batch.ndim > 0 else None
    if isinstance(batch, Mapping):
        return leading_dimension(next(iter(batch.values()))) if batch else None
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        if batch and isinstance(batch[0], torch.Tensor | np.ndarray):
            return leading_dimension(batch[0])
        return len(batch)
    return None


class IterableSource(ShardSource[BatchT]):
    """A list, a ``torch.utils.data.DataLoader``, any iterable, or a one-shot iterator."""

    def __init__(self, iterable: Iterable[BatchT]) -> None:
        self._iterable = iterable
        self._one_shot = iter(iterable) is iterable
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
        if not isinstance(made, Iterable):
            raise TypeError(
                f"the source factory returned {type(made).__name__}, which is not iterable; "
                "it must return a fresh loader, reader or iterable for one pass"
            )
        if _is_petastorm(made):
            from ddp_even.petastorm_sources import petastorm_source

            # The factory made this reader, so the pass owns it and stops it when closed.
            return petastorm_source(made, owned=True).open_pass()
        return ShardPass(iter(made))


def _is_petastorm(obj: object) -> bool:
    return type(obj).__module__.split(".")[0] == "petastorm"


def as_source(source: object) -> ShardSource[Any]:
    """Wrap what the user passed; raise ``TypeError`` saying what is accepted otherwise."""
    if isinstance(source, ShardSource):
        return source
    if _is_petastorm(source):
        from ddp_even.petastorm_sources import petastorm_source

        return petastorm_source(source, owned=False)
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
