"""Loader scenarios over in-memory shards, run inside spawned ranks, checked against arithmetic.

A scenario gives every rank a shard of ``lengths[rank]`` batches; batch ``i`` of rank ``r``
is the list ``[r * 1000 + i]``. What each rank must yield follows from the mode alone:
``expected_batches`` computes it without ddp_even, for the tests to compare with.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook

from ddp_even import EvenLoader, PeerSourceError
from ddp_even.agreement import control_group as _control_group
from ddp_even.share_plan import fill_targets, plan_window


@dataclass(frozen=True)
class Scenario:
    lengths: tuple[int, ...]
    mode: str
    steps_per_epoch: int | None = None
    sync_every: int | None = None
    # "list" (a known length), "factory" (a fresh iterator each pass) or "iterator".
    source: str = "factory"
    epochs: int = 2
    # Stop consuming after this many batches, on every rank, in epoch 0.
    break_after: int | None = None
    # Rank whose source raises after this many batches: (rank, batches). Its source is of
    # the kind ``source`` says ("list": a sequence with a known length).
    failing: tuple[int, int] | None = None
    # Every rank's training step raises ``StepFailed`` on the batch after this many, in epoch
    # 0; the scenario catches it outside the loop and goes on with the next epoch.
    raise_after: int | None = None
    # Every rank stops after this many batches in epoch 0 and drops its loader (``del``, no
    # explicit close); the following epochs run on a new EvenLoader over the same shard.
    drop_after: int | None = None
    # The loader's ``timeout``: how long a rank waits at an agreement.
    timeout: float = 60


def shard(rank: int, length: int) -> list[list[int]]:
    return [[rank * 1000 + index] for index in range(length)]


def expected_batches(scenario: Scenario, rank: int) -> list[list[int]]:
    """What ``rank`` must yield in one full epoch, from the definition of each mode.

    Pad hands out the rank's batches, then its last one again; a rank without a batch pads
    with the first batch of the lowest rank that has one.
    """
    own = shard(rank, scenario.lengths[rank])
    if scenario.mode == "join":
        return own
    if scenario.mode == "share":
        return shared_batches(scenario.lengths, scenario.sync_every or 1)[rank]
    if scenario.mode == "truncate":
        steps = min(scenario.lengths)
        if scenario.steps_per_epoch is not None:
            steps = min(steps, scenario.steps_per_epoch)
        return own[:steps]
    steps = max(scenario.lengths) if scenario.steps_per_epoch is None else scenario.steps_per_epoch
    if scenario.mode == "pad":
        donor = next((r for r, length in enumerate(scenario.lengths) if length), None)
        last = own[-1] if own else shard(donor, 1)[0] if donor is not None else []
        return [own[index] if index < len(own) else last for index in range(steps)]
    return [own[index % len(own)] for index in range(steps)] if own else []


def shared_batches(lengths: Sequence[int], window: int) -> list[list[list[int]]]:
    """What every rank yields in share mode, window by window as the ranks plan it: each
    window's read-ahead (a rank learns that its shard ended only by reading past its end) and
    its plan (:func:`ddp_even.share_plan.plan_window`), turned into batches."""
    world_size = len(lengths)
    read, taken, ended = [0] * world_size, [0] * world_size, [False] * world_size
    yielded: list[list[list[int]]] = [[] for _ in lengths]
    while True:
        for rank, target in enumerate(fill_targets(ended, window)):
            wanted = taken[rank] + target
            if wanted > lengths[rank]:
                read[rank], ended[rank] = lengths[rank], True
            else:
                read[rank] = max(read[rank], wanted)
        buffered = [count - used for count, used in zip(read, taken, strict=True)]
        plan = plan_window(buffered, ended, bool(yielded[0]), window)
        for rank, slots in enumerate(plan.slots):
            for slot in slots:
                if slot.index < 0:
                    yielded[rank].append(yielded[rank][-1])
                else:
                    yielded[rank].append(shard(slot.giver, taken[slot.giver] + slot.index + 1)[-1])
        taken = [before + used for before, used in zip(taken, plan.used, strict=True)]
        if plan.last:
            return yielded


def expected_weights(scenario: Scenario, rank: int) -> list[float]:
    """Pad's ``batch_weight`` of each step: every batch has one row, so a real batch weighs
    ``world_size / (ranks with a real batch at that step)`` and padding 0."""
    steps = len(expected_batches(scenario, rank))
    world_size = len(scenario.lengths)
    real = [sum(1 for length in scenario.lengths if length > step) for step in range(steps)]
    return [
        world_size / real[step] if step < scenario.lengths[rank] else 0.0 for step in range(steps)
    ]


class _FailingShard:
    def __init__(self, batches: list[list[int]], fail_after: int) -> None:
        self._batches = batches
        self._fail_after = fail_after

    def __iter__(self) -> Any:
        for index, batch in enumerate(self._batches):
            if index == self._fail_after:
                raise OSError(f"corrupt row group after {index} batches")
            yield batch


class _FailingSequence(Sequence[list[int]]):
    """A shard with a known length (like a map-style DataLoader) whose batch k raises."""

    def __init__(self, batches: list[list[int]], fail_after: int) -> None:
        self._batches = batches
        self._fail_after = fail_after

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: Any) -> Any:
        batch = self._batches[index]  # IndexError past the end: how a sequence ends
        if index == self._fail_after:
            raise OSError(f"corrupt row group after {index} batches")
        return batch


class StepFailed(Exception):
    """Raised by the training step of a ``raise_after`` scenario, on every rank."""


@dataclass
class PassLog:
    """How many passes over a shard were started and how many were closed (or ended)."""

    opened: int = 0
    closed: int = 0


def _tracked(batches: list[list[int]], log: PassLog) -> Iterator[list[int]]:
    """One pass over ``batches`` that counts itself in ``log``."""
    log.opened += 1
    try:
        yield from batches
    finally:
        log.closed += 1


def _source(scenario: Scenario, rank: int, log: PassLog | None = None) -> Any:
    batches = shard(rank, scenario.lengths[rank])
    if scenario.failing is not None and scenario.failing[0] == rank:
        if scenario.source == "list":
            return _FailingSequence(batches, scenario.failing[1])
        failing = _FailingShard(batches, scenario.failing[1])
        if scenario.source == "iterator":
            return iter(failing)
        return lambda: iter(failing)
    if log is not None and scenario.source != "list":
        # A dropped loader must close the pass it had open: passes count themselves.
        if scenario.source == "iterator":
            return _tracked(batches, log)
        return lambda: _tracked(batches, log)
    if scenario.source == "list":
        return batches
    if scenario.source == "iterator":
        return iter(batches)
    return lambda: iter(batches)


@dataclass
class Outcome:
    """What one rank saw: per epoch the batches and stats, or the error it raised."""

    epochs: list[list[list[int]]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    repeating: list[list[bool]] = field(default_factory=list)
    # Per epoch and batch: loader.padding, and loader.batch_weight (in pad mode).
    padding: list[list[bool]] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)
    error: tuple[str, str] | None = None
    final_weight: list[float] | None = None
    # For a PeerSourceError: (failed_rank, error_type, step).
    peer_failure: tuple[int, str, int] | None = None
    # Control collectives this process had issued when the scenario ended (every loader on
    # the group counts): equal on every rank unless one rank left a collective behind.
    control_collectives: int = 0
    # drop_after: whether the pass the dropped loader had open was closed once ``del``
    # returned (None when the source cannot tell: a list).
    closed_at_drop: bool | None = None
    # Wall time of the scenario on this rank.
    seconds: float = 0.0


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, weight: float = 1.0
) -> None:
    inputs = torch.tensor(batch, dtype=torch.float32).reshape(-1, 1) / 1000
    loss = model(inputs).pow(2).mean() * weight
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


class NoJoin(Joinable):
    """A joinable with nothing to shadow: join mode without a process group takes one."""

    def __init__(self) -> None:
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return None


def control_collectives_issued() -> int:
    """Control collectives this process has issued so far, over every control group."""
    return sum(channel.issued for channel in _control_group._channels.values())


def _make_loader(
    scenario: Scenario, rank: int, model: torch.nn.Module, log: PassLog | None = None
) -> EvenLoader[Any]:
    joinables: list[Joinable] = []
    if scenario.mode == "join":
        joinables = [model] if isinstance(model, Joinable) else [NoJoin()]
    return EvenLoader(
        _source(scenario, rank, log),
        scenario.mode,
        steps_per_epoch=scenario.steps_per_epoch,
        sync_every=scenario.sync_every,
        joinables=joinables,
        timeout=scenario.timeout,
    )


def run_scenario(
    scenario: Scenario,
    rank: int,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Outcome:
    """Run ``scenario`` on this rank with a real DDP model taking optimizer steps.

    ``model`` and ``optimizer`` (a DDP model, or a plain module without a process group) may
    be shared across scenarios; by default a fresh DDP model is made.
    """
    began = time.perf_counter()
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outcome = Outcome()
    histories: list[list[Any]] = []
    try:
        log = PassLog() if scenario.drop_after is not None else None
        loader = _make_loader(scenario, rank, model, log)
        histories.append(loader.history)
        for epoch in range(scenario.epochs):
            seen: list[list[int]] = []
            flags: list[bool] = []
            padding: list[bool] = []
            weights: list[float] = []
            try:
                for batch in loader:
                    if epoch == 0 and scenario.raise_after == len(seen):
                        raise StepFailed(f"training step {len(seen)} failed")
                    weight = loader.batch_weight if scenario.mode == "pad" else 1.0
                    train_step(model, optimizer, batch, weight)
                    seen.append(batch)
                    flags.append(loader.repeating)
                    padding.append(loader.padding)
                    weights.append(weight)
                    if epoch == 0 and scenario.break_after == len(seen):
                        break
                    if epoch == 0 and scenario.drop_after == len(seen):
                        break
            except StepFailed:
                pass
            outcome.epochs.append(seen)
            outcome.repeating.append(flags)
            outcome.padding.append(padding)
            outcome.weights.append(weights)
            if epoch == 0 and scenario.drop_after is not None:
                assert log is not None
                del loader
                if scenario.source != "list":
                    outcome.closed_at_drop = log.opened == log.closed
                # Had the dropped epoch stayed open, the garbage collector would close it at
                # a different moment on each rank; close it here on all of them, so that the
                # check of closed_at_drop fails instead of a later scenario hanging.
                gc.collect()
                loader = _make_loader(scenario, rank, model)
                histories.append(loader.history)
        # An epoch left early is closed when the next one starts; only then (and only in
        # join mode) are its statistics gathered. A loader made after a drop counts its
        # epochs from 0 again.
        gathered = {stats.epoch: dataclasses.asdict(stats) for stats in histories[0]}
        if len(histories) > 1:
            gathered = {stats.epoch + 1: dataclasses.asdict(stats) for stats in histories[1]}
        outcome.stats = [gathered.get(epoch, {}) for epoch in range(scenario.epochs)]
    except (RuntimeError, OSError, TypeError, ValueError) as error:
        # EvenLoaderError is a RuntimeError; so is a gloo error from DDP's all-reduce.
        outcome.error = (type(error).__name__, str(error))
        if isinstance(error, PeerSourceError):
            outcome.peer_failure = (error.failed_rank, error.error_type, error.step)
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    outcome.final_weight = [param.item() for param in module.parameters()]
    outcome.control_collectives = control_collectives_issued()
    outcome.seconds = time.perf_counter() - began
    return outcome


def run_scenarios(rank: int, world_size: int, scenarios: list[Scenario]) -> list[Outcome]:
    """Worker for ``run_ranks``: every scenario in order, in one process group."""
    outcomes = []
    for scenario in scenarios:
        assert len(scenario.lengths) == world_size
        outcomes.append(run_scenario(scenario, rank))
        dist.barrier()
    return outcomes


def run_scenarios_one_model(rank: int, world_size: int, scenarios: list[Scenario]) -> list[Outcome]:
    """Worker for ``run_ranks``: like ``run_scenarios``, but one DDP model for all scenarios.

    Making a DDP model costs a broadcast and a bucket set-up; hundreds of small scenarios
    share one instead. No barrier between scenarios either: the loader's own agreements are
    what keeps the ranks together, and a stray collective would show as a hang or as wrong
    counts in the next scenario.
    """
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outcomes = []
    for scenario in scenarios:
        assert len(scenario.lengths) == world_size
        outcome = run_scenario(scenario, rank, model, optimizer)
        outcomes.append(outcome)
        try:
            # An error in join mode leaves the replicas apart (torch's Join syncs the model
            # only when left normally): start every scenario from rank 0's weights.
            for param in model.parameters():
                dist.broadcast(param.data, src=0)
        except RuntimeError as error:
            # The training group broke in this scenario (ranks left in different
            # collectives): stop here, so that the parent names this scenario.
            outcome.error = outcome.error or ("RuntimeError", f"after the scenario: {error}")
            return outcomes
    dist.barrier()
    return outcomes


def run_scenarios_in_process(scenarios: list[Scenario]) -> list[Outcome]:
    """World size 1 without a process group: the same scenarios, in this process."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return [run_scenario(scenario, 0, model, optimizer) for scenario in scenarios]


Check = Callable[[Scenario, list[Outcome]], None]
