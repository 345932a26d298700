"""A Lightning ``Trainer(strategy="ddp")`` job that stops mid-epoch and resumes from its checkpoint.

Run as ``python tests/helpers/lightning_resume_job.py --results DIR --case MODE:SOURCE:K[,K...]
[--case ...]``; Lightning starts rank 1 itself (a subprocess of this script). For each case, one
after the other on the same two ranks, it fits a tiny linear model for ``EPOCHS`` epochs over
per-rank lists of batches of sample ids of uneven lengths (``BATCHES``), with an
:class:`~ddp_even.EvenLoader` over them (``SOURCE``: the list itself, whose length the loader
knows, or a factory of iterators over it, whose length it does not; or ``parquet``:
``EvenLoader.from_parquet`` over the dataset ``--data`` with seeded row-group and row shuffles
read by three threads, whose length it knows from the plan) as the train dataloader:

* ``full``: uninterrupted;
* ``stop<K>-<variant>``: the same, but Lightning's ``ModelCheckpoint(every_n_train_steps=K)``
  saves a checkpoint at global step ``K`` and a callback stops the fit there
  (``trainer.should_stop``);
* ``resume<K>-<variant>``: a fresh module, trainer and loader; ``trainer.fit(...,
  ckpt_path=...)`` from that checkpoint.

Nothing but the checkpoint file passes from ``stop`` to ``resume``. The variant ``lightning``
relies on Lightning alone (it saves ``loader.state_dict()`` in the checkpoint and calls
``load_state_dict``); ``recipe`` adds ddp_even's ``EvenLoaderCheckpoints`` to the stopped
run. Every rank
writes ``<mode>-<source>-<run>-rank<r>.json``: the sample ids of every training step (with
Lightning's epoch, batch index and global step), the loader's ``history``, the final weights
and, for the stopped runs, the loader states found in the checkpoint
(``loops.fit_loop.state_dict.combined_loader``).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import click
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

# Run as a script: this folder is on sys.path.
from lightning_resume_data import BATCH_SIZE, BATCHES, EPOCHS

from ddp_even import EvenLoader
from ddp_even.integrations.lightning import EvenLoaderCheckpoints

FEATURES = 4
LR = 0.1
# Where the loader states sit in a Lightning 2.x checkpoint.
LOADER_STATES_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")
# "lightning": Lightning's own checkpointing alone; "recipe": with EvenLoaderCheckpoints.
VARIANTS = ("lightning", "recipe")
PARQUET_READING = {"seed": 5, "shuffle_rows": True}


def shard(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s batches of sample ids; the last batch has BATCH_SIZE - 1 ids."""
    count = BATCHES[rank] * BATCH_SIZE - 1
    ids = torch.arange(count, dtype=torch.int64) + rank * 1000
    return [ids[start : start + BATCH_SIZE] for start in range(0, count, BATCH_SIZE)]


