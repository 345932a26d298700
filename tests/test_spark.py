"""petastorm's Spark front doors with a real local Spark: ``make_spark_converter`` and
``materialize_dataset``.

One Spark session for the whole run (``tests/conftest.py``) writes skewed DataFrames once:
through the converter (10 partitions of 1 to 40 rows, one row group each; another with several
row groups per file; one with 2 row groups; one deleted before training) and through
``materialize_dataset`` with a Unischema (``ScalarCodec`` scalars, an ``NdarrayCodec`` array).
Then 4 gloo ranks train a DDP model over them in every mode. The ranks start no Spark: the
converter is pickled to them (it is a plain object) and the materialized dataset is read with
``make_reader``. Expectations come from pyarrow reading the files in the order petastorm numbers
their row groups: ``converter.file_urls`` as given (Spark's unsorted order), a directory's
files sorted (``tests/helpers/spark.py``).

Tests that need Spark are marked ``spark``, those that spawn ranks ``multirank`` too; the one
test of a plain context-manager factory needs neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from ddp_even import EvenLoader
from ddp_even.cli import main as cli
from ddp_even.errors import ConverterDeletedError, TooFewRowGroupsError
from ddp_even.parquet import plan_for_dataset
from ddp_even.petastorm.sources import row_groups_read_by
from ddp_even.petastorm.spark_converter import ConverterSource, converter_files
from tests.helpers.spark import (
    VEC_SIZE,
    materialize_unischema,
    round_robin_ids,
    row_group_ids,
    shard_ids,
    skewed_dataframe,
    sorted_data_files,
)
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.petastorm

WORLD_SIZE = 4
# 152 rows in 10 partitions; which rank gets which depends on Spark's file order.
SIZES = [40, 5, 25, 3, 30, 7, 12, 1, 20, 9]
BATCH_SIZE = 8


@dataclass(frozen=True)
class SparkData:
    """What the parent wrote with Spark; pickled to the ranks as it is."""

    converter: Any
    # Several row groups per file (a 1 KB Parquet block size).
    multi_row_group: Any
    # Two row groups: fewer than the ranks.
    too_small: Any
    # Deleted with converter.delete() before any training.
    deleted: Any
    unischema_url: str


@pytest.fixture(scope="module")
def data(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> SparkData:
    from petastorm.spark import make_spark_converter

    deleted = make_spark_converter(skewed_dataframe(spark, [3, 4, 5, 6, 7]))
    deleted.delete()
    return SparkData(
        converter=make_spark_converter(skewed_dataframe(spark, SIZES)),
        multi_row_group=make_spark_converter(
            skewed_dataframe(spark, [450, 250, 130]), parquet_row_group_size_bytes=1024
        ),
        too_small=make_spark_converter(skewed_dataframe(spark, [6, 9])),
        deleted=deleted,
        unischema_url=materialize_unischema(
            spark, tmp_path_factory.mktemp("materialized") / "data", SIZES
        ),
    )


# --- Plans against what petastorm reads (one process) ----------------------------------------


def _read_shard(context_or_loader: Any) -> tuple[list[int], int, frozenset[int] | None]:
    """Ids and batches of one petastorm pass, and the row groups its reader read."""
    with context_or_loader as loader:
        ids: list[int] = []
        batches = 0
        for batch in loader:
            ids += [int(i) for i in batch["id"]]
            batches += 1
        return sorted(ids), batches, row_groups_read_by(loader.reader)


@pytest.mark.spark
@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", ["converter", "multi_row_group"])
def test_plans_of_a_converter_are_what_make_torch_dataloader_reads(
    data: SparkData, which: str
) -> None:
    converter = getattr(data, which)
    files = converter_files(converter)
    assert files == list(converter.file_urls)  # petastorm's order, not sorted
    if which == "multi_row_group":
        assert len(row_group_ids(files)) > len(files), "expected several row groups per file"
    for world_size in (2, WORLD_SIZE):
        row_groups, plan = plan_for_dataset(files, world_size, BATCH_SIZE)
        assert row_groups.source == "footers"
        expected = round_robin_ids(files, world_size)
        for rank in range(world_size):
            ids, batches, read = _read_shard(
                converter.make_torch_dataloader(
                    batch_size=BATCH_SIZE,
                    num_epochs=1,
                    cur_shard=rank,
                    shard_count=world_size,
                    workers_count=1,
                )
            )
            assert ids == expected[rank]
            assert read == frozenset(plan.shards[rank])
            assert len(ids) == plan.rows_per_rank[rank]
            assert batches == plan.batches_per_rank[rank] == math.ceil(len(ids) / BATCH_SIZE)


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_plans_of_a_materialized_dataset_are_what_make_reader_reads(data: SparkData) -> None:
    from petastorm import make_reader
    from petastorm.pytorch import DataLoader

    url = data.unischema_url
    files = sorted_data_files(url)
    assert len(files) == len(SIZES)
    row_groups, plan = plan_for_dataset(url, WORLD_SIZE, BATCH_SIZE)
    # Spark's output: part files, _SUCCESS, Hadoop's .crc files, and the _common_metadata
    # that materialize_dataset wrote with the row groups per file.
    assert row_groups.source == "_common_metadata"
    assert list(row_groups.files) == files
    assert row_groups.num_rows.tolist() == SIZES
    expected = round_robin_ids(files, WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        reader = make_reader(
            url, num_epochs=1, cur_shard=rank, shard_count=WORLD_SIZE, workers_count=1
        )
        ids, batches, read = _read_shard(DataLoader(reader, batch_size=BATCH_SIZE))
        assert ids == expected[rank]
        assert read == frozenset(plan.shards[rank])
        assert (len(ids), batches) == (plan.rows_per_rank[rank], plan.batches_per_rank[rank])


@pytest.mark.spark
@pytest.mark.timeout(120)
def test_ddp_even_plan_on_converter_files_and_a_materialized_dataset(data: SparkData) -> None:
    files = converter_files(data.converter)
    for dataset, ordered in (
        (files, files),
        ([data.unischema_url], sorted_data_files(data.unischema_url)),
    ):
        args = ["plan", *dataset, "-w", str(WORLD_SIZE), "-b", str(BATCH_SIZE), "--json"]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        expected = round_robin_ids(ordered, WORLD_SIZE)
        assert document["plan"]["rows_per_rank"] == [len(ids) for ids in expected]


# --- Errors (one process) -------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.timeout(120)
def test_a_deleted_converter_is_refused_at_once(data: SparkData) -> None:
    for build in (
        lambda: EvenLoader(data.deleted),
        lambda: ConverterSource(data.deleted, batch_size=4),
        lambda: EvenLoader.from_parquet(data.deleted, batch_size=4),
    ):
        with pytest.raises(ConverterDeletedError, match=r"converter.delete\(\)"):
            build()
    # A factory of petastorm's context managers: at the first pass, not after petastorm's 30 s.
    started = time.monotonic()
    loader = EvenLoader(lambda: data.deleted.make_torch_dataloader(batch_size=4, num_epochs=1))
    with pytest.raises(ConverterDeletedError):
        next(iter(loader))
    assert time.monotonic() - started < 10


@pytest.mark.spark
@pytest.mark.timeout(120)
def test_a_converter_is_checked_when_the_source_is_made(data: SparkData) -> None:
    source = ConverterSource(data.too_small, batch_size=4)
    with pytest.raises(TooFewRowGroupsError, match=r"df\.repartition\(4\)"):
        source.check_shard(0, WORLD_SIZE)
    with pytest.raises(ValueError, match="do not pass cur_shard"):
        ConverterSource(data.converter, cur_shard=0)
    with pytest.raises(ValueError, match="unknown option"):
        ConverterSource(data.converter, batchsize=4)
    with pytest.raises(TypeError, match="serves one pass"):
        EvenLoader(data.converter.make_torch_dataloader())
    # Alone (no process group): the whole DataFrame, petastorm's default batch size of 32.
    loader = EvenLoader(data.converter)
    assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(sum(SIZES)))
    assert loader.stats.own_batches == (math.ceil(sum(SIZES) / 32),)


@pytest.mark.timeout(60)
def test_a_factory_may_return_any_context_manager() -> None:
    """Each pass enters it and exits it at its end, at a break, at an exception (no Spark)."""
    events: list[str] = []

    @contextlib.contextmanager
    def one_pass() -> Iterator[list[list[int]]]:
        events.append("enter")
        try:
            yield [[1], [2], [3]]
        finally:
            events.append("exit")

    loader = EvenLoader(one_pass, mode="cycle", steps_per_epoch=5)
    assert list(loader) == [[1], [2], [3], [1], [2]]
    assert events == ["enter", "exit", "enter", "exit"]
    events.clear()
    for _ in loader:
        break
    assert events == ["enter", "exit"]
    events.clear()
    with pytest.raises(KeyError):
        for _ in loader:
            raise KeyError("the training step failed")
    assert events == ["enter", "exit"]


# --- Training on 4 ranks --------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    # converter: ConverterSource; converter_factory: a factory of make_torch_dataloader
    # contexts; converter_planned: from_parquet(converter, sharding="row_groups");
    # unischema_factory: DataLoader(make_reader(...)); unischema_planned: from_parquet(url,
    # reader="row", sharding="row_groups"); too_small*, deleted*: the error cases.
    source: str
    mode: str = "truncate"
    epochs: int = 2
    # In epoch 0, every rank leaves the loop after this many steps, or raises at this step.
    break_after: int | None = None
    raise_at: int | None = None


@dataclass
class Seen:
    epochs: list[list[list[int]]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    error: tuple[str, str] | None = None
    error_after_s: float = 0.0
    # Reading threads (petastorm's, the pyarrow reader's) alive after each epoch's loop was left
    # (readers not stopped).
    leaked: list[list[str]] = field(default_factory=list)
    vec_matches_id: bool = True
    final_weight: list[float] = field(default_factory=list)
    # The case's time on this rank, to tell a slow case from slow rank start-up.
    seconds: float = 0.0


def _petastorm_threads() -> list[str]:
    return [
        thread.name
        for thread in threading.enumerate()
        if type(thread).__module__.startswith("petastorm")
        or "ventilat" in thread.name
        or thread.name.startswith("ddp_even-arrow")
    ]


def _loader(
    case: Case, data: SparkData, rank: int, world_size: int, model: torch.nn.Module
) -> EvenLoader[Any]:
    from petastorm import make_reader
    from petastorm.pytorch import DataLoader

    options: dict[str, Any] = {
        "joinables": [model] if case.mode == "join" else (),
        "timeout": 60,
    }

    def contexts(converter: Any) -> Any:
        return lambda: converter.make_torch_dataloader(
            batch_size=BATCH_SIZE,
            num_epochs=1,
            cur_shard=rank,
            shard_count=world_size,
            workers_count=2,
        )

    if case.source == "converter":
        source = ConverterSource(data.converter, batch_size=BATCH_SIZE, workers_count=2)
        return EvenLoader(source, case.mode, **options)
    if case.source == "converter_factory":
        return EvenLoader(contexts(data.converter), case.mode, **options)
    if case.source == "unischema_factory":
        return EvenLoader(
            lambda: DataLoader(
                make_reader(
                    data.unischema_url,
                    num_epochs=1,
                    cur_shard=rank,
                    shard_count=world_size,
                    workers_count=2,
                ),
                batch_size=BATCH_SIZE,
            ),
            case.mode,
            **options,
        )
    planned: dict[str, Any] = {
        "batch_size": BATCH_SIZE,
        "mode": case.mode,
        "sharding": "row_groups",
        "loader_kwargs": {"threads": 2},
        **options,
    }
    if case.source == "converter_planned":
        return EvenLoader.from_parquet(data.converter, **planned)
    if case.source == "unischema_planned":
        return EvenLoader.from_parquet(data.unischema_url, reader="row", **planned)
    if case.source == "too_small":
        return EvenLoader(data.too_small, case.mode, **options)
    if case.source == "too_small_factory":
        return EvenLoader(contexts(data.too_small), case.mode, **options)
    if case.source == "deleted":
        return EvenLoader(data.deleted, case.mode, **options)
    if case.source == "deleted_factory":
        return EvenLoader(contexts(data.deleted), case.mode, **options)
    if case.source == "deleted_planned":
        return EvenLoader.from_parquet(data.deleted, **planned)
    raise AssertionError(case.source)


class _Planned(Exception):
    """Raised in the loop by a case that asks for it, to leave the epoch on every rank."""


def _run_case(case: Case, data: SparkData, rank: int, world_size: int) -> Seen:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    seen = Seen()
    started = time.monotonic()
    try:
        loader = _loader(case, data, rank, world_size, model)
        for epoch in range(case.epochs):
            batches: list[list[int]] = []
            try:
                for batch in loader:
                    ids = [int(i) for i in batch["id"]]
                    if "vec" in batch:
                        vec = batch["vec"]
                        expected = torch.tensor(ids, dtype=vec.dtype).unsqueeze(1)
                        matches = vec.shape == (len(ids), VEC_SIZE) and bool(
                            (vec == expected).all()
                        )
                        seen.vec_matches_id = seen.vec_matches_id and matches
                    loss = model(batch["value"].float().reshape(-1, 1)).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    batches.append(ids)
                    if epoch == 0 and len(batches) == case.raise_at:
                        raise _Planned
                    if epoch == 0 and len(batches) == case.break_after:
                        break
            except _Planned:
                pass
            seen.leaked.append(_petastorm_threads())
            seen.epochs.append(batches)
        seen.stats = [dataclasses.asdict(stats) for stats in loader.history]
    except Exception as error:
        seen.error = (type(error).__name__, str(error))
        seen.error_after_s = time.monotonic() - started
    seen.final_weight = [param.item() for param in model.module.parameters()]
    seen.seconds = time.monotonic() - started
    return seen


def run_cases(rank: int, world_size: int, cases: list[Case], data: SparkData) -> list[Seen]:
    # petastorm drives pyarrow 14 through its deprecated API (a dozen warnings per reader) and
    # hands torch read-only arrays: noise on the ranks' stderr, which pytest does not capture.
    warnings.simplefilter("ignore", FutureWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    results = []
    for case in cases:
        results.append(_run_case(case, data, rank, world_size))
        dist.barrier()
    return results


TRAINING = [
    Case("converter", "truncate"),
    Case("converter", "cycle"),
    Case("converter", "join"),
    Case("converter_factory", "cycle"),
    Case("converter_factory", "truncate", break_after=1),
    Case("converter_factory", "join", raise_at=1),
    Case("converter_planned", "truncate"),
    Case("unischema_factory", "truncate"),
    Case("unischema_factory", "cycle"),
    Case("unischema_factory", "join", epochs=1),
    Case("unischema_planned", "cycle", epochs=1),
]
ERRORS = [
    Case("too_small", epochs=1),
    Case("too_small_factory", "cycle", epochs=1),
    Case("deleted", epochs=1),
    Case("deleted_factory", epochs=1),
    Case("deleted_planned", epochs=1),
]
CASES = TRAINING + ERRORS


@pytest.fixture(scope="module")
def trained(data: SparkData) -> dict[Case, list[Seen]]:
    """Every case on the same 4 ranks, one case after the other."""
    per_rank = run_ranks(run_cases, WORLD_SIZE, CASES, data, timeout=400)
    return {case: [results[index] for results in per_rank] for index, case in enumerate(CASES)}


def _own_ids(case: Case, data: SparkData) -> list[list[int]]:
    """What each rank's shard holds, from the files alone (and the plan, for planned cases)."""
    if case.source.startswith("converter"):
        files = list(data.converter.file_urls)
    else:
        files = sorted_data_files(data.unischema_url)
    if not case.source.endswith("planned"):
        return round_robin_ids(files, WORLD_SIZE)
    _, plan = plan_for_dataset(files, WORLD_SIZE, BATCH_SIZE, sharding="row_groups")
    return shard_ids(row_group_ids(files), plan.shards)


