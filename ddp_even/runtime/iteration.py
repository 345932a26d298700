"""One ``for`` over an :class:`~ddp_even.EvenLoader`: the epoch it iterates, and the epoch
numbering trainers drive through ``loader.sampler.set_epoch``."""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterator
from typing import Generic, Protocol, TypeVar

from ddp_even.errors import EvenLoaderError

BatchT = TypeVar("BatchT")

__all__ = ["Epoch", "EpochNumbering"]


class _NumbersEpochs(Protocol):
    def set_epoch(self, epoch: int) -> None: ...


class EpochNumbering:
    """``loader.sampler``: forwards ``set_epoch`` the way trainers call it on samplers."""

    def __init__(self, loader: _NumbersEpochs) -> None:
        self._loader = weakref.ref(loader)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)


class Epoch(Generic[BatchT]):
    """One ``for`` over the loader: its batches, and a clear error if it was superseded."""

    def __init__(self, batches: Generator[BatchT, None, None]) -> None:
        self._batches = batches
        self._superseded = False

    def __iter__(self) -> Iterator[BatchT]:
        return self

    def __next__(self) -> BatchT:
        if self._superseded:
            raise EvenLoaderError(
                "this epoch of the EvenLoader was ended by a newer iter(loader): one loader "
                "cannot be iterated twice at once (zip(loader, loader), or a loop over it "
                "inside a loop over it); use two loaders, or finish one epoch first"
            )
        return next(self._batches)

    def supersede(self) -> None:
        self._superseded = True
        self._batches.close()

    def close(self) -> None:
        self._batches.close()
