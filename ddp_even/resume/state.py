"""Resuming mid-epoch: the loader's saved state (:func:`loader_state`), the checks of a state
against the loader (:func:`pending_resume`) and what the resumed epoch reads
(:func:`resumed_start`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddp_even.errors import StateMismatchError
from ddp_even.modes import Mode
from ddp_even.planning.provenance import Provenance
from ddp_even.planning.sharding import SHARDINGS
from ddp_even.process_group import rank_and_world_size
from ddp_even.runtime.epoch_shape import EpochStart
from ddp_even.runtime.settings import Settings, mismatched_settings
from ddp_even.sources import PlannedSource, ShardSource, as_source

if TYPE_CHECKING:
    from ddp_even.agreement.transport import Agreer
    from ddp_even.planning.plans import ShardPlan
    from ddp_even.runtime.epochs import EpochRun
    from ddp_even.runtime.feed import ShardFeed
    from ddp_even.sources.base import PassReading

logger = logging.getLogger("ddp_even")

#: What the ``format`` key of every loader state says.
STATE_FORMAT = "ddp_even.EvenLoader"
# Raised when what the state holds, or what it means, changes (3: what a wrapped loop's first
# pass read, from the reader itself; 4: settings as fields, a plan's sharding, batch size and
# rows per rank each one).
_VERSION = 4
_LIBRARY_VERSION = importlib.metadata.version("ddp_even")


def loader_state(
    running: EpochRun[Any] | None,
    next_epoch: int,
    pending: PendingResume | None,
    *,
    settings: str,
    world_size: int,
    provenance: Provenance | None,
) -> dict[str, Any]:
    """The state :meth:`ddp_even.EvenLoader.state_dict` returns, plain ints and strings: where a
    loader is, inside its ``running`` epoch, at a resume not yet started, or before
    ``next_epoch``, with this process's global rank.

    Its ``resumed_from_world_size`` is set while an epoch that resumed on another number of
    ranks runs: its steps count the re-planned rest of the epoch, not the epoch. ``provenance``
    is what the loader's reading follows from, where it knows (a planned loader, or a source
    whose passes tell what they read): a state loaded elsewhere is checked against it.
    """
    epoch, step, resumed_from = next_epoch, 0, None
    if running is not None and not running.finished:
        epoch, step = running.epoch, running.counts.steps
        resumed_from = running.resumed_from_world_size
    elif pending is not None and pending.saved_plan is None:
        epoch, step = pending.epoch, pending.step
    return {
        "format": STATE_FORMAT,
        "version": _VERSION,
        "library_version": _LIBRARY_VERSION,
        "settings": settings,
        "world_size": world_size,
        "rank": rank_and_world_size(None)[0],
        "epoch": epoch,
        "step": step,
        "resumed_from_world_size": resumed_from,
        "provenance": None if provenance is None else provenance.as_dict(),
    }


def resume_point(
    state: Mapping[str, Any],
    *,
    settings: str,
    world_size: int,
    provenance: Provenance | None = None,
    strict: bool = True,
) -> tuple[int, int]:
    """``(epoch, step)`` to resume after; ``ValueError`` saying why ``state`` cannot be used.

    ``provenance``: the loader's, when it is known now (a planned loader); checked against the
    state's (:func:`check_provenance`, with ``strict``).
    """
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError("not an EvenLoader state: pass what EvenLoader.state_dict() returned")
    if state.get("version") != _VERSION:
        raise ValueError(
            f"the loader state has format version {state.get('version')!r} (saved by "
            f"ddp_even {state.get('library_version')}); this ddp_even ({_LIBRARY_VERSION}) "
            f"reads version {_VERSION}: resume with the release that saved it, or start the "
            "epoch again"
        )
    if state.get("settings") != settings:
        raise _settings_mismatch(state, settings, provenance)
    if state.get("world_size") != world_size:
        raise ValueError(
            f"the loader state was saved on {state.get('world_size')} ranks, and this job has "
            f"{world_size}: resuming mid-epoch on another number of ranks is not supported; "
            "start the next epoch with loader.set_epoch(epoch + 1)"
        )
    epoch, step = state.get("epoch"), state.get("step")
    for name, value in (("epoch", epoch), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"the loader state's {name} must be an int >= 0, got {value!r}")
    assert isinstance(epoch, int) and isinstance(step, int)
    if step > 0 and state.get("resumed_from_world_size") is not None:
        raise ValueError(
            f"the loader state was saved at step {step} of epoch {epoch}, which had itself "
            f"resumed from {state.get('resumed_from_world_size')} ranks on {world_size}: its "
            "steps count a re-planned rest of the epoch. Resume from the state saved before "
            f"that resume, or start the next epoch (loader.set_epoch({epoch + 1}))"
        )
    if step > 0 and provenance is not None:
        # Between epochs nothing of an epoch was read: any loader may start the next.
        check_provenance(state, provenance, strict)
    return epoch, step


def check_provenance(
    state: Mapping[str, Any], provenance: Provenance | None, strict: bool, rank: int = 0
) -> None:
    """Raise :class:`~ddp_even.StateMismatchError` naming what differs when ``state`` was saved
    by a loader that read other data, or in another order, than ``provenance`` says, or when
    either cannot tell (a source that says nothing of what it reads against one that does, a
    part a process pool hides). Neither telling (plain iterables) is no mismatch. With
    ``strict=False`` the mismatch is logged (on ``rank`` 0) and the resume goes on."""
    saved = state.get("provenance")
    if saved is None and provenance is None:
        return
    if not isinstance(saved, Mapping):
        error = StateMismatchError((), {"data": "the loader that saved the state cannot tell"})
    elif provenance is None:
        error = StateMismatchError((), {"data": "this loader's source cannot tell"})
    else:
        before = Provenance.from_dict(saved)
        differ, untold = before.compare(provenance)
        hidden = {**before.untold(), **provenance.untold()}
        if not differ and not untold:
            return
        error = StateMismatchError(differ, {name: hidden[name] for name in untold})
    if strict:
        raise error
    if rank == 0:
        logger.warning("ddp_even: resuming anyway (load_state_dict(strict=False)): %s", error)


def _settings_mismatch(
    state: Mapping[str, Any], settings: str, provenance: Provenance | None
) -> StateMismatchError:
    """A state saved with other settings: each that differs, and what else differs in what was
    read, where both loaders tell."""
    saved = state.get("provenance")
    differ = (
        Provenance.from_dict(saved).compare(provenance)[0]
        if isinstance(saved, Mapping) and provenance is not None
        else []
    )
    shown = mismatched_settings(str(state.get("settings")), settings)
    return StateMismatchError(differ, {}, settings=shown)


def provenance_of(planned: PlannedSource | None, reading: PassReading | None) -> Provenance | None:
    """What a loader's reading follows from, where it knows: a ``planned`` loader's plan and
    reader settings, or what an epoch's first pass reads (its ``reading``)."""
    if planned is not None:
        return planned.provenance
    return None if reading is None else reading.provenance()


