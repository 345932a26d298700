"""Reading throughput: petastorm's own loop against the same reading through ddp_even.

    python -m benchmarks.bench_reading            # 1 and 2 ranks, tables, bench-results/
    python -m benchmarks.bench_reading --quick    # small datasets, 2 rounds: a smoke run

The benchmark writes its datasets first (into a temporary directory): for petastorm's batch
reader a plain Parquet dataset of ``files x rows`` of 17 columns (``id`` int64, 8 float32, 8
int64; default 16 files x 100,000 rows in row groups of 25,000), and for the row reader a
Unischema dataset of the same columns (``make_reader`` needs one) with fewer rows, since
``make_reader`` decodes row by row (over 100x slower per row here).

Each world size runs in spawned processes: one rank without a process group, and two gloo
ranks whose rank 0's numbers are shown. For each reader kind (``make_batch_reader`` +
``BatchedDataLoader``, ``make_reader`` + ``DataLoader``), batch 512, every rank runs, side by
side in the same process:

* ``petastorm``: petastorm's own loop, ``Loader(make_*_reader(url, num_epochs=1,
  cur_shard=rank, shard_count=W), batch_size)``, a fresh reader per epoch: the reference;
* ``factory, footer lengths``: the same loader from a factory in ``EvenLoader(factory, mode)``:
  its batch counts follow from the Parquet footers (one agreement per epoch);
* ``factory, sync_every=1``: the same, agreeing at every step (one all-reduce per step with
  two ranks; with one, the per-step bookkeeping without a collective);
* ``petastorm, ranks held together`` (two ranks only): petastorm's own loop with, written by
  hand, the collectives ddp_even adds to an epoch of known lengths: an agreement before the
  first batch, asynchronous checks of one int64 at the steps ddp_even's own schedule picks
  (:class:`~ddp_even.runtime.settings.CheckSchedule`: 16 steps apart, or as many as take
  50 ms, up to 1,024; a later epoch starting at the spacing the last one agreed), each waited
  for at the next, a check after the last batch and the ranks' counts gathered. Between it and
  ``petastorm`` is what keeping ranks in step this way costs on the machine; between it and
  the ddp_even rows of known lengths, ddp_even's own cost;
* ``from_parquet <sharding>`` for ``round_robin``, ``row_groups``, ``rows`` and
  ``replicate``: ``EvenLoader.from_parquet(url, batch_size, mode, sharding=...)``, read by its
  own reader (pyarrow; for the row reader, ``reader="row"``: the Unischema decoded by
  petastorm's codecs, as ``make_reader`` decodes it). Its planning (footers, plan) is
  done once before the rounds and not timed: what is timed is a pass's reading. With
  ``replicate`` every rank reads the whole dataset (2x the rows of the others on two ranks);
  its rows/s compare all the same.

One epoch of every variant per round, the variants interleaved and their order turned by one
each round (A B C, B C A, ...), the ranks starting each variant together; round 0 is a warm-up
and is discarded (page cache, imports, the factory's footer plan, ddp_even's gloo group). The
loops only take batches: no training. The run ends with the target as PASS/FAIL lines: with
one process, every ddp_even row at least 0.97 of petastorm's rows/s; with two ranks, every
ddp_even row of known lengths at least 0.97 of the held-together loop's, which does the same
collectives (``sync_every=1`` agrees at every step: no hand-written row does the same).

Per epoch: wall time from the first batch requested (for ``petastorm``, from the call that
builds its reader, as an EvenLoader's factory does at its first batch) to the loop's end
(closing the reader, and ddp_even's statistics, included); the CPU time of the loop's thread
over the same span (petastorm's worker threads not included) and of the whole process (worker
threads included); rows and batches received.

Reading the table (rank 0, medians over rounds): ``rows/s``; ``vs petastorm``: the variant's
median rows/s over the reference's (same reader kind, same world size, same rank), and
``paired``: the median over rounds of that ratio within each round (less sensitive to load
that drifts between rounds); ``per batch``: wall time per batch, ``added``: that minus the
reference's; ``loop CPU`` and ``process CPU``: per batch. On a shared machine differences of
a few percent are noise: the caption gives the load average, and the loop's CPU time moves
least with other processes' load. With two ranks, petastorm's own ranks run unsynchronised
while every ddp_even variant holds its ranks together (spaced-out checks with known lengths,
an agreement every step with ``sync_every=1``): rank 0's wall time then includes waiting for
rank 1, which a loop that only reads does not hide and a DDP step would.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from benchmarks.ranks import COLLECTIVE_TIMEOUT_S, in_turn, run_on_ranks
from benchmarks.report import warn_if_loaded, write_results
from ddp_even import EvenLoader
from ddp_even.planning.sharding import Sharding
from ddp_even.runtime.settings import CheckSchedule

ReaderKind = Literal["batch", "row"]

READER_KINDS: tuple[ReaderKind, ...] = ("batch", "row")
READER_TITLES: dict[ReaderKind, str] = {
    "batch": "make_batch_reader + BatchedDataLoader",
    "row": "make_reader + DataLoader",
}
SHARDINGS: tuple[Sharding, ...] = ("round_robin", "row_groups", "rows", "replicate")
PETASTORM = "petastorm"
FOOTER_LENGTHS = "factory, footer lengths"
PER_STEP = "factory, sync_every=1"
HELD_TOGETHER = "petastorm, ranks held together"
FLOAT_COLUMNS = 8
INT_COLUMNS = 8


@dataclass(frozen=True)
class DatasetShape:
    files: int
    rows_per_file: int
    rows_per_row_group: int

    @property
    def total_rows(self) -> int:
        return self.files * self.rows_per_file

    @property
    def row_groups(self) -> int:
        return self.files * -(-self.rows_per_file // self.rows_per_row_group)


@dataclass(frozen=True)
class BenchConfig:
    batch_dataset: DatasetShape = DatasetShape(16, 100_000, 25_000)
    row_dataset: DatasetShape = DatasetShape(16, 2_048, 512)
    batch_size: int = 512
    repeats: int = 7
    mode: str = "cycle"
    readers: tuple[ReaderKind, ...] = READER_KINDS


QUICK = BenchConfig(
    batch_dataset=DatasetShape(4, 20_000, 5_000),
    row_dataset=DatasetShape(4, 1_024, 256),
    repeats=2,
)


@dataclass(frozen=True)
class EpochTiming:
    """One epoch of one variant on this rank."""

    rows: int
    batches: int
    wall_s: float
    # CPU time of the loop's thread, and of the whole process (petastorm's workers included).
    loop_cpu_s: float
    process_cpu_s: float


@dataclass
class Variant:
    name: str
    reader: ReaderKind
    # What one epoch iterates; called when the epoch's clock has started.
    epoch: Callable[[], Iterable[Mapping[str, Any]]]
    timings: list[EpochTiming] = field(default_factory=list)


def write_dataset(root: Path, shape: DatasetShape, *, unischema: bool) -> str:
    """``shape.files`` Parquet files of ``id`` (consecutive) and random numeric columns, in
    row groups of ``shape.rows_per_row_group``; with ``unischema``, the ``_common_metadata``
    that ``make_reader`` needs (scalar fields without codec: no Spark involved)."""
    root.mkdir(parents=True)
    fields = (
        [("id", np.int64)]
        + [(f"float_{index}", np.float32) for index in range(FLOAT_COLUMNS)]
        + [(f"int_{index}", np.int64) for index in range(INT_COLUMNS)]
    )
    schema = pa.schema([(name, pa.from_numpy_dtype(dtype)) for name, dtype in fields])
    rng = np.random.default_rng(0)
    start = 0
    groups_per_file: dict[str, int] = {}
    for index in range(shape.files):
        name = f"part-{index:05d}.parquet"
        groups_per_file[name] = 0
        with pq.ParquetWriter(str(root / name), schema) as writer:
            for offset in range(0, shape.rows_per_file, shape.rows_per_row_group):
                size = min(shape.rows_per_row_group, shape.rows_per_file - offset)
                columns: dict[str, Any] = {"id": np.arange(start, start + size, dtype=np.int64)}
                for column in range(FLOAT_COLUMNS):
                    columns[f"float_{column}"] = rng.random(size, dtype=np.float32)
                for column in range(INT_COLUMNS):
                    columns[f"int_{column}"] = rng.integers(0, 1_000_000, size, dtype=np.int64)
                writer.write_table(pa.table(columns, schema=schema), row_group_size=size)
                groups_per_file[name] += 1
                start += size
    if unischema:
        from petastorm.etl.dataset_metadata import ROW_GROUPS_PER_FILE_KEY, UNISCHEMA_KEY
        from petastorm.unischema import Unischema, UnischemaField

        stored = Unischema(
            "BenchReading", [UnischemaField(name, dtype, (), None, False) for name, dtype in fields]
        )
        metadata = {
            UNISCHEMA_KEY: pickle.dumps(stored),
            ROW_GROUPS_PER_FILE_KEY: json.dumps(groups_per_file).encode(),
        }
        pq.write_metadata(schema.with_metadata(metadata), str(root / "_common_metadata"))
    return root.resolve().as_uri()


def petastorm_pass(kind: ReaderKind, url: str, rank: int, world_size: int, batch_size: int) -> Any:
    """petastorm's own loader over this rank's round-robin shard, one epoch."""
    from petastorm import make_batch_reader, make_reader
    from petastorm.pytorch import BatchedDataLoader, DataLoader

    # As users write it on one process: no sharding arguments at all.
    shard = {"cur_shard": rank, "shard_count": world_size} if world_size > 1 else {}
    if kind == "batch":
        return BatchedDataLoader(
            make_batch_reader(url, num_epochs=1, **shard), batch_size=batch_size
        )
    return DataLoader(make_reader(url, num_epochs=1, **shard), batch_size=batch_size)


def closing_pass(factory: Callable[[], Any]) -> Iterator[Mapping[str, Any]]:
    """A fresh loader's batches; the reader is built at the first batch asked for and stopped
    after the last."""
    with factory() as loader:
        yield from loader


class HeldTogether:
    """:func:`closing_pass` with the collectives ddp_even adds to an epoch of known lengths,
    written by hand (every rank reads as many batches here): an agreement of two int64s before
    the first batch; a check of one int64 (``all_reduce(MIN)`` of this rank's proposed spacing)
    at the steps :class:`CheckSchedule` picks, waited for at the next; a check after the last
    batch; the ranks' counts gathered. A later epoch starts at the spacing the last agreed."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._spacing = 0

    def __call__(self) -> Iterator[Mapping[str, Any]]:
        opening = torch.zeros(2, dtype=torch.int64)
        dist.all_reduce(opening, op=dist.ReduceOp.MAX)
        schedule = CheckSchedule.after(0, spacing=self._spacing)
        check: tuple[Any, torch.Tensor] | None = None
        count = 0
        for batch in closing_pass(self._factory):
            yield batch
            count += 1
            if count == schedule.next_step:
                agreed = _settled(check)
                proposal = torch.tensor([schedule.proposal(count)], dtype=torch.int64)
                work = dist.all_reduce(proposal, op=dist.ReduceOp.MIN, async_op=True)
                check = (work, proposal)
                schedule.checked(count, agreed)
        agreed = _settled(check)
        if agreed is not None:
            self._spacing = agreed
        last = torch.zeros(1, dtype=torch.int64)
        dist.all_reduce(last, op=dist.ReduceOp.MIN)
        counts = torch.tensor([count, 0, 0, 0], dtype=torch.int64)
        dist.all_gather([torch.zeros_like(counts) for _ in range(dist.get_world_size())], counts)


def _settled(check: tuple[Any, torch.Tensor] | None) -> int | None:
    """The spacing a check in flight agreed, once it completes (None: no check yet)."""
    if check is None:
        return None
    work, proposal = check
    work.wait()
    return int(proposal.item())


def variants_for(
    kind: ReaderKind, url: str, rank: int, world_size: int, config: BenchConfig
) -> list[Variant]:
    """Every variant of one reader kind, in the order they run and are printed."""
    batch_size, mode = config.batch_size, config.mode

    def one_pass() -> Any:
        return petastorm_pass(kind, url, rank, world_size, batch_size)

    def wrapped(sync_every: int | None) -> EvenLoader[Any]:
        return EvenLoader(one_pass, mode, sync_every=sync_every, timeout=COLLECTIVE_TIMEOUT_S)

    def planned(sharding: Sharding) -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url,
            batch_size,
            mode,
            sharding=sharding,
            reader=kind,
            timeout=COLLECTIVE_TIMEOUT_S,
        )

    loaders = {
        FOOTER_LENGTHS: wrapped(None),
        PER_STEP: wrapped(1),
        **{f"from_parquet {sharding}": planned(sharding) for sharding in SHARDINGS},
    }
    held_together = [Variant(HELD_TOGETHER, kind, HeldTogether(one_pass))] if world_size > 1 else []
    return [
        Variant(PETASTORM, kind, lambda: closing_pass(one_pass)),
        *held_together,
        *(Variant(name, kind, _returning(loader)) for name, loader in loaders.items()),
    ]


