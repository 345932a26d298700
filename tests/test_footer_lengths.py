"""The loop users already write, ``EvenLoader(lambda: DataLoader(make_reader(url,
cur_shard=rank, shard_count=world_size)))``, runs like a plan: its batch counts follow from the
Parquet footers, so the epoch needs no agreement between steps (only the overlapped checks of
the sources every few steps). 4 gloo ranks, real petastorm.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ddp_even import EvenLoader
from tests.helpers.collectives import AllReduceCounter, source_checks
from tests.helpers.datasets import shard_rows, write_plain_dataset
from tests.helpers.spawn import run_ranks

pytestmark = [pytest.mark.petastorm, pytest.mark.multirank]

WORLD_SIZE = 4
SIZES = [[40, 50, 25], [33, 30, 70], [12, 41, 20, 39, 16, 42]]
BATCH = 8


def _epoch(loader: EvenLoader[Any]) -> dict[str, Any]:
    counter = AllReduceCounter()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    steps = 0
    for batch in loader:
        if steps == 0:
            counter.start()
        loss = model(batch["value"].reshape(-1, 1).float()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    counter.stop()
    try:
        length = len(loader)
    except TypeError:  # unknown lengths
        length = -1
    return {"steps": steps, "length": length, "collectives_in_epoch": counter.calls}


def seed_loops(rank: int, world_size: int, url: str) -> dict[str, dict[str, Any]]:
    from petastorm import make_batch_reader
    from petastorm.predicates import in_lambda
    from petastorm.pytorch import BatchedDataLoader, DataLoader

    def one_pass(**options: Any) -> Any:
        reader = make_batch_reader(
            url, num_epochs=1, cur_shard=rank, shard_count=world_size, workers_count=2, **options
        )
        return BatchedDataLoader(reader, batch_size=BATCH)

    def row_loader() -> Any:
        reader = make_batch_reader(url, num_epochs=1, cur_shard=rank, shard_count=world_size)
        return DataLoader(reader, batch_size=BATCH)

    keep_all = in_lambda(["id"], lambda ids: ids >= 0)
    return {
        "truncate": _epoch(EvenLoader(one_pass, "truncate")),
        "cycle": _epoch(EvenLoader(one_pass, "cycle")),
        "dataloader": _epoch(EvenLoader(row_loader, "truncate")),
        "predicate": _epoch(EvenLoader(lambda: one_pass(predicate=keep_all), "truncate")),
        "sync_every": _epoch(EvenLoader(one_pass, "truncate", sync_every=2)),
    }


@pytest.mark.timeout(300)
def test_the_seed_loop_runs_without_agreements_between_steps(tmp_path: Any) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    runs = run_ranks(seed_loops, WORLD_SIZE, url, timeout=240)
    batches = [math.ceil(shard_rows(SIZES, WORLD_SIZE, rank) / BATCH) for rank in range(WORLD_SIZE)]
    assert len(set(batches)) > 1, "the test needs uneven shards"
    for run in runs:
        for case in ("truncate", "dataloader"):
            assert run[case]["steps"] == run[case]["length"] == min(batches)
            assert run[case]["collectives_in_epoch"] == source_checks(min(batches)), case
        assert run["cycle"]["steps"] == run["cycle"]["length"] == max(batches)
        assert run["cycle"]["collectives_in_epoch"] == source_checks(max(batches))
        # A predicate may drop rows: counts are unknown, so the ranks agree as they go; the
        # epoch still ends together. So does an explicit sync_every.
        for case in ("predicate", "sync_every"):
            assert run[case]["steps"] == min(batches)
            assert run[case]["collectives_in_epoch"] > source_checks(min(batches)), case
