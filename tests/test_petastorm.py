"""Real petastorm readers over real Parquet on 4 gloo ranks, with a DDP model taking steps.

One process group runs every case; the parent checks each rank's rows and step counts
against what follows from the row-group sizes alone (petastorm gives shard r the row groups
whose index i has i % world_size == r).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from ddp_even import EvenLoader, EvenLoaderError
from tests.helpers import jitter
from tests.helpers.datasets import (
    flat_sizes,
    shard_row_groups,
    write_plain_dataset,
    write_unischema_dataset,
)
from tests.helpers.spawn import run_ranks

pytestmark = [pytest.mark.petastorm, pytest.mark.multirank]

# The soak (scripts/soak.py) runs these cases on 2 to 4 ranks; the expectations below follow.
WORLD_SIZE = int(os.environ.get("DDP_EVEN_SOAK_WORLD_SIZE", "4"))
# On 4 ranks: shards of 90, 21, 37 and 4 rows: 12, 3, 5 and 1 batches of 8.
ROW_GROUP_SIZES = [40, 5, 25, 3, 30, 7, 12, 1, 20, 9]
BATCH_SIZE = 8


@dataclass(frozen=True)
class Keep:
    """A row predicate: keep ids not divisible by ``modulus`` and not in ``dropped``.

    make_reader calls it with one id; make_batch_reader with a pandas Series of ids.
    """

    modulus: int = 0
    dropped: frozenset[int] = frozenset()

    def __call__(self, row_id: Any) -> Any:
        if isinstance(row_id, pd.Series):
            return row_id.map(self.keeps)
        return self.keeps(int(row_id))

    def keeps(self, row_id: int) -> bool:
        jitter.pause()
        if self.modulus and row_id % self.modulus == 0:
            return False
        return row_id not in self.dropped


@dataclass(frozen=True)
class Case:
    mode: str
    # "batch": make_batch_reader on plain Parquet; "row": make_reader on a Unischema dataset.
    reader: str = "batch"
    # "loader": petastorm's DataLoader (row reader) / BatchedDataLoader (batch reader);
    # "reader": the reader itself.
    wraps: str = "loader"
    # "factory": a fresh loader per pass; "reused": one loader for every epoch;
    # "fresh": the seed's loop, a new loader and a new EvenLoader every epoch.
    style: str = "factory"
    keep: Keep | None = None
    steps_per_epoch: int | None = None
    sync_every: int | None = None
    break_after: int | None = None
    epochs: int = 2


@dataclass
class Seen:
    epochs: list[list[list[int]]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    error: tuple[str, str] | None = None
    final_weight: list[float] = field(default_factory=list)


def _make_reader(case: Case, urls: dict[str, str], rank: int, world_size: int) -> Any:
    from petastorm import make_batch_reader, make_reader
    from petastorm.predicates import in_lambda

    options: dict[str, Any] = {
        "num_epochs": 1,
        "cur_shard": rank,
        "shard_count": world_size,
        "workers_count": 2,
    }
    if case.keep is not None:
        options["predicate"] = in_lambda(["id"], case.keep)
    if case.reader == "row":
        return make_reader(urls["row"], schema_fields=["id", "value", "vec"], **options)
    return make_batch_reader(urls["batch"], **options)


def _make_source(case: Case, urls: dict[str, str], rank: int, world_size: int) -> Any:
    from petastorm.pytorch import BatchedDataLoader, DataLoader

    reader = _make_reader(case, urls, rank, world_size)
    if case.wraps == "reader":
        return reader
    loader_class = DataLoader if case.reader == "row" else BatchedDataLoader
    return loader_class(reader, batch_size=BATCH_SIZE)


def _ids(batch: Any) -> list[int]:
    if isinstance(batch, dict):
        return [int(value) for value in batch["id"]]
    ids = batch.id
    return [int(value) for value in ids] if hasattr(ids, "__len__") else [int(ids)]


def _values(batch: Any) -> torch.Tensor:
    values = batch["value"] if isinstance(batch, dict) else batch.value
    return torch.as_tensor(values, dtype=torch.float32).reshape(-1, 1)


def _run_case(case: Case, urls: dict[str, str], rank: int, world_size: int) -> Seen:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    options: dict[str, Any] = {
        "steps_per_epoch": case.steps_per_epoch,
        "sync_every": case.sync_every,
        "joinables": [model] if case.mode == "join" else (),
        "timeout": 60,
    }
    seen = Seen()
    owned: list[Any] = []

    def new_loader() -> EvenLoader[Any]:
        if case.style == "factory":

            def one_pass() -> Any:
                jitter.pause()
                return _make_source(case, urls, rank, world_size)

            return EvenLoader(one_pass, case.mode, **options)
        source = _make_source(case, urls, rank, world_size)
        owned.append(source)
        return EvenLoader(source, case.mode, **options)

    try:
        loader = new_loader()
        history: list[Any] = []
        for epoch in range(case.epochs):
            if case.style == "fresh" and epoch > 0:
                history += loader.history
                loader = new_loader()
            batches: list[list[int]] = []
            for batch in loader:
                loss = model(_values(batch)).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                batches.append(_ids(batch))
                jitter.pause()
                if epoch == 0 and len(batches) == case.break_after:
                    break
            seen.epochs.append(batches)
        iter(loader).close()  # closes an epoch left early, as the next epoch would
        history += loader.history
        gathered = {stats.epoch: dataclasses.asdict(stats) for stats in history}
        if case.style == "fresh":
            gathered = {index: dataclasses.asdict(stats) for index, stats in enumerate(history)}
        seen.stats = [gathered.get(epoch, {}) for epoch in range(case.epochs)]
    except EvenLoaderError as error:
        seen.error = (type(error).__name__, str(error))
    finally:
        for source in owned:
            reader = getattr(source, "reader", source)
            reader.stop()
            reader.join()
    seen.final_weight = [param.item() for param in model.module.parameters()]
    return seen


def run_cases(rank: int, world_size: int, cases: list[Case], urls: dict[str, str]) -> list[Seen]:
    results = []
    for case in cases:
        results.append(_run_case(case, urls, rank, world_size))
        dist.barrier()
    return results


def shard_rows(case: Case, rank: int) -> list[int]:
    """Ids of the rows petastorm delivers to ``rank``, predicate applied."""
    starts = [sum(ROW_GROUP_SIZES[:index]) for index in range(len(ROW_GROUP_SIZES))]
    ids: list[int] = []
    for group in shard_row_groups(len(ROW_GROUP_SIZES), WORLD_SIZE, rank):
        ids += range(starts[group], starts[group] + ROW_GROUP_SIZES[group])
    return [row_id for row_id in ids if case.keep is None or case.keep.keeps(row_id)]


def shard_batches(case: Case, rank: int) -> int:
    rows = shard_rows(case, rank)
    if case.wraps == "loader":
        return math.ceil(len(rows) / BATCH_SIZE)
    if case.reader == "row":
        return len(rows)
    # make_batch_reader yields one item per row group that kept a row.
    starts = [sum(ROW_GROUP_SIZES[:index]) for index in range(len(ROW_GROUP_SIZES))]
    groups = shard_row_groups(len(ROW_GROUP_SIZES), WORLD_SIZE, rank)
    return sum(
        1
        for group in groups
        if any(row in rows for row in range(starts[group], starts[group] + ROW_GROUP_SIZES[group]))
    )


def expected_steps(case: Case, rank: int) -> int:
    batches = [shard_batches(case, peer) for peer in range(WORLD_SIZE)]
    if case.mode == "join":
        return batches[rank]
    steps = min(batches) if case.mode == "truncate" else max(batches)
    if case.steps_per_epoch is not None:
        steps = steps_per_epoch_steps(case, steps)
    return steps


def steps_per_epoch_steps(case: Case, agreed: int) -> int:
    assert case.steps_per_epoch is not None
    return min(agreed, case.steps_per_epoch) if case.mode == "truncate" else case.steps_per_epoch


def _check_epoch(case: Case, results: list[Seen], epoch: int) -> None:
    stats = results[0].stats[epoch]
    every_row: list[int] = []
    for rank, seen in enumerate(results):
        batches = seen.epochs[epoch]
        own_rows = shard_rows(case, rank)
        own_batches = shard_batches(case, rank)
        rows = [row for batch in batches for row in batch]
        every_row += rows
        assert seen.stats[epoch] == stats, "statistics differ between ranks"
        assert len(batches) == expected_steps(case, rank) == stats["steps"][rank], (case, rank)
        assert stats["samples"][rank] == len(rows)
        if case.mode == "cycle":
            assert set(own_rows) <= set(rows), "cycle must hand out every own row"
            assert stats["own_batches"][rank] == min(own_batches, len(batches))
            assert stats["repeated_batches"][rank] == len(batches) - stats["own_batches"][rank]
        else:
            assert len(rows) == len(set(rows)), "no row twice without cycling"
            assert set(rows) <= set(own_rows), "a rank only sees its own shard"
            assert stats["repeated_batches"][rank] == 0
        assert stats["truncated"][rank] == (own_batches > stats["own_batches"][rank])
    if case.mode == "join":
        every_kept_row = [row for rank in range(WORLD_SIZE) for row in shard_rows(case, rank)]
        assert sorted(every_row) == sorted(every_kept_row), "join sees every row exactly once"


def _check(case: Case, results: list[Seen]) -> None:
    for seen in results:
        assert seen.error is None, (case, seen.error)
    for epoch in range(case.epochs):
        if epoch == 0 and case.break_after is not None:
            for seen in results:
                assert len(seen.epochs[0]) == case.break_after
            continue
        _check_epoch(case, results, epoch)
    assert len({tuple(seen.final_weight) for seen in results}) == 1, "DDP replicas diverged"


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("petastorm")
    assert len(flat_sizes(ROW_GROUP_SIZES)) == 10
    return {
        "batch": write_plain_dataset(root / "plain", ROW_GROUP_SIZES),
        "row": write_unischema_dataset(root / "unischema", ROW_GROUP_SIZES),
    }


def _rank_ids(rank: int) -> frozenset[int]:
    return frozenset(shard_rows(Case("truncate"), rank))


CASES = [
    *(Case(mode) for mode in ("truncate", "cycle", "join")),
    *(Case(mode, reader="row") for mode in ("truncate", "cycle", "join")),
    *(Case(mode, reader="row", style="fresh") for mode in ("truncate", "cycle", "join")),
    Case("cycle", reader="row", style="reused"),
    Case("truncate", style="reused"),
    Case("join", reader="row", style="reused"),
    Case("cycle", wraps="reader", style="reused"),
    Case("truncate", reader="row", wraps="reader"),
    Case("join", keep=Keep(modulus=3)),
    Case("cycle", reader="row", keep=Keep(modulus=3)),
    Case("truncate", keep=Keep(dropped=_rank_ids(WORLD_SIZE - 1))),
    Case("join", reader="row", keep=Keep(dropped=_rank_ids(WORLD_SIZE - 1))),
    Case("cycle", steps_per_epoch=20, sync_every=4),
    Case("truncate", reader="row", steps_per_epoch=2),
    Case("cycle", break_after=2),
    Case("join", reader="row", break_after=1),
]


@pytest.mark.timeout(420)
def test_petastorm_loaders_in_every_mode(urls: dict[str, str]) -> None:
    per_rank = run_ranks(run_cases, WORLD_SIZE, CASES, urls, timeout=400)
    for index, case in enumerate(CASES):
        _check(case, [results[index] for results in per_rank])


@pytest.mark.timeout(180)
def test_cycle_over_a_shard_the_predicate_empties_fails_on_every_rank(
    urls: dict[str, str],
) -> None:
    case = Case("cycle", keep=Keep(dropped=_rank_ids(WORLD_SIZE - 1)), epochs=1)
    per_rank = run_ranks(run_cases, WORLD_SIZE, [case], urls, timeout=150)
    errors = {results[0].error for results in per_rank}
    assert errors == {
        (
            "EmptyShardError",
            f"cycle mode cannot wrap around an empty shard: rank(s) {WORLD_SIZE - 1} have no "
            "batch. Give every "
            "rank at least one row group (fewer ranks, smaller row groups, or a balanced plan), "
            "or use mode='truncate' or mode='join' (or mode='pad')",
        )
    }
