"""What a rank reads from, as passes over its shard; and the registry of source kinds.

A :class:`ShardSource` starts passes (:class:`ShardPass`); the loader starts one per epoch (and
more in cycle mode). Kinds that need care (petastorm's loaders and readers) register their
module here by the qualified names of their classes, so that the module, and the library it
wraps, is imported only when such an object is seen.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from ddp_even.modes import AfterOwnData
    from ddp_even.parquet.dataset_plan import DatasetPlan
    from ddp_even.planning.pass_order import PassOrder
    from ddp_even.planning.plans import ShardPlan
    from ddp_even.planning.provenance import Provenance

BatchT = TypeVar("BatchT")


class PassReading(ABC):
    """What one pass reads of a Parquet dataset, where its source can tell (petastorm's readers
    can; a list cannot).

    With it, every epoch's start checks that the ranks' first passes read the dataset's row
    groups once between them (:mod:`ddp_even.runtime.epoch_shape`), a saved state records what
    the pass read and in which order (:meth:`provenance`), and a resume into a loop that reads
    otherwise is refused.
    """

    #: The global indices of the row groups the pass reads (petastorm's numbering).
    row_groups: frozenset[int]

    @abstractmethod
    def dataset_row_groups(self) -> int:
        """How many row groups the dataset has."""

    @abstractmethod
    def selects(self) -> bool:
        """Whether the reader may leave row groups out before it shards (a predicate on hive
        partition keys, a row-group selector): its shard is then one of what was left."""

    @abstractmethod
    def provenance(self) -> Provenance:
        """What the pass reads, and in which order, follows from (:mod:`~ddp_even.planning.
        provenance`): the data, the reader's and the loader's settings."""

    def unrepeatable(self) -> str | None:
        """Why another pass may yield other batches, or the same in another order (an unseeded
        shuffle, a pool handing out what finishes first), or None."""
        return None

    def plan_for(self, rank: int, world_size: int) -> ShardPlan | None:
        """The shard plan of every rank's pass, worked out from the data's metadata, where the
        batches follow from it; None where they may not."""
        return None


class ShardPass(Generic[BatchT]):
    """One pass over a rank's shard: an iterator that must be closed when done with."""

    def __init__(
        self,
        batches: Iterator[BatchT],
        on_close: Callable[[], None] | None = None,
        count_samples: Callable[[BatchT], int | None] | None = None,
        give_back: Callable[[list[BatchT]], None] | None = None,
        endless: bool = False,
        reading: PassReading | None = None,
    ) -> None:
        # What the pass reads: the feed takes each batch from it directly.
        self.batches = batches
        self._on_close = on_close
        self._give_back = give_back
        # Rows in a batch, or None where the batch's size cannot be read.
        self.count_samples: Callable[[BatchT], int | None] = count_samples or count_rows
        # The pass never ends (a petastorm reader with num_epochs=None).
        self.endless = endless
        # What the pass reads of a Parquet dataset, where the source can tell.
        self.reading = reading

    def __iter__(self) -> Iterator[BatchT]:
        return self

    def __next__(self) -> BatchT:
        return next(self.batches)

    def give_back(self, unused: list[BatchT]) -> None:
        """Batches read ahead but never handed out: a source that continues keeps them."""
        if self._give_back is not None and unused:
            self._give_back(unused)

    def close(self) -> None:
        close_generator = getattr(self.batches, "close", None)
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
        """Whether a fresh pass can be started (cycle mode needs it)."""

    @abstractmethod
    def open_pass(self) -> ShardPass[BatchT]:
        """Start a pass over the shard (a fresh one, unless the source continues)."""

    @property
    def continues(self) -> bool:
        """Whether each epoch continues the stream where the last one stopped.

        True for a petastorm reader with ``num_epochs=None``, which never ends and cannot
        start afresh.
        """
        return False

    @property
    def endless(self) -> bool:
        """Whether a pass never ends (an epoch then needs ``steps_per_epoch``)."""
        return False

    def known_batches(self) -> int | None:
        """The number of batches a pass yields, when the source can be trusted to know it."""
        return None

    def check_shard(self, rank: int, world_size: int) -> None:
        """Told, at construction, the training group's rank and world size: a source that
        builds its own sharded readers (a petastorm Spark converter) reads that shard, and
        raises ``ValueError`` here where it cannot. What a reader the user built reads is
        checked at every epoch's start, with every rank (:mod:`ddp_even.runtime.epoch_shape`).
        """

    def check_fits(self, after_own_data: AfterOwnData, steps_per_epoch: int | None) -> None:
        """Raise when a loader whose mode does ``after_own_data`` past a rank's data (cycle
        restarts), with ``steps_per_epoch``, cannot run over this source; say what to pass
        instead."""
        if self.endless and steps_per_epoch is None:
            raise ValueError(
                "the petastorm reader has num_epochs=None, so it never ends and neither would "
                "an epoch: pass steps_per_epoch=N (each epoch takes N steps and the next one "
                "continues the reader), or build the reader with num_epochs=1"
            )
        if after_own_data == "restart" and not self.restartable and not self.endless:
            raise TypeError(
                "cycle mode starts short shards again, which a one-shot iterator cannot do; "
                "pass a factory instead, e.g. lambda: DataLoader(make_reader(url, num_epochs=1, "
                "cur_shard=rank, shard_count=world_size), batch_size=64)"
            )

    def start_epoch(self, epoch: int) -> None:
        """Told the epoch number before the epoch's first pass (a factory may want it)."""

    def starts_at(self, batch: int) -> bool:
        """Make the next pass start at its ``batch``-th batch, if the source can (True)."""
        return False


