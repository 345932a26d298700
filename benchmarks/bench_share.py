"""What an epoch of uneven shards costs in each mode that trains every row: share, pad, cycle,
against an unwrapped DDP loop on equal shards of the same rows.

    python -m benchmarks.bench_share            # 22/166 on 2 ranks, 10/40/70/120 on 4
    python -m benchmarks.bench_share --quick    # 2 ranks, small shards: a smoke run

Each ``--shape`` (batches per rank, comma-separated; default ``22,166``, the shape of Hugging
Face ``datasets`` streaming six Parquet files split by node over 2 ranks, and
``10,40,70,120``) starts one gloo rank per shard. A rank's data is a
``torch.utils.data.DataLoader`` over an ``IterableDataset`` yielding that many batches of
``batch_size`` rows (``id``, ``x``, ``y``): no length, as a streaming source has none, so
ddp_even agrees every window (``--sync-every``: 1 batch by default, as ``EvenLoader``'s; a
larger window shows what of an epoch's cost is the agreement and what the hand-over).
``--known-lengths`` makes the shards map-style datasets, whose lengths ddp_even reads: share
then plans the whole hand-over before the first step. Every
rank trains a real DDP model (an MLP ``features`` -> ``hidden`` -> ``hidden`` -> 10, SGD; at
the defaults 256 -> 512 -> 512 -> 10, 0.4 M parameters: forward, backward and step take about
2 ms of one core on batch 64 on the 2-core machine the project is developed on, and a step of
the equal-shards loop, DDP's all-reduce of 1.6 MB of gradients included, about 5 ms of CPU per
rank), its loss multiplied by ``loader.batch_weight`` (0 for padding), as a pad or share loop does.

Variants, interleaved, their order turned by one each round, the ranks starting each together:

* ``equal shards, unwrapped``: the same rows, ``B / W`` batches on every rank (``B``: every
  shard's batches, ``W``: the ranks), a ``DataLoader`` over the same ``IterableDataset`` in a
  plain loop: the same model, the same per-step DDP all-reduce, no ddp_even. The reference;
* ``ddp_even pad``, ``ddp_even cycle`` and ``ddp_even share`` (where ddp_even has it):
  ``EvenLoader(DataLoader(...), mode)`` over the uneven shards, one loader per variant for the
  whole run.

Round 0 is a warm-up and is discarded (ddp_even's gloo group, the allocator). Per epoch, from
the barrier before asking for the first batch to the loop's end (the epoch's opening
agreement and closing statistics included): ``wall`` is the slowest rank's, ``CPU`` the sum
over all ranks' processes (every thread: gloo's too). Rows trained count the rows of the
batches that are not padding, over all ranks; ``distinct`` the different row ids among them.

Reading the table (medians over rounds): ``steps``, ``rows trained`` and ``distinct``;
``wall`` and ``CPU`` per epoch; ``x equal`` and ``x pad``: the median over rounds of the
variant's wall time over the reference's in the same round (paired, so that load drifting
between rounds cancels), and the same for CPU. The run ends with the targets as PASS/FAIL
lines: share's epoch at most 1.15x the equal shards' (every shape), and at most 0.6x pad's
(the 22/166 shape), on wall time. The caption gives the load average: on shared cores wall
times move by more than CPU times.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, IterableDataset

from benchmarks.ranks import COLLECTIVE_TIMEOUT_S, in_turn, run_on_ranks
from benchmarks.report import warn_if_loaded, write_results
from ddp_even import EvenLoader
from ddp_even.modes import MODES

Batch = dict[str, torch.Tensor]

EQUAL = "equal shards, unwrapped"
PAD = "ddp_even pad"
# The modes that train every row, in the order they run and are printed; share where it exists.
MODES_TIMED = tuple(mode for mode in ("pad", "cycle", "share") if mode in MODES)
SHARE_VS_EQUAL = 1.15
SHARE_VS_PAD = 0.6
# The shape whose epoch share must cut to SHARE_VS_PAD of pad's.
PAD_TARGET_SHAPE = (22, 166)
COLUMNS = (
    "steps",
    "rows trained",
    "distinct",
    "wall / epoch",
    "CPU / epoch",
    "x equal",
    "x pad",
    "CPU x equal",
    "CPU x pad",
)


@dataclass(frozen=True)
class BenchConfig:
    shapes: tuple[tuple[int, ...], ...] = (PAD_TARGET_SHAPE, (10, 40, 70, 120))
    repeats: int = 5
    batch_size: int = 64
    features: int = 256
    hidden: int = 512
    outputs: int = 10
    sync_every: int | None = None
    known_lengths: bool = False


class Shard(Dataset[Batch]):
    """``batches`` batches of ``batch_size`` rows numbered from ``first_row``; each row's ``x``
    and ``y`` drawn from its batch's first row id (the same rows whoever reads them)."""

    def __init__(self, first_row: int, batches: int, config: BenchConfig) -> None:
        self.first_row, self.batches, self.config = first_row, batches, config

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> Batch:
        size = self.config.batch_size
        start = self.first_row + index * size
        generator = torch.Generator().manual_seed(start)
        return {
            "id": torch.arange(start, start + size),
            "x": torch.randn(size, self.config.features, generator=generator),
            "y": torch.randn(size, self.config.outputs, generator=generator),
        }


