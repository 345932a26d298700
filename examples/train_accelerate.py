"""Train with Hugging Face accelerate on uneven Petastorm shards with ddp_even.

accelerate prepares the model and the optimizer (DDP over gloo on CPU); the EvenLoader is used
as it is: ``accelerator.prepare`` only wraps ``torch.utils.data.DataLoader`` objects and hands an
EvenLoader back unchanged, so there is nothing to gain from passing it. Each rank builds its
own loader over its own shard (``--source``: a factory of petastorm loaders, or
``from_parquet``: ``examples/shard_loaders.py``), and the
loop is accelerate's usual one.

Modes (``--mode``, repeat to train once in each):

* ``truncate``, ``cycle``: ddp_even gives every rank the same number of steps; no Join needed;
* ``pad``: as many steps as cycle, every row once; a rank past its data gets padding, whose
  loss the loop multiplies by ``loader.batch_weight`` (0);
* ``share``: every row once in fewer steps (all batches over the ranks, rounded up): the ranks
  that ran out train on batches the others hand them; padding only at the last step, weighted
  by ``loader.batch_weight`` as in pad;
* ``join``: ddp_even's join mode, ``EvenLoader(..., mode="join", joinables=[model])`` with the
  *prepared* (DDP) model, and no ``accelerator.join_uneven_inputs`` around the loop: ddp_even
  already runs each epoch inside torch's ``Join`` with that model (and its own agreement as a
  second joinable), so accelerate's context, which is torch's ``Join`` again, adds nothing;
* ``accelerate-join``: no ddp_even, for comparison: the plain petastorm loader inside
  ``accelerator.join_uneven_inputs([model], even_batches=False)``. Two traps: with the default
  ``even_batches=True`` that context does not enable ``Join`` at all, and on CPU (accelerate
  1.15, ``MULTI_CPU``) it never does ("only supported for multi-GPU training"): uneven shards
  then hang in DDP's all-reduce. So on CPU this mode uses torch's ``Join([model])`` itself,
  which is what accelerate does on GPUs. It trains on every row too, but keeps no statistics
  (and needs petastorm, as ``--source factory`` does).

After training, every run evaluates the model exactly: an EvenLoader in pad mode (share after
training in share) over the same shards (every row once, the same steps on every rank), a
torchmetrics metric that leaves the padding out, and a collective of the loop's own at every
step (``accelerator.reduce``).

Run it under torchrun or accelerate launch (2 CPU processes here)::

    python examples/train_accelerate.py --demo --data demo-data-2ranks   # a skewed dataset
    torchrun --nproc-per-node 2 examples/train_accelerate.py --data demo-data-2ranks --mode cycle
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py \\
        --data demo-data-2ranks --mode truncate --mode join

(``--multi_gpu`` is accelerate's name for its torchrun launcher; on a machine without GPUs the
processes are CPU ranks, made so by ``Accelerator(cpu=True)`` below.)

A dataset needs float columns x0..x3 and label.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import click
import torch
from accelerate import Accelerator
from shard_loaders import even_loader, petastorm_pass, refuse_without_petastorm, source_option
from skewed_parquet import FEATURES, LABEL, dataset_url, keep_demo_dataset
from torch.distributed.algorithms.join import Join
from torchmetrics.regression import MeanSquaredError

from ddp_even import EvenLoader, allreduce_hook


def hide_known_warnings() -> None:
    """Hide warnings that do not concern this script.

    petastorm 0.12.1 drives pyarrow 14 through its deprecated legacy API (FutureWarnings), its
    thread pool leaves a file to the garbage collector (a ResourceWarning), and BatchedDataLoader
    hands Arrow's read-only buffers to torch (a UserWarning). Called again after each epoch:
    leaving torch's ``Join`` (join modes) runs ``warnings.simplefilter("once")``, which puts every
    warning in front of these filters.
    """
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")
    warnings.filterwarnings("ignore", category=ResourceWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


hide_known_warnings()

# 334 rows in 8 row groups; with 2 ranks petastorm gives rank 0 row groups 0, 2, 4, 6 (280
# rows) and rank 1 row groups 1, 3, 5, 7 (54 rows).
DEMO_ROW_GROUP_SIZES = (120, 8, 60, 16, 90, 20, 10, 10)
MODES = ("truncate", "cycle", "pad", "share", "join", "accelerate-join")


def train(
    accelerator: Accelerator,
    data_url: str,
    mode: str,
    source: str,
    epochs: int,
    batch_size: int,
    lr: float,
) -> dict[str, Any]:
    """Train a fresh model in ``mode``; what this rank saw, as JSON-ready data."""
    rank, world_size = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = torch.nn.Linear(len(FEATURES), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # With several processes: DistributedDataParallel over accelerate's process group.
    model, optimizer = accelerator.prepare(model, optimizer)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # DDP's own all-reduce, except that a rank dying in it is named by ddp_even's error.
        model.register_comm_hook(None, allreduce_hook)
    loader: EvenLoader[dict[str, torch.Tensor]] | None = None
    if mode != "accelerate-join":
        # Join mode shadows DDP's all-reduces for ranks that ran out: give it the prepared
        # model (the DDP wrapper accelerate made), not the bare module.
        joinables = [model] if mode == "join" else []
        loader = even_loader(
            source,
            data_url,
            rank,
            world_size,
            batch_size=batch_size,
            mode=mode,
            joinables=joinables,
        )

    steps: list[int] = []
    rows: list[int] = []
    started = time.perf_counter()
    for _epoch in range(epochs):
        epoch_steps = epoch_rows = 0
        if loader is not None:
            epoch_steps, epoch_rows = train_epoch(accelerator, model, optimizer, loader)
        else:
            # accelerate's own recipe for uneven inputs: torch's Join around a plain loop.
            # even_batches=False is what turns Join on; on CPU accelerate never turns it on, so
            # use torch's Join directly there (see the module docstring).
            if accelerator.multi_device:
                join: AbstractContextManager[Any] = accelerator.join_uneven_inputs(
                    [model], even_batches=False
                )
            else:
                join = Join([model])
            with join:
                shard = petastorm_pass(data_url, rank, world_size, batch_size)()
                try:
                    epoch_steps, epoch_rows = train_epoch(accelerator, model, optimizer, shard)
                finally:
                    shard.reader.stop()
                    shard.reader.join()
        hide_known_warnings()
        steps.append(epoch_steps)
        rows.append(epoch_rows)
        if loader is not None and accelerator.is_main_process:
            print(loader.stats.summary())
    # accelerate's recipe has no EvenLoader source of its own: its evaluation wraps its loader.
    evaluation = even_loader(
        "factory" if source == "plain" else source,
        data_url,
        rank,
        world_size,
        batch_size=batch_size,
        mode="share" if mode == "share" else "pad",
    )
    mse, eval_rows = evaluate(accelerator, model, evaluation)
    if accelerator.is_main_process:
        print(f"evaluation, every row once: mse {mse:.5f} over {eval_rows} rows")
    return {
        "mode": mode,
        "source": source,
        "rank": rank,
        "world_size": world_size,
        "distributed_type": str(accelerator.distributed_type),
        "steps": steps,
        "rows": rows,
        "history": [] if loader is None else [stats.as_dict() for stats in loader.history],
        "eval_mse": mse,
        "eval_rows": eval_rows,
        "eval_history": [stats.as_dict() for stats in evaluation.history],
        "weights": [value for tensor in model.parameters() for value in tensor.flatten().tolist()],
        "seconds": time.perf_counter() - started,
    }


def train_epoch(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[dict[str, torch.Tensor]],
) -> tuple[int, int]:
    """One epoch of accelerate's usual loop; this rank's steps and rows."""
    steps = rows = 0
    for batch in batches:
        features = torch.stack([batch[name] for name in FEATURES], dim=1).float()
        labels = batch[LABEL].float().unsqueeze(1)
        features, labels = features.to(accelerator.device), labels.to(accelerator.device)
        loss = torch.nn.functional.mse_loss(model(features), labels)
        if isinstance(batches, EvenLoader):
            # Pad and share: 0 for padding, else the batch's share of the step's real rows (pad)
            # or batches (share); 1.0 in the other modes. DDP's average is then the gradient of
            # the step's mean loss.
            loss = loss * batches.batch_weight
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        steps += 1
        rows += len(labels)
    return steps, rows


def evaluate(
    accelerator: Accelerator,
    model: torch.nn.Module,
    loader: EvenLoader[dict[str, torch.Tensor]],
) -> tuple[float, int]:
    """Mean squared error over every row of the dataset, and the rows; the same on every rank."""
    metric = MeanSquaredError().to(accelerator.device)
    rows = torch.zeros((), dtype=torch.int64, device=accelerator.device)
    with torch.no_grad():
        for batch in loader:
            features = torch.stack([batch[name] for name in FEATURES], dim=1).float()
            labels = batch[LABEL].float().unsqueeze(1)
            features, labels = features.to(accelerator.device), labels.to(accelerator.device)
            predictions = model(features)
            # Padding (this rank's data ran out) is left out; every rank still takes the step,
            # so a collective here, every step, never waits for a rank that ran out.
            if not loader.padding:
                metric.update(predictions, labels)
            real = torch.tensor(0 if loader.padding else len(labels), device=accelerator.device)
            rows += accelerator.reduce(real, reduction="sum")
    return float(metric.compute()), int(rows)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--demo",
    is_flag=True,
    help="Write a skewed demo dataset to --data (a new or empty directory) and stop.",
)
@click.option("--data", required=True, help="Dataset path or petastorm URL (x0..x3, label).")
@click.option(
    "--mode",
    "modes",
    type=click.Choice(MODES),
    multiple=True,
    default=["cycle"],
    show_default=True,
    help="Repeat to train once in each.",
)
@source_option
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--lr", type=float, default=0.05, show_default=True)
@click.option(
    "--results",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write <mode>-<source>-rank<r>.json per rank and run here.",
)
def main(
    demo: bool,
    data: str,
    modes: tuple[str, ...],
    sources: tuple[str, ...],
    epochs: int,
    batch_size: int,
    lr: float,
    results: Path | None,
) -> None:
    """Train a linear regression with accelerate over uneven Petastorm shards."""
    if demo:
        keep_demo_dataset(Path(data), DEMO_ROW_GROUP_SIZES)
        print(f"{data}: {sum(DEMO_ROW_GROUP_SIZES)} rows in {len(DEMO_ROW_GROUP_SIZES)} row groups")
        return
    plain_petastorm = ["--mode accelerate-join"] if "accelerate-join" in modes else []
    refuse_without_petastorm(sources, *plain_petastorm)
    data_url = dataset_url(data)
    torch.set_num_threads(1)  # several ranks share this machine's cores
    # cpu=True: on a machine without GPUs, Accelerator() under torchrun or `accelerate launch`
    # finds no device to distribute over and falls back to a single process (num_processes 1,
    # no process group): every rank would train alone, unsynchronised, and EvenLoader would
    # only warn that WORLD_SIZE > 1 with no process group. cpu=True makes it a MULTI_CPU job
    # that joins the launched ranks in a gloo process group. With GPUs use Accelerator().
    accelerator = Accelerator(cpu=True)
    if accelerator.is_main_process:
        print(
            f"{accelerator.num_processes} processes ({accelerator.distributed_type}), "
            f"data {data_url}"
        )
    runs = [(mode, source) for mode in modes if mode != "accelerate-join" for source in sources]
    if "accelerate-join" in modes:
        runs.append(("accelerate-join", "plain"))
    for mode, source in runs:
        result = train(accelerator, data_url, mode, source, epochs, batch_size, lr)
        # Rows trained on per rank in the last epoch (one all-gather, outside the loop).
        last = torch.tensor([result["steps"][-1], result["rows"][-1]], device=accelerator.device)
        steps, rows = accelerator.gather(last).view(-1, 2).T.tolist()
        if accelerator.is_main_process:
            print(f"== {mode}, {source}: last epoch, steps per rank {steps}, rows per rank {rows}")
        if results is not None:
            results.mkdir(parents=True, exist_ok=True)
            path = results / f"{mode}-{source}-rank{result['rank']}.json"
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(result, indent=1))
            partial.replace(path)  # whole or absent, for whoever reads it
    accelerator.wait_for_everyone()
    sys.exit(0)


if __name__ == "__main__":
    main()
