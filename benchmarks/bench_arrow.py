"""Reading throughput of the pyarrow reader against petastorm, on the same files and batches.

    python -m benchmarks.bench_arrow              # 1 and 2 ranks, a table each, JSON
    python -m benchmarks.bench_arrow --quick      # small dataset, 2 rounds: a smoke run

One plain Parquet dataset (default 8 files x 100,000 rows of 17 columns, ``id`` int64, 8
float32, 8 int64, one row group per file: :func:`benchmarks.bench_reading.write_dataset`;
``--row-group-rows`` cuts smaller ones, which cost every reader more per row), batches of 512
rows, and on every rank, side by side in the same process:

* ``petastorm``: petastorm's own loop, ``BatchedDataLoader(make_batch_reader(url,
  num_epochs=1, cur_shard=rank, shard_count=W), batch_size)``, a fresh reader per epoch: the
  reference;
* ``from_parquet``: ``EvenLoader.from_parquet(url, batch_size, mode)``: ddp_even's reader
  (pyarrow);
* ``arrow pass alone``: one pass of the pyarrow reader's factory with no ``EvenLoader`` around
  it (what the loader adds is the difference);
* ``decoding alone``: the same row groups decoded as that pass decodes them
  (``ParquetFile.read_row_group``, each row group's columns in a part per reading thread) and
  let go of at once, batches counted but no tensor made: the ceiling of any reader built on
  pyarrow here (what the pass adds to pyarrow's decoding is the difference).

Every loader reads the row groups in file order (``shuffle_row_groups=False``), petastorm's
with its default pool (10 threads), the pyarrow reader in :data:`READING_THREADS`; the planned
paths plan once, before the rounds (not timed). One epoch of every variant per round, in an
order turned by one each round, the ranks starting each variant together; round 0 is a warm-up
and is discarded. The loops only take batches; an epoch is timed from asking for its first
batch to the loop's end (closing the reader and ddp_even's statistics included).

Per variant (rank 0, medians over rounds): rows/s, its ratio to petastorm's own loop (``vs
petastorm``, and ``paired``: the median of the per-round ratios), the CPU time of the whole
process per batch (every thread: petastorm's workers, the pyarrow reader's thread and
pyarrow's decoding threads), and the peak resident memory above the epoch's start (sampled
every 2 ms). The run ends with the target as a PASS/FAIL line: with one process, the pyarrow
reader through ``EvenLoader`` reads at least :data:`TARGET_RATIO` times petastorm's own loop.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pyarrow.parquet as pq
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from benchmarks.bench_reading import DatasetShape, closing_pass, write_dataset
from benchmarks.ranks import COLLECTIVE_TIMEOUT_S, in_turn, run_on_ranks
from benchmarks.report import warn_if_loaded, write_results

PETASTORM = "petastorm"
FROM_PARQUET = "from_parquet"
ARROW_ALONE = "arrow pass alone"
DECODING_ALONE = "decoding alone"
#: The target: the pyarrow reader through EvenLoader, against petastorm's own loop, 1 process.
TARGET_RATIO = 2.0
#: Threads the pyarrow reader decodes in (its default), and the decoding-alone row too.
READING_THREADS = 2
_SAMPLE_S = 0.002
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class BenchConfig:
    dataset: DatasetShape = field(default_factory=lambda: DatasetShape(8, 100_000, 100_000))
    batch_size: int = 512
    repeats: int = 7
    mode: str = "cycle"


QUICK = BenchConfig(dataset=DatasetShape(4, 20_000, 5_000), repeats=2)


@dataclass(frozen=True)
class EpochRun:
    rows: int
    batches: int
    wall_s: float
    process_cpu_s: float
    peak_rss_bytes: int


@dataclass
class Variant:
    name: str
    epoch: Callable[[], Iterable[Mapping[str, Any]]]
    runs: list[EpochRun] = field(default_factory=list)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


class PeakRss:
    """The most resident memory above the start while the block runs (a sampling thread)."""

    def __enter__(self) -> PeakRss:
        self._start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def above_start(self) -> int:
        return self.peak - self._start


def timed_epoch(batches: Callable[[], Iterable[Mapping[str, Any]]]) -> EpochRun:
    rows = count = 0
    with PeakRss() as memory:
        start = (time.perf_counter(), time.process_time())
        for batch in batches():
            rows += len(batch["id"])
            count += 1
        # At the loop's end: closing the reader and ddp_even's statistics included.
        end = (time.perf_counter(), time.process_time())
    return EpochRun(rows, count, end[0] - start[0], end[1] - start[1], memory.above_start)


def variants_for(url: str, rank: int, world_size: int, config: BenchConfig) -> list[Variant]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader
    from ddp_even.arrow.passes import make_shard_factory

    unshuffled = {"shuffle_row_groups": False}
    threads = {"threads": READING_THREADS}
    shard = {"cur_shard": rank, "shard_count": world_size} if world_size > 1 else {}

    def petastorm_pass() -> Any:
        reader = make_batch_reader(url, num_epochs=1, **unshuffled, **shard)
        return BatchedDataLoader(reader, batch_size=config.batch_size)

    planned = EvenLoader.from_parquet(
        url,
        config.batch_size,
        config.mode,
        reader_kwargs=unshuffled,
        loader_kwargs=threads,
        timeout=COLLECTIVE_TIMEOUT_S,
    )

    _, arrow_passes = make_shard_factory(
        url, rank, world_size, config.batch_size, reader_kwargs=unshuffled, loader_kwargs=threads
    )
    row_groups = arrow_passes.dataset_plan.row_groups
    storage = arrow_passes.dataset_plan.resolved.storage

    def decoded_rows(group: int, columns: list[str], footer: pq.FileMetaData) -> int:
        with storage.filesystem.open_input_file(
            row_groups.files[row_groups.file_of[group]]
        ) as source:
            table = pq.ParquetFile(source, metadata=footer).read_row_group(
                int(row_groups.index_in_file[group]), columns=columns, use_threads=False
            )
        return table.num_rows

    def decoding_pass() -> Iterator[Mapping[str, Any]]:
        groups = arrow_passes.plan.row_groups_of(rank)
        # As the reader reads: each file's footer once a pass, a pool per pass, each row
        # group's columns in a part per thread.
        footers = {
            file: storage.read_footer(row_groups.files[file])
            for file in {int(row_groups.file_of[group]) for group in groups}
        }
        names = footers[int(row_groups.file_of[groups[0]])].schema.to_arrow_schema().names
        count = min(READING_THREADS, len(names))
        parts = [names[index::count] for index in range(count)]
        with ThreadPoolExecutor(READING_THREADS) as pool:
            reads = [
                pool.submit(decoded_rows, group, part, footers[int(row_groups.file_of[group])])
                for group in groups
                for part in parts
            ]
            rows = sum(read.result() for read in reads) // count  # each part has every row
        # Batches counted after the decoding (a few µs in all): the pass is decoding alone.
        for start in range(0, rows, config.batch_size):
            yield {"id": range(start, min(start + config.batch_size, rows))}

    return [
        Variant(PETASTORM, lambda: closing_pass(petastorm_pass)),
        Variant(FROM_PARQUET, _returning(planned)),
        Variant(ARROW_ALONE, lambda: _closed_after(arrow_passes())),
        Variant(DECODING_ALONE, decoding_pass),
    ]


def _returning(loader: Any) -> Callable[[], Any]:
    return lambda: loader


def _closed_after(batches: Any) -> Iterator[Mapping[str, Any]]:
    try:
        yield from batches
    finally:
        batches.close()


def measure_on_rank(rank: int, world_size: int, config: BenchConfig, url: str) -> dict[str, Any]:
    # petastorm 0.12.1 drives pyarrow 14 through its deprecated legacy API, loudly.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    variants = variants_for(url, rank, world_size, config)
    load_before = os.getloadavg()
    for round_index in range(config.repeats + 1):
        for variant in in_turn(variants, round_index):
            if world_size > 1:
                dist.barrier()
            run = timed_epoch(variant.epoch)
            if round_index > 0:
                variant.runs.append(run)
    return {
        "world_size": world_size,
        "load_average": [load_before[0], os.getloadavg()[0]],
        "results": summarize(variants),
    }


def summarize(variants: list[Variant]) -> list[dict[str, Any]]:
    base = next(variant for variant in variants if variant.name == PETASTORM)
    base_rates = [run.rows / run.wall_s for run in base.runs]
    rows = []
    for variant in variants:
        rates = [run.rows / run.wall_s for run in variant.runs]
        rows.append(
            {
                "variant": variant.name,
                "rows_per_epoch": variant.runs[0].rows,
                "batches_per_epoch": variant.runs[0].batches,
                "rows_per_s": statistics.median(rates),
                "vs_petastorm": statistics.median(rates) / statistics.median(base_rates),
                "vs_petastorm_paired": statistics.median(
                    rate / base_rate for rate, base_rate in zip(rates, base_rates, strict=True)
                ),
                "process_cpu_per_batch_s": statistics.median(
                    run.process_cpu_s / run.batches for run in variant.runs
                ),
                "peak_rss_bytes": statistics.median(run.peak_rss_bytes for run in variant.runs),
                "rounds": [vars(run) for run in variant.runs],
            }
        )
    return rows


def evaluate_target(result: dict[str, Any]) -> dict[str, Any] | None:
    """The target, with one process: the pyarrow reader through EvenLoader >= 2x petastorm."""
    if result["world_size"] != 1:
        return None
    row = next(row for row in result["results"] if row["variant"] == FROM_PARQUET)
    return {
        "target": f"1 process: {FROM_PARQUET} >= {TARGET_RATIO}x petastorm's own loop",
        "passed": row["vs_petastorm"] >= TARGET_RATIO,
        "detail": f"{row['vs_petastorm']:.2f}x (paired {row['vs_petastorm_paired']:.2f}x)",
    }


def results_table(result: dict[str, Any], config: BenchConfig) -> Table:
    shape = config.dataset
    world = result["world_size"]
    table = Table(
        title=f"{world} rank{'s (gloo)' if world > 1 else ''}, {shape.files} x "
        f"{shape.rows_per_file:,} rows x 17 columns in row groups of "
        f"{shape.rows_per_row_group:,}, batch {config.batch_size}: rank 0, median of "
        f"{config.repeats} rounds",
        title_justify="left",
    )
    table.add_column("variant")
    for column in ("rows / batches", "rows/s", "vs petastorm", "paired", "CPU/batch", "peak RSS"):
        table.add_column(column, justify="right")
    for row in result["results"]:
        reference = row["variant"] == PETASTORM
        table.add_row(
            row["variant"],
            f"{row['rows_per_epoch']:,} / {row['batches_per_epoch']:,}",
            f"{row['rows_per_s']:,.0f}",
            "reference" if reference else f"{row['vs_petastorm']:.2f}x",
            "" if reference else f"{row['vs_petastorm_paired']:.2f}x",
            f"{row['process_cpu_per_batch_s'] * 1e6:.0f} us",
            f"{row['peak_rss_bytes'] / 2**20:.0f} MiB",
        )
    load = "/".join(f"{value:.1f}" for value in result["load_average"])
    table.caption = f"load average before/after: {load} on {os.cpu_count()} CPUs"
    return table


@click.command()
@click.option(
    "--ranks",
    multiple=True,
    type=click.IntRange(1),
    help="World sizes to run, one table each (repeatable).  [default: 1 and 2]",
)
@click.option("--repeats", type=click.IntRange(1), default=7, show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/arrow.json"),
    show_default=True,
)
@click.option(
    "--row-group-rows",
    type=click.IntRange(1),
    default=100_000,
    show_default=True,
    help="Rows per row group (100,000: one per file).",
)
@click.option("--quick", is_flag=True, help="Smoke run: 4 x 20,000 rows, 2 rounds.")
def main(ranks: tuple[int, ...], repeats: int, out: Path, row_group_rows: int, quick: bool) -> None:
    """Rows/s of from_parquet's reader (pyarrow) and petastorm's own loop, side by side."""
    config = (
        QUICK
        if quick
        else BenchConfig(dataset=DatasetShape(8, 100_000, row_group_rows), repeats=repeats)
    )
    console = Console() if sys.stdout.isatty() else Console(width=140)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-arrow-") as workdir:
        url = write_dataset(Path(workdir) / "batch", config.dataset, unischema=False)
        for world_size in ranks or (1, 2):
            started = time.perf_counter()
            result: dict[str, Any] = run_on_ranks(measure_on_rank, world_size, config, url)
            result["target"] = evaluate_target(result)
            console.print(results_table(result, config))
            if result["target"] is not None:
                verdict = "[green]PASS[/]" if result["target"]["passed"] else "[red]FAIL[/]"
                console.print(
                    f"{verdict} {result['target']['target']}: {result['target']['detail']}"
                )
            warn_if_loaded(console, result["load_average"][0], "ratios move by a few percent")
            console.print(f"({time.perf_counter() - started:.0f} s)\n")
            runs.append(result)
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