def check_resumed_reading(
    start: EpochStart, feed: ShardFeed[Any], planned: PlannedSource | None, rank: int
) -> None:
    """What the resumed epoch reads (its first pass opened here), checked against the state
    ``start`` resumes from (``start.unchecked``, which the caller checked is there): a state
    that does not fit is the feed's failure, which every rank reports at the resume agreement."""
    assert start.unchecked is not None
    feed.first_pass_reading()
    try:
        check_provenance(start.unchecked, provenance_of(planned, feed.reading), start.strict, rank)
    except StateMismatchError as error:
        feed.failure = feed.failure or error


@dataclass(frozen=True)
class PendingResume:
    """Where the loader's next epoch resumes (from a loaded state)."""

    epoch: int
    # The steps of that epoch every rank had handed out when the state was saved.
    step: int
    # The plan the state was saved under, when it was saved on another number of ranks: the
    # epoch then reads the rows no rank had read, re-planned over this job's ranks.
    saved_plan: ShardPlan | None = None
    # Per rank of the saved plan, the batches of its pass handed out before the step, where
    # that is not the first ``step`` (share hands batches to other ranks).
    read: tuple[tuple[int, ...], ...] | None = None
    # The state itself, while what it follows from is checked only when the epoch starts (a
    # loader whose passes tell what they read knows it once the epoch's first pass is open).
    unchecked: Mapping[str, Any] | None = None
    # Whether a state that does not fit is refused (or resumed anyway).
    strict: bool = True


