"""EvenLoader with a shard plan (``from_parquet`` / ``plan=``) on 4 gloo ranks over real Parquet.

The plan is made from the footers; the test checks, against counts computed from the
row-group sizes the test wrote, that ``len()`` answers before the first step, that no
collective runs between the first and the last step, that the statistics say exactly what
each rank dropped or repeated, and that a reader delivering fewer rows than planned is named.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from ddp_even import EvenLoader
from ddp_even.parquet import plan_for_dataset
from tests.helpers.collectives import AllReduceCounter, source_checks
from tests.helpers.datasets import shard_row_groups, write_plain_dataset
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.multirank

WORLD_SIZE = 4
ROW_GROUP_SIZES = [40, 5, 25, 3, 30, 7, 12, 1, 20, 9, 16, 2]
BATCH_SIZE = 8


@dataclass
class Run:
    length_before_first_step: int = -1
    steps: int = 0
    rows: list[int] = field(default_factory=list)
    collectives_during_epoch: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _drop_one_row_of_rank_0(row_ids: Any) -> Any:
    # Row 0 lives in row group 0, which is rank 0's: its batch count stays 12, its rows drop by 1.
    return row_ids != 0 if hasattr(row_ids, "index") else int(row_ids) != 0


def run_planned(
    rank: int,
    world_size: int,
    url: str,
    mode: str,
    balanced: bool,
    lossy: bool,
) -> Run:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    joinables = [model] if mode == "join" else ()
    if lossy:
        from petastorm import make_batch_reader
        from petastorm.predicates import in_lambda
        from petastorm.pytorch import BatchedDataLoader

        # A reader that loses a row the footers promise, with the footers' plan.
        _, plan = plan_for_dataset(url, world_size, BATCH_SIZE)
        predicate = in_lambda(["id"], _drop_one_row_of_rank_0)

        def one_pass() -> Any:
            reader = make_batch_reader(
                url, num_epochs=1, cur_shard=rank, shard_count=world_size, predicate=predicate
            )
            return BatchedDataLoader(reader, batch_size=BATCH_SIZE)

        loader: EvenLoader[Any] = EvenLoader(one_pass, mode, plan=plan, joinables=joinables)
    else:
        loader = EvenLoader.from_parquet(
            url,
            BATCH_SIZE,
            mode,
            sharding="row_groups" if balanced else "round_robin",
            joinables=joinables,
        )
    collected = _Collect()
    logging.getLogger("ddp_even").addHandler(collected)
    counter = AllReduceCounter()
    run = Run(length_before_first_step=len(loader))
    for batch in loader:
        if run.steps == 0:
            counter.start()
        loss = model(batch["value"].reshape(-1, 1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.steps += 1
        run.rows += [int(row) for row in batch["id"]]
    counter.stop()
    run.collectives_during_epoch = counter.calls
    run.stats = loader.stats.as_dict()
    run.warnings = collected.messages
    return run


def _shard_rows(sizes: list[int], groups: list[int]) -> list[int]:
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    return [row for group in groups for row in range(starts[group], starts[group] + sizes[group])]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_plain_dataset(tmp_path_factory.mktemp("planned") / "data", ROW_GROUP_SIZES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["truncate", "cycle", "join"])
def test_round_robin_plan_counts_match_what_the_reader_delivers(url: str, mode: str) -> None:
    runs = run_ranks(run_planned, WORLD_SIZE, url, mode, False, False, timeout=240)
    groups = [shard_row_groups(len(ROW_GROUP_SIZES), WORLD_SIZE, rank) for rank in range(4)]
    rows = [_shard_rows(ROW_GROUP_SIZES, shard) for shard in groups]
    batches = [math.ceil(len(shard_rows) / BATCH_SIZE) for shard_rows in rows]
    for rank, run in enumerate(runs):
        expected = {"truncate": min(batches), "cycle": max(batches), "join": batches[rank]}[mode]
        assert run.length_before_first_step == run.steps == expected
        assert run.stats == runs[0].stats
        if mode != "join":
            assert run.collectives_during_epoch == source_checks(run.steps), "no agreement per step"
        if mode == "truncate":
            assert run.stats["dropped_batches"][rank] == batches[rank] - expected
            kept = min(len(rows[rank]), expected * BATCH_SIZE)
            assert run.stats["dropped_rows"][rank] == len(rows[rank]) - kept
            assert run.rows == rows[rank][:kept] or set(run.rows) <= set(rows[rank])
        else:
            assert run.stats["dropped_batches"][rank] == 0
            assert set(rows[rank]) <= set(run.rows)
        assert run.warnings == []
    # One over-sampling figure: the statistics' and `ddp-even plan`'s cycle waste are the same.
    _, plan = plan_for_dataset(url, WORLD_SIZE, BATCH_SIZE)
    expected_oversampling = plan.stats("cycle").waste_percent if mode == "cycle" else 0.0
    assert 100 * runs[0].stats["oversampling"] == pytest.approx(expected_oversampling, abs=1e-3)


@pytest.mark.timeout(300)
def test_balanced_plan_reads_every_row_group_once_and_drops_at_most_one_batch(url: str) -> None:
    runs = run_ranks(run_planned, WORLD_SIZE, url, "truncate", True, False, timeout=240)
    _, plan = plan_for_dataset(url, WORLD_SIZE, BATCH_SIZE, sharding="row_groups")
    assert max(plan.rows_per_rank) - min(plan.rows_per_rank) <= max(ROW_GROUP_SIZES)
    for rank, run in enumerate(runs):
        assert run.steps == min(plan.batches_per_rank)
        assert run.stats["dropped_batches"][rank] <= 1
        assert set(run.rows) <= set(_shard_rows(ROW_GROUP_SIZES, list(plan.shards[rank])))
    every_group = sorted(group for shard in plan.shards for group in shard)
    assert every_group == list(range(len(ROW_GROUP_SIZES)))


@pytest.mark.timeout(300)
@pytest.mark.petastorm
def test_a_reader_that_loses_rows_is_named_after_the_epoch(url: str) -> None:
    runs = run_ranks(run_planned, WORLD_SIZE, url, "cycle", False, True, timeout=240)
    warnings = runs[0].warnings
    assert len(warnings) == 1, warnings
    assert "rank 0 read 12 batches / 89 rows" in warnings[0]
    assert "says 12 batches / 90 rows" in warnings[0]
    assert all(run.warnings == [] for run in runs[1:]), "rank 0 alone reports"
