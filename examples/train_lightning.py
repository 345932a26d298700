"""Train with PyTorch Lightning (``strategy="ddp"``) on uneven Petastorm shards with ddp_even.

The EvenLoader is what ``train_dataloader()`` returns: Lightning calls it once the process
group exists, injects no sampler into it and runs the steps it hands out, the same number on
every rank. ``ddp_even.integrations.lightning.EvenLoaderStats`` logs each epoch's statistics to
the trainer's loggers (here a CSV file per run under ``--results``).

What works in which mode:

* ``truncate``, ``cycle``, ``pad`` and ``share``: yes, with a factory of petastorm loaders
  (``--source factory``) or with ``EvenLoader.from_parquet`` (``--source parquet``, the
  default where petastorm is not installed); with ``from_parquet`` Lightning knows
  ``len(loader)`` and, except in share (planned window by window), no collective runs inside
  the epoch (``examples/shard_loaders.py``). In pad and share modes the training step
  multiplies its loss by the batch's weight (0 for padding);
* ``join``: no. Lightning broadcasts a tensor from rank 0 at every step (its SIGTERM check),
  a collective torch's ``Join`` cannot shadow for the ranks that ran out, so the job would
  hang; ddp_even raises ``EvenLoaderError`` on every rank at the first epoch instead.

Validation, after every training epoch, is exact whatever the training mode: the validation
loader is an EvenLoader in pad mode (share when training in share) over the whole dataset, so
every row is seen once and every rank takes the same steps; ``validation_step`` leaves padding
out of a torchmetrics metric and out of a mean it logs with ``sync_dist=True`` at every step.

Run it three ways (Lightning starts the other ranks itself, as subprocesses of this script)::

    python examples/train_lightning.py --demo                  # skewed temp dataset, 2 CPU ranks
    python examples/train_lightning.py --data DATASET --devices 4 --mode cycle --source parquet
    torchrun --nproc-per-node 2 examples/train_lightning.py --data DATASET --devices 2

A dataset needs float columns x0..x3 and label (``--demo --data DIR`` writes one to keep).
Several ``--mode`` and ``--source`` options train once per combination, one after the other.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from shard_loaders import even_loader, refuse_without_petastorm, source_option
from skewed_parquet import FEATURES, LABEL, dataset_url, keep_demo_dataset
from torch.distributed.algorithms.join import Joinable
from torch.nn.parallel import DistributedDataParallel
from torchmetrics.regression import MeanSquaredError

from ddp_even import EvenLoader, EvenLoaderError
from ddp_even.integrations.lightning import EvenLoaderStats

# petastorm 0.12.1 drives pyarrow 14 through its deprecated legacy API (FutureWarnings), and
# BatchedDataLoader hands Arrow's read-only buffers to torch (a UserWarning); neither concerns
# this script. Lightning's hints for this toy run (few batches, no worker processes) neither.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
warnings.filterwarnings("ignore", message=".*(does not have many workers|smaller than the logging)")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
# Lightning's info lines (devices found, tips) for every run; its warnings still show.
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

# 334 rows in 8 row groups; with 2 ranks petastorm gives rank 0 row groups 0, 2, 4, 6 (280
# rows) and rank 1 row groups 1, 3, 5, 7 (54 rows).
DEMO_ROW_GROUP_SIZES = (120, 8, 60, 16, 90, 20, 10, 10)
# Lightning re-runs this script for ranks 1..N-1 with the environment of rank 0: the demo's
# first process writes the dataset and names it here, so every rank reads the same one.
DEMO_DATA_ENV = "DDP_EVEN_LIGHTNING_DEMO_DATA"


@dataclass(frozen=True)
class Run:
    data_url: str
    mode: str
    source: str  # shard_loaders.SOURCES
    epochs: int
    batch_size: int
    devices: int
    lr: float
    results: Path | None


# --- Data -------------------------------------------------------------------------------------


def to_tensors(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    features = torch.stack([batch[name] for name in FEATURES], dim=1).float()
    return features, batch[LABEL].float().unsqueeze(1)


# --- The Lightning module ---------------------------------------------------------------------


class Regression(pl.LightningModule):
    def __init__(self, run: Run) -> None:
        super().__init__()
        self.settings = run
        self.net = torch.nn.Linear(len(FEATURES), 1)
        self.loader: EvenLoader[dict[str, torch.Tensor]] | None = None
        self.val_loader: EvenLoader[dict[str, torch.Tensor]] | None = None
        # Synced over the ranks when computed, at the end of each validation epoch.
        self.val_mse = MeanSquaredError()
        # The hooks DDP averages the gradients through (EvenLoaderStats registers ddp_even's).
        self.comm_hooks: list[str] = []

    def on_train_start(self) -> None:
        model = self.trainer.strategy.model
        self.comm_hooks = [hook.__name__ for hook, _ in getattr(model, "_comm_hooks", [])]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.loader is not None
        features, labels = to_tensors(batch)
        loss = torch.nn.functional.mse_loss(self.net(features), labels)
        # Averaged over the ranks at the end of the epoch (a collective every rank reaches).
        self.log(
            "train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(labels)
        )
        # Pad and share: 0 for padding, else this batch's share of the step's real rows (pad) or
        # batches (share); 1.0 in the other modes. By batch_idx: Lightning may have fetched the
        # next batch already.
        return loss * self.loader.batch_weight_at(batch_idx)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        assert self.val_loader is not None
        features, labels = to_tensors(batch)
        predictions = self.net(features)
        # A padding batch (this rank's data ran out) counts for nothing: every rank still takes
        # the step, and the per-step sync_dist below, so no rank waits for one that ran out.
        padding = self.val_loader.padding_at(batch_idx)
        if not padding:
            self.val_mse.update(predictions, labels)
        self.log("val_mse", self.val_mse, on_epoch=True)
        squared_error = torch.nn.functional.mse_loss(predictions, labels)
        self.log(
            "val_mse_mean",
            squared_error,
            on_step=True,
            on_epoch=True,
            sync_dist=True,
            batch_size=0 if padding else len(labels),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.settings.lr)

    def train_dataloader(self) -> EvenLoader[dict[str, torch.Tensor]]:
        # Called by Lightning once the process group exists and the model is wrapped in DDP.
        run = self.settings
        # Join mode needs the DDP model to shadow its all-reduces (and refuses to run under
        # Lightning, see the module docstring); the other modes need nothing.
        joinables: list[Joinable] = []
        if run.mode == "join":
            assert isinstance(self.trainer.strategy.model, DistributedDataParallel)
            joinables.append(self.trainer.strategy.model)
        self.loader = self.even_loader(run.mode, joinables)
        return self.loader

    def val_dataloader(self) -> EvenLoader[dict[str, torch.Tensor]]:
        # Every row once, the same steps on every rank, whatever the training's mode (share's
        # fewer steps when training in share).
        self.val_loader = self.even_loader("share" if self.settings.mode == "share" else "pad")
        return self.val_loader

    def even_loader(
        self, mode: str, joinables: Sequence[Joinable] = ()
    ) -> EvenLoader[dict[str, torch.Tensor]]:
        run = self.settings
        return even_loader(
            run.source,
            run.data_url,
            self.trainer.global_rank,
            self.trainer.world_size,
            batch_size=run.batch_size,
            mode=mode,
            joinables=joinables,
        )


# --- One training run (every rank) ------------------------------------------------------------


def train(run: Run) -> dict[str, Any]:
    """Fit a fresh model for ``run.epochs`` epochs; what this rank saw, as JSON-ready data."""
    torch.manual_seed(0)
    module = Regression(run)
    stats_callback = EvenLoaderStats()
    name = f"{run.mode}-{run.source}"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=run.devices,
        strategy="ddp",
        max_epochs=run.epochs,
        callbacks=[stats_callback],
        logger=CSVLogger(run.results / "logs", name=name) if run.results else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    error = None
    started = time.perf_counter()
    try:
        trainer.fit(module)
    except EvenLoaderError as raised:  # join mode: raised on every rank at the first epoch
        error = {"type": type(raised).__name__, "message": str(raised)}
    seconds = time.perf_counter() - started
    loader, val_loader = module.loader, module.val_loader
    return {
        "mode": run.mode,
        "source": run.source,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "history": [] if loader is None else [stats.as_dict() for stats in loader.history],
        "val_history": [] if val_loader is None else [s.as_dict() for s in val_loader.history],
        # The last validation's values (after the last training epoch), the same on every rank.
        "validation": {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if name.startswith("val_")
        },
        "logged_metrics": stats_callback.metrics,
        "global_step": trainer.global_step,
        "comm_hooks": module.comm_hooks,
        "weights": [value for tensor in module.parameters() for value in tensor.flatten().tolist()],
        "error": error,
        "seconds": seconds,
    }


def report(result: dict[str, Any]) -> None:
    """Rank 0's lines about one run."""
    print(f"\n== {result['mode']}, {result['source']}: {result['seconds']:.1f} s")
    if result["error"] is not None:
        print(f"{result['error']['type']} on every rank: {result['error']['message']}")
        return
    for epoch in result["history"]:
        print(
            f"epoch {epoch['epoch']}: steps {epoch['steps']}, own batches {epoch['own_batches']}, "
            f"repeated {epoch['repeated_batches']}, oversampling {epoch['oversampling']:.0%}, "
            f"dropped batches {epoch['dropped_batches']}, padded {epoch['padded_batches']}"
        )
    if "val_mse" in result["validation"]:
        print(f"validation (every row once): mse {result['validation']['val_mse']:.5f}")


