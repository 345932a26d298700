"""Where batches come from: :func:`as_source` turns what the user passed into a shard source.

The plain-Python kinds are here (a re-iterable, a one-shot iterator, a factory of either or of
a context manager yielding one); petastorm's are registered in ``base.py`` by class name and
imported on first sight: nothing here imports petastorm.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from ddp_even.sources.base import (
    PlannedSource,
    ShardPass,
    ShardSource,
    count_rows,
    registered_source,
)

__all__ = ["PlannedSource", "ShardPass", "ShardSource", "as_source", "count_rows"]

BatchT = TypeVar("BatchT")


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
    """A callable that returns a fresh iterable for one pass over the shard.

    A factory with a parameter named ``epoch`` is called as ``factory(epoch=N)``, N counting
    epochs from 0 as the loader does (``set_epoch`` and resuming included), so that what it
    builds can depend on the epoch (a shuffle seed). A factory with a parameter named
    ``start_batch`` can start a pass at a position: when an epoch resumes after step ``k``
    (truncate and join), its first pass is ``factory(start_batch=k)`` and must yield that
    pass's batches from the ``k``-th on (0-based); the loader then reads nothing again.
    """

    def __init__(self, factory: Callable[..., Iterable[BatchT]]) -> None:
        self._factory = factory
        self._takes_epoch = _takes_parameter(factory, "epoch")
        self._takes_start_batch = _takes_parameter(factory, "start_batch")
        self._epoch = 0
        self._start_batch: int | None = None

    @property
    def restartable(self) -> bool:
        return True

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def starts_at(self, batch: int) -> bool:
        if not self._takes_start_batch:
            return False
        self._start_batch = batch
        return True

    def open_pass(self) -> ShardPass[BatchT]:
        options: dict[str, int] = {"epoch": self._epoch} if self._takes_epoch else {}
        if self._start_batch is not None:
            options["start_batch"], self._start_batch = self._start_batch, None
        # The factory made it, so the pass owns it and stops it when closed.
        return _pass_over(self._factory(**options), "the source factory returned", owned=True)


def is_context_manager(obj: object) -> bool:
    """Whether ``obj`` has ``__enter__`` and ``__exit__`` (on its class, as ``with`` looks them up).

    Example::

        >>> import contextlib
        >>> is_context_manager(contextlib.nullcontext([1])), is_context_manager([1])
        (True, False)
    """
    return hasattr(type(obj), "__enter__") and hasattr(type(obj), "__exit__")


def open_context_pass(context: AbstractContextManager[Any]) -> ShardPass[Any]:
    """One pass over what ``context`` yields; closing the pass exits the context.

    For a factory that returns a context manager rather than a loader (petastorm's
    ``converter.make_torch_dataloader(...)``): the pass enters it, reads what it yields (a
    petastorm loader or reader, or any iterable) and exits it when the pass is closed: at the
    end of the pass, at a ``break``, at an exception in the loop, when the epoch is dropped. The
    context is exited with no exception: it is closed, not told why, so that a ``with`` body
    that suppresses exceptions cannot swallow the training loop's.

    Example::

        >>> import contextlib
        >>> @contextlib.contextmanager
        ... def one_pass():
        ...     print("open")
        ...     yield [[1, 2], [3]]
        ...     print("closed")
        >>> opened = open_context_pass(one_pass())
        open
        >>> next(opened)
        [1, 2]
        >>> opened.close()
        closed
    """
    entered = context.__enter__()
    try:
        # What the context yields is the context's to stop (its __exit__ does): not owned here.
        inner = _pass_over(
            entered, "the context manager the source factory returned yielded", owned=False
        )
    except BaseException:
        # Nothing is left open; the error is raised even if the context would suppress it,
        # since a pass that failed to start must not pass for an empty shard.
        context.__exit__(*sys.exc_info())
        raise

    def exit_context() -> None:
        context.__exit__(None, None, None)

    # ``inner`` is closed first (ShardPass closes what it iterates), then the context.
    return ShardPass(
        inner,
        on_close=exit_context,
        count_samples=inner.count_samples,
        give_back=inner.give_back,
        endless=inner.endless,
        reading=inner.reading,
    )


def _pass_over(made: Any, said: str, *, owned: bool) -> ShardPass[Any]:
    """A pass over ``made``: a registered kind, an iterable, or (made by a factory, ``owned``)
    a context manager yielding one; ``TypeError`` naming what ``said`` it is otherwise."""
    registered = registered_source(made, owned=owned)
    if registered is not None:
        opened: ShardPass[Any] = registered.open_pass()
        return opened
    if isinstance(made, Iterable):
        return ShardPass(iter(made))
    if owned and is_context_manager(made):
        return open_context_pass(made)
    raise TypeError(
        f"{said} {type(made).__name__}, which is not iterable; it must be a fresh loader, "
        "reader or iterable for one pass"
        + (" (or a context manager yielding one)" if owned else "")
    )


def _takes_parameter(factory: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: called without arguments
        return False
    parameter = parameters.get(name)
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
