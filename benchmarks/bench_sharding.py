"""Equal shards by construction: round robin vs balanced row groups vs row ranges vs replicate.

    python -m benchmarks.bench_sharding          # tables on stdout, JSON in bench-results/
    python -m benchmarks.bench_sharding --quick  # smaller on-disk datasets, fewer repeats

1. Simulated from row-group sizes (three skewed shapes): rows truncate drops and cycle
   repeats per epoch, and the most batches one rank drops or repeats, for each sharding; also
   with a predicate keeping ~10 % of rows, unevenly over row groups (counts drawn per row group).
2. Planning time of ``sharding="rows"``: 100,000 row groups over 1,024 ranks.
3. On disk, read by 4 gloo ranks through ``EvenLoader.from_parquet``: the skewed 13-row-group
   dataset, without and with a predicate (counted before training): steps, the most batches a
   rank drops (truncate) or repeats (cycle), collectives between the first and last step.
4. The predicate scan's cost against one epoch's read of the same dataset, one process: the
   scan reads one int64 column, the epoch all columns (one wide binary payload).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from benchmarks.bench_plan import lognormal_sizes, median_seconds
from ddp_even.planning import plan_shards
from ddp_even.planning.sharding import Sharding

SHARDINGS: tuple[Sharding, ...] = ("round_robin", "row_groups", "rows")
WORLD_SIZE = 4
KEEP_EVERY = 10  # the on-disk predicate keeps ids divisible by this, plus a dense block


def skewed_13() -> npt.NDArray[np.int64]:
    """13 row groups from 3 to 9,999 rows (geometric), in a shuffled order."""
    sizes = np.geomspace(3, 9_999, 13).astype(np.int64)
    return np.asarray(sizes[np.random.default_rng(0).permutation(13)], dtype=np.int64)


def lognormal(count: int, sigma: float, seed: int) -> npt.NDArray[np.int64]:
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.rint(rng.lognormal(np.log(2_000), sigma, count)), 1, None)
    return np.asarray(sizes, dtype=np.int64)


def predicate_counts(sizes: npt.NDArray[np.int64], seed: int) -> npt.NDArray[np.int64]:
    """Rows a ~10 % predicate keeps per row group, uneven: the share itself varies 100x."""
    rng = np.random.default_rng(seed)
    share = np.clip(rng.lognormal(np.log(0.06), 1.2, len(sizes)), 0, 1)
    return rng.binomial(sizes, share).astype(np.int64)


def simulated() -> list[dict[str, Any]]:
    shapes: list[tuple[str, npt.NDArray[np.int64], int, int]] = [
        ("13 row groups, 3 … 9,999 rows", skewed_13(), 4, 64),
        ("lognormal sigma 1, 2,000 row groups", lognormal(2_000, 1.0, 1), 256, 256),
        ("lognormal sigma 1.5, 300 row groups", lognormal(300, 1.5, 2), 64, 256),
    ]
    results = []
    for name, sizes, world_size, batch_size in shapes:
        for label, counts in (("all rows", sizes), ("~10 % predicate", predicate_counts(sizes, 3))):
            row: dict[str, Any] = {
                "dataset": name,
                "which_rows": label,
                "world_size": world_size,
                "batch_size": batch_size,
                "total_rows": int(counts.sum()),
            }
            for sharding in SHARDINGS:
                plan = plan_shards(counts, world_size, batch_size, sharding=sharding)
                truncate, cycle = plan.stats("truncate"), plan.stats("cycle")
                row[sharding] = {
                    "truncate_drop_percent": truncate.waste_percent,
                    "cycle_repeat_percent": cycle.waste_percent,
                    "max_batches_dropped_per_rank": max(truncate.dropped_batches),
                    "max_batches_repeated_per_rank": max(cycle.repeated_batches),
                    "split_row_groups": plan.split_row_groups,
                }
            results.append(row)
    return results


def planning_time(repeats: int) -> dict[str, Any]:
    sizes = lognormal_sizes(100_000, median=2_000, seed=0)
    median, times = median_seconds(lambda: plan_shards(sizes, 1_024, 256, sharding="rows"), repeats)
    return {"row_groups": 100_000, "world_size": 1_024, "median_s": median, "max_s": max(times)}


def write_dataset(root: Path, sizes: npt.NDArray[np.int64], payload_bytes: int) -> str:
    """Rows ``id``, ``value`` and an incompressible ``payload`` of ``payload_bytes`` each."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(4)
    start = 0
    schema = pa.schema([("id", pa.int64()), ("value", pa.float32()), ("payload", pa.binary())])
    with pq.ParquetWriter(str(root / "part-00000.parquet"), schema) as writer:
        for size in sizes.tolist():
            ids = np.arange(start, start + size, dtype=np.int64)
            noise = rng.bytes(payload_bytes * size)
            payload = pa.array(
                [noise[i * payload_bytes : (i + 1) * payload_bytes] for i in range(size)],
                pa.binary(),
            )
            table = pa.table(
                {"id": ids, "value": (ids % 97).astype(np.float32), "payload": payload}, schema
            )
            writer.write_table(table, row_group_size=size)
            start += size
    return root.resolve().as_uri()


