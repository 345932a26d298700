"""The reader of planned rows (``from_parquet``, pyarrow alone): every guarantee of the planned
path, without petastorm.

On 4 gloo ranks, real Parquet files, a DDP model taking optimizer steps: every sharding gives
each rank exactly its planned rows; a pyarrow expression (and a petastorm-style predicate) is
counted before planning and applied when reading; seeded shuffles repeat within an epoch and
change between epochs; an epoch resumes exactly, also on another number of ranks; pad's weights
follow the plan. In one process: what it refuses (petastorm's own reader's options, columns
the dataset lacks, a changed dataset, rows that disagree with the plan), and that a pass let go
of stops its threads.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from ddp_even import EvenLoader
from ddp_even.arrow.columns import Decoding
from ddp_even.arrow.passes import make_shard_factory
from ddp_even.arrow.reader import ArrowPass, PassRows
from ddp_even.errors import PlanMismatchError, RowCountMismatchError
from ddp_even.parquet import plan_for_dataset
from ddp_even.parquet.dataset_plan import plan_dataset
from tests.helpers.collectives import AllReduceCounter, source_checks
from tests.helpers.datasets import flat_sizes, write_plain_dataset
from tests.helpers.logs import ddp_even_messages
from tests.helpers.spawn import run_ranks

SIZES = [[30, 7, 55], [12, 90, 3], [41, 20, 9, 33]]
TOTAL = sum(flat_sizes(SIZES))
BATCH = 8
WORLD_SIZE = 4
SHARDINGS = ["round_robin", "row_groups", "rows", "replicate"]
KEEP = pc.field("label") != 2  # label is id % 3: two rows in three


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_plain_dataset(tmp_path_factory.mktemp("arrow") / "data", SIZES)


def _ids(batch: dict[str, Any]) -> list[int]:
    return [int(value) for value in batch["id"]]


def _epoch(loader: EvenLoader[Any], model: Any) -> dict[str, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = AllReduceCounter()
    ids: list[int] = []
    steps = 0
    length = len(loader)
    for batch in loader:
        if steps == 0:
            counter.start()
        assert isinstance(batch["value"], torch.Tensor) and batch["value"].dtype == torch.float32
        loss = model(batch["value"].reshape(-1, 1) / 100).pow(2).mean()
        (loss * loader.batch_weight).backward()
        optimizer.step()
        optimizer.zero_grad()
        if not loader.padding:
            ids += _ids(batch)
        steps += 1
    counter.stop()
    return {
        "ids": ids,
        "steps": steps,
        "length": length,
        "collectives": counter.calls,
        "stats": loader.stats.as_dict(),
        "weight": float(model.module.weight.item()),
    }


def _shardings_worker(rank: int, world_size: int, url: str, cache: str) -> dict[str, Any]:
    import os

    os.environ["DDP_EVEN_CACHE_DIR"] = cache
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    # A model of its own for join: torch's Join leaves a DDP model all-reducing at every step.
    joined = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    runs: dict[str, Any] = {}
    for sharding in SHARDINGS:
        for mode in ("truncate", "pad", "join"):
            loader = EvenLoader.from_parquet(
                url,
                BATCH,
                mode,
                sharding=sharding,
                joinables=[joined] if mode == "join" else (),
                reader_kwargs={"seed": 3, "shuffle_rows": True},
            )
            runs[f"{sharding} {mode}"] = _epoch(loader, joined if mode == "join" else model)
    messages = ddp_even_messages()
    for attempt in ("counted", "cached"):
        loader = EvenLoader.from_parquet(url, BATCH, "cycle", predicate=KEEP)
        runs[f"predicate {attempt}"] = _epoch(loader, model)
    runs["messages"] = messages
    return runs


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_every_sharding_and_mode_reads_the_planned_rows_on_four_ranks(
    url: str, tmp_path: Path
) -> None:
    runs = run_ranks(_shardings_worker, WORLD_SIZE, url, str(tmp_path / "cache"), timeout=360)
    for sharding in SHARDINGS:
        _, plan = plan_for_dataset(url, WORLD_SIZE, BATCH, sharding=sharding)  # type: ignore[arg-type]
        for mode in ("truncate", "pad", "join"):
            case = f"{sharding} {mode}"
            outcomes = [run[case] for run in runs]
            assert len({str(outcome["stats"]) for outcome in outcomes}) == 1, case
            for rank, outcome in enumerate(outcomes):
                assert outcome["length"] == outcome["steps"], case
                if mode != "join":
                    assert outcome["collectives"] == source_checks(outcome["steps"]), case
                assert len(outcome["ids"]) == len(set(outcome["ids"])), "no row twice on a rank"
                if mode != "truncate":
                    assert len(outcome["ids"]) == plan.rows_per_rank[rank], case
            if sharding == "replicate" and mode != "truncate":
                assert all(sorted(o["ids"]) == list(range(TOTAL)) for o in outcomes), case
                assert len({tuple(o["ids"]) for o in outcomes}) == WORLD_SIZE, "own orders"
            elif mode != "truncate":
                trained = sorted(i for outcome in outcomes for i in outcome["ids"])
                assert trained == list(range(TOTAL)), f"{case}: every row once over the ranks"
            if mode == "pad":
                assert len({outcome["weight"] for outcome in outcomes}) == 1, "DDP in step"
    kept = [row for row in range(TOTAL) if row % 3 != 2]
    for attempt in ("counted", "cached"):
        trained = Counter(i for run in runs for i in run[f"predicate {attempt}"]["ids"])
        assert set(trained) == set(kept), attempt  # cycle: every kept row, short shards repeat
    assert any("counted the rows the predicate keeps" in m for m in runs[0]["messages"])
    assert any("from the cache" in m for m in runs[0]["messages"])


def _resume_worker(
    rank: int, world_size: int, url: str, mode: str, states: list[dict[str, Any]] | None
) -> dict[str, Any]:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    options = {"seed": 5, "shuffle_rows": True}

    def loader() -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url,
            BATCH,
            mode,
            sharding="rows",
            joinables=[model] if mode == "join" else (),
            reader_kwargs=options,
        )

    if states is not None:  # on another number of ranks: finish the saved epoch
        resumed = loader()
        resumed.load_state_dict(states[rank])
        return {"rest": _epoch(resumed, model)}
    whole = [_ids(batch) for batch in _trained(loader(), model)]
    stopped = loader()
    epoch = _trained(stopped, model)
    first = [_ids(next(epoch)) for _ in range(3)]
    state = stopped.state_dict()
    del epoch
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [_ids(batch) for batch in _trained(resumed, model)]
    return {"whole": whole, "first": first, "rest": rest, "state": state}


def _trained(loader: EvenLoader[Any], model: Any) -> Any:
    for batch in loader:
        model(batch["value"].reshape(-1, 1)).sum().backward()
        yield batch


@pytest.mark.multirank
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["truncate", "join"])
def test_an_epoch_resumes_exactly_and_on_fewer_ranks(url: str, mode: str) -> None:
    first = run_ranks(_resume_worker, WORLD_SIZE, url, mode, None, timeout=240)
    for run in first:
        assert run["first"] + run["rest"] == run["whole"], "the uninterrupted epoch, exactly"
    states = [run["state"] for run in first]
    second = run_ranks(_resume_worker, 3, url, mode, states[:3], timeout=240)
    read = Counter(row for run in first for batch in run["first"] for row in batch)
    read.update(row for run in second for row in run["rest"]["ids"])
    dropped = sum(second[0]["rest"]["stats"]["dropped_rows"])
    assert max(read.values()) == 1, "no row twice"
    assert sum(read.values()) + dropped == TOTAL
    assert second[0]["rest"]["stats"]["resumed_from_world_size"] == WORLD_SIZE


# --- one process ------------------------------------------------------------------------------


def test_seeded_shuffles_repeat_within_an_epoch_and_change_between_epochs(url: str) -> None:
    _, factory = make_shard_factory(
        url, 0, 1, BATCH, reader_kwargs={"seed": 9, "shuffle_rows": True}
    )

    def order(epoch: int) -> list[int]:
        reading = factory(epoch)
        try:
            return [i for batch in reading for i in _ids(batch)]
        finally:
            reading.close()

    assert order(0) == order(0) and sorted(order(0)) == list(range(TOTAL))
    assert order(1) != order(0) and sorted(order(1)) == list(range(TOTAL))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("sharding", ["round_robin", "rows"])
def test_each_rows_columns_stay_together_whatever_threads_read_them(
    url: str, threads: int, sharding: str
) -> None:
    # A row group's columns are read in parts, one per thread (the predicate's column, decoded
    # to decide the rows, is not read again): each part must keep the same rows in the same
    # order, also where the predicate drops rows and the shuffle is unseeded.
    per_rank = []
    for rank in range(2):
        _, factory = make_shard_factory(
            url,
            rank,
            2,
            BATCH,
            sharding=sharding,
            predicate=KEEP,
            reader_kwargs={"shuffle_rows": True, "shuffle_row_groups": True},
            loader_kwargs={"threads": threads, "prefetch": 2},
        )
        with factory() as reading:
            batches = list(reading)
        ids = torch.cat([batch["id"] for batch in batches])
        assert torch.equal(torch.cat([batch["label"] for batch in batches]), ids % 3)
        assert torch.equal(torch.cat([batch["value"] for batch in batches]), ids * 0.5)
        assert [list(batch) for batch in batches] == [["id", "value", "label"]] * len(batches)
        per_rank.append(ids.tolist())
    assert sorted(per_rank[0] + per_rank[1]) == [i for i in range(TOTAL) if i % 3 != 2]


@pytest.mark.parametrize("columns", [["value", "id"], ["label", "id"]])
def test_a_predicate_keeps_the_same_rows_whether_its_column_is_handed_out_or_not(
    url: str, columns: list[str]
) -> None:
    _, factory = make_shard_factory(
        url,
        0,
        1,
        BATCH,
        predicate=KEEP,
        reader_kwargs={"schema_fields": columns, "seed": 3, "shuffle_rows": True},
    )
    with factory() as reading:
        batches = list(reading)
    assert [list(batch) for batch in batches] == [columns] * len(batches)
    ids = torch.cat([batch["id"] for batch in batches])
    assert sorted(ids.tolist()) == [i for i in range(TOTAL) if i % 3 != 2]
    handed_out = columns[0]
    expected = ids * 0.5 if handed_out == "value" else ids % 3
    assert torch.equal(torch.cat([batch[handed_out] for batch in batches]), expected)


def test_batches_are_tensors_of_the_columns_asked_for(url: str) -> None:
    loader = EvenLoader.from_parquet(url, BATCH, reader_kwargs={"schema_fields": ["id", "label"]})
    batches = list(loader)
    assert set(batches[0]) == {"id", "label"} and batches[0]["id"].dtype == torch.int64
    assert [len(batch["id"]) for batch in batches] == [BATCH] * (TOTAL // BATCH) + [TOTAL % BATCH]


def test_what_only_petastorms_own_reader_has_is_refused_in_one_line(url: str) -> None:
    for options, instead in (
        ({"workers_count": 4}, r"loader_kwargs=\{'threads': N\}"),
        ({"reader_pool_type": "process"}, r"loader_kwargs=\{'threads': N\}"),
        ({"shuffle_row_drop_partitions": 2}, "shuffle_rows=True"),
        ({"cur_shard": 0}, "sharding follows the plan"),
        ({"filters": [("id", ">", 3)]}, "predicate="),
    ):
        with pytest.raises(ValueError, match=f"option of petastorm's own reader.*{instead}"):
            EvenLoader.from_parquet(url, BATCH, reader_kwargs=options)
    with pytest.raises(ValueError, match="shuffle_rows=True"):
        EvenLoader.from_parquet(url, BATCH, loader_kwargs={"shuffling_queue_capacity": 10})
    for gone, value in (("engine", "petastorm"), ("loader", "dataloader")):  # pyarrow's batches
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{gone}'"):
            EvenLoader.from_parquet(url, BATCH, **{gone: value})
    with pytest.raises(ValueError, match=r"schema_fields=\[\] reads no column"):
        EvenLoader.from_parquet(url, BATCH, reader_kwargs={"schema_fields": []})
    with pytest.raises(ValueError, match="not an option of from_parquet's reader"):
        EvenLoader.from_parquet(url, BATCH, loader_kwargs={"nope": 1})
    with pytest.raises(ValueError, match="did you mean 'seed'"):
        EvenLoader.from_parquet(url, BATCH, reader_kwargs={"sed": 1})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
            EvenLoader.from_parquet(url, BATCH, loader_kwargs={"pin_memory": True})


def test_schema_fields_that_name_no_column_are_refused_naming_the_nearest(url: str) -> None:
    with pytest.raises(ValueError, match=r"names 'lable'.*did you mean 'label'"):
        EvenLoader.from_parquet(url, BATCH, reader_kwargs={"schema_fields": ["id", "lable"]})
    # Petastorm's regular expressions select Unischema fields (reader="row") only.
    with pytest.raises(ValueError, match="Regular expressions need reader='row'"):
        EvenLoader.from_parquet(url, BATCH, reader_kwargs={"schema_fields": ["val.*"]})
    with pytest.raises(TypeError, match="a list of column names"):
        EvenLoader.from_parquet(url, BATCH, reader_kwargs={"schema_fields": "id"})
    loader = EvenLoader.from_parquet(url, BATCH, reader_kwargs={"schema_fields": ["label", "id"]})
    assert list(next(iter(loader))) == ["label", "id"]


def test_a_changed_dataset_and_rows_other_than_planned_are_named(tmp_path: Path) -> None:
    changing = write_plain_dataset(tmp_path / "changing", [10, 10])
    _, factory = make_shard_factory(changing, 0, 1, 4)
    write_plain_dataset(tmp_path / "changing", [10, 9])
    with pytest.raises(PlanMismatchError, match="the dataset changed since it was planned"):
        factory()  # before a row is read: the epoch's agreement carries it to every rank
    # A row group that yields other rows than the plan counted (a predicate that is not
    # deterministic, footers that disagree with the data): the pass names it.
    planned = plan_dataset(write_plain_dataset(tmp_path / "counted", [6, 5]), 1, 4)
    miscounted = dataclasses.replace(planned.row_groups, num_rows=np.array([6, 4]))
    rows = PassRows(
        planned.resolved,
        miscounted,
        [(0, 0, 6), (1, 0, 4)],
        None,
        None,
        [],
        False,
        0,
        planned.partitions,
        Decoding(),
    )
    reading = ArrowPass(rows, batch_size=4, prefetch=2, threads=1, pin_memory=False)
    with pytest.raises(RowCountMismatchError, match="yielded 5 rows, the shard plan counted 4"):
        list(reading)
    reading.close()


def test_a_pass_let_go_of_stops_its_threads(url: str) -> None:
    def readers() -> int:
        return sum(thread.name.startswith("ddp_even-arrow") for thread in threading.enumerate())

    before = readers()
    loader = EvenLoader.from_parquet(url, BATCH)
    for step, _ in enumerate(loader):
        if step == 2:
            break
    assert readers() == before
