"""``EvenLoader``: the loader the user already has, with the same number of steps on every rank.

One ``for`` is one epoch: ``_start_epoch`` prepares the source (:mod:`ddp_even.resume.state`),
settles the plan (given, from the footers, or none) and runs the epoch in its shape
(:mod:`ddp_even.runtime.epochs`)."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable

from ddp_even.agreement.control_group import start_heartbeat_for
from ddp_even.agreement.transport import Agreer, agreer_for
from ddp_even.checks import (
    check_timeout,
    check_world_size,
    checked_loader_arguments,
    warn_if_launched_without_a_group,
)
from ddp_even.modes import Mode, mode_named
from ddp_even.process_group import group_is_up, rank_and_world_size
from ddp_even.runtime.epoch_shape import EpochStart, LoaderPlan, run_epoch, settle_epoch
from ddp_even.runtime.epochs import EpochRun
from ddp_even.runtime.feed import ShardFeed
from ddp_even.runtime.iteration import Epoch, EpochNumbering, HandedOut, LoaderAccount
from ddp_even.runtime.settings import Settings
from ddp_even.sources import PlannedSource, as_source

if TYPE_CHECKING:
    from ddp_even.names import ModeName, Sharding
    from ddp_even.planning.plans import ShardPlan
    from ddp_even.resume.state import PendingResume
    from ddp_even.runtime.stats import EpochStats

BatchT = TypeVar("BatchT")

logger = logging.getLogger("ddp_even")


class EvenLoader(LoaderAccount, Generic[BatchT]):
    r"""Wraps a rank's data loader so that every DDP rank takes the same number of steps.

    Each ``for`` over the loader is one epoch. Before handing out batches, the ranks agree
    (one small all-reduce on a CPU gloo group, overlapped with the training step) on how many
    steps to take, so no rank ever waits in a collective the others will not enter.

    Args:
        source: this rank's data: a ``petastorm.pytorch.DataLoader`` or ``BatchedDataLoader``,
            a petastorm reader (``make_reader`` / ``make_batch_reader``), any re-iterable
            iterable (a list, a ``torch.utils.data.DataLoader``), a one-shot iterator
            (truncate and join, one epoch), or a factory returning a fresh iterable for one
            pass over the shard. Each epoch starts the source afresh, except a petastorm reader
            with ``num_epochs=None``, which each epoch continues (``steps_per_epoch`` needed).
        mode: ``"truncate"`` (every rank stops where the shortest shard ends), ``"cycle"``
            (short shards start again until the longest ends, or for ``steps_per_epoch``
            steps), ``"pad"`` (cycle's steps; past its data a rank hands out padding) or
            ``"join"`` (every rank yields all its batches; ranks that finish early shadow the
            others' DDP all-reduces through ``torch``'s ``Join``), or a
            :class:`~ddp_even.modes.Mode` of your own (docs/design.md).
        steps_per_epoch: a cap on the steps of an epoch (truncate) or the exact number of
            steps (cycle, pad). Not allowed in join mode.
        sync_every: batches per agreement. ``None`` (default): agree once per epoch when the
            source's length is known (a list, a map-style ``DataLoader``; in pad mode only a
            plan will do), else every batch.
            ``K > 1`` reads up to ``K`` batches ahead and agrees once per ``K`` steps.
        group: the training's process group (default: the world group).
        joinables: join mode only, and required there: the DDP model and any other
            :class:`~torch.distributed.algorithms.join.Joinable` (e.g. a
            ``ZeroRedundancyOptimizer``) whose collectives joined ranks must shadow. The DDP
            model is made to average its gradients through :func:`~ddp_even.allreduce_hook`
            (unless it has a communication hook of its own), so that a rank that dies inside
            ``backward()`` is named on every survivor.
        timeout: seconds a peer may show no sign of life (its heartbeat stopped: dead or
            frozen) before every rank raises :class:`~ddp_even.PeerTimeoutError` naming it; a
            live peer is waited for up to the training group's timeout (also the default).
        plan: a :class:`~ddp_even.planning.ShardPlan` of the dataset this rank reads (from
            :func:`~ddp_even.parquet.plan_for_dataset`, no row predicate): every rank's batch
            count is then known up front, ``len()`` answers before the first step, and the
            rows read are checked against the plan after each epoch.

    Attributes:
        stats: the :class:`EpochStats` of the last epoch that ran to its end.
        history: the stats of every such epoch, in order.
        repeating, padding, batch_weight: what the batch last handed out is (see each).

    Example, run on every rank (``examples/train.py`` is the whole script)::

        def one_pass():
            reader = make_reader(url, num_epochs=1, cur_shard=rank, shard_count=world_size)
            return DataLoader(reader, batch_size=64)

        loader = EvenLoader(one_pass, mode="cycle")
        for epoch in range(3):
            for batch in loader:
                ddp_model(batch["x"]).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            print(loader.stats.summary())

    Without a process group (or with one rank) it passes batches through and still counts::

        >>> loader = EvenLoader([[1, 2], [3], [4, 5]], mode="cycle", steps_per_epoch=5)
        >>> [batch for batch in loader]
        [[1, 2], [3], [4, 5], [1, 2], [3]]
        >>> loader.stats.repeated_batches, loader.stats.samples
        ((2,), (8,))
    """

    def __init__(
        self,
        source: Any,
        mode: ModeName | Mode = "truncate",
        *,
        steps_per_epoch: int | None = None,
        sync_every: int | None = None,
        group: dist.ProcessGroup | None = None,
        joinables: Sequence[Joinable] = (),
        timeout: float | None = None,
        plan: ShardPlan | None = None,
    ) -> None:
        self._mode = mode_named(mode)
        joinables = checked_loader_arguments(
            steps_per_epoch=steps_per_epoch,
            sync_every=sync_every,
            timeout=timeout,
            group=group,
            joinables=joinables,
            plan=plan,
        )
        self._mode.check(steps_per_epoch=steps_per_epoch, has_joinables=bool(joinables))
        if joinables:
            from ddp_even.liveness.gradient_hook import register_on

            for joinable in joinables:
                register_on(joinable)
        self._source = as_source(source)
        self._source.check_fits(self._mode.after_own_data, steps_per_epoch)
        if group_is_up():
            self._source.check_shard(*rank_and_world_size(group))
            start_heartbeat_for(group, timeout)  # this process lives, from now until exit
        self._steps_per_epoch = steps_per_epoch
        self._sync_every = sync_every
        self._group = group
        self._joinables = joinables
        self._timeout = None if timeout is None else float(timeout)
        # A factory that reads any plan of its dataset (from_parquet's): resumes elastically.
        self._passes = source if isinstance(source, PlannedSource) else None
        # The plan given (or the planned factory's), else the one its footers give.
        self._plan = LoaderPlan(
            plan if plan is not None or self._passes is None else self._passes.plan
        )
        # Made at the first epoch, a point every rank reaches (or met while planning).
        self._agreer: Agreer | None = None
        self._next_epoch = 0
        self._running: weakref.ref[Epoch[BatchT]] | None = None
        self._current_run: EpochRun[BatchT] | None = None
        # Where the next epoch resumes, from load_state_dict.
        self._pending: PendingResume | None = None
        self.history: list[EpochStats] = []
        self._handed_out = HandedOut()
        # Trainers number epochs through sampler.set_epoch (Lightning); no batch sampler here.
        self.sampler = EpochNumbering(self)
        self.batch_sampler = None

    @property
    def mode(self) -> str:
        """The mode's name: one of :data:`~ddp_even.modes.MODES`, or a mode's of your own."""
        return self._mode.name

    @classmethod
    def from_parquet(
        cls,
        dataset: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        batch_size: int,
        mode: ModeName | Mode = "truncate",
        *,
        sharding: Sharding = "round_robin",
        predicate: Any = None,
        reader: Literal["batch", "row"] = "batch",
        reader_kwargs: Mapping[str, Any] | None = None,
        loader_kwargs: Mapping[str, Any] | None = None,
        steps_per_epoch: int | None = None,
        sync_every: int | None = None,
        group: dist.ProcessGroup | None = None,
        joinables: Sequence[Joinable] = (),
        timeout: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
        filesystem: Any = None,
    ) -> EvenLoader[Any]:
        """One line for the common case: this rank's shard, planned from footers, read.

        Plans every rank's shard of ``dataset`` (a path, a URL that ``storage_options`` or
        ``filesystem`` reach, a list of files, or a petastorm Spark converter) from its Parquet
        footers, cut as ``sharding`` says (``"round_robin"``, ``"row_groups"``, ``"rows"``,
        ``"replicate"``), a row ``predicate``'s rows counted first; reads each pass with
        pyarrow, batches of ``batch_size`` rows as dicts of tensors (docs/using.md
        lists ``reader_kwargs`` and ``loader_kwargs``). ``reader="row"`` decodes a dataset
        petastorm wrote with a Unischema by its codecs, as ``make_reader`` does (needs
        petastorm). ``len()`` answers before the first step and :class:`EpochStats` says
        exactly what each rank dropped. docs/using.md has the details.

        Example, on every rank::

            loader = EvenLoader.from_parquet("file:///data/train", batch_size=64,
                                             mode="truncate", sharding="rows")
            print(len(loader))          # steps per epoch, the same on every rank
        """
        from ddp_even.arrow.passes import make_shard_factory

        if not isinstance(dataset, str | os.PathLike | Sequence):
            from ddp_even.petastorm.spark_converter import converter_files, is_spark_converter

            if is_spark_converter(dataset):  # its files, in petastorm's order
                dataset = converter_files(dataset)
        check_timeout(timeout)
        rank, world_size = rank_and_world_size(group)
        # Counting a predicate's rows is the first time the ranks meet: the loader goes on with
        # that agreement.
        agreer = agreer_for(group, timeout) if predicate is not None else None
        _, passes = make_shard_factory(
            dataset,
            rank,
            world_size,
            batch_size,
            sharding=sharding,
            predicate=predicate,
            share=None if agreer is None else agreer.gather_counts,
            reader=reader,
            reader_kwargs=reader_kwargs,
            loader_kwargs=loader_kwargs,
            storage_options=storage_options,
            filesystem=filesystem,
        )
        planned = cls(
            passes,
            mode,
            steps_per_epoch=steps_per_epoch,
            sync_every=sync_every,
            group=group,
            joinables=joinables,
            timeout=timeout,
        )
        planned._agreer = agreer
        return planned

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: plain data to save with the model, to resume mid-epoch.

        Call it at the same step on every rank, after the step's optimizer update (the batch
        last handed out counts as trained on). The state holds the format ``version``, the
        ddp_even ``library_version``, the loader's ``settings`` (mode, ``steps_per_epoch``,
        ``sync_every``, plan digest), ``world_size``, this process's global ``rank``, the
        ``epoch`` in progress (or the next one between epochs), ``step``: how many of that
        epoch's steps this rank has handed out, and ``provenance``: what the epoch's reading
        follows from, where the source can tell (see :meth:`load_state_dict`). Ints and
        strings only: safe for ``torch.save`` and ``torch.distributed.checkpoint``.

        Example::

            >>> loader = EvenLoader([[1], [2], [3]])
            >>> epoch = iter(loader)
            >>> next(epoch)
            [1]
            >>> state = loader.state_dict()
            >>> state["epoch"], state["step"]
            (0, 1)
            >>> resumed = EvenLoader([[1], [2], [3]])
            >>> resumed.load_state_dict(state)
            >>> list(resumed), resumed.stats.steps, resumed.stats.resumed_at_step
            ([[2], [3]], (3,), 1)
        """
        from ddp_even.resume.state import loader_state, provenance_of

        alive = self._running is not None and self._running() is not None
        return loader_state(
            self._current_run if alive else None,
            self._next_epoch,
            self._pending,
            settings=self._settings().description,
            world_size=rank_and_world_size(self._group)[1],
            provenance=provenance_of(
                self._passes, None if self._current_run is None else self._current_run.feed.reading
            ),
        )

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): the next ``for`` resumes its epoch.

        The rest of the interrupted epoch is what an uninterrupted run would have handed out
        when every pass over a rank's shard yields the same batches in the same order (lists,
        unshuffled or seeded readers, factories building such sources); its statistics count
        the whole epoch. Each rank reads again what it had consumed, unless its source can
        start at the step (a factory taking ``start_batch``, a ``from_parquet`` loader, which
        also resumes on another number of ranks). Raises ``ValueError`` when ``state`` does
        not fit this loader's settings, and :class:`~ddp_even.StateMismatchError` (at once
        for ``from_parquet``, else on every rank before the resumed epoch's first step) when
        it was saved by a loop that read other data or in another order, or when either loop
        cannot tell; ``strict=False`` resumes anyway. docs/resume.md has the whole story.
        """
        from ddp_even.resume.state import pending_resume

        self._next_epoch, self._pending = pending_resume(
            state,
            self._settings(),
            world_size=rank_and_world_size(self._group)[1],
            planned=self._passes,
            strict=strict,
        )

    def set_epoch(self, epoch: int) -> None:
        """Number the next epoch ``epoch`` (as ``DistributedSampler.set_epoch`` does).

        Epochs are numbered by the loader from 0, one per ``for``; trainers that keep their
        own count (Lightning calls ``set_epoch`` before each epoch) keep the two equal, also
        after resuming. Every rank must set the same number: ranks compare epochs at every
        agreement.

        Example::

            >>> loader = EvenLoader([[1], [2]])
            >>> loader.set_epoch(5)
            >>> _ = list(loader)
            >>> loader.stats.epoch
            5
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        run = self._current_run
        if run is not None and not run.finished and run.epoch == epoch:
            return  # that epoch is already running (a trainer fetched its first batch early)
        self._next_epoch = epoch

    def __len__(self) -> int:
        plan = self._plan.current
        if plan is not None:
            rank, world_size = rank_and_world_size(self._group)
            check_world_size(plan.world_size, world_size)
            return self._mode.steps_per_rank(plan.batches_per_rank, self._steps_per_epoch)[rank]
        steps = None if self._current_run is None else self._current_run.agreed_steps
        if steps is None:
            raise TypeError(
                "the number of steps is known only with a shard plan (plan=..., from_parquet), "
                "or once an epoch has started when every rank's source has a known length "
                "(a list, a map-style DataLoader)"
            )
        return steps

    def __iter__(self) -> Iterator[BatchT]:
        running = None if self._running is None else self._running()
        if running is not None:
            # An epoch left unfinished and still referenced (``it = iter(loader)``) is closed
            # before the next, at this call: the same point on every rank. Advancing it again
            # (nested or concurrent iteration) raises instead of silently ending.
            running.supersede()
        epoch = Epoch(self._start_epoch)
        # Only a weak reference: the epoch's frame refers to the loader, so a strong one would
        # make a cycle that only the garbage collector breaks, closing an epoch left early
        # (its collectives included) at a different moment on every rank. Held weakly, the
        # epoch closes when its last user lets go of it: at the ``break``, at an exception
        # leaving the loop, at ``del loader``: the same step on every rank.
        self._running = weakref.ref(epoch)
        return epoch

    def _start_epoch(self) -> Generator[BatchT, None, None]:
        """The next epoch, started: its shape's generator, which hands out its batches."""
        # Called when the first batch is asked for: the epoch number is taken then.
        epoch = self._next_epoch
        self._next_epoch += 1
        agreer = self._agreer_for_this_process()
        pending, self._pending = self._pending, None
        if pending is not None and pending.epoch == epoch:
            from ddp_even.resume.state import resumed_start

            start = resumed_start(
                pending, self._source, self._plan.given, self._passes, self._mode, agreer
            )
        else:
            self._source.start_epoch(epoch)
            start = EpochStart(self._source)
        feed: ShardFeed[BatchT] = ShardFeed(
            start.source,
            self._mode.after_own_data,
            steps_capped=self._steps_per_epoch is not None,
            starts_after=len(start.skipped),
        )
        # Whatever ends the epoch before its first step (a refused resume, a mismatch) closes
        # what it opened, as the shape's generator does after: a reader left running at exit
        # aborts the process.
        try:
            run = settle_epoch(
                self._settings(),
                epoch=epoch,
                agreer=agreer,
                start=start,
                feed=feed,
                loader_plan=self._plan,
                previous=self._current_run,
                handed_out=self._handed_out,
                record=self.history.append,
            )
            if start.unchecked is not None:
                from ddp_even.resume.state import check_resumed_reading

                check_resumed_reading(start, feed, self._passes, agreer.rank)
            self._current_run = run
            self._handed_out.epoch_started()
            if start.step is not None:
                run.resume_after(start.step, start.skipped, start.out_of_order)
        except BaseException:
            self._handed_out.epoch_ended()
            feed.close()
            raise
        return run_epoch(run, self._joinables)

    def _settings(self) -> Settings:
        return Settings(self._mode, self._steps_per_epoch, self._sync_every, self._plan.given)

    def _agreer_for_this_process(self) -> Agreer:
        if self._agreer is None:
            self._agreer = agreer_for(self._group, self._timeout)
            if self._agreer.world_size == 1:
                warn_if_launched_without_a_group()
        return self._agreer