class PlannedSource(ABC):
    """A factory that can read any plan of one dataset (what ``EvenLoader.from_parquet`` gives
    the loader, whichever reader reads it): through it an epoch resumes without reading again
    what was consumed, and on another number of ranks (:mod:`ddp_even.resume.state`).

    ``source(epoch=N)`` reads this rank's shard of :attr:`plan` for epoch ``N``;
    ``source(epoch=N, shard_plan=rest)`` this rank's pieces of another plan of the same row
    groups (a re-planned rest of the epoch, :meth:`~ddp_even.planning.plans.ShardPlan.rest`).
    """

    def __init__(
        self,
        dataset_plan: DatasetPlan,
        order: PassOrder,
        why_not_in_plan_order: str | None,
        provenance: Provenance,
    ) -> None:
        #: The dataset's plan (:mod:`ddp_even.parquet.dataset_plan`): the plan of a whole
        #: epoch, the row groups it shares out, the same row groups planned for other ranks.
        self.dataset_plan = dataset_plan
        #: The plan of a whole epoch.
        self.plan: ShardPlan = dataset_plan.plan
        #: Rows of every row group (after a predicate, if any), in petastorm's order.
        self.row_group_sizes: list[int] = dataset_plan.row_groups.num_rows.tolist()
        #: The order of a pass over a whole shard of :attr:`plan`.
        self.order = order
        #: Why a pass may read the shard's rows in another order than :attr:`order` says.
        self.why_not_in_plan_order = why_not_in_plan_order
        #: What the plan and the reading order follow from: the data, the reader settings
        #: that decide what is read and in which order, the predicate's code, the batch size.
        self.provenance = provenance

    @abstractmethod
    def __call__(self, epoch: int = 0, shard_plan: ShardPlan | None = None) -> Any:
        """A fresh loader (an iterable of batches) for one pass."""


class ContinuingStream(Generic[BatchT]):
    """One iterator that successive passes continue, with what the last pass left unused."""

    def __init__(self, batches: Iterator[BatchT]) -> None:
        self._batches = batches
        self._returned: deque[BatchT] = deque()

    def resume(self, **pass_options: Any) -> ShardPass[BatchT]:
        return ShardPass(self._next_batches(), give_back=self._keep, **pass_options)

    def _keep(self, unused: list[BatchT]) -> None:
        self._returned.extendleft(reversed(unused))

    def _next_batches(self) -> Iterator[BatchT]:
        while self._returned:
            yield self._returned.popleft()
        # Not ``yield from``: closing this pass must not close the stream.
        while True:
            try:
                batch = next(self._batches)
            except StopIteration:
                return
            yield batch


