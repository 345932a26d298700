"""Equal shards by construction: ``sharding="rows"``, row predicates counted up front, and
``sharding="replicate"``, over real Parquet read by the pyarrow reader (plain values, and a
petastorm Unischema dataset decoded by petastorm's codecs), compared with petastorm's own reader
where it differs.

The fast tests read every rank's shard in turn in one process; the multirank ones train a DDP
model on 4 gloo ranks with ``EvenLoader.from_parquet`` (petastorm-style predicates and pyarrow
expressions) and check what each rank trained on.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_even import EvenLoader
from ddp_even.arrow.passes import make_shard_factory
from ddp_even.errors import RowCountMismatchError
from ddp_even.parquet import plan_for_dataset
from ddp_even.planning import plan_shards
from tests.helpers.collectives import AllReduceCounter, source_checks
from tests.helpers.datasets import flat_sizes, write_plain_dataset, write_unischema_dataset
from tests.helpers.logs import ddp_even_messages
from tests.helpers.shard_reads import collect
from tests.helpers.spawn import run_ranks

# Skewed on purpose: one row group holds most rows, several hold a handful.
SIZES = [[3, 400, 5], [4, 6, 100], [7, 8, 9, 10, 11, 12, 125]]
TOTAL = sum(flat_sizes(SIZES))
WORLD_SIZE = 4
BATCH = 8
# Loader options: row groups read by two threads.
THREADS = {"threads": 2}
# One reading thread, one row group in flight.
ONE_THREAD = {"threads": 1, "prefetch": 1}


def keeps(row_id: Any) -> Any:
    """A predicate keeping ~12 % of rows, unevenly: all of the first 30 rows, then every 11th."""
    return (row_id < 30) | (row_id % 11 == 0)


def _in_lambda() -> Any:
    from petastorm.predicates import in_lambda

    return in_lambda(["id"], keeps)


def kept_ids() -> list[int]:
    return [row for row in range(TOTAL) if keeps(row)]


class Datasets(dict[str, str]):
    """The test datasets' URLs by layout, each written when a test first asks for it (the
    Unischema one needs petastorm)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self._root = root

    def __missing__(self, layout: str) -> str:
        write = {"plain": write_plain_dataset, "unischema": write_unischema_dataset}[layout]
        self[layout] = url = write(self._root / layout, SIZES)
        return url


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return Datasets(tmp_path_factory.mktemp("row-sharding"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DDP_EVEN_CACHE_DIR", str(cache))
    return cache


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50), min_size=1, max_size=40),
    world_size=st.integers(1, 24),
)
def test_rows_sharding_gives_every_row_to_exactly_one_rank(
    sizes: list[int], world_size: int
) -> None:
    plan = plan_shards(sizes, world_size, batch_size=4, sharding="rows")
    total = sum(sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    owners: Counter[int] = Counter()
    for rank in range(world_size):
        ranges = {group: (start, stop) for group, start, stop in plan.row_ranges_of(rank)}
        assert set(ranges) <= set(plan.shards[rank])
        assert list(plan.shards[rank]) == sorted(plan.shards[rank])
        rows = 0
        for group in plan.shards[rank]:
            start, stop = ranges.get(group, (0, sizes[group]))
            assert 0 <= start < stop <= sizes[group] or sizes[group] == 0
            owners.update(range(starts[group] + start, starts[group] + stop))
            rows += stop - start
        assert rows == plan.rows_per_rank[rank]
        assert total // world_size <= rows <= -(-total // world_size)
        assert len(ranges) <= 2, "a rank's range cuts at most the row groups at its two ends"
    assert owners == Counter(range(total)), "every row once"
    assert plan.split_row_groups <= world_size - 1
    assert max(plan.batches_per_rank) - min(plan.batches_per_rank) <= 1


@pytest.mark.petastorm
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("layout", "reader", "predicate"),
    [
        ("plain", "batch", False),
        ("plain", "batch", True),
        ("unischema", "row", False),
        pytest.param("unischema", "row", True, marks=pytest.mark.petastorm),
    ],
    ids=["plain-all-rows", "plain-predicate", "unischema-all-rows", "unischema-predicate"],
)
def test_rows_readers_read_every_row_exactly_once(
    datasets: dict[str, str], layout: str, reader: Any, predicate: bool
) -> None:
    ids_per_rank: list[list[int]] = []
    for rank in range(WORLD_SIZE):
        plan, factory = make_shard_factory(
            datasets[layout],
            rank,
            WORLD_SIZE,
            BATCH,
            sharding="rows",
            reader=reader,
            predicate=_in_lambda() if predicate else None,
            reader_kwargs={"shuffle_rows": True, "seed": 5},
            loader_kwargs=THREADS,
        )
        with factory(epoch=2) as shard_pass:
            read = collect(shard_pass)
        assert read.rows == plan.rows_per_rank[rank]
        assert read.batches == plan.batches_per_rank[rank]
        if layout == "unischema":
            # The ndarray codec decoded each row's own vector: the split kept rows whole.
            with factory(epoch=2) as shard_pass:
                for batch in shard_pass:
                    assert torch.equal(batch["vec"][:, 0].long(), batch["id"])
        ids_per_rank.append(read.ids)
    expected = kept_ids() if predicate else list(range(TOTAL))
    assert sorted(row for ids in ids_per_rank for row in ids) == expected
    sizes = [len(ids) for ids in ids_per_rank]
    assert max(sizes) - min(sizes) <= 1
    assert plan.split_row_groups >= 1, "the test must split row groups"


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_the_row_reader_reads_past_a_row_group_its_predicate_empties(tmp_path: Path) -> None:
    from petastorm.predicates import in_lambda

    url = write_unischema_dataset(tmp_path / "ds", [[4, 4, 4]])
    empties_the_second = in_lambda(["id"], lambda row_id: row_id < 4 or row_id >= 8)
    plan, factory = make_shard_factory(
        url,
        0,
        1,
        3,
        reader="row",
        predicate=empties_the_second,
        reader_kwargs={"shuffle_row_groups": False},
    )
    with factory() as shard_pass:
        batches = list(shard_pass)
    assert [row for batch in batches for row in batch["id"].tolist()] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert all(torch.equal(batch["vec"][:, 0].long(), batch["id"]) for batch in batches)
    assert len(batches) == plan.batches_per_rank[0]


