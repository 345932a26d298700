"""Planning a many-file dataset on S3, against pyarrow.dataset opening the same dataset.

    python -m benchmarks.bench_remote              # 10,000 files, table + bench-results/remote.json
    python -m benchmarks.bench_remote --quick      # 500 files, one timed repeat: a smoke run
    python -m benchmarks.bench_remote --files 2000 --repeats 5

A local S3 server (moto, tests/helpers/s3_server.py) holds two copies of one skewed dataset of
``--files`` Parquet files (1 to 3 row groups each): ``footers/`` (data files only) and
``summary/`` (the same files and a ``_metadata`` summary). On each, side by side:

* ``ddp_even plan``: ``read_row_groups`` (list, read footers or ``_metadata``) and a balanced
  plan for 64 ranks;
* ``pyarrow open``: what pyarrow alone does to learn the same row groups:
  ``pyarrow.dataset.dataset`` (listing) and every file's row groups (one footer read per
  file), or on ``summary/`` ``pyarrow.dataset.parquet_dataset`` of the ``_metadata`` file,
  through a ``pyarrow.fs.S3FileSystem`` of its own. (petastorm's own reader is not opened here:
  on S3 it needs s3fs, which is not installed, and ddp_even no longer reads through it.)

Times are medians of ``--repeats`` runs. Requests are counted by the server (moto's request
recorder, one extra run of each, not timed): listings, HEADs and GETs.
"""

from __future__ import annotations

import functools
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from ddp_even.parquet import read_row_groups
from ddp_even.planning import plan_shards
from tests.helpers.s3_server import RequestLog, S3Server, start_s3_server

BUCKET = "bench"
WORLD_SIZE = 64
BATCH_SIZE = 256
# Distinct file bodies; file i gets body i % _BODIES (planning reads footers, not values).
_BODIES = 32
_UPLOAD_THREADS = 16


