"""petastorm's Spark front door as a shard source: the converter of ``make_spark_converter(df)``.

``make_spark_converter(df)`` writes a DataFrame as Parquet under a cache directory and returns
a ``SparkDatasetConverter``; ``converter.make_torch_dataloader(...)`` returns a context manager
whose ``__enter__`` opens ``make_batch_reader(converter.file_urls, ...)`` and a petastorm
``DataLoader``, and whose ``__exit__`` stops the reader. What this module relies on (petastorm
0.12.1, pyspark 4.3, measured):

* ``converter.file_urls`` is in the order of Spark's ``inputFiles`` (a hash set: not sorted,
  different for every write), and petastorm numbers and shards row groups in that order
  (:func:`converter_files`).
* A converter is a plain object (``cache_dir_url``, ``file_urls``, ``dataset_size``): it
  pickles to spawned ranks, which read it without a Spark session (they import pyspark's
  Python package, not its JVM).
* ``make_torch_dataloader`` waits 30 s for missing files, then raises ``RuntimeError``
  (here :class:`ConverterDeletedError`, at once).
* With fewer row groups than ``shard_count`` petastorm raises ``NoDataAvailableError`` on
  every rank (here :class:`TooFewRowGroupsError`, saying what to do).
* The process that called ``make_spark_converter`` deletes the cache when it exits (atexit).
* Under ``pyspark.ml.torch.distributor.TorchDistributor`` each rank is a ``torchrun`` worker
  (``RANK``/``WORLD_SIZE`` set; ``local_mode=False`` runs one Spark barrier task per rank):
  the process group made from that environment gives the shard (:func:`check_distributor`
  refuses on the driver what would stall Spark or fail every rank).

petastorm and pyspark are imported only when a converter is seen, never by importing this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddp_even.checks import check_positive_int
from ddp_even.errors import (
    ConverterDeletedError,
    DatasetError,
    TooFewRowGroupsError,
    TooFewTaskSlotsError,
)
from ddp_even.process_group import group_is_up, rank_and_world_size
from ddp_even.sources import open_context_pass
from ddp_even.sources.base import ShardPass, ShardSource

if TYPE_CHECKING:
    from ddp_even.parquet.dataset_plan import DatasetPlan

__all__ = [
    "ConverterSource",
    "check_distributor",
    "converter_files",
    "is_spark_converter",
    "source_for",
]

logger = logging.getLogger("ddp_even")

_CONVERTER = "petastorm.spark.spark_dataset_converter.SparkDatasetConverter"
_DISTRIBUTOR = "pyspark.ml.torch.distributor.TorchDistributor"

# make_torch_dataloader's keyword arguments that ConverterSource sets itself, with the reason.
_SET_HERE = {
    "cur_shard": "the shard is the training group's rank (set by ddp_even)",
    "shard_count": "the shard count is the training group's world size (set by ddp_even)",
    "num_epochs": "each pass reads the shard once (num_epochs=1); an epoch may restart it",
    "dataset_url_or_urls": "the converter names its own files",
}

# Options that may drop rows or read some twice (every other option of make_torch_dataloader and
# make_batch_reader leaves every row of the shard in, once: the batches of a pass are then
# ceil(rows / batch_size), known from the Parquet footers before reading). With one of them the
# ranks agree at every step.
_COUNT_CHANGING = frozenset(
    {
        "predicate",
        "transform_spec",
        "data_loader_fn",
        "filters",
        "rowgroup_selector",
        "shard_seed",
        "shuffle_row_drop_partitions",
    }
)


def is_spark_converter(obj: object) -> bool:
    """Whether ``obj`` is a petastorm ``SparkDatasetConverter`` (told without importing petastorm).

    Example::

        >>> is_spark_converter("file:///data/train")
        False
    """
    return _CONVERTER in _class_names(obj)


def _class_names(obj: object) -> set[str]:
    """The full names of ``obj``'s class and its bases: petastorm's and pyspark's classes are
    told by name, without importing either."""
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(obj).__mro__}


def converter_files(converter: Any) -> list[str]:
    """The converter's Parquet files in the order petastorm reads them (``converter.file_urls``).

    Plan with this list, not with ``converter.cache_dir_url``: petastorm numbers a converter's
    row groups in this (unsorted) order, and a directory would be read in sorted order. Raises
    :class:`ConverterDeletedError` when the files are gone.
    """
    if not is_spark_converter(converter):
        raise TypeError(
            f"expected a petastorm SparkDatasetConverter (from make_spark_converter), got "
            f"{type(converter).__name__}"
        )
    files = [str(url) for url in converter.file_urls]
    _raise_if_deleted(converter.cache_dir_url, files)
    return files


def check_distributor(distributor: Any, *converters: Any, wait_for_slots_s: float = 60.0) -> None:
    """Before ``distributor.run(train, converter, ...)``: refuse at once what could not work.

    ``distributor`` is a ``pyspark.ml.torch.distributor.TorchDistributor``; call this on the
    driver, with the converters the training function will read:

    * each converter's files are there (:class:`ConverterDeletedError`), instead of every
      rank raising after ``torchrun`` has started;
    * with ``local_mode=False``, the cluster can run all the distributor's barrier tasks at
      once. Executors that are still registering get ``wait_for_slots_s`` seconds (a
      ``local[N]`` master has all its slots from the start: no wait); then
      :class:`TooFewTaskSlotsError`, instead of Spark's 10 minutes of retries
      (``BarrierJobSlotsNumberCheckFailed``). Skipped, with a DEBUG log, where the session
      cannot tell its slots (Spark Connect).

    Example, on the driver::

        distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
        check_distributor(distributor, converter)
        statistics = distributor.run(train, converter)

    It takes the distributor, not its class::

        >>> check_distributor(object())
        Traceback (most recent call last):
        ...
        TypeError: expected a pyspark.ml.torch.distributor.TorchDistributor, got object
    """
    if _DISTRIBUTOR not in _class_names(distributor):
        raise TypeError(f"expected a {_DISTRIBUTOR}, got {type(distributor).__name__}")
    for converter in converters:
        converter_files(converter)
    if distributor.local_mode:
        return
    # num_tasks: num_processes, or fewer when each task drives several GPUs.
    tasks = int(getattr(distributor, "num_tasks", distributor.num_processes))
    spark = distributor.spark
    master = str(spark.conf.get("spark.master", "?"))
    # local[N] runs its tasks in the driver's JVM: its slots are there from the start and
    # never grow, so there is nothing to wait for.
    in_driver = master == "local" or master.startswith("local[")
    started = time.monotonic()
    deadline = started + (0.0 if in_driver else wait_for_slots_s)
    while True:
        slots = _task_slots(spark)
        if slots is None or slots >= tasks:
            return
        if time.monotonic() >= deadline:
            cpus_per_task = int(spark.conf.get("spark.task.cpus", "1"))
            raise TooFewTaskSlotsError(
                tasks, slots, master, cpus_per_task, time.monotonic() - started
            )
        time.sleep(1.0)


def _task_slots(spark: Any) -> int | None:
    """How many tasks the cluster runs at once: the count Spark's barrier check compares with."""
    try:
        scala_context = spark.sparkContext._jsc.sc()
        profile = scala_context.resourceProfileManager().defaultResourceProfile()
        return int(scala_context.maxNumConcurrentTasks(profile))
    except Exception as error:
        # Spark Connect has no JVM on the client; py4j raises its own error types.
        logger.debug("ddp_even: cannot count the Spark cluster's task slots (%s)", error)
        return None


