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
   scan reads one int64 column, the epoch all columns (one binary payload of 512 or 16 bytes
   a row); 1M rows (2M without ``--quick``) in row groups of 20,000, the narrow rows also in
   row groups of 200,000; where the scan's time goes.
"""

from __future__ import annotations

import json
import os
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

from benchmarks.bench_plan import lognormal_sizes, median_seconds
from benchmarks.ranks import run_on_ranks
from ddp_even.planning import plan_shards
from ddp_even.planning.sharding import Sharding

SHARDINGS: tuple[Sharding, ...] = ("round_robin", "row_groups", "rows")
WORLD_SIZE = 4
KEEP_EVERY = 10  # the on-disk predicate keeps ids divisible by this, plus a dense block
# The scan-cost datasets: (payload bytes per row, rows per row group).
SCAN_SHAPES = ((512, 20_000), (16, 20_000), (16, 200_000))


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
            offsets = np.arange(0, (size + 1) * payload_bytes, payload_bytes, dtype=np.int32)
            payload = pa.BinaryArray.from_buffers(
                pa.binary(), size, [None, pa.py_buffer(offsets), pa.py_buffer(noise)]
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


def rank_epoch(
    rank: int, world_size: int, url: str, sharding: Sharding, predicate: bool
) -> dict[str, Any]:
    """One epoch per mode on this rank; its steps, drops, repeats and collectives."""
    import torch.distributed as dist
    from petastorm.predicates import in_lambda

    import ddp_even.agreement.transport
    from ddp_even import EvenLoader

    results = {}
    real_all_reduce = dist.all_reduce
    for mode in ("truncate", "cycle"):
        loader = EvenLoader.from_parquet(
            url,
            64,
            mode,
            sharding=sharding,
            predicate=in_lambda(["id"], keeps) if predicate else None,
            reader_kwargs={"schema_fields": ["id", "value"]},
            loader_kwargs={"threads": 2},
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
    return results


def on_disk(workdir: Path) -> list[dict[str, Any]]:
    os.environ["DDP_EVEN_CACHE_DIR"] = str(workdir / "cache")  # inherited by the ranks
    url = write_dataset(workdir / "thirteen", skewed_13(), payload_bytes=16)
    results = []
    for predicate in (False, True):
        for sharding in SHARDINGS:
            result = run_on_ranks(rank_epoch, WORLD_SIZE, url, sharding, predicate)
            results.append({"predicate": predicate, "sharding": sharding, **result})
    return results


def scan_cost(workdir: Path, rows: int, repeats: int) -> list[dict[str, Any]]:
    """Seconds to count a one-column predicate vs to read an epoch of every column, for
    ``rows`` rows of each of ``SCAN_SHAPES``: a wide row (a 512-byte payload, as features or
    encoded images make it) and a narrow one (16 bytes), in small and in larger row groups.

    Epoch and scan alternate, so that both see the same load; the data are in the page cache
    for both. Wall seconds are the target's measure; CPU seconds (all the process's threads)
    change least with other processes' load. The parts say where the scan's time goes:
    footers and planning (what planning without a predicate costs too), counting
    (``count_in_columns``: read, convert, predicate), and within counting, pyarrow reading
    the column alone and the predicate alone on ready DataFrames.
    """
    results = []
    for payload_bytes, group_rows in SCAN_SHAPES:
        sizes = np.full(rows // group_rows, group_rows, dtype=np.int64)
        root = workdir / f"payload-{payload_bytes}-groups-{group_rows}"
        url = write_dataset(root, sizes, payload_bytes)
        main = medians(alternate(scan_steps(url, workdir), repeats))
        results.append(
            {
                "row_groups": len(sizes),
                "rows": int(sizes.sum()),
                "payload_bytes_per_row": payload_bytes,
                "rows_per_row_group": group_rows,
                **column_share(url),
                **main,
                "scan_over_epoch": main["scan_s"] / main["epoch_read_s"],
                "scan_over_epoch_cpu": main["scan_cpu_s"] / main["epoch_read_cpu_s"],
                "parts": medians(alternate(scan_parts(url), repeats)),
            }
        )
    return results


Steps = dict[str, Callable[[], object]]


def scan_steps(url: str, workdir: Path) -> Steps:
    """One epoch's read of every column, and planning with the predicate counted (no cache)."""
    from petastorm.predicates import in_lambda

    from ddp_even.arrow.passes import make_shard_factory

    def read_epoch() -> None:
        _, factory = make_shard_factory(url, 0, 1, 256, loader_kwargs={"threads": 2})
        with factory() as shard_pass:
            for _ in shard_pass:
                pass

    def scan() -> None:
        os.environ["DDP_EVEN_CACHE_DIR"] = tempfile.mkdtemp(dir=str(workdir))  # no cache hit
        make_shard_factory(url, 0, 1, 256, predicate=in_lambda(["id"], keeps))

    return {"epoch_read": read_epoch, "scan": scan}


