"""Train a small DDP model on uneven Petastorm shards with ``ddp_even``, in every mode.

Petastorm gives rank ``r`` the row groups whose index ``i`` has ``i % world_size == r``. When
row groups differ in size, so do the shards, and plain DDP breaks: the rank with the shortest
shard leaves the loop first and the others wait forever in an all-reduce it never enters.
``ddp_even.EvenLoader`` wraps each rank's loader so that every rank takes the same number of
steps, in one of five modes, and says afterwards what each rank did (``loader.stats``):

* ``truncate``: every rank stops where the shortest shard ends (the rest is not trained on);
* ``cycle``: short shards start again until the longest one ends (some rows are seen twice);
* ``pad``: every rank trains on all its rows, once; a rank whose shard ended hands out padding
  (its last batch again, ``loader.padding``) whose loss the loop multiplies by
  ``loader.batch_weight`` (0), until the longest shard ends;
* ``join``: every rank trains on all its rows, once; ranks that finish early shadow DDP's
  all-reduces (``torch.distributed.algorithms.join.Join``) until the last one is done.

After training, each mode's model is evaluated on every row of the dataset exactly once, with
an EvenLoader in pad mode: every rank takes the same steps, so the loop can all-reduce its
running sums at every step.

The same script runs two ways:

* ``python examples/train.py --demo`` writes a small, skewed Parquet dataset, starts 4 CPU
  ranks on this machine (gloo) and trains a linear regression in each mode, printing a table
  of every epoch and a comparison of the modes;
* under ``torchrun`` (one node or many), on a dataset of your own::

      torchrun --nproc-per-node 4 examples/train.py --data /path/to/dataset --mode cycle

The pieces to copy into a training script are ``open_shard`` (a fresh petastorm loader for one
pass over this rank's shard), the ``EvenLoader(...)`` call in ``train_mode`` and the loop under
it, which is an ordinary DDP loop. ``ddp-even plan DATASET --world-size N --batch-size B``
shows the shards and what each mode would do before any training.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from petastorm import make_batch_reader
from petastorm.pytorch import BatchedDataLoader
from rich.console import Console
from rich.table import Table
from skewed_parquet import DEMO_FILE, FEATURES, LABEL, dataset_url, keep_demo_dataset
from torch.nn.parallel import DistributedDataParallel

from ddp_even import EpochStats, EvenLoader, allreduce_hook
from ddp_even.modes import MODES

# petastorm 0.12.1 (the release that does not lose row groups, see constraints.txt) drives
# pyarrow 14 through pyarrow's deprecated legacy ParquetDataset API, and every reader it opens
# emits a dozen FutureWarnings about that (and so does ddp_even's adapter of petastorm, reading
# a reader's dataset). They concern petastorm's internals, not this script, and would bury its
# output; hide those and only those. Set at import time, so that the spawned demo ranks (which
# import this module afresh) hide them too.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(ddp_even\.)?petastorm(\.|$)")
# BatchedDataLoader hands Arrow's read-only buffers to torch.as_tensor, which warns once per
# process; this script never writes into a batch, so the warning does not apply.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)


# The demo dataset: 400 rows in 10 row groups of very different sizes. With 4 ranks, petastorm
# gives rank 0 row groups 0, 4, 8 (260 rows), rank 1 row groups 1, 5, 9 (22 rows), rank 2
# row groups 2, 6 (90 rows) and rank 3 row groups 3, 7 (28 rows).
DEMO_ROW_GROUP_SIZES = (120, 8, 60, 16, 90, 4, 30, 12, 50, 10)
DEMO_RANKS = 4
# label = x @ TRUE_WEIGHTS + TRUE_BIAS + noise: a model that learned it reaches a loss near
# NOISE**2 = 0.01.
TRUE_WEIGHTS = (2.0, -1.0, 0.5, 3.0)
TRUE_BIAS = 1.0
NOISE = 0.1


@dataclass(frozen=True)
class Config:
    """Everything a rank needs; the same on every rank (the demo pickles it to each)."""

    data_url: str
    modes: tuple[str, ...]
    epochs: int
    batch_size: int
    sync_every: int | None
    backend: str
    device: str
    lr: float
    # The demo prints its own introduction and no per-epoch lines.
    demo: bool = False


@dataclass(frozen=True)
class EpochResult:
    stats: EpochStats
    # Mean loss over every step of every rank.
    train_loss: float
    # Rows trained on, summed over ranks: from each rank's own pass, and from restarted passes.
    own_rows: int
    repeated_rows: int
    seconds: float


@dataclass(frozen=True)
class ModeResult:
    mode: str
    epochs: list[EpochResult]
    # Evaluated after training on every row of the dataset (each rank its whole shard).
    final_loss: float
    dataset_rows: int
    seconds: float


# --- Data -------------------------------------------------------------------------------------


def open_shard(data_url: str, rank: int, world_size: int, batch_size: int) -> BatchedDataLoader:
    """One pass over this rank's shard: a new reader each time, read once (``num_epochs=1``)."""
    reader = make_batch_reader(
        data_url,
        schema_fields=[*FEATURES, LABEL],
        num_epochs=1,
        cur_shard=rank,
        shard_count=world_size,
        workers_count=2,
    )
    return BatchedDataLoader(reader, batch_size=batch_size)


