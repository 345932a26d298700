"""Every exception ddp_even raises: :class:`EvenLoaderError` and its subclasses, each saying
who raises it, where, and with which fields."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence


class EvenLoaderError(RuntimeError):
    """Base class: something made the ranks unable to agree on the next step.

    Every rank raises it at the same step, so ``except EvenLoaderError`` on every rank is safe.

    Example::

        >>> from ddp_even import EmptyShardError, EvenLoaderError
        >>> issubclass(EmptyShardError, EvenLoaderError)
        True
    """


class PeerSourceError(EvenLoaderError):
    """Another rank's data source raised; this rank stops at the same step.

    ``step``: the steps done before it raised (0: before the first step, or while planning).

    The rank whose source failed re-raises its own exception instead.

    Example::

        >>> error = PeerSourceError(2, "OSError", "corrupt footer", step=41)
        >>> error.failed_rank
        2
        >>> print(error)
        rank 2's data source raised OSError: corrupt footer (before step 41); every rank ...
    """

    def __init__(self, failed_rank: int, error_type: str, error_message: str, step: int) -> None:
        self.failed_rank = failed_rank
        self.error_type = error_type
        self.error_message = error_message
        self.step = step
        when = f"before step {step}" if step > 0 else "before the first step"
        super().__init__(
            f"rank {failed_rank}'s data source raised {error_type}: {error_message} "
            f"({when}); every rank stops here"
        )


class SourceEndedEarlyError(EvenLoaderError):
    """A rank's source ended before the batch count its length or shard plan promised.

    With known lengths the ranks agree on the epoch's steps up front, from every rank's batch
    count; a source that then yields fewer batches lost rows (a predicate or transform that is
    not deterministic, a reader that dropped row groups, data rewritten mid-pass). When the
    epoch needs batches the source no longer has (cycle restarts a short pass instead, and
    ``EpochStats.lost_rows`` counts what it lost, unless the pass was empty), the rank raises
    it and every other rank raises :class:`PeerSourceError` naming it, together: before the
    first step when the source has nothing at all, else where the check of the sources that
    heard of it is settled, at most 32 steps or about 0.1 s later (ranks check every 16 steps,
    or 50 ms of shorter steps, without waiting; until then the short rank hands out its last
    batch again).

    Example::

        >>> print(SourceEndedEarlyError(read=3, promised=12))
        this rank's source ended after 3 of the 12 batches its length (or shard plan) ...
    """

    def __init__(self, read: int, promised: int) -> None:
        self.read = read
        self.promised = promised
        super().__init__(
            f"this rank's source ended after {read} of the {promised} batches its length (or "
            "shard plan) promised: rows were lost while reading (a predicate or transform_spec "
            "that is not deterministic, or data rewritten during the pass). Plan again, or set "
            "sync_every=1 so that ranks agree as they go instead of trusting the length"
        )


class EmptyShardError(EvenLoaderError):
    """Cycle mode was asked to wrap around a shard that yields no batch at all (or, in pad mode,
    the batch another rank would lend an empty one as padding cannot be sent: ``why``).

    Example (one process; with several ranks every rank raises it, naming the empty ones)::

        >>> from ddp_even import EvenLoader
        >>> loader = EvenLoader(lambda: iter([]), mode="cycle", steps_per_epoch=3)
        >>> next(iter(loader))
        Traceback (most recent call last):
        ...
        ddp_even.errors.EmptyShardError: cycle mode cannot wrap around an empty shard: ...
    """

    def __init__(self, empty_ranks: tuple[int, ...], why: str | None = None) -> None:
        self.empty_ranks = empty_ranks
        names = ", ".join(str(rank) for rank in empty_ranks)
        what = "cycle mode cannot wrap around an empty shard"
        if why is not None:
            what = f"pad mode has nothing to pad empty shards with: {why}"
        super().__init__(
            f"{what}: rank(s) {names} have no batch. Give every rank at least one row group "
            "(fewer ranks, smaller row groups, or a balanced plan), or use mode='truncate' or "
            "mode='join'" + ("" if why is not None else " (or mode='pad')")
        )


class RankMismatchError(EvenLoaderError):
    """Ranks were set up differently (mode, steps_per_epoch, window) or are in different epochs.

    Raised on every rank at the first agreement, before any training step. Example:
    rank 0 running ``EvenLoader(source, "cycle")`` while rank 1 runs
    ``EvenLoader(source, "truncate")`` raises, on both::

        RankMismatchError: ranks are not running the same loop; ... (rank 0: epoch 0,
        mode=cycle steps_per_epoch=None sync_every=1; rank 1: epoch 0, mode=truncate ...)
    """


class OffPlanError(EvenLoaderError):
    """Some ranks' sources do not read what the shard plan given to the loader says.

    Raised on every rank at the first agreement of an epoch, before any training step, when a
    rank can tell that its source reads other row groups than its shard of the plan (for
    example a balanced plan given with petastorm's round-robin readers). ``off_plan`` maps each
    such rank to what differs.

    Example::

        >>> print(OffPlanError({1: "it reads row groups [1, 3], the plan gives it [2]"}))
        the shard plan does not match what the ranks read (rank 1: it reads row groups [1, 3], ...
    """

    def __init__(self, off_plan: dict[int, str]) -> None:
        self.off_plan = off_plan
        described = "; ".join(f"rank {rank}: {what}" for rank, what in sorted(off_plan.items()))
        super().__init__(
            f"the shard plan does not match what the ranks read ({described}); build the "
            "readers from the same plan (EvenLoader.from_parquet), or plan with the sharding the "
            "readers use (sharding='round_robin' for petastorm's cur_shard/shard_count)"
        )


class ShardCoverageError(EvenLoaderError, ValueError):
    """The readers of the ranks do not read the dataset once between them: some row groups are
    read by no rank, or by several while others skip them (petastorm readers built with another
    ``cur_shard``/``shard_count`` than the training group's rank and world size).

    Raised on every rank before the first step of the epoch whose first passes showed it;
    ``unread`` lists the row groups no rank reads, ``read_by`` those several ranks read, with
    their (global) ranks. Every rank reading every row group (no sharding) is not an error.

    Example::

        >>> from ddp_even.planning.coverage import coverage_problem
        >>> print(ShardCoverageError(*coverage_problem(
        ...     [frozenset({0, 3}), frozenset({1, 4})], 6, selects=False, ranks=[0, 1])))
        the ranks' readers do not read the dataset once between them: row group(s) [2, 5] are ...
    """

    def __init__(
        self, unread: tuple[int, ...], read_by: Mapping[int, tuple[int, ...]], message: str
    ) -> None:
        self.unread = unread
        self.read_by = dict(read_by)
        super().__init__(message)


class StateMismatchError(EvenLoaderError, ValueError):
    """A loader state does not fit the loader it was loaded into: it was saved by a loop with
    other settings (``settings``: each one that differs, with its value there and here where
    it has one to show), that read other data or in another order (``differ`` names every
    field that differs, settings included), or one of the two loops cannot tell what it read
    (``untold`` names the settings hidden, and what hides them).

    Raised on every rank before the first step of the resumed epoch; nothing was read for it.
    ``load_state_dict(state, strict=False)`` resumes anyway where only what was read differs
    (docs/resume.md); a state whose settings differ (its steps are other steps) never loads.

    Example::

        >>> print(StateMismatchError(["seed"], {}))
        the loader state was saved by a loader whose seed differs from this one's: the rows ...
        >>> print(StateMismatchError([], {}, settings={"batch_size": ("8", "4")}))
        the loader state was saved by a loader with other settings (batch_size=8) than this ...
    """

    def __init__(
        self,
        differ: Sequence[str],
        untold: Mapping[str, str],
        *,
        settings: Mapping[str, tuple[str, str] | None] | None = None,
    ) -> None:
        self.settings = dict(settings or {})
        self.differ = tuple(dict.fromkeys([*self.settings, *differ]))
        self.untold = dict(untold)
        shown = {name: values for name, values in self.settings.items() if values is not None}
        others = [name for name in self.differ if name not in shown]
        found = []
        said = "the loader state was saved by a loader"
        if shown:
            there = ", ".join(f"{name}={values[0]}" for name, values in shown.items())
            here = ", ".join(f"{name}={values[1]}" for name, values in shown.items())
            said += f" with other settings ({there}) than this one ({here})"
        if others:
            verb = "differs" if len(others) == 1 else "differ"
            said += f"{', and' if shown else ''} whose {', '.join(others)} {verb}"
            said += " too" if shown else " from this one's"
            # True whatever differs (another reader may read the same rows, or not).
            said += ": the rows it had read by its step may not be the rows this one reads by then"
        if shown or others:
            found.append(said)
        if untold:
            hidden = "; ".join(f"{name}: {why}" for name, why in self.untold.items())
            found.append(
                "whether the loop that saved the state read the same rows in the same order "
                f"cannot be told ({hidden})"
            )
        advice = (
            "Build the loader as it was built when the state was saved (the same data, reader "
            "settings, predicate and batch size), start the next epoch with "
            "loader.set_epoch(epoch + 1)"
        )
        if not self.settings:
            advice += ", or resume anyway with load_state_dict(state, strict=False)"
        else:
            advice = advice.replace(", start the next", ", or start the next")
        super().__init__(f"{'; and '.join(found)}. {advice}")


class PeerTimeoutError(EvenLoaderError):
    """Some ranks are lost: dead, stalled, or alive but away past the training group's timeout.

    ``missing_ranks`` names them (global ranks) and ``states`` says, for each, what became of
    it: ``"dead"`` (its process is gone), ``"exited"`` (its process ended, or destroyed its
    process group), ``"stalled"`` (no sign of life, no heartbeat, for ``timeout``: frozen by
    SIGSTOP or a debugger, or its main thread holding the GIL), ``"busy"`` (alive, but it did
    not come within the training group's own timeout; the message says what it was doing) or
    ``"unseen"`` (it never made an ``EvenLoader``). ``timeout`` is the deadline that applied:
    the loader's ``timeout`` (how long a peer may show no sign of life) or the training
    group's. A stalled rank that wakes up later raises it too, with ``late=True`` and itself
    among the missing.

    Example::

        >>> error = PeerTimeoutError((3,), 30.0, "rank 3 is dead: ...", states={3: "dead"})
        >>> print(error)
        rank(s) 3 did not answer a step agreement: rank 3 is dead: ...
        >>> error.states
        {3: 'dead'}
    """

    def __init__(
        self,
        missing_ranks: tuple[int, ...],
        timeout: float,
        detail: str,
        *,
        rank: int | None = None,
        late: bool = False,
        states: Mapping[int, str] | None = None,
        what: str = "a step agreement",
    ) -> None:
        # The lost ranks; empty when they could not be told.
        self.missing_ranks = missing_ranks
        self.timeout = timeout
        # The rank raising this error, and whether it was the one that came too late (it
        # stalled, and the others had already given up on it).
        self.rank = rank
        self.late = late
        self.states = dict(states or {})
        self.detail = detail
        if late:
            super().__init__(
                f"rank {rank} reached {what} after every other rank had stopped waiting for "
                f"it: this rank was stalled or too slow, and every rank stops: {detail}"
            )
            return
        names = ", ".join(str(missing) for missing in missing_ranks) or "unknown"
        super().__init__(f"rank(s) {names} did not answer {what}: {detail}")


class DatasetError(EvenLoaderError, ValueError):
    """The dataset cannot be planned: missing, unreachable, not Parquet, or laid out so petastorm
    fails too.

    The message is one line: it names the path or URL and says what to do. A ``ValueError``
    too: the dataset given is wrong.

    Example:
        >>> from ddp_even.parquet import read_row_groups
        >>> try:
        ...     read_row_groups("/no/such/dataset")
        ... except DatasetError as error:
        ...     print(error)
        /no/such/dataset does not exist: check the path or URL
    """


class PlanMismatchError(EvenLoaderError):
    """The dataset is no longer the one planned: its files or row groups changed.

    Raised by ``factory()`` before any data is read, when the footers of the pass's files
    give a row group other rows than the plan counted or show a file rewritten since planning
    (plan again), or when petastorm lists the row groups differently from the plan (the
    dataset changed, or ddp_even lists row groups wrongly: please report it).

    Example:
        >>> issubclass(PlanMismatchError, EvenLoaderError)
        True
    """


class RowCountMismatchError(EvenLoaderError):
    """A row group yielded a different number of rows from the plan's count.

    The dataset changed since it was planned, its footers disagree with its data, or a row
    predicate or transform is not deterministic (the plan counted its rows once). Raised by the
    rank that read the row group, while it reads; the others learn it at their next agreement
    (:class:`PeerSourceError`).

    Example:
        >>> issubclass(RowCountMismatchError, EvenLoaderError)
        True
    """


class ConverterDeletedError(EvenLoaderError):
    """The Parquet files of a petastorm Spark converter are not there.

    ``converter.delete()`` removes them, and so does the exit of the process that called
    ``make_spark_converter`` (petastorm registers that with ``atexit``); a Spark executor on
    another machine also misses them when the cache is on a disk only the driver sees. Raised
    on every rank when the loader is built or a pass starts, instead of petastorm's
    ``RuntimeError`` after waiting 30 s for the files, and by
    :func:`~ddp_even.petastorm.spark_converter.check_distributor` on the driver.

    Example::

        >>> print(ConverterDeletedError("file:///cache/run-1", ["file:///cache/run-1/part-0"], 4))
        the Spark converter's Parquet files under file:///cache/run-1 are not on ... (1 of 4 ...
    """

    def __init__(self, cache_dir_url: str, missing: Sequence[str], total: int) -> None:
        self.cache_dir_url = cache_dir_url
        self.missing = tuple(missing)
        super().__init__(
            f"the Spark converter's Parquet files under {cache_dir_url} are not on "
            f"{socket.gethostname()} ({len(self.missing)} of {total} missing, e.g. "
            f"{self.missing[0]}): it was deleted (converter.delete()), the process that called "
            "make_spark_converter has exited (petastorm deletes the files then), or this "
            "machine cannot reach the cache. Keep that process alive and call "
            "converter.delete() after training, or make a new converter: "
            "make_spark_converter(df). Ranks on Spark executors (TorchDistributor with "
            "local_mode=False) need a cache every machine reads: set "
            "SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF to a shared file system, DBFS, "
            "S3 or HDFS URL"
        )


class TooFewRowGroupsError(EvenLoaderError, ValueError):
    """A Spark converter holds fewer row groups than there are ranks.

    petastorm shards a converter by row group (one per non-empty DataFrame partition, or more
    for large partitions), so some ranks would have nothing: its readers raise
    ``NoDataAvailableError`` on every rank. Raised on every rank when the loader is built (or
    when a factory's ``make_torch_dataloader`` context is entered), saying what to do.

    Example::

        >>> print(TooFewRowGroupsError(1, 4, "file:///cache/run-1"))
        the Spark converter's DataFrame (file:///cache/run-1) was written as 1 row group(s), ...
    """

    def __init__(self, row_groups: int, world_size: int, where: str) -> None:
        self.row_groups = row_groups
        self.world_size = world_size
        super().__init__(
            f"the Spark converter's DataFrame ({where}) was written as {row_groups} row "
            f"group(s), fewer than the {world_size} ranks: petastorm shards by row group and "
            f"raises NoDataAvailableError on every rank. Repartition the DataFrame into at "
            f"least {world_size} partitions before converting it: "
            f"make_spark_converter(df.repartition({world_size})) (a multiple of "
            f"{world_size} partitions of similar sizes keeps shards even); or plan the shards: "
            "EvenLoader.from_parquet(converter, batch_size=..., sharding='row_groups', "
            "mode='join') runs with ranks that hold no row group"
        )


class TooFewTaskSlotsError(EvenLoaderError):
    """``TorchDistributor(local_mode=False)`` needs more Spark task slots than the cluster has.

    Each rank is a Spark barrier task, and a barrier stage starts only when all its tasks can
    run at once; with fewer slots Spark retries for about 10 minutes before it fails
    (SPARK-24819). Raised by :func:`~ddp_even.petastorm.spark_converter.check_distributor`.

    Example::

        >>> print(TooFewTaskSlotsError(3, 2, "local[2]", 1, 60.0))
        TorchDistributor(local_mode=False) runs 3 Spark barrier tasks at once, but ...
    """

    def __init__(
        self, tasks: int, slots: int, master: str, cpus_per_task: int, waited_s: float
    ) -> None:
        self.tasks = tasks
        self.slots = slots
        super().__init__(
            f"TorchDistributor(local_mode=False) runs {tasks} Spark barrier tasks at once, but "
            f"the Spark cluster ({master}) has {slots} task slot(s) (checked for "
            f"{waited_s:.0f} s): Spark would retry for about 10 minutes and then "
            "fail (SPARK-24819). Use num_processes="
            f"{max(slots, 1)} or fewer, give the cluster more executor cores (each task takes "
            f"spark.task.cpus={cpus_per_task}), or train on the driver with local_mode=True"
        )