def features_and_labels(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression sample per id."""
    scales = torch.arange(1, FEATURES + 1, dtype=torch.float64) * 0.37
    features = torch.sin(ids.to(torch.float64).unsqueeze(1) * scales)
    labels = features @ torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64) + 1.0
    return features.float(), labels.float().unsqueeze(1)


class Regression(pl.LightningModule):
    def __init__(self, mode: str, source: str, data_url: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.source = source
        self.data_url = data_url
        self.net = torch.nn.Linear(FEATURES, 1)
        self.loader: EvenLoader[Any] | None = None
        self.steps: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):  # petastorm's loader: a dict of columns
            batch = batch["id"]
        self.steps.append(
            {
                "epoch": self.trainer.current_epoch,
                "batch_idx": batch_idx,
                "global_step": self.trainer.global_step,
                "ids": batch.tolist(),
            }
        )
        features, labels = features_and_labels(batch)
        return torch.nn.functional.mse_loss(self.net(features), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> EvenLoader[Any]:
        batches = shard(self.trainer.global_rank)
        if self.source == "parquet":  # a plan: lengths known from the footers
            assert self.data_url is not None, "--data is required for the parquet source"
            self.loader = EvenLoader.from_parquet(
                self.data_url,
                batch_size=BATCH_SIZE,
                mode=self.mode,
                reader_kwargs=PARQUET_READING,
                timeout=30,
            )
        elif self.source == "list":  # known length: one agreement per epoch
            self.loader = EvenLoader(batches, mode=self.mode, timeout=30)
        else:  # a factory, unknown length: agreements as it goes
            self.loader = EvenLoader(lambda: iter(batches), mode=self.mode, timeout=30)
        return self.loader


class StopAt(pl.Callback):
    """Stops the fit after global step ``step`` (after that step's checkpoint)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def fit(
    mode: str,
    source: str,
    workdir: Path,
    data_url: str | None,
    *,
    stop_at: int | None = None,
    ckpt_path: Path | None = None,
    recipe: bool = False,
) -> tuple[Regression, pl.Trainer]:
    torch.manual_seed(0)
    module = Regression(mode, source, data_url)
    callbacks: list[pl.Callback] = []
    if stop_at is not None:
        callbacks.append(StopAt(stop_at))
        if recipe:
            callbacks.append(EvenLoaderCheckpoints())
        callbacks.append(
            ModelCheckpoint(
                dirpath=workdir,
                filename="saved",
                every_n_train_steps=stop_at,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=stop_at is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=workdir,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def record(module: Regression, trainer: pl.Trainer) -> dict[str, Any]:
    loader = module.loader
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "steps": module.steps,
        "history": [] if loader is None else [stats.as_dict() for stats in loader.history],
        "weights": [value for tensor in module.parameters() for value in tensor.flatten().tolist()],
    }


def write(results: Path, name: str, rank: int, document: dict[str, Any]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}-rank{rank}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(document, indent=1))
    partial.replace(path)  # whole or absent, for whoever reads it


def run_case(
    results: Path, mode: str, source: str, save_at: list[int], data_url: str | None
) -> None:
    """The uninterrupted run, then for each step and variant a stopped and a resumed run."""
    name = f"{mode}-{source}"
    module, trainer = fit(mode, source, results / name / "full", data_url)
    write(results, f"{name}-full", trainer.global_rank, record(module, trainer))
    for step in save_at:
        for variant in VARIANTS:
            run = f"{step}-{variant}"
            workdir = results / name / run
            module, trainer = fit(
                mode, source, workdir, data_url, stop_at=step, recipe=variant == "recipe"
            )
            saved = workdir / "saved.ckpt"
            document = record(module, trainer)
            checkpoint = torch.load(saved, map_location="cpu", weights_only=False)
            states: Any = checkpoint
            for key in LOADER_STATES_PATH:
                states = states.get(key) if isinstance(states, dict) else None
            document["checkpoint_global_step"] = checkpoint["global_step"]
            document["checkpoint_loader_states"] = states
            write(results, f"{name}-stop{run}", trainer.global_rank, document)
            module, trainer = fit(mode, source, workdir / "resumed", data_url, ckpt_path=saved)
            write(results, f"{name}-resume{run}", trainer.global_rank, record(module, trainer))


@click.command()
@click.option("--results", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--case",
    "cases",
    multiple=True,
    required=True,
    help="MODE:SOURCE:K[,K...]: save and stop at each global step K (source: list, factory, "
    "parquet).",
)
@click.option("--data", "data_url", default=None, help="The parquet source's dataset URL.")
def main(results: Path, cases: tuple[str, ...], data_url: str | None) -> None:
    # Lightning's hints for this toy run, its info lines, and the warning that ckpt_path comes
    # without the callbacks that saved it (on purpose: the resumed run only trains).
    warnings.filterwarnings("ignore", message=".*(does not have many workers|smaller than the)")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    for case in cases:
        mode, source, steps = case.split(":")
        run_case(results, mode, source, [int(step) for step in steps.split(",")], data_url)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