def to_tensors(
    batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    features = torch.stack([batch[name] for name in FEATURES], dim=1).float()
    labels = batch[LABEL].float().unsqueeze(1)
    return features.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def write_demo_dataset(directory: Path) -> None:
    """One Parquet file whose row groups have the sizes in ``DEMO_ROW_GROUP_SIZES``."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    rows = sum(DEMO_ROW_GROUP_SIZES)
    features = rng.standard_normal((rows, len(FEATURES))).astype(np.float32)
    noise = rng.normal(0.0, NOISE, rows)
    labels = (features @ np.array(TRUE_WEIGHTS) + TRUE_BIAS + noise).astype(np.float32)
    columns: dict[str, Any] = {"id": np.arange(rows, dtype=np.int64)}
    columns.update({name: features[:, i] for i, name in enumerate(FEATURES)})
    columns[LABEL] = labels
    table = pa.table(columns)
    partial = directory / f".{DEMO_FILE}.partial"
    with pq.ParquetWriter(partial, table.schema) as writer:
        start = 0
        for size in DEMO_ROW_GROUP_SIZES:
            # One write_table call with row_group_size >= its rows makes exactly one row group.
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size
    partial.rename(directory / DEMO_FILE)


# --- Training (runs on every rank) ------------------------------------------------------------


def train_on_this_rank(config: Config) -> None:
    """Join the process group described by the environment, train in each mode, report.

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the demo sets them
    for the processes it spawns.
    """
    dist.init_process_group(config.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if config.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    console = make_console() if rank == 0 else None
    if console is not None and not config.demo:
        console.print(
            f"[bold]{world_size} ranks[/] ({config.backend}, {config.device}), data "
            f"{config.data_url}, batch size {config.batch_size}, {config.epochs} epoch(s), "
            f"mode(s) {', '.join(config.modes)}"
        )
    if console is not None:
        console.print(
            "[dim]In the tables, a/b/c/... lists one value per rank, rank 0 first. Own batches "
            "come from a rank's first pass over its shard, repeated ones from starting it "
            "again; 'ranks cut short' still had data when the epoch ended.[/]"
        )
    try:
        results = []
        for mode in config.modes:
            result = train_mode(config, mode, rank, world_size, device, console)
            results.append(result)
            if console is not None:
                print_mode(console, result)
        if console is not None and len(results) > 1:
            print_comparison(console, results)
    finally:
        dist.destroy_process_group()


def train_mode(
    config: Config,
    mode: str,
    rank: int,
    world_size: int,
    device: torch.device,
    console: Console | None,
) -> ModeResult:
    """Train a fresh model for ``config.epochs`` epochs with ``EvenLoader`` in ``mode``."""
    torch.manual_seed(0)  # the same starting model in every mode (DDP copies rank 0's anyway)
    module = torch.nn.Linear(len(FEATURES), 1).to(device)
    model = DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None
    )
    # DDP's own all-reduce, except that a rank dying in it is named by ddp_even's error.
    model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)

    def one_pass() -> BatchedDataLoader:
        return open_shard(config.data_url, rank, world_size, config.batch_size)

    # The one ddp_even line: a factory, so each epoch (and each restart in cycle mode) reads
    # the shard with a fresh reader. Join mode needs the DDP model to shadow its all-reduces.
    loader: EvenLoader[dict[str, torch.Tensor]] = EvenLoader(
        one_pass,
        mode=mode,
        sync_every=config.sync_every,
        joinables=[model] if mode == "join" else (),
    )

    epochs: list[EpochResult] = []
    started = time.perf_counter()
    for _epoch in range(config.epochs):
        epoch_started = time.perf_counter()
        # Summed on this rank, reduced once after the epoch: no collective inside the loop
        # besides DDP's own (join mode forbids any other).
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        own_rows = repeated_rows = trained_batches = 0
        for batch in loader:
            features, labels = to_tensors(batch, device)
            loss = torch.nn.functional.mse_loss(model(features), labels)
            optimizer.zero_grad()
            # 1.0 except in pad mode: 0 for padding, else this batch's share of the step's
            # real rows, so that DDP's average is the gradient of the step's mean loss.
            (loss * loader.batch_weight).backward()
            optimizer.step()
            if loader.padding:  # pad mode: past this rank's data; trained on nothing
                continue
            loss_sum += loss.detach()
            trained_batches += 1
            if loader.repeating:  # this batch comes from a restarted pass (cycle mode)
                repeated_rows += len(labels)
            else:
                own_rows += len(labels)
        stats = loader.stats  # the same on every rank
        totals = torch.tensor(
            [loss_sum.item(), own_rows, repeated_rows, trained_batches],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(totals)
        result = EpochResult(
            stats=stats,
            train_loss=totals[0].item() / max(totals[3].item(), 1),
            own_rows=int(totals[1].item()),
            repeated_rows=int(totals[2].item()),
            seconds=time.perf_counter() - epoch_started,
        )
        epochs.append(result)
        if console is not None and not config.demo:
            console.print(f"{stats.summary()}; train loss {result.train_loss:.4f}")
    training_seconds = time.perf_counter() - started
    final_loss, dataset_rows = evaluate(module, one_pass, device)
    return ModeResult(mode, epochs, final_loss, dataset_rows, training_seconds)


def evaluate(
    module: torch.nn.Module,
    one_pass: Callable[[], BatchedDataLoader],
    device: torch.device,
) -> tuple[float, int]:
    """Mean squared error on every row of the dataset, exactly: pad mode hands out every row
    once, and every rank takes the same steps, so the sums are all-reduced at every step."""
    loader: EvenLoader[dict[str, torch.Tensor]] = EvenLoader(one_pass, mode="pad")
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in loader:
            features, labels = to_tensors(batch, device)
            squared_error = ((module(features) - labels) ** 2).sum().double()
            step = torch.stack([squared_error, squared_error.new_tensor(len(labels))])
            if loader.padding:  # a copy of a batch already counted: leave it out
                step.zero_()
            dist.all_reduce(step)
            totals += step
    dataset_rows = int(totals[1].item())
    return totals[0].item() / max(dataset_rows, 1), dataset_rows


# --- Output (rank 0) --------------------------------------------------------------------------


def make_console() -> Console:
    # Piped output (a log, CI) gets a width that fits the tables instead of rich's 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=110)


def per_rank(values: Sequence[int | None]) -> str:
    """``17/2/6/2`` for a few ranks; ``min-max`` when there are too many to list."""
    known = [value for value in values if value is not None]
    if len(known) < len(values):
        return "?"
    if len(values) <= 8:
        return "/".join(str(value) for value in known)
    return f"{min(known)}-{max(known)}"


def rank_list(flags: Sequence[bool]) -> str:
    """``0, 2`` for the ranks whose flag is set, ``-`` for none."""
    ranks = [str(rank) for rank, flag in enumerate(flags) if flag]
    return ", ".join(ranks) if ranks else "-"


def ranks_phrase(flags: Sequence[bool]) -> str:
    """``rank 0`` or ``ranks 0, 2``."""
    return ("ranks " if sum(flags) > 1 else "rank ") + rank_list(flags)


def print_mode(console: Console, result: ModeResult) -> None:
    table = Table(
        title=f"[bold]{result.mode}[/]: {MODES[result.mode].summary}",
        title_justify="left",
        caption=mode_caption(result),
        caption_justify="left",
    )
    table.add_column("epoch", justify="right")
    table.add_column("steps\nper rank", justify="right")
    table.add_column("own\nbatches", justify="right")
    table.add_column("repeated\nbatches", justify="right")
    table.add_column("rows\ntrained", justify="right")
    table.add_column("over-\nsampling", justify="right")
    table.add_column("ranks cut\nshort", justify="right")
    table.add_column("train\nloss", justify="right")
    table.add_column("time", justify="right")
    for epoch in result.epochs:
        stats = epoch.stats
        table.add_row(
            str(stats.epoch),
            per_rank(stats.steps),
            per_rank(stats.own_batches),
            per_rank(stats.repeated_batches),
            # Rows handed out, less padding (pad mode: copies trained on with weight 0).
            per_rank(
                [
                    None if rows is None or padded is None else rows - padded
                    for rows, padded in zip(stats.samples, stats.padded_rows, strict=True)
                ]
            ),
            f"{stats.oversampling:.0%}",
            rank_list(stats.truncated),
            f"{epoch.train_loss:.4f}",
            f"{epoch.seconds:.2f} s",
        )
    console.print()
    console.print(table)


def mode_caption(result: ModeResult) -> str:
    last = result.epochs[-1]
    stats = last.stats
    total = result.dataset_rows
    if result.mode == "truncate":
        dropped = total - last.own_rows
        return (
            f"Every rank took {stats.steps[0]} steps per epoch; {dropped} of {total} rows "
            f"({dropped / total:.0%}) were left out of each epoch ({ranks_phrase(stats.truncated)} "
            "still had data)."
        )
    if result.mode == "cycle":
        restarted = [passes > 1 for passes in stats.passes]
        shards = "their shards" if sum(restarted) > 1 else "its shard"
        return (
            f"Every rank took {stats.steps[0]} steps per epoch; {ranks_phrase(restarted)} "
            f"started {shards} again: {sum(stats.repeated_batches)} repeated batches "
            f"({last.repeated_rows} rows) on top of {sum(stats.own_batches)} own ones."
        )
    if result.mode == "pad":
        padded = [count > 0 for count in stats.padded_batches]
        return (
            f"Every rank took {stats.steps[0]} steps per epoch and all {total} rows were trained "
            f"on once; {ranks_phrase(padded)} ran out of data and handed out "
            f"{sum(stats.padded_batches)} padding batches of weight 0."
        )
    if result.mode == "share":
        return (
            f"Every rank took {stats.steps[0]} steps per epoch and all {total} rows were trained "
            f"on once: {sum(stats.sent_batches)} batches were handed from ranks with data left "
            f"to ranks that ran out, {stats.steps_saved} steps fewer than pad; "
            f"{sum(stats.padded_batches)} padding batches of weight 0 at the last step."
        )
    longest = max(stats.steps)
    idle = sum(longest - steps for steps in stats.steps)
    slots = longest * len(stats.steps)
    return (
        f"All {total} rows trained on once per epoch; ranks that finished early shadowed "
        f"DDP's all-reduces until the last one was done: {idle} of {slots} rank-steps "
        f"({idle / slots if slots else 0:.0%}) were spent waiting."
    )


def print_comparison(console: Console, results: Sequence[ModeResult]) -> None:
    table = Table(
        title="[bold]The modes side by side[/] (per epoch, all ranks together)",
        title_justify="left",
    )
    table.add_column("mode")
    table.add_column("steps\nper rank", justify="right")
    table.add_column("rows\ntrained", justify="right")
    table.add_column("rows\nleft out", justify="right")
    table.add_column("rows\nrepeated", justify="right")
    table.add_column("idle\nrank-steps", justify="right")
    table.add_column("loss on\nall rows", justify="right")
    table.add_column("training\ntime", justify="right")
    for result in results:
        last = result.epochs[-1]
        stats = last.stats
        idle = sum(max(stats.steps) - steps for steps in stats.steps)
        table.add_row(
            result.mode,
            per_rank(stats.steps),
            str(last.own_rows + last.repeated_rows),
            str(result.dataset_rows - last.own_rows),
            str(last.repeated_rows),
            str(idle),
            f"{result.final_loss:.4f}",
            f"{result.seconds:.2f} s",
        )
    console.print()
    console.print(table)
    rows = results[0].dataset_rows
    console.print(
        f"The dataset has {rows} rows. 'loss on all rows' is the final model's mean squared "
        f"error over the whole dataset (the noise in the labels puts the best possible at "
        f"about {NOISE**2:.2f}).\n"
        "[bold]truncate[/]: fewest steps, but rows past the shortest shard are never used; "
        "fine when shards are nearly even.\n"
        "[bold]cycle[/]: every row is used and every rank stays busy, at the price of "
        "repeating the short shards' rows.\n"
        "[bold]pad[/]: every row exactly once and any collective in the loop (evaluation, "
        "SyncBatchNorm, metrics); ranks that run out compute on padding of weight 0.\n"
        "[bold]join[/]: every row exactly once; ranks that run out idle until the last one "
        "finishes, which costs time when shards are very uneven.\n"
        "[bold]share[/]: pad's promises in fewer steps: ranks with data left hand batches to "
        "those that ran out (each batch sent costs a transfer between ranks).\n"
        "Equal shards avoid the skew in the first place: "
        '`EvenLoader.from_parquet(..., sharding="rows")` cuts the rows evenly between ranks, '
        "and `ddp-even plan DATASET --world-size N --batch-size B --sharding rows` shows how."
    )


# --- The demo launcher ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def demo_rank(local_rank: int, config: Config, world_size: int, port: int) -> None:
    """One spawned demo rank: the environment torchrun would have set, then the same code."""
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    train_on_this_rank(config)


def print_demo_intro(console: Console, data_dir: Path, world_size: int, batch_size: int) -> None:
    sizes = [
        row_group.num_rows
        for path in sorted(data_dir.glob("*.parquet"))
        for metadata in [pq.read_metadata(path)]
        for row_group in (metadata.row_group(i) for i in range(metadata.num_row_groups))
    ]
    console.print(
        f"[bold]ddp_even demo[/]: {world_size} CPU ranks (gloo) train a linear regression on "
        f"{sum(sizes)} rows in {len(sizes)} Parquet row groups of {min(sizes)} to {max(sizes)} "
        f"rows ({data_dir}).\nPetastorm gives rank r the row groups i with "
        f"i % {world_size} == r, so the shards are uneven:"
    )
    table = Table()
    table.add_column("rank", justify="right")
    table.add_column("row groups")
    table.add_column("rows", justify="right")
    table.add_column(f"batches of {batch_size}", justify="right")
    batches = []
    for rank in range(world_size):
        mine = [i for i in range(len(sizes)) if i % world_size == rank]
        rows = sum(sizes[i] for i in mine)
        batches.append(math.ceil(rows / batch_size))
        table.add_row(str(rank), ", ".join(map(str, mine)), str(rows), str(batches[-1]))
    console.print(table)
    console.print(
        f"With a plain DDP loop, the ranks with {min(batches)} batches would leave after "
        f"{min(batches)} steps and the others would wait in DDP's next all-reduce until the "
        "process group times out. ddp_even gives every rank the same number of steps, in one "
        "of five modes, and reports what each rank did."
    )


def run_demo(config: Config, data: str | None, world_size: int) -> None:
    console = make_console()
    temporary = None
    if data is None:
        temporary = tempfile.mkdtemp(prefix="ddp-even-demo-")
        data_dir = Path(temporary)
    else:
        data_dir = Path(data)
    try:
        keep_demo_dataset(data_dir, DEMO_ROW_GROUP_SIZES, write_demo_dataset)
        config = dataclasses.replace(config, data_url=data_dir.resolve().as_uri())
        print_demo_intro(console, data_dir, world_size, config.batch_size)
        console.print(f"[dim]Starting {world_size} processes (importing torch and petastorm)...[/]")
        # Every rank gets one thread: 4 ranks may share 2 cores.
        os.environ["OMP_NUM_THREADS"] = "1"
        started = time.perf_counter()
        mp.start_processes(
            demo_rank,
            args=(config, world_size, free_port()),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        console.print(f"\n[dim]Demo done in {time.perf_counter() - started:.1f} s.[/]")
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


# --- Command line -----------------------------------------------------------------------------


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--demo", is_flag=True, help="Write a skewed demo dataset and train on 4 CPU ranks.")
@click.option(
    "--data",
    help="Dataset: a path or a petastorm URL (file://, hdfs://, s3://...) that every rank can "
    "read. With --demo: where to write the demo dataset and keep it, or find it from an earlier "
    "run (default: a temporary directory, deleted afterwards); a directory holding anything "
    "else is refused.",
)
@click.option(
    "--mode",
    type=click.Choice([*MODES, "all"]),
    default="all",
    show_default=True,
    help="EvenLoader mode; 'all' trains once in each, one after the other.",
)
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--sync-every",
    type=click.IntRange(min=1),
    default=None,
    help="Batches per agreement between ranks (default: every batch, as a petastorm loader "
    "has no length). Larger values read ahead and agree less often.",
)
@click.option("--lr", type=float, default=0.1, show_default=True, help="SGD learning rate.")
@click.option(
    "--backend",
    type=click.Choice(["gloo", "nccl"]),
    default="gloo",
    show_default=True,
    help="torch.distributed backend: gloo on CPU, nccl with --device cuda.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="cuda: each rank uses the GPU numbered LOCAL_RANK.",
)
@click.option(
    "--ranks",
    # Petastorm refuses more shards than the demo dataset has row groups.
    type=click.IntRange(min=1, max=len(DEMO_ROW_GROUP_SIZES)),
    default=DEMO_RANKS,
    show_default=True,
    help="With --demo: how many CPU ranks to start.",
)
def main(
    demo: bool,
    data: str | None,
    mode: str,
    epochs: int,
    batch_size: int,
    sync_every: int | None,
    lr: float,
    backend: str,
    device: str,
    ranks: int,
) -> None:
    """Train a DDP linear regression on uneven Petastorm shards with ddp_even.EvenLoader.

    \b
    The demo (4 CPU ranks on this machine, a temporary dataset, every mode):
      python examples/train.py --demo
    Keep the demo dataset in demo-data/ and train on it with torchrun:
      python examples/train.py --demo --data demo-data
      torchrun --nproc-per-node 2 examples/train.py --data demo-data --mode cycle --epochs 2
    GPUs, one process per GPU:
      torchrun --nproc-per-node 8 examples/train.py --data DATASET --backend nccl --device cuda
    Several nodes (run on each node with its --node-rank; DATASET readable from all of them):
      torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 \\
               --nproc-per-node 8 examples/train.py --data DATASET --mode join

    Without --demo the dataset needs float columns x0, x1, x2, x3 and label.
    """
    if device == "cuda" and backend != "nccl":
        click.echo("note: --device cuda is meant to run with --backend nccl", err=True)
    if backend == "nccl" and device != "cuda":
        raise click.UsageError("--backend nccl needs --device cuda")
    config = Config(
        data_url="",  # the demo's, or --data's once checked below
        modes=tuple(MODES) if mode == "all" else (mode,),
        epochs=epochs,
        batch_size=batch_size,
        sync_every=sync_every,
        backend=backend,
        device=device,
        lr=lr,
        demo=demo,
    )
    if demo:
        if backend != "gloo" or device != "cpu":
            raise click.UsageError("--demo runs CPU ranks with gloo; use torchrun for GPUs")
        run_demo(config, data, ranks)
        return
    if data is None:
        raise click.UsageError("--data is required (or pass --demo)")
    if "RANK" not in os.environ:
        raise click.UsageError(
            "run under torchrun, which sets RANK, WORLD_SIZE and MASTER_ADDR, e.g. "
            f"torchrun --nproc-per-node 2 examples/train.py --data {data}; "
            "or pass --demo to start CPU ranks here"
        )
    train_on_this_rank(dataclasses.replace(config, data_url=dataset_url(data)))


if __name__ == "__main__":
    main()
