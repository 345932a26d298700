"""Planning speed, and what balanced shards save on skewed datasets.

    python benchmarks/bench_plan.py            # tables on stdout, JSON in bench-results/plan.json

1. Timing: plan 100,000 row groups over 1,024 ranks from sizes already read (what is left
   once footers are in memory), round robin and balanced, median of several repeats.
2. Skew: for a few skewed datasets, rows truncate drops and cycle repeats per epoch with
   petastorm's round robin versus the balanced plan, and the most batches any one rank drops
   or repeats. One dataset is written to a temporary directory and planned from its footers.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from ddp_even.modes import MODES
from ddp_even.parquet import read_row_groups
from ddp_even.planning import ShardPlan, plan_shards


def lognormal_sizes(count: int, median: int, seed: int) -> npt.NDArray[np.int64]:
    """Row-group sizes spread over two orders of magnitude, as uneven Spark output is."""
    rng = np.random.default_rng(seed)
    sizes: npt.NDArray[np.float64] = np.rint(rng.lognormal(np.log(median), 1.0, count))
    return np.clip(sizes, 1, 25 * median).astype(np.int64)


def one_big_row_group_per_file(
    files: int, per_file: int, big: int, small: int
) -> npt.NDArray[np.int64]:
    """Each file starts with one big row group; with ``per_file`` ranks they all go to rank 0."""
    return np.tile(np.array([big] + [small] * (per_file - 1), dtype=np.int64), files)


def write_skewed_dataset(root: Path, sizes_per_file: list[list[int]]) -> None:
    schema = pa.schema([("id", pa.int64())])
    start = 0
    for index, sizes in enumerate(sizes_per_file):
        with pq.ParquetWriter(str(root / f"part-{index:05d}.parquet"), schema) as writer:
            for size in sizes:
                ids = pa.array(np.arange(start, start + size, dtype=np.int64))
                writer.write_table(pa.table({"id": ids}), row_group_size=size)
                start += size


def median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: imports, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def balanced_with_stats(sizes: npt.NDArray[np.int64], world_size: int, batch_size: int) -> object:
    plan = plan_shards(sizes, world_size, batch_size, sharding="row_groups")
    return [plan.stats(mode) for mode in MODES]


def timing(row_groups: int, world_size: int, batch_size: int, repeats: int) -> list[dict[str, Any]]:
    sizes = lognormal_sizes(row_groups, median=2_000, seed=0)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("round robin", lambda: plan_shards(sizes, world_size, batch_size)),
        ("balanced", lambda: plan_shards(sizes, world_size, batch_size, sharding="row_groups")),
        ("balanced + stats of 3 modes", lambda: balanced_with_stats(sizes, world_size, batch_size)),
    ]
    results = []
    for name, fn in cases:
        median, times = median_seconds(fn, repeats)
        results.append(
            {
                "case": name,
                "row_groups": row_groups,
                "world_size": world_size,
                "median_s": median,
                "min_s": min(times),
                "max_s": max(times),
                "repeats": repeats,
            }
        )
    return results


def compare(name: str, round_robin: ShardPlan, balanced: ShardPlan) -> dict[str, Any]:
    def summary(plan: ShardPlan) -> dict[str, Any]:
        truncate, cycle = plan.stats("truncate"), plan.stats("cycle")
        return {
            "rows_min": min(plan.rows_per_rank),
            "rows_max": max(plan.rows_per_rank),
            "spread_rows": plan.spread_rows,
            "truncate_steps": truncate.steps,
            "truncate_rows_dropped": truncate.total_dropped_rows,
            "truncate_waste_percent": truncate.waste_percent,
            "truncate_max_batches_dropped_per_rank": max(truncate.dropped_batches),
            "cycle_steps": cycle.steps,
            "cycle_rows_repeated": cycle.total_repeated_rows,
            "cycle_waste_percent": cycle.waste_percent,
            "cycle_max_batches_repeated_per_rank": max(cycle.repeated_batches),
        }

    return {
        "dataset": name,
        "row_groups": balanced.num_row_groups,
        "total_rows": balanced.total_rows,
        "world_size": balanced.world_size,
        "batch_size": balanced.batch_size,
        "lower_bound_rows": balanced.lower_bound_rows,
        "round_robin": summary(round_robin),
        "balanced": summary(balanced),
    }


def skew(workdir: Path) -> list[dict[str, Any]]:
    scenarios: list[tuple[str, npt.NDArray[np.int64], int, int]] = [
        ("lognormal sizes", lognormal_sizes(4_096, median=2_000, seed=1), 64, 256),
        ("one big row group per file", one_big_row_group_per_file(128, 8, 20_000, 500), 8, 256),
        ("lognormal, 100k row groups", lognormal_sizes(100_000, median=2_000, seed=2), 1_024, 256),
    ]
    # A real dataset on disk, planned from its footers: 32 files of 8 skewed row groups.
    on_disk = lognormal_sizes(256, median=400, seed=3).reshape(32, 8).tolist()
    root = workdir / "skewed"
    root.mkdir()
    write_skewed_dataset(root, on_disk)
    footers = read_row_groups(f"file://{root}")
    results = [
        compare(
            f"Parquet on disk ({len(footers)} row groups from footers)",
            plan_shards(footers, 16, 64),
            plan_shards(footers, 16, 64, sharding="row_groups"),
        )
    ]
    for name, sizes, world_size, batch_size in scenarios:
        results.append(
            compare(
                name,
                plan_shards(sizes, world_size, batch_size),
                plan_shards(sizes, world_size, batch_size, sharding="row_groups"),
            )
        )
    return results


def timing_table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="Planning time (sizes already read)", title_justify="left")
    for column in ("case", "row groups", "ranks", "median", "min", "max"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in results:
        table.add_row(
            row["case"],
            f"{row['row_groups']:,}",
            f"{row['world_size']:,}",
            f"{row['median_s'] * 1e3:.1f} ms",
            f"{row['min_s'] * 1e3:.1f} ms",
            f"{row['max_s'] * 1e3:.1f} ms",
        )
    table.caption = f"median of {results[0]['repeats']} repeats after one warm-up; target < 1 s"
    return table


def skew_table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="Skewed datasets: round robin → balanced, per epoch", title_justify="left")
    table.add_column("dataset")
    for column in (
        "ranks x batch",
        "spread (rows)",
        "truncate: rows dropped",
        "max batches dropped / rank",
        "cycle: rows repeated",
        "max batches repeated / rank",
    ):
        table.add_column(column, justify="right")
    for row in results:
        rr, bal = row["round_robin"], row["balanced"]

        def both(key: str, rr: dict[str, Any] = rr, bal: dict[str, Any] = bal) -> str:
            return f"{rr[key]:,} → {bal[key]:,}"

        table.add_row(
            f"{row['dataset']}\n{row['row_groups']:,} row groups, {row['total_rows']:,} rows",
            f"{row['world_size']:,} x {row['batch_size']:,}",
            both("spread_rows"),
            both("truncate_rows_dropped"),
            both("truncate_max_batches_dropped_per_rank"),
            both("cycle_rows_repeated"),
            both("cycle_max_batches_repeated_per_rank"),
        )
    return table


@click.command()
@click.option("--row-groups", default=100_000, show_default=True, help="Row groups to time.")
@click.option("--world-size", default=1_024, show_default=True, help="Ranks to time.")
@click.option("--batch-size", default=256, show_default=True)
@click.option("--repeats", default=7, show_default=True, help="Timed repeats (median reported).")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/plan.json"),
    show_default=True,
)
def main(row_groups: int, world_size: int, batch_size: int, repeats: int, out: Path) -> None:
    """Time planning and compare round robin with balanced shards on skewed datasets."""
    console = Console() if sys.stdout.isatty() else Console(width=170)
    timings = timing(row_groups, world_size, batch_size, repeats)
    console.print(timing_table(timings))
    with tempfile.TemporaryDirectory() as workdir:
        skews = skew(Path(workdir))
    console.print(skew_table(skews))
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "timing": timings,
        "skew": skews,
    }
    out.write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