def file_bodies(seed: int) -> list[tuple[bytes, pq.FileMetaData]]:
    """Small Parquet files of 1-3 row groups of skewed sizes, with their footers."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(_BODIES):
        sizes = np.clip(np.rint(rng.lognormal(np.log(200), 1.0, rng.integers(1, 4))), 1, 5_000)
        buffer = io.BytesIO()
        schema = pa.schema([("id", pa.int64()), ("value", pa.float32())])
        with pq.ParquetWriter(buffer, schema) as writer:
            for size in sizes.astype(int):
                ids = np.arange(size, dtype=np.int64)
                table = pa.table({"id": ids, "value": ids.astype(np.float32)}, schema=schema)
                writer.write_table(table, row_group_size=int(size))
        data = buffer.getvalue()
        bodies.append((data, pq.read_metadata(pa.BufferReader(data))))
    return bodies


def write_datasets(server: S3Server, files: int, console: Console) -> dict[str, str]:
    """``footers/`` and ``summary/`` (with ``_metadata``) of ``files`` files each."""
    filesystem = server.filesystem()
    filesystem.create_dir(BUCKET)
    bodies = file_bodies(seed=0)
    names = [f"part-{index:06d}.parquet" for index in range(files)]

    def put(key: str, data: bytes) -> None:
        with filesystem.open_output_stream(key) as stream:
            stream.write(data)

    started = time.perf_counter()
    with ThreadPoolExecutor(_UPLOAD_THREADS) as pool:
        jobs = [
            pool.submit(put, f"{BUCKET}/{prefix}/{name}", bodies[index % _BODIES][0])
            for prefix in ("footers", "summary")
            for index, name in enumerate(names)
        ]
        for job in jobs:
            job.result()
    collected = []
    for index, name in enumerate(names):
        footer = pq.read_metadata(pa.BufferReader(bodies[index % _BODIES][0]))
        footer.set_file_path(name)
        collected.append(footer)
    summary = io.BytesIO()
    pq.write_metadata(bodies[0][1].schema.to_arrow_schema(), summary, metadata_collector=collected)
    put(f"{BUCKET}/summary/_metadata", summary.getvalue())
    console.print(
        f"wrote 2 x {files:,} files and a {len(summary.getvalue()) / 1e6:.1f} MB _metadata in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return {"footers": f"s3://{BUCKET}/footers", "summary": f"s3://{BUCKET}/summary"}


def ddp_even_plan(url: str, options: dict[str, Any]) -> int:
    row_groups = read_row_groups(url, storage_options=options)
    plan_shards(row_groups, WORLD_SIZE, BATCH_SIZE, sharding="row_groups")
    return len(row_groups)


def pyarrow_open(server: S3Server, url: str) -> int:
    """The row groups of ``url`` as pyarrow.dataset finds them (``summary/``: from _metadata)."""
    import pyarrow.dataset as ds

    filesystem = server.filesystem()
    root = url.removeprefix("s3://")
    if root.endswith("/summary"):
        dataset = ds.parquet_dataset(f"{root}/_metadata", filesystem=filesystem)
    else:
        dataset = ds.dataset(root, filesystem=filesystem, format="parquet")
    return sum(len(fragment.row_groups) for fragment in dataset.get_fragments())


def measure(
    server: S3Server, run: Callable[[], int], repeats: int
) -> tuple[list[float], RequestLog, int]:
    with server.recording() as log:
        row_groups = run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times, log, row_groups


def summarise(times: list[float], log: RequestLog, row_groups: int, files: int) -> dict[str, Any]:
    methods = log.by_method()
    reads = log.reads_per_object()
    data_reads = [count for path, count in reads.items() if path.endswith(".parquet")]
    return {
        "median_s": statistics.median(times),
        "times_s": times,
        "row_groups": row_groups,
        "requests": {
            "total": len(log.requests),
            "list": methods.get("LIST", 0),
            "head": methods.get("HEAD", 0),
            "get": methods.get("GET", 0),
        },
        "data_files_read": len(data_reads),
        "max_requests_per_data_file": max(data_reads, default=0),
        "requests_per_file": len(log.requests) / files,
    }


@click.command()
@click.option("--files", default=10_000, show_default=True, help="Parquet files per dataset.")
@click.option("--repeats", default=3, show_default=True, help="Timed repeats (median reported).")
@click.option("--quick", is_flag=True, help="500 files, one timed repeat.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/remote.json"),
    show_default=True,
)
def main(files: int, repeats: int, quick: bool, output: Path) -> None:
    """Plan vs pyarrow open on a local S3 server; table on stdout, JSON in ``output``."""
    if quick:
        files, repeats = min(files, 500), 1
    console = Console(width=120)
    server = start_s3_server()
    os.environ.update(server.env())
    results: dict[str, dict[str, Any]] = {}
    try:
        urls = write_datasets(server, files, console)
        options = server.storage_options()
        tools: dict[str, Callable[[str], int]] = {
            "ddp_even plan": lambda url: ddp_even_plan(url, options),
            "pyarrow open": lambda url: pyarrow_open(server, url),
        }
        for layout, url in urls.items():
            for tool, run in tools.items():
                times, log, row_groups = measure(server, functools.partial(run, url), repeats)
                results[f"{layout} / {tool}"] = summarise(times, log, row_groups, files)
                console.print(f"{layout} / {tool}: {statistics.median(times):.2f} s")
    finally:
        server.stop()
    table = Table(title=f"{files:,} files on a local S3 server (moto), median of {repeats}")
    for column in ("dataset / tool", "median s", "row groups", "requests", "LIST", "HEAD", "GET"):
        table.add_column(column, justify="left" if column == "dataset / tool" else "right")
    table.add_column("max per data file", justify="right")
    for name, result in results.items():
        requests = result["requests"]
        table.add_row(
            name,
            f"{result['median_s']:.2f}",
            f"{result['row_groups']:,}",
            f"{requests['total']:,}",
            f"{requests['list']:,}",
            f"{requests['head']:,}",
            f"{requests['get']:,}",
            str(result["max_requests_per_data_file"]),
        )
    table.caption = (
        "requests counted by the server; footers/: data files only, summary/: with _metadata"
    )
    console.print(table)
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "files": files,
        "repeats": repeats,
        "world_size": WORLD_SIZE,
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "results": results,
    }
    output.write_text(json.dumps(document, indent=2))
    console.print(f"wrote {output}")


if __name__ == "__main__":
    main()
