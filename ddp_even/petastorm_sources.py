"""Petastorm loaders and readers as shard sources: the one place that knows petastorm's quirks.

* A ``Reader`` can only be ``reset()`` after its last row was read; mid-pass it raises
  ``NotImplementedError``. A pass that stopped early (truncate) is read to its end first.
* ``petastorm.pytorch.DataLoader`` keeps the rows of its short last batch and emits them
  again at the start of the next pass; the accumulator is emptied before each pass.
* ``DataLoader.__iter__`` resets its reader itself on every pass after the first.
* A reader the loader opened (through a factory) is stopped and joined when its pass ends;
  a reader the user passed in stays theirs to stop.
"""

from __future__ import annotations

import logging
from typing import Any

from petastorm.pytorch import LoaderBase
from petastorm.reader import Reader

from ddp_even.sources import ShardPass, ShardSource, leading_dimension

logger = logging.getLogger("ddp_even")


def petastorm_source(obj: Any, *, owned: bool) -> ShardSource[Any]:
    """Wrap a petastorm ``DataLoader``/``BatchedDataLoader`` or ``Reader``."""
    if isinstance(obj, LoaderBase):
        return PetastormLoaderSource(obj, owned=owned)
    if isinstance(obj, Reader):
        return PetastormReaderSource(obj, owned=owned)
    raise TypeError(
        f"unsupported petastorm object {type(obj).__name__}: pass a petastorm.pytorch "
        "DataLoader or BatchedDataLoader, or a reader from make_reader / make_batch_reader"
    )


def _stop(reader: Reader) -> None:
    reader.stop()
    reader.join()


def _read_to_end(reader: Reader) -> None:
    """Let ``reader.reset()`` work after a pass that stopped early."""
    if reader.last_row_consumed:
        return
    leftover = sum(1 for _ in reader)
    logger.info(
        "read %d leftover item(s) of an unfinished petastorm reader so that it can be reset; "
        "pass a factory (lambda: DataLoader(make_reader(...))) to start each pass afresh instead",
        leftover,
    )


class _PetastormSource(ShardSource[Any]):
    def __init__(self, reader: Reader, *, owned: bool) -> None:
        self._reader = reader
        self._owned = owned
        self._passes_opened = 0

    @property
    def restartable(self) -> bool:
        # A reader the user passed in can be reset; one a factory made is used for one pass.
        return not self._owned

    def _begin_pass(self) -> None:
        if self._passes_opened > 0:
            if self._owned:
                raise RuntimeError("a reader made by a factory serves a single pass")
            _read_to_end(self._reader)
        self._passes_opened += 1

    def _closer(self) -> Any:
        return (lambda: _stop(self._reader)) if self._owned else None


class PetastormLoaderSource(_PetastormSource):
    """A ``petastorm.pytorch.DataLoader`` or ``BatchedDataLoader``."""

    def __init__(self, loader: LoaderBase, *, owned: bool) -> None:
        super().__init__(loader.reader, owned=owned)
        self._loader = loader

    def open_pass(self) -> ShardPass[Any]:
        self._begin_pass()
        # DataLoader would emit the previous pass's short last batch again (see module doc).
        self._loader._batch_acc = []
        return ShardPass(iter(self._loader), on_close=self._closer())


class PetastormReaderSource(_PetastormSource):
    """A reader from ``make_reader`` (one row per item) or ``make_batch_reader``."""

    def open_pass(self) -> ShardPass[Any]:
        first_pass = self._passes_opened == 0
        self._begin_pass()
        if not first_pass:
            self._reader.reset()
        counter = leading_dimension if self._reader.batched_output else _one_row
        return ShardPass(_items(self._reader), on_close=self._closer(), count_samples=counter)


def _items(reader: Reader) -> Any:
    yield from reader


def _one_row(_row: Any) -> int:
    return 1
