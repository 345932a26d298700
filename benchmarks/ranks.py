"""A benchmark's measurement on N spawned CPU processes; rank 0's result comes back.

``run_on_ranks(measure, world_size, *args)`` spawns ``world_size`` processes, joins them in one
gloo process group (``file://`` rendezvous in a fresh temporary directory) when there are
several, and none for one, calls ``measure(rank, world_size, *args)`` on each and returns what
rank 0 returned, through JSON (what the benchmarks write). ``measure`` must be a module-level
function and ``args`` must pickle (spawn start method). ``in_turn(variants, round_index)``
is the order a round runs a benchmark's variants in.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

# Seconds a gloo collective may wait before raising, instead of hanging the benchmark.
COLLECTIVE_TIMEOUT_S = 120

Measure = Callable[..., Any]
T = TypeVar("T")


def in_turn(variants: Sequence[T], round_index: int) -> list[T]:
    """``variants`` as round ``round_index`` runs them: starting one later each round, so that no
    variant always follows the same one (in a fixed order, the agreement benchmark's variant
    after Join was slower than its twin in every round of one workload, faster in another)."""
    turn = round_index % len(variants)
    return [*variants[turn:], *variants[:turn]]


def run_on_ranks(measure: Measure, world_size: int, *args: Any) -> Any:
    """Rank 0's ``measure(0, world_size, *args)``, run beside the other ranks (see module doc)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks before they import torch
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as workdir:
        torch_mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
            _rank_main, args=(measure, world_size, args, workdir), nprocs=world_size
        )
        return json.loads(Path(workdir, "result.json").read_text())


def _rank_main(
    rank: int, measure: Measure, world_size: int, args: tuple[Any, ...], workdir: str
) -> None:
    # One compute thread per rank: the ranks share the machine's cores.
    torch.set_num_threads(1)
    grouped = world_size > 1
    if grouped:
        dist.init_process_group(
            "gloo",
            init_method=Path(workdir, "rendezvous").as_uri(),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    try:
        if grouped:
            dist.barrier()
        result = measure(rank, world_size, *args)
        if rank == 0:
            Path(workdir, "result.json").write_text(json.dumps(result))
    finally:
        if grouped:
            dist.destroy_process_group()