def keeps(ids: Any) -> Any:
    """~10 % of rows, unevenly: every 10th id, plus all of ids 4,000 to 4,999."""
    return (ids % KEEP_EVERY == 0) | ((ids >= 4_000) & (ids < 5_000))


class CountingAllReduce:
    """Counts the all-reduces ddp_even starts (its only per-step collective)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.real(*args, **kwargs)


def rank_epoch(rank: int, url: str, sharding: Sharding, predicate: bool, workdir: str) -> None:
    import datetime

    import torch.distributed as dist

    import ddp_even.agreement.transport
    from ddp_even import EvenLoader

    dist.init_process_group(
        "gloo",
        init_method=Path(workdir, "rendezvous").as_uri(),
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=120),
    )
    from petastorm.predicates import in_lambda

    results = {}
    real_all_reduce = dist.all_reduce
    for mode in ("truncate", "cycle"):
        loader = EvenLoader.from_parquet(
            url,
            64,
            mode,
            sharding=sharding,
            predicate=in_lambda(["id"], keeps) if predicate else None,
            reader_kwargs={"schema_fields": ["id", "value"], "workers_count": 2},
        )
        counting = CountingAllReduce(real_all_reduce)
        for step, _batch in enumerate(loader):
            if step == 0:  # from the first step on: collectives between steps
                ddp_even.agreement.transport.dist.all_reduce = counting  # type: ignore[attr-defined]
        ddp_even.agreement.transport.dist.all_reduce = real_all_reduce  # type: ignore[attr-defined]
        stats = loader.stats
        results[mode] = {
            "steps": stats.steps[rank],
            "max_batches_dropped_per_rank": max(stats.dropped_batches or (0,)),
            "max_batches_repeated_per_rank": max(stats.repeated_batches),
            "collectives_between_steps": counting.calls,
        }
    if rank == 0:
        Path(workdir, "result.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def on_disk(workdir: Path) -> list[dict[str, Any]]:
    import torch.multiprocessing as torch_mp

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["DDP_EVEN_CACHE_DIR"] = str(workdir / "cache")
    url = write_dataset(workdir / "thirteen", skewed_13(), payload_bytes=16)
    results = []
    for predicate in (False, True):
        for sharding in SHARDINGS:
            with tempfile.TemporaryDirectory(prefix="bench-sharding-") as rundir:
                torch_mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
                    _spawned, args=(url, sharding, predicate, rundir), nprocs=WORLD_SIZE
                )
                result = json.loads(Path(rundir, "result.json").read_text())
            results.append({"predicate": predicate, "sharding": sharding, **result})
    return results


def _spawned(rank: int, url: str, sharding: Sharding, predicate: bool, workdir: str) -> None:
    rank_epoch(rank, url, sharding, predicate, workdir)


def scan_cost(workdir: Path, row_groups: int, repeats: int) -> list[dict[str, Any]]:
    """Seconds to count a one-column predicate vs to read an epoch of every column, for a wide
    row (a 512-byte payload, as features or encoded images make it) and a narrow one."""
    from petastorm.predicates import in_lambda

    from ddp_even.planning.readers import make_shard_factory

    results = []
    sizes = np.full(row_groups, 20_000, dtype=np.int64)
    for payload_bytes in (512, 16):
        url = write_dataset(workdir / f"payload-{payload_bytes}", sizes, payload_bytes)

        def read_epoch(url: str = url) -> None:
            options = {"workers_count": 2}
            _, factory = make_shard_factory(url, 0, 1, 256, loader="reader", reader_kwargs=options)
            with factory() as reader:
                for _ in reader:
                    pass

        def scan(url: str = url) -> None:
            os.environ["DDP_EVEN_CACHE_DIR"] = tempfile.mkdtemp(dir=workdir)  # no cache hit
            make_shard_factory(url, 0, 1, 256, predicate=in_lambda(["id"], keeps))

        epoch_s, _ = median_seconds(read_epoch, repeats)
        scan_s, _ = median_seconds(scan, repeats)
        results.append(
            {
                "row_groups": row_groups,
                "rows": int(sizes.sum()),
                "payload_bytes_per_row": payload_bytes,
                "epoch_read_s": epoch_s,
                "scan_s": scan_s,
                "scan_over_epoch": scan_s / epoch_s,
            }
        )
    return results


def simulated_table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="Per epoch, simulated from sizes", title_justify="left")
    table.add_column("dataset")
    table.add_column("ranks x batch", justify="right")
    for sharding in SHARDINGS:
        table.add_column(f"{sharding}\ndrop % / repeat %\nmax batches/rank", justify="right")
    for row in results:
        cells = []
        for sharding in SHARDINGS:
            s = row[sharding]
            cells.append(
                f"{s['truncate_drop_percent']:.1f} / {s['cycle_repeat_percent']:.1f}\n"
                f"{s['max_batches_dropped_per_rank']:,} / {s['max_batches_repeated_per_rank']:,}"
            )
        table.add_row(
            f"{row['dataset']}\n{row['which_rows']}, {row['total_rows']:,} rows",
            f"{row['world_size']} x {row['batch_size']}",
            *cells,
        )
    table.caption = "target for rows: at most 1 batch dropped / repeated per rank"
    return table


def on_disk_table(results: list[dict[str, Any]]) -> Table:
    table = Table(title=f"On disk, {WORLD_SIZE} gloo ranks, from_parquet", title_justify="left")
    for column in (
        "predicate",
        "sharding",
        "truncate steps",
        "max dropped / rank",
        "cycle steps",
        "max repeated / rank",
        "collectives between steps",
    ):
        table.add_column(column, justify="right")
    for row in results:
        truncate, cycle = row["truncate"], row["cycle"]
        table.add_row(
            "~10 %" if row["predicate"] else "none",
            row["sharding"],
            str(truncate["steps"]),
            str(truncate["max_batches_dropped_per_rank"]),
            str(cycle["steps"]),
            str(cycle["max_batches_repeated_per_rank"]),
            str(truncate["collectives_between_steps"] + cycle["collectives_between_steps"]),
        )
    return table


@click.command()
@click.option("--quick", is_flag=True, help="Fewer repeats and a smaller scan dataset.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/sharding.json"),
    show_default=True,
)
def main(quick: bool, out: Path) -> None:
    """Compare the shardings against their targets: at most one batch dropped or repeated per
    rank with row ranges, planning under 1 s, a predicate scan under 1/5 of an epoch's read."""
    console = Console() if sys.stdout.isatty() else Console(width=150)
    repeats = 3 if quick else 7
    simulation = simulated()
    console.print(simulated_table(simulation))
    timing = planning_time(repeats)
    console.print(
        f"planning 100,000 row groups over 1,024 ranks with sharding='rows': median "
        f"{timing['median_s'] * 1e3:.1f} ms (max {timing['max_s'] * 1e3:.1f} ms; target < 1 s)"
    )
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        began = time.perf_counter()
        disk = on_disk(workdir)
        console.print(on_disk_table(disk))
        console.print(f"(4-rank runs took {time.perf_counter() - began:.0f} s)")
        scans = scan_cost(workdir, 6 if quick else 12, repeats)
    for scan in scans:
        console.print(
            f"predicate scan (one int64 column) {scan['scan_s']:.3f} s vs one epoch's read of "
            f"all columns {scan['epoch_read_s']:.3f} s: {scan['scan_over_epoch']:.2f} of it "
            f"({scan['row_groups']} row groups, {scan['rows']:,} rows of "
            f"{scan['payload_bytes_per_row']}-byte payload; target ≤ 0.2, median of {repeats})"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "simulated": simulation,
        "planning_time": timing,
        "on_disk": disk,
        "scan_cost": scans,
    }
    out.write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