def _check_training(case: Case, results: list[Seen], data: SparkData) -> None:
    for seen in results:
        assert seen.error is None, (case, seen.error)
        assert seen.leaked == [[]] * case.epochs, (case, "a petastorm reader was left running")
        assert seen.vec_matches_id
    assert len({tuple(seen.final_weight) for seen in results}) == 1, "DDP replicas diverged"
    own = _own_ids(case, data)
    own_batches = [math.ceil(len(ids) / BATCH_SIZE) for ids in own]
    assert all(own_batches), (case, "every rank has data")
    steps = {"truncate": [min(own_batches)] * WORLD_SIZE, "cycle": [max(own_batches)] * WORLD_SIZE}
    expected_steps = steps.get(case.mode, own_batches)
    for epoch in range(case.epochs):
        if epoch == 0 and case.break_after is not None:
            assert [len(seen.epochs[0]) for seen in results] == [case.break_after] * WORLD_SIZE
            continue
        if epoch == 0 and case.raise_at is not None:
            assert [len(seen.epochs[0]) for seen in results] == [case.raise_at] * WORLD_SIZE
            continue
        stats = results[0].stats[-case.epochs + epoch]
        every_row: list[int] = []
        for rank, seen in enumerate(results):
            assert seen.stats[-case.epochs + epoch] == stats, "statistics differ between ranks"
            rows = [i for batch in seen.epochs[epoch] for i in batch]
            every_row += rows
            assert len(seen.epochs[epoch]) == expected_steps[rank] == stats["steps"][rank]
            assert stats["samples"][rank] == len(rows)
            if case.mode == "cycle":
                assert set(own[rank]) <= set(rows), "cycle hands out every own row"
                assert set(rows) <= set(own[rank])
            else:
                assert len(rows) == len(set(rows)) and set(rows) <= set(own[rank])
        if case.mode == "join":
            assert sorted(every_row) == list(range(sum(SIZES))), "join: every row once"