def pending_resume(
    state: Mapping[str, Any],
    settings: Settings,
    *,
    world_size: int,
    planned: PlannedSource | None,
    strict: bool = True,
) -> tuple[int, PendingResume | None]:
    """``(next epoch, where it resumes)`` from ``state``, for a loader of ``settings``;
    ``ValueError`` saying why not.

    A ``planned`` loader checks what the state was read from at once; any other when the
    resumed epoch's first pass is open (``strict``: :func:`check_provenance`). A state saved on
    another number of ranks loads only into a ``planned`` loader, in truncate and join, whose
    pass order is known (``planned.why_not_in_plan_order`` is None).
    """
    provenance = None if planned is None else planned.provenance
    saved_world_size = state.get("world_size") if isinstance(state, Mapping) else None
    if (
        planned is None
        or not isinstance(saved_world_size, int)
        or isinstance(saved_world_size, bool)
        or saved_world_size < 1
        or saved_world_size == world_size
    ):
        epoch, step = resume_point(
            state,
            settings=settings.description,
            world_size=world_size,
            provenance=provenance,
            strict=strict,
        )
        unchecked = state if planned is None else None
        pending = PendingResume(epoch, step, unchecked=unchecked, strict=strict)
        return epoch, (pending if step > 0 else None)
    cannot = None
    plan = planned.plan
    if settings.mode.after_own_data == "restart":
        cannot = "cycle mode repeats rows, so 'the rows not yet read' is not one set"
    elif settings.steps_per_epoch is not None:
        cannot = "steps_per_epoch caps the epoch by steps, not rows"
    elif SHARDINGS[plan.sharding].why_not_elastic is not None:
        cannot = SHARDINGS[plan.sharding].why_not_elastic
    elif planned.why_not_in_plan_order is not None:
        cannot = (
            "which rows were read before the saved step is not known: "
            f"{planned.why_not_in_plan_order}"
        )
    saved_step = state.get("step")
    if cannot is not None and isinstance(saved_step, int) and saved_step > 0:
        raise ValueError(
            f"the loader state was saved on {saved_world_size} ranks in the middle of epoch "
            f"{state.get('epoch')}, and this job has {plan.world_size}: {cannot}. "
            f"Resume on {saved_world_size} ranks, or start the next epoch (set_epoch)"
        )
    saved_plan = planned.dataset_plan.for_ranks(saved_world_size)
    epoch, step = resume_point(
        state,
        settings=dataclasses.replace(settings, plan=saved_plan).description,
        world_size=saved_world_size,
        provenance=provenance,
        strict=strict,
    )
    if step == 0:  # between epochs the next epoch is planned for this job's ranks anyway
        return epoch, None
    read = None
    if settings.mode.hands_over:
        from ddp_even.share_plan import handed_out_in

        # Without sync_every the saved epoch planned its hand-over from the plan's lengths.
        sync_every = settings.sync_every
        handed = handed_out_in(
            saved_plan.batches_per_rank, sync_every or 1, step, ends_known=sync_every is None
        )
        read = tuple(tuple(batches) for batches in handed)
    return epoch, PendingResume(epoch, step, saved_plan, read=read)