_ARRAYS = (torch.Tensor, np.ndarray)
_LISTS = (list, tuple)


def count_rows(batch: Any) -> int | None:
    """Rows in a batch, or None when they cannot be told; never a wrong number.

    A tensor or array has its leading dimension. A dict, or a tuple/list holding a tensor or
    array (``(texts, labels)``, torch's collated ``[x, y]``), is a set of fields: the length
    they all agree on. A list of scalars, strings or dicts is a list of rows, and so is a
    list of lists of different lengths (ragged rows), and a list of tuples. A list of
    equal-length lists is ambiguous (rows or fields?): None.

    Example::

        >>> import torch
        >>> count_rows({"x": torch.zeros(4, 3), "y": torch.zeros(4)})
        4
        >>> count_rows((["a", "b", "c"], torch.tensor([0, 1, 1])))
        3
        >>> count_rows([[1, 2, 3], [4]]), count_rows([[1, 2], [3, 4]]), count_rows([7, 8])
        (2, None, 2)
    """
    # Counted at every step: the usual types by identity first, the slower checks after.
    kind = type(batch)
    if kind is dict:
        return _agreed_length(batch.values())
    if kind not in _LISTS:
        if isinstance(batch, _ARRAYS):
            shape = batch.shape
            return shape[0] if shape else None
        if isinstance(batch, Mapping):
            return _agreed_length(batch.values())
        if not _is_list(batch):
            return None
    if not batch:
        return 0
    for item in batch:
        if isinstance(item, _ARRAYS):
            return _agreed_length(batch)
    lengths = [len(item) if _is_list(item) else None for item in batch]
    if all(length is None for length in lengths):
        return len(batch)
    if None not in lengths and len(set(lengths)) > 1:
        return len(batch)
    if isinstance(batch, list) and all(isinstance(item, tuple) for item in batch):
        return len(batch)  # a list of row tuples, as a plain Python dataset yields them
    return None


def _is_list(item: Any) -> bool:
    return type(item) in _LISTS or (
        isinstance(item, Sequence) and not isinstance(item, str | bytes)
    )


def _agreed_length(fields: Iterable[Any]) -> int | None:
    """The leading length every field shares (scalars aside), or None."""
    agreed: int | None = None
    for field in fields:
        if isinstance(field, _ARRAYS):
            # One read of the shape: a tensor builds a new torch.Size at each.
            shape = field.shape
            if not shape:
                continue
            length = shape[0]
        elif _is_list(field):
            length = len(field)
        else:
            continue
        if agreed is None:
            agreed = length
        elif length != agreed:
            return None
    return agreed


# Kinds whose module wraps a library of its own: the qualified name of a class (matched
# against the object's class and its bases) -> the module with ``source_for(obj, owned)``.
_REGISTERED_KINDS: dict[str, str] = {
    "petastorm.pytorch.LoaderBase": "ddp_even.petastorm.sources",
    "petastorm.reader.Reader": "ddp_even.petastorm.sources",
    # make_spark_converter's result, and what its make_torch_dataloader() returns.
    "petastorm.spark.spark_dataset_converter.SparkDatasetConverter": (
        "ddp_even.petastorm.spark_converter"
    ),
    "petastorm.spark.spark_dataset_converter.TorchDatasetContextManager": (
        "ddp_even.petastorm.spark_converter"
    ),
    # A pass of the pyarrow reader (what its factory returns).
    "ddp_even.arrow.reader.ArrowPass": "ddp_even.arrow.reader",
}


def registered_source(obj: object, *, owned: bool) -> ShardSource[Any] | None:
    """The source for ``obj`` when its class (or a base) is a registered kind, else None.

    ``owned``: the object was made by a factory of ours, so its pass stops it when closed.
    """
    for cls in type(obj).__mro__:
        module_name = _REGISTERED_KINDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if module_name is not None:
            source: ShardSource[Any] = importlib.import_module(module_name).source_for(
                obj, owned=owned
            )
            return source
    return None
