"""One ``for`` over an :class:`~ddp_even.EvenLoader`: the epoch it iterates, the loader's
account of what it handed out (each epoch's statistics, each batch's marks), and the epoch
numbering trainers drive through ``loader.sampler.set_epoch``."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

from ddp_even.errors import EvenLoaderError
from ddp_even.liveness.heartbeat import INSIDE, OUTSIDE, presence

if TYPE_CHECKING:
    from ddp_even.runtime.stats import EpochStats

BatchT = TypeVar("BatchT")

__all__ = ["BatchMarks", "Epoch", "EpochNumbering", "HandedOut", "LoaderAccount"]


class BatchMarks(NamedTuple):
    """What one batch handed out is: its step in the epoch (from 0), whether it comes from a
    restarted pass (cycle) or is padding (pad), and the weight to multiply its loss by (None
    where some rank's rows at that step cannot be told)."""

    step: int
    repeating: bool = False
    padding: bool = False
    weight: float | None = 1.0


class HandedOut:
    """The marks of the batches the loader handed out last, by step.

    The batch last handed out is not always the one being trained on: a trainer that reads
    ahead (Lightning's fetcher, one batch when it does not know ``len(loader)``) asks by step.
    The marks stay until the next epoch's first batch, so that a trainer still working on the
    last batches when the epoch ended can ask.
    """

    #: How many steps back a trainer may ask.
    KEPT = 64

    def __init__(self) -> None:
        self._marks: deque[BatchMarks] = deque(maxlen=self.KEPT)
        # The batch last handed out, until its epoch ends.
        self.last = BatchMarks(-1)

    def epoch_started(self) -> None:
        self._marks.clear()

    def add(self, marks: BatchMarks) -> None:
        self._marks.append(marks)
        self.last = marks

    def epoch_ended(self) -> None:
        self.last = BatchMarks(-1)

    def at(self, step: int) -> BatchMarks:
        """The marks of the batch handed out at ``step`` of the epoch (the latest epoch)."""
        for marks in reversed(self._marks):
            if marks.step == step:
                return marks
        kept = f"steps {self._marks[0].step} to {self._marks[-1].step}" if self._marks else "none"
        raise ValueError(
            f"no batch of the latest epoch was handed out at step {step} among the last "
            f"{self.KEPT} kept ({kept}): pass the batch's index in its epoch, counted from 0 "
            "(Lightning's batch_idx)"
        )


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
    """One ``for`` over the loader: its batches, and a clear error if it was superseded.

    ``start`` is called when the first batch is asked for (so that probing iterability,
    ``iter(loader)`` and letting it go as trainers do, starts no epoch) and returns the epoch's
    shape (:mod:`ddp_even.runtime.epochs`), whose batches come straight from there.
    """

    def __init__(self, start: Callable[[], Generator[BatchT, None, None]]) -> None:
        self._start: Callable[[], Generator[BatchT, None, None]] | None = start
        self._batches: Generator[BatchT, None, None] | None = None
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
        # What this process's heartbeat tells the others: inside the loader, or outside it
        # (a training step, a checkpoint), and one more batch since.
        presence.doing = INSIDE
        try:
            if self._start is not None:
                # Started once: an epoch whose start raised has ended.
                start, self._start = self._start, None
                self._batches = start()
            if self._batches is None:
                raise StopIteration
            return next(self._batches)
        finally:
            presence.doing = OUTSIDE
            presence.progress += 1

    def supersede(self) -> None:
        self._superseded = True
        self.close()

    def close(self) -> None:
        self._start = None
        if self._batches is not None:
            self._batches.close()


class LoaderAccount:
    """:class:`~ddp_even.EvenLoader`'s account of what it handed out: each epoch's statistics,
    and what each batch was (:class:`HandedOut`)."""

    history: list[EpochStats]
    _handed_out: HandedOut

    @property
    def stats(self) -> EpochStats:
        """The statistics of the last epoch that ran to its end."""
        if not self.history:
            raise RuntimeError("no epoch has run to its end yet: iterate the loader first")
        return self.history[-1]

    @property
    def repeating(self) -> bool:
        """True while the batch last handed out comes from a restarted pass (cycle)."""
        return self._handed_out.last.repeating

    @property
    def padding(self) -> bool:
        """True while the batch last handed out is padding (pad): past this rank's data, a copy
        of its last batch, to leave out of metrics (its :attr:`batch_weight` is 0).

        Example::

            >>> from ddp_even import EvenLoader
            >>> loader = EvenLoader([[1, 2], [3]], mode="pad", steps_per_epoch=3)
            >>> [(batch, loader.padding) for batch in loader]
            [([1, 2], False), ([3], False), ([3], True)]
        """
        return self._handed_out.last.padding

    @property
    def batch_weight(self) -> float:
        """The weight to multiply the batch last handed out's mean loss by (pad; 1.0 in the
        other modes): 0 for padding, else ``n * world_size / N``, with ``n`` the batch's rows and
        ``N`` the real rows over all ranks at this step. DDP's average of the gradients is then
        the gradient of the mean loss over the step's real rows:
        ``(loss * loader.batch_weight).backward()``. Raises
        :class:`~ddp_even.EvenLoaderError` where some rank's rows cannot be told
        (:func:`~ddp_even.sources.base.count_rows` returns None for its batch).

        Example::

            >>> from ddp_even import EvenLoader
            >>> loader = EvenLoader([[1, 2], [3]], mode="pad", steps_per_epoch=3)
            >>> [loader.batch_weight for _ in loader]
            [1.0, 1.0, 0.0]
        """
        return _known_weight(self._handed_out.last)

    def padding_at(self, step: int) -> bool:
        """Whether the batch handed out at ``step`` of the latest epoch (from 0) is padding: for a
        trainer that reads ahead, with its batch index (Lightning's ``batch_idx``).

        Example::

            >>> from ddp_even import EvenLoader
            >>> loader = EvenLoader([[1, 2], [3]], mode="pad", steps_per_epoch=3)
            >>> _ = list(loader)
            >>> [loader.padding_at(step) for step in range(3)]
            [False, False, True]
        """
        return self._handed_out.at(step).padding

    def batch_weight_at(self, step: int) -> float:
        """:attr:`batch_weight` of the batch handed out at ``step`` of the latest epoch.

        Example::

            >>> from ddp_even import EvenLoader
            >>> loader = EvenLoader([[1, 2], [3]], mode="pad", steps_per_epoch=3)
            >>> _ = list(loader)
            >>> loader.batch_weight_at(2)
            0.0
        """
        return _known_weight(self._handed_out.at(step))


def _known_weight(marks: BatchMarks) -> float:
    if marks.weight is None:
        raise EvenLoaderError(
            f"the batch weight at step {marks.step} is unknown: some rank's batch there has rows "
            "that cannot be counted (ddp_even.sources.base.count_rows says None: use tensors, "
            "arrays or dicts of them), or give the loader a shard plan"
        )
    return marks.weight