class Streamed(IterableDataset[Batch]):
    """A shard read as a stream: no length, as a streaming source has none."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def __iter__(self) -> Iterator[Batch]:
        return (self.shard[index] for index in range(len(self.shard)))


@dataclass(frozen=True)
class Epoch:
    """One epoch of one variant on one rank."""

    wall_s: float
    cpu_s: float
    steps: int
    rows: int
    ids: list[int]


@dataclass
class Variant:
    name: str
    batches: Iterable[Batch]
    # The weight of the batch last handed out, and whether it is padding.
    marks: Callable[[], tuple[float, bool]]
    epochs: list[Epoch] = field(default_factory=list)


def shard(rank: int, lengths: tuple[int, ...], config: BenchConfig) -> DataLoader[Batch]:
    """Rank ``rank``'s loader when the shards hold ``lengths`` batches, rows numbered on."""
    first_row = sum(lengths[:rank]) * config.batch_size
    dataset = Shard(first_row, lengths[rank], config)
    return DataLoader(dataset if config.known_lengths else Streamed(dataset), batch_size=None)


def training_step(config: BenchConfig) -> Callable[[Batch, float], None]:
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts them too)
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Linear(config.features, config.hidden),
            nn.ReLU(),
            nn.Linear(config.hidden, config.hidden),
            nn.ReLU(),
            nn.Linear(config.hidden, config.outputs),
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: Batch, weight: float) -> None:
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"]) * weight
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    return step