@pytest.mark.timeout(120)
def test_replicate_reads_everything_on_every_rank_in_different_orders(
    datasets: dict[str, str],
) -> None:
    orders: dict[tuple[int, int], list[int]] = {}
    world_size = 2  # each rank reads the whole dataset: two show that the orders differ
    for rank in range(world_size):
        plan, factory = make_shard_factory(
            datasets["plain"],
            rank,
            world_size,
            BATCH,
            sharding="replicate",
            loader_kwargs=ONE_THREAD,
        )
        assert plan.rows_per_rank[rank] == TOTAL
        for epoch in (0, 1):
            with factory(epoch=epoch) as shard_pass:
                orders[rank, epoch] = collect(shard_pass).ids
            assert sorted(orders[rank, epoch]) == list(range(TOTAL))
    assert len({tuple(order) for order in orders.values()}) == len(orders), "all orders differ"
    with factory(epoch=1) as shard_pass:
        assert collect(shard_pass).ids == orders[world_size - 1, 1], "seeded: the same again"


@pytest.mark.petastorm
@pytest.mark.timeout(120)
def test_petastorm_shuffle_rows_with_a_predicate_mixes_rows_but_planned_passes_do_not(
    datasets: dict[str, str],
) -> None:
    from petastorm import make_batch_reader

    def wrong_rows(batches: Any) -> int:
        bad = 0
        for batch in batches:
            ids = np.asarray(batch.id if hasattr(batch, "id") else batch["id"])
            values = np.asarray(batch.value if hasattr(batch, "value") else batch["value"])
            bad += int(np.sum(values != ids * 0.5))
            bad += int(np.sum(~keeps(ids)))
        return bad

    options = {"shuffle_rows": True, "seed": 1}
    with make_batch_reader(
        datasets["plain"], predicate=_in_lambda(), reader_pool_type="dummy", **options
    ) as reader:
        assert wrong_rows(reader) > 0, "petastorm 0.12.1 misaligns columns here"
    _, factory = make_shard_factory(
        datasets["plain"],
        0,
        1,
        BATCH,
        predicate=_in_lambda(),
        reader_kwargs=options,
        loader_kwargs=ONE_THREAD,
    )
    with factory() as shard_pass:
        assert wrong_rows(shard_pass) == 0
    _, factory = make_shard_factory(
        datasets["plain"], 0, 1, BATCH, predicate=_in_lambda(), reader_kwargs=options
    )
    with factory() as shard_pass:
        assert wrong_rows(shard_pass) == 0, "with threads too"