@pytest.mark.multirank
@pytest.mark.spark
@pytest.mark.timeout(480)
def test_ddp_over_a_converter_in_every_mode(
    trained: dict[Case, list[Seen]], data: SparkData
) -> None:
    for case in TRAINING:
        if case.source.startswith("converter"):
            _check_training(case, trained[case], data)


@pytest.mark.multirank
@pytest.mark.spark
@pytest.mark.timeout(480)
def test_ddp_over_a_materialized_dataset_in_every_mode(
    trained: dict[Case, list[Seen]], data: SparkData
) -> None:
    for case in TRAINING:
        if case.source.startswith("unischema"):
            _check_training(case, trained[case], data)


@pytest.mark.multirank
@pytest.mark.spark
@pytest.mark.timeout(480)
def test_converter_errors_reach_every_rank(trained: dict[Case, list[Seen]]) -> None:
    expected = {
        "too_small": "TooFewRowGroupsError",
        "too_small_factory": "TooFewRowGroupsError",
        "deleted": "ConverterDeletedError",
        "deleted_factory": "ConverterDeletedError",
        "deleted_planned": "ConverterDeletedError",
    }
    for case in ERRORS:
        results = trained[case]
        errors = {seen.error for seen in results}
        assert len(errors) == 1, (case, errors)
        (error,) = errors
        assert error is not None and error[0] == expected[case.source], (case, error)
        # Said at once (not after petastorm's 30 s wait for missing files), with what to do.
        assert max(seen.error_after_s for seen in results) < 20
        assert "repartition" in error[1] or "make_spark_converter(df)" in error[1]