def resumed_start(
    pending: PendingResume,
    source: ShardSource[Any],
    plan: ShardPlan | None,
    planned: PlannedSource | None,
    mode: Mode,
    agreer: Agreer,
) -> EpochStart:
    """What the epoch ``pending`` resumes reads, and where it starts on this rank (the sources
    are told the epoch first)."""
    epoch, step, rank, world_size = pending.epoch, pending.step, agreer.rank, agreer.world_size
    if pending.saved_plan is not None:
        assert planned is not None
        rest = _rest_of_epoch(planned, pending, world_size, rank)
        rest_source = as_source(functools.partial(planned, shard_plan=rest))
        rest_source.start_epoch(epoch)
        return EpochStart(
            rest_source, plan=rest, resumed_from=(step, pending.saved_plan.world_size)
        )
    unchecked, strict = pending.unchecked, pending.strict
    out_of_order = None if planned is None else planned.why_not_in_plan_order
    tails = _own_tails(planned, plan, mode, epoch, step, rank)
    if tails is not None:
        assert planned is not None and plan is not None
        tails_source = as_source(_first_pass_from(planned, tails))
        tails_source.start_epoch(epoch)
        batch_size, rows = plan.batch_size, plan.rows_per_rank[rank]
        skipped = [min(batch_size, rows - index * batch_size) for index in range(step)]
        return EpochStart(
            tails_source,
            first_pass=tails,
            step=step,
            skipped=skipped,
            unchecked=unchecked,
            strict=strict,
            out_of_order=out_of_order,
        )
    source.start_epoch(epoch)
    # A repeated pass (cycle) cannot be reached by starting the first one later, nor can
    # padding (pad) that copies a batch before the step.
    starts_at_step = not mode.goes_past_own_data and source.starts_at(step)
    return EpochStart(
        source,
        step=step,
        skipped=[None] * step if starts_at_step else (),
        unchecked=unchecked,
        strict=strict,
        out_of_order=out_of_order,
    )


def _own_tails(
    planned: PlannedSource | None,
    plan: ShardPlan | None,
    mode: Mode,
    epoch: int,
    step: int,
    rank: int,
) -> ShardPlan | None:
    """When resuming on as many ranks with a planned reader whose order is known, the plan of
    each rank's rows not yet read, in its reading order: its first pass starts there."""
    if (
        planned is None
        or plan is None
        or planned.why_not_in_plan_order is not None
        or step > plan.batches_per_rank[rank]  # in a repeated pass
        # Share runs the steps before the cut again, reading its shard from its start.
        or mode.hands_over
        # Padding copies the rank's last batch: a rank past its data reads it again; and a
        # rank with an empty shard pads with another's first batch, which is read again.
        or (mode.after_own_data == "pad" and step >= plan.batches_per_rank[rank])
        or (mode.after_own_data == "pad" and 0 in plan.batches_per_rank)
    ):
        return None
    tails = plan.own_tails(planned.row_group_sizes, step, planned.order, epoch)
    # Once for the job, on rank 0; each rank's own count in its debug log.
    logger.log(
        logging.INFO if rank == 0 else logging.DEBUG,
        "ddp_even: epoch %d resumes after step %d: this rank reads only its %d rows not yet read",
        epoch,
        step,
        tails.rows_per_rank[rank],
    )
    return tails


def _rest_of_epoch(
    planned: PlannedSource, pending: PendingResume, world_size: int, rank: int
) -> ShardPlan:
    """The plan of the rows not yet read in the epoch ``pending`` resumes, saved on another
    number of ranks; logged by rank 0 (every rank makes the same)."""
    saved_plan = pending.saved_plan
    assert saved_plan is not None
    rest = saved_plan.rest(
        planned.row_group_sizes,
        pending.step,
        world_size,
        planned.order,
        pending.epoch,
        read=pending.read,
    )
    if rank == 0:
        logger.info(
            "ddp_even: epoch %d resumes after step %d of %d ranks on %d: its %d unread rows "
            "re-planned (%s rows per rank)",
            pending.epoch,
            pending.step,
            saved_plan.world_size,
            world_size,
            sum(rest.rows_per_rank),
            "/".join(map(str, rest.rows_per_rank)),
        )
    return rest


def _first_pass_from(planned: PlannedSource, first: ShardPlan) -> Callable[[int], Any]:
    """A factory whose first pass reads ``first``'s shard, the later ones the whole shard."""
    opened = 0

    def factory(epoch: int = 0) -> Any:
        nonlocal opened
        opened += 1
        return planned(epoch, shard_plan=first if opened == 1 else None)

    return factory
