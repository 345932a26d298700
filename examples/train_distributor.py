"""Train DDP on a Spark DataFrame with Spark's own launcher, ``TorchDistributor``.

What a PySpark (or Databricks) job does when one machine is not enough:

1. the driver builds a DataFrame whose partitions have very different sizes (one row group
   each once written) and converts it once with petastorm's ``make_spark_converter``;
2. ``check_distributor`` refuses at once what could not run (a barrier stage with more tasks
   than the cluster's task slots, a converter whose files are gone);
3. ``TorchDistributor(num_processes=N, local_mode=..., use_gpu=False).run(train, converter,
   options)`` starts N ranks: ``torchrun`` on the driver (``--local-mode``), or one Spark
   barrier task per rank, each starting ``torchrun`` (``--barrier``: how it runs on a
   cluster). TorchDistributor sets each rank's ``RANK``/``WORLD_SIZE``/``MASTER_*``;
   ``init_process_group("gloo")`` reads them and ddp_even takes rank and world size from
   that group: no code here for them;
4. every rank trains with ``EvenLoader(ConverterSource(converter, batch_size=...), mode)``
   (or ``EvenLoader(converter)`` with ``--petastorm-defaults``) and returns the statistics of
   every epoch and the model, the same on every rank; the driver prints them.

    .venv/bin/python examples/train_distributor.py --mode cycle
    .venv/bin/python examples/train_distributor.py --mode join --barrier

Needs Java, the ``petastorm`` extra and a pyspark whose barrier tasks accept pyarrow 14
(constraints.txt). On a cluster, set ``--cache-url`` to storage every executor reads.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

# The skewed 12-partition DataFrame of the other Spark example (run as a script, this folder
# is on sys.path).
from train_spark import make_dataframe

from ddp_even.petastorm.spark_converter import check_distributor


def train(converter: Any, options: dict[str, Any]) -> dict[str, Any]:
    """One rank, started by TorchDistributor. Runs in another process: it imports what it uses.

    Returns the same on every rank: in local mode TorchDistributor hands the driver the value
    of whichever rank finishes last.
    """
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddp_even import EvenLoader
    from ddp_even.petastorm.spark_converter import ConverterSource

    # petastorm 0.12.1 drives pyarrow 14 through its deprecated API and warns at every reader;
    # its DataLoader hands torch read-only arrays, which this function never writes into.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def fit() -> dict[str, Any]:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        joinables = [model] if options["mode"] == "join" else []
        if options["petastorm_defaults"]:
            # converter.make_torch_dataloader's defaults: batch_size=32, four reader threads.
            loader = EvenLoader(converter, options["mode"], joinables=joinables)
        else:
            source = ConverterSource(converter, batch_size=options["batch_size"], workers_count=2)
            loader = EvenLoader(source, options["mode"], joinables=joinables)
        for _ in range(options["epochs"]):
            for batch in loader:
                x, y = batch["x"].float().unsqueeze(1), batch["y"].float().unsqueeze(1)
                # batch_weight: 1.0 but in pad mode, where padding weighs 0 and real rows count
                # alike.
                loss = torch.nn.functional.mse_loss(model(x), y) * loader.batch_weight
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        weight, bias = (param.item() for param in model.module.parameters())
        # EpochStats are equal on every rank, and DDP keeps the replicas equal.
        return {"history": loader.history, "weight": weight, "bias": bias}

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT: TorchDistributor's
    try:
        return fit()
    finally:  # fit's model is freed by now (docs/using.md, "Ending a job")
        dist.destroy_process_group()


@click.command()
@click.option("--mode", type=click.Choice(["truncate", "cycle", "pad", "join"]), default="cycle")
@click.option(
    "--local-mode/--barrier",
    default=True,
    show_default=True,
    help="Ranks under torchrun on the driver, or one Spark barrier task per rank.",
)
@click.option("--processes", type=click.IntRange(1, 12), default=2, show_default=True)
@click.option("--master", default="local[2]", show_default=True, help="Spark master URL.")
@click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--petastorm-defaults",
    is_flag=True,
    help="EvenLoader(converter): make_torch_dataloader's defaults instead of ConverterSource.",
)
@click.option(
    "--cache-url",
    default=None,
    help="Where make_spark_converter writes (default: a new local directory).",
)
def main(
    mode: str,
    local_mode: bool,
    processes: int,
    master: str,
    epochs: int,
    batch_size: int,
    petastorm_defaults: bool,
    cache_url: str | None,
) -> None:
    """Convert a skewed Spark DataFrame once and train on it with TorchDistributor."""
    # Spark's Python workers (barrier tasks) must import torch and ddp_even: this interpreter.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # Any URL every rank reads; ranks in barrier tasks on other machines need shared storage.
    cache = cache_url or Path(tempfile.mkdtemp(prefix="ddp-even-spark-")).as_uri()
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, cache)
    converter = make_spark_converter(make_dataframe(spark))
    print(f"{len(converter)} rows in {len(converter.file_urls)} files at {converter.cache_dir_url}")
    options = {
        "mode": mode,
        "epochs": epochs,
        "batch_size": batch_size,
        "petastorm_defaults": petastorm_defaults,
    }
    try:
        distributor = TorchDistributor(
            num_processes=processes, local_mode=local_mode, use_gpu=False
        )
        check_distributor(distributor, converter)
        started = time.monotonic()
        result = distributor.run(train, converter, options)
        where = "torchrun on the driver" if local_mode else "Spark barrier tasks"
        print(f"{processes} ranks ({where}) trained in {time.monotonic() - started:.1f} s")
        for stats in result["history"]:
            print(stats.summary())
        print(f"learned y = {result['weight']:.2f}x + {result['bias']:.2f} (the data: y = 3x + 1)")
    finally:
        converter.delete()
        spark.stop()


if __name__ == "__main__":
    main()
