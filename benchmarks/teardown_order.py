"""Which order of ending a job hangs: the DDP model freed before or after its gloo group.

Each try is a fresh process running rounds of "init a 1-rank gloo group, one DDP step, end"
(the end in the order under test), under a hard timeout; a try that outlives it hung.

    .venv/bin/python -m benchmarks.teardown_order --tries 3 --rounds 600

Why: with torch 2.13 a DDP model freed after ``destroy_process_group()`` frees the gloo group
itself, from its reducer, holding the GIL while it joins gloo's threads; a gloo thread still
letting go of the step's all-reduce needs the GIL, and the process hangs
(docs/using.md, "Ending a job"). Freed first, the model leaves the group to
``destroy_process_group()``, which joins with the GIL released.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from benchmarks.report import write_results

ORDERS = ("model-first", "group-first")
ALL_REDUCES = ("ddp", "allreduce_hook")


@dataclass(frozen=True)
class Config:
    tries: int
    rounds: int
    timeout_s: float


@dataclass(frozen=True)
class Try:
    order: str
    all_reduce: str
    hung: bool
    seconds: float


def run_rounds(order: str, all_reduce: str, rounds: int) -> None:
    """``rounds`` times in this process: a 1-rank group, one DDP step, then the end in ``order``."""
    import torch
    import torch.distributed as dist

    import ddp_even

    for _ in range(rounds):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        if all_reduce == "allreduce_hook":
            model.register_comm_hook(None, ddp_even.allreduce_hook)
        model(torch.ones(4, 2)).sum().backward()
        if order == "model-first":
            del model
            dist.destroy_process_group()
        else:
            dist.destroy_process_group()
            del model


def one_try(order: str, all_reduce: str, rounds: int, timeout_s: float) -> Try:
    """``run_rounds`` in a fresh process; hung when it outlives ``timeout_s``."""
    code = (
        "from benchmarks.teardown_order import run_rounds; "
        f"run_rounds({order!r}, {all_reduce!r}, {rounds})"
    )
    started = time.monotonic()
    try:
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=Path(__file__).resolve().parents[1],
            check=True,
            timeout=timeout_s,
            stdout=subprocess.DEVNULL,  # stderr passes: a try that failed shows why
        )
    except subprocess.TimeoutExpired:  # the child is killed
        return Try(order, all_reduce, True, time.monotonic() - started)
    return Try(order, all_reduce, False, time.monotonic() - started)


@click.command()
@click.option("--tries", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--rounds", type=click.IntRange(min=1), default=600, show_default=True, help="Rounds a try."
)
@click.option(
    "--timeout", "timeout_s", type=float, default=40.0, show_default=True, help="Seconds a try."
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("bench-results/teardown_order.json"),
    show_default=True,
)
def main(tries: int, rounds: int, timeout_s: float, out: Path) -> None:
    """Try both orders with DDP's own all-reduce and with ddp_even's hook; print the hangs."""
    console = Console()
    runs = [
        one_try(order, all_reduce, rounds, timeout_s)
        for _ in range(tries)
        for order in ORDERS
        for all_reduce in ALL_REDUCES
    ]
    table = Table(title=f"{rounds} rounds a try, a try hung when it outlived {timeout_s:g} s")
    for column in ("order", "all-reduce", "tries", "hung", "median s of those that ended"):
        table.add_column(column)
    for order in ORDERS:
        for all_reduce in ALL_REDUCES:
            mine = [run for run in runs if (run.order, run.all_reduce) == (order, all_reduce)]
            ended = [run.seconds for run in mine if not run.hung]
            median = f"{statistics.median(ended):.1f}" if ended else "-"
            hung = sum(run.hung for run in mine)
            table.add_row(order, all_reduce, str(len(mine)), str(hung), median)
    console.print(table)
    write_results(console, out, Config(tries, rounds, timeout_s), [asdict(run) for run in runs])


if __name__ == "__main__":
    main()
