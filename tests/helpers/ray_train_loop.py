"""The train loops tests/test_stack_ray.py hands to Ray Train's ``TorchTrainer`` (the recipe of
docs/stacks.md). Ray's workers import this module (the test puts the repository on their
``PYTHONPATH``); each writes what it trained to ``results/<name>-rank<r>.json``.

- :func:`ray_data_loop`: each worker reads its own files through Ray Data
  (``iter_torch_batches``), wrapped in an EvenLoader in pad mode.
- :func:`from_parquet_loop`: ``EvenLoader.from_parquet`` over the whole dataset, in pad mode.
- :func:`both_loops`: one, then the other, in the same workers (their start is most of a run's
  time on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ddp_even import EvenLoader
from tests.helpers.stacks import LR, Seen, make_model, to_tensors


def ray_data_loop(config: dict[str, Any]) -> None:
    import ray.data
    import ray.train
    from ray.train.torch import prepare_model

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    # This worker's own files: unequal files give the workers unequal numbers of batches.
    dataset = ray.data.read_parquet(config["files"][rank::world_size])
    model = prepare_model(make_model())  # DDP over the gloo group Ray Train started
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def one_pass() -> Any:  # a fresh pass over this worker's files
        return dataset.iter_torch_batches(batch_size=config["batch_size"])

    loader = EvenLoader(one_pass, mode="pad")
    seen = Seen()
    for batch in loader:
        features, labels = to_tensors(batch)
        loss = torch.nn.functional.mse_loss(model(features), labels)
        # 0 for padding, else the batch's share of the step's real rows.
        (loss * loader.batch_weight).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.add(batch, loader)
    _write(seen, model, None, Path(config["results"]) / f"ray-data-rank{rank}.json")


def from_parquet_loop(config: dict[str, Any]) -> None:
    import ray.train
    from ray.train.torch import prepare_model

    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    # Planned from the footers over torch.distributed's group, which Ray Train started.
    loader = EvenLoader.from_parquet(config["data"], batch_size=config["batch_size"], mode="pad")
    seen = Seen()
    for batch in loader:
        features, labels = to_tensors(batch)
        loss = torch.nn.functional.mse_loss(model(features), labels)
        (loss * loader.batch_weight).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.add(batch, loader)
    path = Path(config["results"]) / f"from-parquet-rank{rank}.json"
    _write(seen, model, len(loader), path)


def both_loops(config: dict[str, Any]) -> None:
    ray_data_loop(config)
    from_parquet_loop(config)


def _write(seen: Seen, model: torch.nn.Module, length: int | None, path: Path) -> None:
    seen.keep_weights(model.parameters())
    path.write_text(json.dumps({**dataclasses.asdict(seen), "length": length}))