def _returning(loader: EvenLoader[Any]) -> Callable[[], EvenLoader[Any]]:
    return lambda: loader


def timed_epoch(batches: Callable[[], Iterable[Mapping[str, Any]]]) -> EpochTiming:
    rows = count = 0
    start = (time.perf_counter(), time.thread_time(), time.process_time())
    for batch in batches():
        rows += len(batch["id"])
        count += 1
    # Wall clock, this thread's CPU time, the process's: at the loop's end.
    last = (time.perf_counter(), time.thread_time(), time.process_time())
    return EpochTiming(
        rows=rows,
        batches=count,
        wall_s=last[0] - start[0],
        loop_cpu_s=last[1] - start[1],
        process_cpu_s=last[2] - start[2],
    )


def measure_on_rank(
    rank: int, world_size: int, config: BenchConfig, urls: dict[str, str]
) -> dict[str, Any]:
    """Every variant's rounds on this rank; rank 0's summary is the result."""
    # petastorm 0.12.1 drives pyarrow 14 through its deprecated legacy API, loudly, and hands
    # torch read-only arrays (its loaders' batches are never written to here).
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    grouped = world_size > 1
    variants = [
        variant
        for kind in config.readers
        for variant in variants_for(kind, urls[kind], rank, world_size, config)
    ]
    load_before = os.getloadavg()
    for round_index in range(config.repeats + 1):
        for variant in in_turn(variants, round_index):
            if grouped:
                dist.barrier()  # every variant starts with the ranks together
            timing = timed_epoch(variant.epoch)
            if round_index > 0:
                variant.timings.append(timing)
    return {
        "world_size": world_size,
        "rank": rank,
        # This machine may be shared: 1-minute load averages before and after the rounds.
        "load_average": [load_before[0], os.getloadavg()[0]],
        "results": summarize(variants),
    }


