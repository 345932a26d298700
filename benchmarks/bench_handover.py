"""What handing a batch over to another rank costs (mode share), and why it has a group of its own.

    python -m benchmarks.bench_handover            # 0 to 64 MB, 20 round trips each
    python -m benchmarks.bench_handover --quick    # 0 to 4 MB, 5 round trips: a smoke run

Two gloo ranks on this machine, each an ``EvenLoader``'s agreer and a ``Handover``
(``ddp_even/runtime/handover.py``). A batch is what a loader yields: ``{"x": float32 rows of
the size, "y": 64 int64 labels, "ids": 64 strings}`` (0 MB: ``x`` empty). Rank 0 hands it to
rank 1, which hands it back; half the round trip's median is one hand-over: packing, the
messages (the header's size, the header, each tensor), the copy through the loopback, the
waits in their threads, unpacking.

Then the question of the group: while a batch of each size in ``busy_mb`` goes from rank 0 to
rank 1, both ranks time one-int64 all-reduces on ddp_even's control group, with the batch on
the control group itself and on a group of its own (what ``Handover`` uses), the two in turn,
``busy_repeats`` times each. Reported, as medians over the repeats: the all-reduce idle, the
first and the slowest one while the batch was in flight, and the batch's transfer time.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from benchmarks.ranks import in_turn, run_on_ranks
from benchmarks.report import warn_if_loaded, write_results

MB = 2**20
# The loader's timeout the agreer runs with (nothing here waits for a lost peer).
TIMEOUT_S = 60.0
# All-reduces timed idle, and while a batch is in flight.
ALL_REDUCES = 10


@dataclass(frozen=True)
class BenchConfig:
    sizes_mb: tuple[float, ...] = (0.0, 0.25, 1.0, 4.0, 16.0, 64.0)
    round_trips: int = 20
    busy_mb: tuple[float, ...] = (16.0, 128.0)
    busy_repeats: int = 5


QUICK = BenchConfig(sizes_mb=(0.0, 1.0, 4.0), round_trips=5, busy_mb=(4.0,), busy_repeats=2)


def batch_of(size_mb: float) -> dict[str, Any]:
    rows = round(size_mb * MB / 4)
    return {
        "x": torch.ones(rows, dtype=torch.float32),
        "y": torch.arange(64),
        "ids": [f"row-{index}" for index in range(64)],
    }


def measure(rank: int, world_size: int, config: BenchConfig) -> dict[str, Any]:
    from ddp_even.agreement.transport import CollectiveAgreer, agreer_for
    from ddp_even.runtime.handover import Handover

    agreer = agreer_for(None, TIMEOUT_S)
    assert isinstance(agreer, CollectiveAgreer)
    handover = Handover(agreer)
    handovers = [_round_trips(rank, handover, size, config.round_trips) for size in config.sizes_mb]
    groups = {"control group": agreer.group, "group of its own": agreer.handover_group()}
    busy = []
    for size in config.busy_mb:
        seen: dict[str, list[dict[str, float]]] = {name: [] for name in groups}
        for repeat in range(config.busy_repeats):
            for name in in_turn(list(groups), repeat):
                seen[name].append(_all_reduces_beside(rank, agreer.group, groups[name], size))
        for name, rows in seen.items():
            medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
            busy.append({"batch_mb": size, "batch_on": name, **medians})
    return {"handovers": handovers, "busy": busy, "load_average": os.getloadavg()}


def _round_trips(rank: int, handover: Any, size_mb: float, count: int) -> dict[str, Any]:
    batch = batch_of(size_mb)
    seconds = []
    for _ in range(count + 1):  # the first one warms up
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            handover.send(batch, 1)
            back = handover.collect(handover.expect(1, 1)[0])
        else:
            back = handover.collect(handover.expect(0, 1)[0])
            handover.send(back, 0)
        handover.finish()
        seconds.append(time.perf_counter() - began)
    median = statistics.median(seconds[1:]) / 2
    return {"batch_mb": size_mb, "median_s": median, "mb_per_s": size_mb / median}


def _all_reduces_beside(rank: int, control: Any, group: Any, size_mb: float) -> dict[str, float]:
    payload = torch.ones(round(size_mb * MB / 4))
    _all_reduces(control, 3)  # warm
    idle = _all_reduces(control, ALL_REDUCES)
    dist.barrier()
    began = time.perf_counter()
    if rank == 0:
        work = dist.isend(payload, dst=1, group=group)
    else:
        work = dist.irecv(payload, src=0, group=group)
    during = _all_reduces(control, ALL_REDUCES)
    assert work is not None
    work.wait()
    return {
        "idle_median_s": statistics.median(idle),
        "first_during_s": during[0],
        "slowest_during_s": max(during),
        "transfer_s": time.perf_counter() - began,
    }


def _all_reduces(group: Any, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        value = torch.ones(1, dtype=torch.int64)
        began = time.perf_counter()
        dist.all_reduce(value, group=group)
        seconds.append(time.perf_counter() - began)
    return seconds


def run(config: BenchConfig) -> dict[str, Any]:
    result: dict[str, Any] = run_on_ranks(measure, 2, config)
    return result


def tables(result: dict[str, Any], config: BenchConfig) -> list[Table]:
    cost = Table(title=f"one hand-over, 2 gloo ranks (median of {config.round_trips} round trips)")
    for column in ("batch MB", "ms", "MB/s"):
        cost.add_column(column, justify="right")
    for row in result["handovers"]:
        rate = f"{row['mb_per_s']:.0f}" if row["batch_mb"] else "-"
        cost.add_row(f"{row['batch_mb']:g}", f"{row['median_s'] * 1e3:.2f}", rate)
    busy = Table(
        title="a control all-reduce (one int64) while a batch is in flight, ms "
        f"(medians of {config.busy_repeats})"
    )
    for column in ("batch MB", "batch on", "idle", "first during", "slowest during", "transfer"):
        busy.add_column(column, justify="right")
    for row in result["busy"]:
        busy.add_row(
            f"{row['batch_mb']:g}",
            row["batch_on"],
            *(
                f"{row[key] * 1e3:.2f}"
                for key in ("idle_median_s", "first_during_s", "slowest_during_s", "transfer_s")
            ),
        )
    return [cost, busy]


@click.command()
@click.option("--round-trips", type=click.IntRange(1), default=20, show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/handover.json"),
    show_default=True,
)
@click.option("--quick", is_flag=True, help="Smoke run: 0 to 4 MB, 5 round trips.")
def main(round_trips: int, out: Path, quick: bool) -> None:
    """A hand-over's cost by batch size; control all-reduces beside a batch in flight."""
    config = QUICK if quick else dataclasses.replace(BenchConfig(), round_trips=round_trips)
    console = Console() if sys.stdout.isatty() else Console(width=120)
    result = run(config)
    for table in tables(result, config):
        console.print(table)
    warn_if_loaded(console, result["load_average"][0], "times include other processes' time")
    write_results(console, out, config, [result])


if __name__ == "__main__":
    main()