class ConverterSource(ShardSource[Any]):
    """This rank's shard of a petastorm Spark converter, read afresh on every pass.

    Each pass enters ``converter.make_torch_dataloader(batch_size=batch_size, num_epochs=1,
    cur_shard=rank, shard_count=world_size, **loader_kwargs)`` and exits it when the pass ends
    (also at a ``break`` or an exception), so no reader is left running. ``rank`` and
    ``world_size`` are those of the loader's training group (``EvenLoader(group=...)``), or of
    the world when the group is made after the loader; with no process group, the whole
    dataset. ``EvenLoader(converter)`` is ``EvenLoader(ConverterSource(converter))``:
    petastorm's defaults (``batch_size=32``, four reader threads). docs/spark.md says which
    ``loader_kwargs`` keep every rank's batches per pass known from the footers, and what is
    refused, and when (:class:`ConverterDeletedError`, :class:`TooFewRowGroupsError`).

    Example, on every rank (the converter made once, by the driver, and sent to the ranks)::

        loader = EvenLoader(ConverterSource(converter, batch_size=64, workers_count=2),
                            mode="cycle")
        for epoch in range(3):
            for batch in loader:
                loss = ddp_model(batch["features"]).sum()
                ...

    It takes a converter, not its URL::

        >>> ConverterSource("file:///data/train")
        Traceback (most recent call last):
        ...
        TypeError: expected a petastorm SparkDatasetConverter (from make_spark_converter), got str
    """

    def __init__(self, converter: Any, batch_size: int = 32, **loader_kwargs: Any) -> None:
        self._files = converter_files(converter)  # a TypeError for anything but a converter
        check_positive_int("batch_size", batch_size)
        _check_loader_kwargs(loader_kwargs)
        self._converter = converter
        self._batch_size = batch_size
        self._loader_kwargs = loader_kwargs
        self._planned = _planned(self._files, batch_size)
        self._counts_exact = not _COUNT_CHANGING & set(loader_kwargs)
        self._shard: tuple[int, int] | None = None

    @property
    def restartable(self) -> bool:
        return True

    def check_shard(self, rank: int, world_size: int) -> None:
        self._check_enough_row_groups(world_size)
        self._shard = (rank, world_size)

    def known_batches(self) -> int | None:
        if self._planned is None or not self._counts_exact:
            return None
        rank, world_size = self._rank_and_world_size()
        # petastorm's round robin: row group i goes to shard i % shard_count.
        return self._planned.for_ranks(world_size).batches_per_rank[rank]

    def open_pass(self) -> ShardPass[Any]:
        rank, world_size = self._rank_and_world_size()
        _raise_if_deleted(self._converter.cache_dir_url, self._files)
        self._check_enough_row_groups(world_size)
        context = self._converter.make_torch_dataloader(
            batch_size=self._batch_size,
            num_epochs=1,
            cur_shard=rank,
            shard_count=world_size,
            **self._loader_kwargs,
        )
        return open_context_pass(context)

    def _rank_and_world_size(self) -> tuple[int, int]:
        if self._shard is None and group_is_up():
            # The loader was built before the process group: the world's shard.
            self.check_shard(*rank_and_world_size())
        return self._shard or (0, 1)

    def _check_enough_row_groups(self, world_size: int) -> None:
        if self._planned is not None and len(self._planned.row_groups) < world_size:
            raise TooFewRowGroupsError(
                len(self._planned.row_groups), world_size, self._converter.cache_dir_url
            )