def summarize(variants: list[Variant]) -> list[dict[str, Any]]:
    rows = []
    reference = {v.reader: v for v in variants if v.name == PETASTORM}
    for variant in variants:
        base = reference[variant.reader]
        rates = [t.rows / t.wall_s for t in variant.timings]
        base_rates = [t.rows / t.wall_s for t in base.timings]
        per_batch = statistics.median(t.wall_s / t.batches for t in variant.timings)
        base_per_batch = statistics.median(t.wall_s / t.batches for t in base.timings)
        rows.append(
            {
                "reader": variant.reader,
                "variant": variant.name,
                "rows_per_epoch": variant.timings[0].rows,
                "batches_per_epoch": variant.timings[0].batches,
                "rows_per_s": statistics.median(rates),
                "vs_petastorm": statistics.median(rates) / statistics.median(base_rates),
                "vs_petastorm_paired": statistics.median(
                    rate / base_rate for rate, base_rate in zip(rates, base_rates, strict=True)
                ),
                "per_batch_s": per_batch,
                "added_per_batch_s": per_batch - base_per_batch,
                "loop_cpu_per_batch_s": statistics.median(
                    t.loop_cpu_s / t.batches for t in variant.timings
                ),
                "process_cpu_per_batch_s": statistics.median(
                    t.process_cpu_s / t.batches for t in variant.timings
                ),
                "rounds": [asdict(t) for t in variant.timings],
            }
        )
    return rows


