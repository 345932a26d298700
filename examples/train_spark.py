"""Train a DDP model on a Spark DataFrame: petastorm's converter, with ddp_even keeping ranks even.

A PySpark (or Databricks) job starts from a DataFrame. This script does what such a job does:

1. the driver builds a DataFrame whose partitions have very different sizes (one row group
   each once written), and converts it once with petastorm's ``make_spark_converter``;
2. it starts ``--ranks`` CPU ranks (gloo) and sends each the converter: a small picklable
   object, so the ranks start no Spark; they read its Parquet files;
3. every rank trains with ``EvenLoader(ConverterSource(converter, batch_size=...), mode)``
   (or ``EvenLoader.from_parquet(converter, sharding=...)`` with ``--sharding``), so every rank
   takes the same number of steps; rank 0 prints each epoch's statistics;
4. the driver deletes the converter's files (``converter.delete()``) after training.

Without ddp_even, petastorm's ``converter.make_torch_dataloader(cur_shard=rank,
shard_count=world_size)`` gives the ranks different numbers of batches and DDP hangs.

    .venv/bin/python examples/train_spark.py --mode cycle --ranks 4 --epochs 3
    .venv/bin/python examples/train_spark.py --mode truncate --sharding rows

Needs Java (Spark's local mode) and the ``petastorm`` extra; about a minute on 2 cores.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, get_args

import click
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from ddp_even import EvenLoader
from ddp_even.modes import MODES
from ddp_even.names import Sharding
from ddp_even.petastorm.spark_converter import ConverterSource

# petastorm 0.12.1 drives pyarrow 14 through its deprecated API and warns at every reader;
# its DataLoader hands torch read-only arrays, which this script never writes into.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# Rows per DataFrame partition: 12 partitions, 3 to 400 rows (1,000 rows in all).
PARTITION_ROWS = (400, 3, 150, 20, 90, 7, 160, 10, 60, 40, 50, 10)


def make_dataframe(spark: Any) -> Any:
    """``PARTITION_ROWS[k]`` rows in partition ``k``: ``x`` in [0, 1), ``y = 3x + 1 + noise``."""
    starts = [sum(PARTITION_ROWS[:k]) for k in range(len(PARTITION_ROWS))]
    lasts = [start + rows - 1 for start, rows in zip(starts, PARTITION_ROWS, strict=True)]

    def pick(values: list[int]) -> str:
        array = ", ".join(f"cast({value} as bigint)" for value in values)
        return f"element_at(array({array}), cast(id + 1 as int))"

    # One row per partition, exploded into its own rows: narrow, so the partitions stay.
    return (
        spark.range(0, len(PARTITION_ROWS), 1, len(PARTITION_ROWS))
        .selectExpr(f"explode(sequence({pick(starts)}, {pick(lasts)})) as id")
        .selectExpr("id", "rand(0) as x")
        .selectExpr("id", "x", "3 * x + 1 + 0.1 * randn(1) as y")
    )


def train(rank: int, world_size: int, port: int, converter: Any, options: dict[str, Any]) -> None:
    """One rank: join the group, train, print the statistics (rank 0)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fit(rank, converter, options)
    finally:  # fit's model is freed by now (docs/using.md, "Ending a job")
        dist.destroy_process_group()


def fit(rank: int, converter: Any, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    joinables = [model] if options["mode"] == "join" else []
    if options["sharding"] is not None:
        # Shards planned from the converter's footers ("rows": equal shards by construction).
        loader = EvenLoader.from_parquet(
            converter,
            batch_size=options["batch_size"],
            mode=options["mode"],
            sharding=options["sharding"],
            joinables=joinables,
        )
    else:
        # petastorm's own round robin: converter.make_torch_dataloader(cur_shard=rank, ...).
        source = ConverterSource(converter, batch_size=options["batch_size"], workers_count=2)
        loader = EvenLoader(source, options["mode"], joinables=joinables)
    for _ in range(options["epochs"]):
        for batch in loader:
            x, y = batch["x"].float().unsqueeze(1), batch["y"].float().unsqueeze(1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(loader.stats.summary())
    if rank == 0:
        weight, bias = (param.item() for param in model.module.parameters())
        print(f"learned y = {weight:.2f}x + {bias:.2f} (the data: y = 3x + 1)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--mode", type=click.Choice(list(MODES)), default="cycle", show_default=True)
@click.option("--ranks", type=click.IntRange(1, 12), default=4, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--sharding",
    type=click.Choice(get_args(Sharding)),
    help="Plan the shards from the converter's footers (EvenLoader.from_parquet) cut this way, "
    "instead of petastorm's own loader (ConverterSource, round robin).",
)
def main(mode: str, ranks: int, epochs: int, batch_size: int, sharding: str | None) -> None:
    """Convert a skewed Spark DataFrame once and train on it with RANKS ranks."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.sql import SparkSession

    cache = Path(tempfile.mkdtemp(prefix="ddp-even-spark-"))
    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # Where make_spark_converter writes its Parquet files (any URL the ranks can read).
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, cache.as_uri())
    converter = make_spark_converter(make_dataframe(spark))
    print(f"{len(converter)} rows in {len(converter.file_urls)} files at {converter.cache_dir_url}")
    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = {"mode": mode, "epochs": epochs, "batch_size": batch_size, "sharding": sharding}
    try:
        # The ranks get the converter pickled; they read its files and start no Spark.
        mp.spawn(train, args=(ranks, port, converter, options), nprocs=ranks)
    finally:
        converter.delete()
        spark.stop()


if __name__ == "__main__":
    main()
