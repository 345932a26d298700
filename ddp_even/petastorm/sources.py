"""Petastorm loaders and readers as shard sources: the one runtime module that knows petastorm.

docs/design.md ("Where petastorm's quirks are handled") lists each quirk and how it is met
here. One more: ``DataLoader.__iter__`` resets its reader itself on every pass after the
first, so a loader's reader is never reset here.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from petastorm.pytorch import LoaderBase
from petastorm.reader import Reader

from ddp_even.petastorm.pools import close_end_of_results_race
from ddp_even.petastorm.reading import ReaderReading, row_groups_read_by
from ddp_even.sources.base import ContinuingStream, ShardPass, ShardSource, count_rows

logger = logging.getLogger("ddp_even")

# Every reader read from here, while it lives (see _stop_running_readers).
_READERS: weakref.WeakSet[Reader] = weakref.WeakSet()


@atexit.register
def _stop_running_readers() -> None:
    """Stop, at interpreter exit, the readers still running (an epoch left mid-pass: a
    ``break``, an exception, a refused resume; a reader of the user's never stopped).

    Their threads read Parquet in pyarrow's C++; a thread the exiting interpreter stops there
    aborts the process (``terminate called without an active exception``). atexit runs before
    that, while every thread still runs: nothing reads these readers again.
    """
    for reader in list(_READERS):
        if not reader.stopped:
            _stop(reader)


def source_for(obj: Any, *, owned: bool) -> ShardSource[Any]:
    """Wrap a petastorm ``DataLoader``/``BatchedDataLoader`` or ``Reader`` (the kinds registered
    for this module in :mod:`ddp_even.sources.base`)."""
    if isinstance(obj, LoaderBase):
        return PetastormSource(obj.reader, owned=owned, loader=obj)
    return PetastormSource(obj, owned=owned)


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


class PetastormSource(ShardSource[Any]):
    """A reader from ``make_reader`` (one row per item) or ``make_batch_reader``, or the
    ``petastorm.pytorch.DataLoader`` or ``BatchedDataLoader`` (``loader``) around it."""

    def __init__(self, reader: Reader, *, owned: bool, loader: LoaderBase | None = None) -> None:
        close_end_of_results_race(reader._workers_pool)
        _READERS.add(reader)
        self._reader = reader
        self._loader = loader
        self._owned = owned
        self._passes_opened = 0
        self._stream: ContinuingStream[Any] | None = None

    @property
    def restartable(self) -> bool:
        # A reader the user passed in can be reset (unless it never ends); one a factory
        # made is used for one pass.
        return not self._owned and not self.endless

    @property
    def endless(self) -> bool:
        return self._reader.num_epochs is None

    @property
    def continues(self) -> bool:
        return self.endless and not self._owned

    def open_pass(self) -> ShardPass[Any]:
        reading = ReaderReading(self._reader, row_groups_read_by(self._reader), self._loader)
        if self._loader is not None:
            count_samples: Callable[[Any], int | None] = _rows_of_columns
        else:
            count_samples = count_rows if self._reader.batched_output else _one_row
        if self._stream is None:
            batches = self._fresh_pass()
            if not self.continues:
                return ShardPass(
                    batches,
                    on_close=(lambda: _stop(self._reader)) if self._owned else None,
                    count_samples=count_samples,
                    endless=self.endless,
                    reading=reading,
                )
            self._stream = ContinuingStream(batches)
        # An endless reader: every epoch continues the one stream.
        return self._stream.resume(count_samples=count_samples, endless=True, reading=reading)

    def _fresh_pass(self) -> Iterator[Any]:
        """The batches of a new pass."""
        if self._passes_opened > 0:
            if self._owned:
                raise RuntimeError("a reader made by a factory serves a single pass")
            _read_to_end(self._reader)
        self._passes_opened += 1
        if self._loader is not None:
            # DataLoader would emit the previous pass's short last batch again (see module doc).
            self._loader._batch_acc = []
            return iter(self._loader)
        if self._passes_opened > 1:
            self._reader.reset()
        return _items(self._reader)


def _items(reader: Reader) -> Iterator[Any]:
    yield from reader


def _rows_of_columns(batch: Any) -> int | None:
    """Rows in a petastorm loader's batch: every column holds the same rows, so the first
    tensor column says (7 µs a batch less than asking every column, with 17 of them)."""
    if type(batch) is dict:
        for column in batch.values():
            if isinstance(column, torch.Tensor) and column.ndim > 0:
                return int(column.shape[0])
            break
    return count_rows(batch)


def _one_row(_row: Any) -> int:
    return 1