@pytest.mark.petastorm
@pytest.mark.timeout(120)
def test_predicate_counts_are_cached_per_predicate(
    datasets: dict[str, str], private_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ddp_even")
    first, _ = make_shard_factory(datasets["plain"], 0, 2, BATCH, predicate=_in_lambda())
    assert any("counted the rows the predicate keeps" in m for m in caplog.messages)
    assert len(list(private_cache.glob("predicate-counts-*.npy"))) == 1
    caplog.clear()
    second, _ = make_shard_factory(datasets["plain"], 1, 2, BATCH, predicate=_in_lambda())
    assert not any("counted the rows" in m for m in caplog.messages), "rank 1 read the cache"
    assert second.total_rows == first.total_rows == len(kept_ids())
    from petastorm.predicates import in_lambda

    make_shard_factory(datasets["plain"], 0, 2, BATCH, predicate=in_lambda(["id"], np.isfinite))
    assert len(list(private_cache.glob("predicate-counts-*.npy"))) == 2, "another predicate"


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_bad_predicates_say_what_is_wrong(datasets: dict[str, str]) -> None:
    from petastorm.predicates import in_lambda

    with pytest.raises(ValueError, match=r"field\(s\) nope, which .* does not have"):
        make_shard_factory(datasets["plain"], 0, 2, BATCH, predicate=in_lambda(["nope"], bool))
    with pytest.raises(
        TypeError, match=r"must be a pyarrow expression .* or a petastorm predicate"
    ):
        make_shard_factory(datasets["plain"], 0, 2, BATCH, predicate=lambda row: True)


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_a_row_group_that_yields_other_rows_than_planned_is_named(tmp_path: Path) -> None:
    from petastorm.transform import TransformSpec

    url = write_plain_dataset(tmp_path / "ds", [[10, 30]])
    # A transform that drops rows: the plan counted the footers' rows. (A file rewritten after
    # planning is refused before the pass reads: tests/test_changed_dataset.py.)
    drops_one = TransformSpec(lambda frame: frame.iloc[1:])
    _, factory = make_shard_factory(
        url,
        1,
        2,
        BATCH,
        sharding="rows",
        reader_kwargs={"transform_spec": drops_one},
        loader_kwargs=THREADS,
    )
    mismatch = (
        # The rank's 20 rows of row group 1 (rank 0 has its first 10 and row group 0's 10).
        r"row group 1 \(.*part-00000.parquet #1\) yielded 19 rows after the transform_spec, "
        "the shard plan counted 20: a transform_spec must keep every row"
    )
    with pytest.raises(RowCountMismatchError, match=mismatch), factory() as shard_pass:
        list(shard_pass)


def train_rows(
    rank: int, world_size: int, url: str, reader: str, sharding: str, predicate: bool
) -> dict[str, Any]:
    """One truncate epoch of a DDP model over ``from_parquet(sharding=...)``; ``reader`` is
    "batch" or "row" (a petastorm predicate, called on a frame or a decoded row) or "arrow"
    (a pyarrow expression predicate)."""
    caught = ddp_even_messages()
    if reader == "arrow":
        import pyarrow.compute as pc

        options: dict[str, Any] = {}
        missing, kept = pc.field("missing") == 1, pc.field("id").isin(kept_ids())
    else:
        from petastorm.predicates import in_lambda

        options = {"reader": reader, "loader_kwargs": THREADS}
        missing, kept = in_lambda(["missing"], bool), _in_lambda()
    try:
        EvenLoader.from_parquet(url, BATCH, predicate=missing, **options)
        bad_predicate = ""
    except ValueError as error:
        bad_predicate = str(error)

    def make() -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url,
            BATCH,
            "truncate",
            sharding=sharding,  # type: ignore[arg-type]
            predicate=kept if predicate else None,
            **options,
        )

    loader = make()
    scans = [m for m in caught if "counted the rows" in m]
    loader = make()  # a second run: the counts come from the cache
    cached = [m for m in caught if "from the cache" in m]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = AllReduceCounter()
    ids: list[int] = []
    steps = 0
    for batch in loader:
        if steps == 0:
            counter.start()
        loss = model(batch["value"].reshape(-1, 1).float() / 1000).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ids += [int(row) for row in batch["id"]]
        steps += 1
    counter.stop()
    return {
        "ids": ids,
        "steps": steps,
        "length": len(loader),
        "collectives_in_epoch": counter.calls,
        "stats": loader.stats.as_dict(),
        "weight": model.module.weight.item(),
        "bad_predicate": bad_predicate,
        "scans": scans,
        "cached": cached,
    }