def variants_for(rank: int, shape: tuple[int, ...], config: BenchConfig) -> list[Variant]:
    equal = (sum(shape) // len(shape),) * len(shape)
    variants = [Variant(EQUAL, shard(rank, equal, config), lambda: (1.0, False))]
    for mode in MODES_TIMED:
        loader: EvenLoader[Batch] = EvenLoader(
            shard(rank, shape, config),
            MODES[mode],
            sync_every=config.sync_every,
            timeout=COLLECTIVE_TIMEOUT_S,
        )
        variants.append(
            Variant(
                f"ddp_even {mode}",
                loader,
                lambda loader=loader: (loader.batch_weight, loader.padding),  # type: ignore[misc]
            )
        )
    return variants


def timed_epoch(variant: Variant, step: Callable[[Batch, float], None]) -> Epoch:
    dist.barrier()  # every variant starts with the ranks together
    steps = rows = 0
    trained = []
    started_s, started_cpu_s = time.perf_counter(), time.process_time()
    for batch in variant.batches:
        weight, padding = variant.marks()
        step(batch, weight)
        steps += 1
        if not padding:
            trained.append(batch["id"])
            rows += len(batch["id"])
    wall_s, cpu_s = time.perf_counter() - started_s, time.process_time() - started_cpu_s
    ids = torch.cat(trained).tolist() if trained else []
    return Epoch(wall_s, cpu_s, steps, rows, ids)


def measure_on_rank(
    rank: int, world_size: int, shape: tuple[int, ...], config: BenchConfig
) -> dict[str, Any]:
    """Every variant's epochs on this rank; rank 0 returns every rank's, combined per epoch."""
    step = training_step(config)
    variants = variants_for(rank, shape, config)
    load_before = os.getloadavg()[0]
    rounds: dict[str, list[dict[str, Any]]] = {variant.name: [] for variant in variants}
    for round_index in range(config.repeats + 1):
        for variant in in_turn(variants, round_index):
            epoch = timed_epoch(variant, step)
            gathered: list[Epoch | None] = [None] * world_size
            dist.all_gather_object(gathered, epoch)  # after the clock stopped
            if round_index > 0:
                rounds[variant.name].append(combined([e for e in gathered if e is not None]))
    return {
        "world_size": world_size,
        "shard_batches": list(shape),
        "total_rows": sum(shape) * config.batch_size,
        "share_steps": math.ceil(sum(shape) / world_size),
        # This machine may be shared: 1-minute load averages before and after the rounds.
        "load_average": [load_before, os.getloadavg()[0]],
        "results": summarize(rounds),
    }


def combined(epochs: list[Epoch]) -> dict[str, Any]:
    """One epoch over all ranks: the slowest rank's wall, the ranks' CPU summed."""
    ids = [row for epoch in epochs for row in epoch.ids]
    return {
        "wall_s": max(epoch.wall_s for epoch in epochs),
        "cpu_s": sum(epoch.cpu_s for epoch in epochs),
        "cpu_per_rank_s": [epoch.cpu_s for epoch in epochs],
        "steps": [epoch.steps for epoch in epochs],
        "rows_trained": sum(epoch.rows for epoch in epochs),
        "distinct_rows": len(set(ids)),
    }


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    def paired(name: str, reference: str, key: str) -> float | None:
        if reference not in rounds:
            return None
        pairs = zip(rounds[name], rounds[reference], strict=True)
        return float(statistics.median(mine[key] / theirs[key] for mine, theirs in pairs))

    rows = []
    for name, epochs in rounds.items():
        last = epochs[-1]
        rows.append(
            {
                "variant": name,
                "steps": max(last["steps"]),
                "steps_per_rank": last["steps"],
                "rows_trained": last["rows_trained"],
                "distinct_rows": last["distinct_rows"],
                "wall_s": statistics.median(epoch["wall_s"] for epoch in epochs),
                "cpu_s": statistics.median(epoch["cpu_s"] for epoch in epochs),
                "wall_vs_equal": paired(name, EQUAL, "wall_s"),
                "wall_vs_pad": paired(name, PAD, "wall_s"),
                "cpu_vs_equal": paired(name, EQUAL, "cpu_s"),
                "cpu_vs_pad": paired(name, PAD, "cpu_s"),
                "rounds": epochs,
            }
        )
    return rows


def measure_shape(shape: tuple[int, ...], config: BenchConfig) -> dict[str, Any]:
    """Start one rank per shard, run every variant on them, return the combined numbers."""
    if sum(shape) % len(shape):
        raise ValueError(f"{sum(shape)} batches do not split into {len(shape)} equal shards")
    result: dict[str, Any] = run_on_ranks(measure_on_rank, len(shape), shape, config)
    result["targets"] = evaluate_targets(result)
    return result


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Share's epoch against the equal shards' (every shape) and pad's (the 22/166 shape);
    ``passed`` is None where this ddp_even has no share mode."""
    rows = {row["variant"]: row for row in result["results"]}
    share = rows.get("ddp_even share")
    limits = [("equal shards", SHARE_VS_EQUAL, "wall_vs_equal", "cpu_vs_equal")]
    if tuple(result["shard_batches"]) == PAD_TARGET_SHAPE:
        limits.append(("pad", SHARE_VS_PAD, "wall_vs_pad", "cpu_vs_pad"))
    targets = []
    for reference, limit, wall, cpu in limits:
        target = f"share / {reference} <= {limit}x (epoch, wall)"
        if share is None:
            targets.append({"target": target, "passed": None, "detail": "no share mode yet"})
            continue
        targets.append(
            {
                "target": target,
                "passed": share[wall] <= limit,
                "detail": f"{share[wall]:.2f}x wall, {share[cpu]:.2f}x CPU "
                f"({share['steps']} steps)",
            }
        )
    return targets


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def results_table(result: dict[str, Any], config: BenchConfig) -> Table:
    shards = "/".join(map(str, result["shard_batches"]))
    table = Table(
        title=f"{result['world_size']} ranks (gloo, CPU), shards of {shards} batches of "
        f"{config.batch_size} rows ({result['total_rows']:,} rows; share's steps: "
        f"ceil(B/W) = {result['share_steps']}; "
        + (
            "lengths known: share planned before the first step)"
            if config.known_lengths and config.sync_every is None
            else f"sync_every={config.sync_every or 1})"
        ),
        title_justify="left",
    )
    table.add_column("variant")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for row in result["results"]:
        table.add_row(
            row["variant"],
            str(row["steps"]),
            f"{row['rows_trained']:,}",
            f"{row['distinct_rows']:,}",
            f"{row['wall_s']:.2f} s",
            f"{row['cpu_s']:.2f} s",
            *(
                _ratio(row[key])
                for key in ("wall_vs_equal", "wall_vs_pad", "cpu_vs_equal", "cpu_vs_pad")
            ),
        )
    load = "/".join(f"{value:.1f}" for value in result["load_average"])
    table.caption = (
        "medians over rounds; wall: the slowest rank's, CPU: all ranks' summed; ratios paired "
        f"within rounds; load average before/after: {load} on {os.cpu_count()} CPUs"
    )
    return table


def print_targets(console: Console, result: dict[str, Any]) -> None:
    shards = "/".join(map(str, result["shard_batches"]))
    for target in result["targets"]:
        verdict = {True: "[green]PASS[/]", False: "[red]FAIL[/]", None: "[yellow]N/A[/]"}[
            target["passed"]
        ]
        console.print(
            f"{verdict} {shards}: {target['target']}: {target['detail']}", highlight=False
        )


def _shape(value: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: batches per rank, comma-separated") from None
    if len(shape) < 2 or min(shape) < 1 or sum(shape) % len(shape):
        raise click.BadParameter(
            f"{value!r}: at least 2 ranks of at least 1 batch, their sum a multiple of the ranks"
        )
    return shape


QUICK = BenchConfig(shapes=((3, 9),), repeats=2, batch_size=16, features=32, hidden=64)


@click.command()
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    type=_shape,
    help="Batches per rank, comma-separated, one table each (repeatable).  "
    "[default: 22,166 and 10,40,70,120; --quick: 3,9]",
)
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=64, show_default=True)
@click.option(
    "--sync-every",
    type=click.IntRange(1),
    default=None,
    help="The ddp_even variants' batches per agreement.  [default: EvenLoader's, 1 here]",
)
@click.option(
    "--known-lengths",
    is_flag=True,
    help="Map-style shards, whose lengths ddp_even reads: share plans its hand-over before the "
    "first step instead of agreeing every window.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/share.json"),
    show_default=True,
)
@click.option("--quick", is_flag=True, help="Smoke run: shards 3/9, a small model, 2 repeats.")
def main(
    shapes: tuple[tuple[int, ...], ...],
    repeats: int,
    batch_size: int,
    sync_every: int | None,
    known_lengths: bool,
    out: Path,
    quick: bool,
) -> None:
    """An epoch of uneven shards in share, pad and cycle against equal shards, unwrapped."""
    config = QUICK if quick else BenchConfig(repeats=repeats, batch_size=batch_size)
    config = dataclasses.replace(config, sync_every=sync_every, known_lengths=known_lengths)
    if shapes:
        config = dataclasses.replace(config, shapes=shapes)
    # Wide enough for the table when the output is not a terminal (a file, a pipe).
    console = Console() if sys.stdout.isatty() else Console(width=170)
    runs = []
    for shape in config.shapes:
        started = time.perf_counter()
        result = measure_shape(shape, config)
        console.print(results_table(result, config))
        print_targets(console, result)
        warn_if_loaded(console, result["load_average"][0], "wall ratios move by several percent")
        console.print(f"({time.perf_counter() - started:.0f} s)\n")
        runs.append(result)
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