# --- Command line -----------------------------------------------------------------------------


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--demo", is_flag=True, help="Write a skewed demo dataset (to --data, or a temp dir)."
)
@click.option("--data", help="Dataset path or petastorm URL with float columns x0..x3, label.")
@click.option(
    "--mode",
    "modes",
    type=click.Choice(["truncate", "cycle", "pad", "share", "join"]),
    multiple=True,
    default=["cycle"],
    show_default=True,
    help="EvenLoader mode; repeat to train once in each.",
)
@source_option
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--devices",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="CPU processes on this machine (under torchrun: its --nproc-per-node).",
)
@click.option("--lr", type=float, default=0.05, show_default=True)
@click.option(
    "--results",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write <mode>-<source>-rank<r>.json per rank and run, and Lightning's CSV logs, here.",
)
def main(
    demo: bool,
    data: str | None,
    modes: tuple[str, ...],
    sources: tuple[str, ...],
    epochs: int,
    batch_size: int,
    devices: int,
    lr: float,
    results: Path | None,
) -> None:
    """Train a linear regression with Lightning DDP on CPU over uneven Petastorm shards."""
    temporary = None
    if demo:
        if os.environ.get(DEMO_DATA_ENV):
            data = os.environ[DEMO_DATA_ENV]
        else:
            if data is None:
                data = temporary = tempfile.mkdtemp(prefix="ddp-even-lightning-")
            keep_demo_dataset(Path(data), DEMO_ROW_GROUP_SIZES)
            os.environ[DEMO_DATA_ENV] = data
    if data is None:
        raise click.UsageError("--data is required (or pass --demo)")
    refuse_without_petastorm(sources)
    data_url = dataset_url(data)
    torch.set_num_threads(1)  # several ranks share this machine's cores
    failed = False
    for mode in modes:
        for source in sources:
            run = Run(data_url, mode, source, epochs, batch_size, devices, lr, results)
            result = train(run)
            failed |= result["error"] is not None
            if results is not None:
                results.mkdir(parents=True, exist_ok=True)
                path = results / f"{mode}-{source}-rank{result['rank']}.json"
                partial = path.with_suffix(".partial")
                partial.write_text(json.dumps(result, indent=1))
                partial.replace(path)  # whole or absent, for whoever reads it
            if result["rank"] == 0:
                report(result)
    if dist.is_initialized():
        dist.barrier()  # every rank is done reading before the demo's dataset is removed
    if temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