class _ContextPassSource(ShardSource[Any]):
    """What a factory's ``converter.make_torch_dataloader(...)`` returned: one pass."""

    def __init__(self, context: Any) -> None:
        self._context = context

    @property
    def restartable(self) -> bool:
        return False

    def open_pass(self) -> ShardPass[Any]:
        from petastorm.errors import NoDataAvailableError

        files = [str(url) for url in self._context.parquet_file_url_list]
        cache_dir = files[0].rsplit("/", 1)[0] if files else "the converter's cache"
        _raise_if_deleted(cache_dir, files)
        try:
            return open_context_pass(self._context)
        except NoDataAvailableError as error:
            shard_count = int(self._context.petastorm_reader_kwargs.get("shard_count") or 1)
            planned = _planned(files, 1)
            raise TooFewRowGroupsError(
                len(planned.row_groups) if planned is not None else 0, shard_count, cache_dir
            ) from error


def source_for(obj: Any, *, owned: bool) -> ShardSource[Any]:
    """A converter (petastorm's defaults), or a ``make_torch_dataloader`` context a factory made
    (the two kinds registered for this module in :mod:`ddp_even.sources.base`)."""
    if is_spark_converter(obj):
        return ConverterSource(obj)
    if not owned:
        raise TypeError(
            "converter.make_torch_dataloader(...) serves one pass; pass the converter "
            "(EvenLoader(ConverterSource(converter, batch_size=64))) or a factory that makes "
            "a fresh one per pass (lambda: converter.make_torch_dataloader(batch_size=64, "
            "num_epochs=1, cur_shard=rank, shard_count=world_size))"
        )
    return _ContextPassSource(obj)


def _check_loader_kwargs(loader_kwargs: dict[str, Any]) -> None:
    import inspect

    from petastorm import make_batch_reader
    from petastorm.spark.spark_dataset_converter import SparkDatasetConverter

    for name in loader_kwargs:
        if name in _SET_HERE:
            raise ValueError(f"do not pass {name}: {_SET_HERE[name]}")
    accepted = {
        name
        for function in (SparkDatasetConverter.make_torch_dataloader, make_batch_reader)
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    } - {"self", "batch_size", *_SET_HERE}
    unknown = sorted(set(loader_kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for converter.make_torch_dataloader; "
            f"accepted: {', '.join(sorted(accepted))}"
        )


def _raise_if_deleted(cache_dir_url: str, files: Sequence[str]) -> None:
    from ddp_even.storage import resolve_dataset

    if not files:
        return
    try:
        resolved = resolve_dataset(list(files))
    except (DatasetError, ValueError) as error:
        # petastorm may still reach them (an HDFS driver, a filesystem of its own).
        logger.debug("ddp_even: cannot check the converter's files (%s)", error)
        return
    missing = [
        url
        for url, path in zip(files, resolved.paths, strict=True)
        if resolved.storage.kind(path) == "missing"
    ]
    if missing:
        raise ConverterDeletedError(cache_dir_url, missing, len(files))


def _planned(files: Sequence[str], batch_size: int) -> DatasetPlan | None:
    """The converter's files planned for one rank (their row groups in petastorm's order), or
    None if the footers cannot be read here (storage ddp_even cannot reach): then nothing is
    checked or counted up front."""
    from ddp_even.parquet.dataset_plan import plan_dataset

    try:
        return plan_dataset(list(files), 1, batch_size)
    except (DatasetError, OSError) as error:
        logger.debug("ddp_even: cannot read the converter's row groups (%s)", error)
        return None
