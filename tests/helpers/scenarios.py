"""Loader scenarios over in-memory shards, run inside spawned ranks, checked against arithmetic.

A scenario gives every rank a shard of ``lengths[rank]`` batches; batch ``i`` of rank ``r``
is the list ``[r * 1000 + i]``. What each rank must yield follows from the mode alone:
``expected_batches`` computes it without ddp_even, for the tests to compare with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddp_even import EvenLoader, EvenLoaderError


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
    # Rank whose source raises after this many batches: (rank, batches).
    failing: tuple[int, int] | None = None


def shard(rank: int, length: int) -> list[list[int]]:
    return [[rank * 1000 + index] for index in range(length)]


def expected_batches(scenario: Scenario, rank: int) -> list[list[int]]:
    """What ``rank`` must yield in one full epoch, from the definition of each mode."""
    own = shard(rank, scenario.lengths[rank])
    if scenario.mode == "join":
        return own
    if scenario.mode == "truncate":
        steps = min(scenario.lengths)
        if scenario.steps_per_epoch is not None:
            steps = min(steps, scenario.steps_per_epoch)
        return own[:steps]
    steps = max(scenario.lengths) if scenario.steps_per_epoch is None else scenario.steps_per_epoch
    return [own[index % len(own)] for index in range(steps)] if own else []


class _FailingShard:
    def __init__(self, batches: list[list[int]], fail_after: int) -> None:
        self._batches = batches
        self._fail_after = fail_after

    def __iter__(self) -> Any:
        for index, batch in enumerate(self._batches):
            if index == self._fail_after:
                raise OSError(f"corrupt row group after {index} batches")
            yield batch


def _source(scenario: Scenario, rank: int) -> Any:
    batches = shard(rank, scenario.lengths[rank])
    if scenario.failing is not None and scenario.failing[0] == rank:
        failing = _FailingShard(batches, scenario.failing[1])
        return lambda: iter(failing)
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
    error: tuple[str, str] | None = None
    final_weight: list[float] | None = None


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> None:
    inputs = torch.tensor(batch, dtype=torch.float32).reshape(-1, 1) / 1000
    loss = model(inputs).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def run_scenario(scenario: Scenario, rank: int) -> Outcome:
    """Run ``scenario`` on this rank with a real DDP model taking optimizer steps."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outcome = Outcome()
    try:
        loader = EvenLoader(
            _source(scenario, rank),
            scenario.mode,
            steps_per_epoch=scenario.steps_per_epoch,
            sync_every=scenario.sync_every,
            joinables=[model] if scenario.mode == "join" else (),
            timeout=60,
        )
        for epoch in range(scenario.epochs):
            seen: list[list[int]] = []
            flags: list[bool] = []
            for batch in loader:
                _train_step(model, optimizer, batch)
                seen.append(batch)
                flags.append(loader.repeating)
                if epoch == 0 and scenario.break_after == len(seen):
                    break
            outcome.epochs.append(seen)
            outcome.repeating.append(flags)
        # An epoch left early is closed when the next one starts; only then (and only in
        # join mode) are its statistics gathered.
        gathered = {stats.epoch: dataclasses.asdict(stats) for stats in loader.history}
        outcome.stats = [gathered.get(epoch, {}) for epoch in range(scenario.epochs)]
    except (EvenLoaderError, OSError, TypeError, ValueError) as error:
        outcome.error = (type(error).__name__, str(error))
    outcome.final_weight = [param.item() for param in model.module.parameters()]
    return outcome


def run_scenarios(rank: int, world_size: int, scenarios: list[Scenario]) -> list[Outcome]:
    """Worker for ``run_ranks``: every scenario in order, in one process group."""
    outcomes = []
    for scenario in scenarios:
        assert len(scenario.lengths) == world_size
        outcomes.append(run_scenario(scenario, rank))
        dist.barrier()
    return outcomes


Check = Callable[[Scenario, list[Outcome]], None]