def scan_parts(url: str) -> Steps:
    """The scan's parts (see :func:`scan_cost`), and a run that finds the counts cached."""
    from petastorm.predicates import in_lambda

    from ddp_even.arrow.passes import make_shard_factory
    from ddp_even.parquet.metadata import read_row_groups
    from ddp_even.parquet.partitions import partition_keys
    from ddp_even.parquet.predicate_counts import count_in_columns
    from ddp_even.storage import resolve_dataset

    predicate = in_lambda(["id"], keeps)
    resolved = resolve_dataset(url)
    row_groups = read_row_groups(resolved)
    keys = partition_keys(resolved.paths[0], row_groups.files)
    everything = list(range(len(row_groups)))
    parquet_file = pq.ParquetFile(row_groups.files[0])
    frames = [
        parquet_file.read_row_group(position, columns=["id"]).to_pandas()
        for position in range(parquet_file.num_row_groups)
    ]
    make_shard_factory(url, 0, 1, 256, predicate=predicate)  # fills the cache for "cached"
    return {
        "footers_and_plan": lambda: make_shard_factory(url, 0, 1, 256),
        "count": lambda: count_in_columns(
            resolved, row_groups, everything, predicate, ["id"], partitions=keys
        ),
        "column_read": lambda: pq.ParquetFile(row_groups.files[0]).read(columns=["id"]),
        "predicate": lambda: [predicate.do_include(frame) for frame in frames],
        "cached": lambda: make_shard_factory(url, 0, 1, 256, predicate=predicate),
    }


def alternate(steps: Steps, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Wall and CPU seconds of each step, ``repeats`` times, the steps taking turns (after
    one warm-up round), so that all of them see the same load."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for repeat in range(repeats + 1):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            if repeat:
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def medians(times: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """``<step>_s`` and ``<step>_cpu_s``: median wall and CPU seconds, and every time."""
    result: dict[str, Any] = {}
    for name, pairs in times.items():
        result[f"{name}_s"] = statistics.median(wall for wall, _ in pairs)
        result[f"{name}_cpu_s"] = statistics.median(cpu for _, cpu in pairs)
        result[f"{name}_times_s"] = [wall for wall, _ in pairs]
    return result


def column_share(url: str) -> dict[str, float]:
    """The predicate column's share of the row's bytes, on disk and decoded (the footer's
    uncompressed sizes): what "a small column" means here."""
    metadata = pq.ParquetFile(url.removeprefix("file://") + "/part-00000.parquet").metadata
    on_disk = {"id": 0, "all": 0}
    decoded = {"id": 0, "all": 0}
    for group in range(metadata.num_row_groups):
        for column in range(metadata.num_columns):
            chunk = metadata.row_group(group).column(column)
            for name in ("all", chunk.path_in_schema):
                if name in on_disk:
                    on_disk[name] += chunk.total_compressed_size
                    decoded[name] += chunk.total_uncompressed_size
    return {
        "predicate_column_share_on_disk": on_disk["id"] / on_disk["all"],
        "predicate_column_share_decoded": decoded["id"] / decoded["all"],
        "bytes_on_disk": on_disk["all"],
    }


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


def scan_table(results: list[dict[str, Any]], repeats: int) -> Table:
    table = Table(
        title=f"Predicate scan vs one epoch's read, one process, medians of {repeats}",
        title_justify="left",
    )
    for column in (
        "rows x payload\n(rows per group)",
        "id's share of\nbytes: disk /\ndecoded",
        "epoch read s\nwall / CPU",
        "scan s\nwall / CPU",
        "scan / epoch\nwall / CPU",
        "CPU s of parts: footers+plan,\ncount (column read,\npredicate), cached",
    ):
        table.add_column(column, justify="right")
    for row in results:
        parts = row["parts"]
        table.add_row(
            f"{row['rows']:,} x {row['payload_bytes_per_row']} B\n({row['rows_per_row_group']:,})",
            f"{row['predicate_column_share_on_disk']:.0%} / "
            f"{row['predicate_column_share_decoded']:.0%}",
            f"{row['epoch_read_s']:.3f} / {row['epoch_read_cpu_s']:.3f}",
            f"{row['scan_s']:.3f} / {row['scan_cpu_s']:.3f}",
            f"{row['scan_over_epoch']:.2f} / {row['scan_over_epoch_cpu']:.2f}",
            f"{parts['footers_and_plan_cpu_s']:.3f}, {parts['count_cpu_s']:.3f} "
            f"({parts['column_read_cpu_s']:.3f}, {parts['predicate_cpu_s']:.3f}), "
            f"{parts['cached_cpu_s']:.3f}",
        )
    table.caption = (
        "target: scan ≤ 0.2 of an epoch's read (wall); count = read + convert + predicate"
    )
    return table


@click.command()
@click.option(
    "--quick", is_flag=True, help="Fewer repeats and smaller scan datasets (1M rows, not 2M)."
)
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
        scan_repeats = 5 if quick else 9
        scans = scan_cost(workdir, 1_000_000 if quick else 2_000_000, scan_repeats)
    console.print(scan_table(scans, scan_repeats))
    load = os.getloadavg()
    console.print(f"load average (1, 5, 15 min) after the scan runs: {load}, {os.cpu_count()} cpus")
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_after_scan": load,
        },
        "simulated": simulation,
        "planning_time": timing,
        "on_disk": disk,
        "scan_cost": {"repeats": scan_repeats, "results": scans},
    }
    out.write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