def write_datasets(workdir: Path, config: BenchConfig) -> dict[str, str]:
    shapes = {"batch": config.batch_dataset, "row": config.row_dataset}
    return {
        kind: write_dataset(workdir / kind, shapes[kind], unischema=kind == "row")
        for kind in config.readers
    }


def measure_world(world_size: int, config: BenchConfig, urls: dict[str, str]) -> dict[str, Any]:
    """Run every variant on ``world_size`` spawned ranks over the datasets ``urls`` names (by
    reader kind, from :func:`write_datasets`); rank 0's numbers."""
    result: dict[str, Any] = run_on_ranks(measure_on_rank, world_size, config, urls)
    result["targets"] = evaluate_targets(result)
    return result


#: The target: every ddp_even path reads at least this share of the loop doing the same
#: collectives (petastorm's own in one process; held together by hand on several ranks).
TARGET_RATIO = 0.97


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ddp_even row against :data:`TARGET_RATIO` of the loop that does its collectives:
    petastorm's own in one process, the held-together one on several ranks (rows of known
    lengths only: ``sync_every=1`` agrees at every step, which no hand-written row does)."""
    rows = {(row["reader"], row["variant"]): row for row in result["results"]}
    targets = []
    for (kind, variant), row in rows.items():
        if variant in (PETASTORM, HELD_TOGETHER):
            continue
        held = rows.get((kind, HELD_TOGETHER))
        if held is None:
            baseline, name = rows[(kind, PETASTORM)], "petastorm's own loop"
        elif variant == PER_STEP:
            continue
        else:
            baseline, name = held, "petastorm held together by hand"
        ratio = row["rows_per_s"] / baseline["rows_per_s"]
        paired = statistics.median(
            mine["rows"] / mine["wall_s"] / (theirs["rows"] / theirs["wall_s"])
            for mine, theirs in zip(row["rounds"], baseline["rounds"], strict=True)
        )
        targets.append(
            {
                "target": f"{READER_TITLES[kind]}: >= {TARGET_RATIO} of {name}",
                "variant": variant,
                "passed": ratio >= TARGET_RATIO,
                "detail": f"{ratio:.3f} of its rows/s (paired {paired:.3f}); process CPU "
                f"{row['process_cpu_per_batch_s'] * 1e6:.1f} us a batch against "
                f"{baseline['process_cpu_per_batch_s'] * 1e6:.1f}, loop CPU "
                f"{row['loop_cpu_per_batch_s'] * 1e6:.1f} against "
                f"{baseline['loop_cpu_per_batch_s'] * 1e6:.1f}",
            }
        )
    return targets


def print_targets(console: Console, result: dict[str, Any]) -> None:
    ranks = f"{result['world_size']} rank{'s' if result['world_size'] > 1 else ''}"
    for target in result["targets"]:
        verdict = "[green]PASS[/]" if target["passed"] else "[red]FAIL[/]"
        console.print(
            f"{verdict} {ranks}, {target['target']}: {target['variant']}: {target['detail']}",
            highlight=False,
        )


def results_table(result: dict[str, Any], config: BenchConfig) -> Table:
    shapes = {"batch": config.batch_dataset, "row": config.row_dataset}
    table = Table(
        title=f"{result['world_size']} rank{'s (gloo)' if result['world_size'] > 1 else ''}, "
        f"mode={config.mode}, batch {config.batch_size}: rank 0's reading, "
        f"median of {config.repeats} rounds",
        title_justify="left",
    )
    table.add_column("reader")
    table.add_column("variant")
    for column in (
        "rows / batches",
        "rows/s",
        "vs petastorm",
        "paired",
        "per batch",
        "added",
        "loop CPU",
        "process CPU",
    ):
        table.add_column(column, justify="right")
    previous = None
    for row in result["results"]:
        kind = row["reader"]
        if previous is not None and kind != previous:
            table.add_section()
        shape = shapes[kind]
        reference = row["variant"] == PETASTORM
        table.add_row(
            f"{READER_TITLES[kind]}\n{shape.files} x {shape.rows_per_file:,} rows"
            if kind != previous
            else "",
            row["variant"],
            f"{row['rows_per_epoch']:,} / {row['batches_per_epoch']:,}",
            f"{row['rows_per_s']:,.0f}",
            "reference" if reference else f"{row['vs_petastorm']:.3f}",
            "" if reference else f"{row['vs_petastorm_paired']:.3f}",
            f"{row['per_batch_s'] * 1e6:.1f} us",
            "" if reference else f"{row['added_per_batch_s'] * 1e6:+.1f} us",
            f"{row['loop_cpu_per_batch_s'] * 1e6:.1f} us",
            f"{row['process_cpu_per_batch_s'] * 1e6:.1f} us",
        )
        previous = kind
    load = "/".join(f"{value:.1f}" for value in result["load_average"])
    table.caption = (
        f"per batch: wall, and CPU of the loop thread and of the process (petastorm's workers "
        f"included); load average before/after: {load} on {os.cpu_count()} CPUs"
    )
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
    "--mode",
    type=click.Choice(["truncate", "cycle"]),
    default="cycle",
    show_default=True,
    help="The ddp_even variants' mode (equal shards: no batch dropped or repeated).",
)
@click.option(
    "--reader",
    "readers",
    multiple=True,
    type=click.Choice(READER_KINDS),
    help="Reader kinds to run (repeatable).  [default: batch and row]",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/reading.json"),
    show_default=True,
)
@click.option(
    "--quick",
    is_flag=True,
    help="Smoke run: 4 x 20,000 rows (batch reader), 4 x 1,024 (row reader), 2 rounds.",
)
def main(
    ranks: tuple[int, ...],
    repeats: int,
    mode: str,
    readers: tuple[ReaderKind, ...],
    out: Path,
    quick: bool,
) -> None:
    """Rows/s of petastorm's own loop and of the same reading through each ddp_even path."""
    base = QUICK if quick else BenchConfig(repeats=repeats)
    config = BenchConfig(
        batch_dataset=base.batch_dataset,
        row_dataset=base.row_dataset,
        repeats=base.repeats,
        mode=mode,
        readers=readers or READER_KINDS,
    )
    # Wide enough for the table when the output is not a terminal (a file, a pipe).
    console = Console() if sys.stdout.isatty() else Console(width=170)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-reading-") as workdir:
        started = time.perf_counter()
        urls = write_datasets(Path(workdir), config)
        console.print(f"wrote the datasets in {time.perf_counter() - started:.1f} s")
        for world_size in ranks or (1, 2):
            started = time.perf_counter()
            result = measure_world(world_size, config, urls)
            console.print(results_table(result, config))
            print_targets(console, result)
            warn_if_loaded(
                console, result["load_average"][0], "differences of a few percent are noise"
            )
            console.print(f"({time.perf_counter() - started:.0f} s)\n")
            runs.append(result)
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