@pytest.mark.multirank
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("layout", "reader", "sharding", "predicate"),
    [
        pytest.param("plain", "batch", "rows", False, marks=pytest.mark.petastorm),
        pytest.param(
            "unischema",
            "row",
            "rows",
            True,
            marks=pytest.mark.petastorm,
        ),
        pytest.param("plain", "batch", "replicate", True, marks=pytest.mark.petastorm),
        ("plain", "arrow", "rows", True),
        ("plain", "arrow", "replicate", True),
    ],
    ids=[
        "plain-rows",
        "unischema-rows-predicate",
        "plain-replicate-predicate",
        "arrow-rows-predicate",
        "arrow-replicate-predicate",
    ],
)
def test_four_ranks_train_on_equal_shards(
    datasets: dict[str, str],
    layout: str,
    reader: str,
    sharding: str,
    predicate: bool,
    tmp_path: Path,
) -> None:
    env = {"DDP_EVEN_CACHE_DIR": str(tmp_path / "shared-cache")}
    runs = run_ranks(
        train_rows, WORLD_SIZE, datasets[layout], reader, sharding, predicate, env=env, timeout=360
    )
    expected = kept_ids() if predicate else list(range(TOTAL))
    _, plan = plan_for_dataset(datasets[layout], WORLD_SIZE, BATCH, sharding="rows")
    for rank, run in enumerate(runs):
        assert "field(s) missing" in run["bad_predicate"], f"rank {rank}: {run['bad_predicate']}"
        assert run["steps"] == run["length"] == runs[0]["steps"]
        assert run["collectives_in_epoch"] == source_checks(run["steps"]), "no per-step agreement"
        assert run["weight"] == pytest.approx(runs[0]["weight"])
        assert run["stats"]["dropped_batches"][rank] <= 1
        assert run["stats"]["sharding"] == sharding, "the statistics name the sharding"
        if predicate:
            # Each rank counts its share; the cache hit is logged once, by rank 0.
            assert len(run["scans"]) == 1 and len(run["cached"]) == (1 if rank == 0 else 0), run
            assert (
                f"({len(range(rank, plan.num_row_groups, WORLD_SIZE))} on this rank)"
                in run["scans"][0]
            )
    if sharding == "replicate":
        for run in runs:
            assert sorted(run["ids"]) == expected, "every rank trains on every row once"
        assert len({tuple(run["ids"]) for run in runs}) == WORLD_SIZE, "own order per rank"
        return
    trained = sorted(row for run in runs for row in run["ids"])
    dropped = sum(run["stats"]["dropped_rows"][rank] for rank, run in enumerate(runs))
    assert len(trained) + dropped == len(expected)
    assert set(trained) <= set(expected) and len(set(trained)) == len(trained), "no row twice"
    if dropped == 0:
        assert trained == expected, "every row exactly once"


def test_a_plan_beyond_what_an_agreement_carries_is_refused() -> None:
    with pytest.raises(ValueError, match="more than the 4,294,967,295 ddp_even can agree on"):
        plan_shards([2**33, 5], world_size=2, batch_size=1, sharding="rows")
