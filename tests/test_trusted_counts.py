"""Counts ddp_even reuses are checked against what they describe, or are never trusted blindly.

Each case below was reproduced on 0.2 as a one-rank failure mid-epoch or as rows skipped or
trained twice without a word; each now ends in the uninterrupted run's exact batches, a
recomputation, or the same clear error on every rank before the first step.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.datasets import write_plain_dataset
from tests.helpers.spawn import run_ranks

# 17 rows: "rows" sharding gives rank 0 rows 0-7 (2 batches of 4) and rank 1 rows 8-16 (3).
SIZES = [[5, 6], [6]]
BATCH = 4
# The two kinds of row predicate from_parquet takes: petastorm's (in_lambda) and pyarrow's.
PREDICATES = [pytest.param("petastorm", marks=pytest.mark.petastorm), "expression"]


def _ids(batch: Any) -> list[int]:
    return [int(value) for value in batch["id"]]


def _cycle_resumed_after_a_ranks_last_own_batch(
    rank: int, world_size: int, url: str, sync_every: int | None
) -> dict[str, Any]:
    from ddp_even import EvenLoader

    def loader() -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url,
            BATCH,
            "cycle",
            sharding="rows",
            sync_every=sync_every,
            reader_kwargs={"seed": 3},
        )

    torch.manual_seed(0)
    whole = [_ids(batch) for batch in loader()]
    stopped = loader()
    state = None
    for step, _ in enumerate(stopped, start=1):
        if step == 2:  # rank 0 has just handed out its own last batch
            state = stopped.state_dict()
            break
    resumed = loader()
    assert state is not None
    resumed.load_state_dict(state)
    rest = [_ids(batch) for batch in resumed]
    return {"whole": whole, "rest": rest, "stats": resumed.stats.as_dict()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync_every", [None, 1], ids=["known-lengths", "every-step"])
@pytest.mark.multirank
def test_cycle_resumes_right_after_a_ranks_last_own_batch(
    tmp_path: Path, sync_every: int | None
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    results = run_ranks(
        _cycle_resumed_after_a_ranks_last_own_batch, 2, url, sync_every, timeout=200
    )
    for rank, result in enumerate(results):
        assert len(result["whole"]) == 3, "cycle runs the longest shard's 3 steps"
        assert result["rest"] == result["whole"][2:], (rank, result)
    assert results[0]["stats"]["repeated_batches"] == (1, 0)
    assert results[0]["stats"]["resumed_at_step"] == 2


# --- a state loaded into a loader of other data or another reading order (cases 2 and 7) ----


def _keep_all_two_ways(predicates: str) -> tuple[Any, Any]:
    """Two predicates that keep every row: the same rows, another predicate."""
    if predicates == "expression":
        import pyarrow.compute as pc

        return pc.field("id") >= 0, pc.field("id") > -1
    from petastorm.predicates import in_lambda

    return in_lambda(["id"], lambda ids: ids >= 0), in_lambda(["id"], lambda ids: ids > -1)


def _state_loaded_elsewhere(
    rank: int, world_size: int, url: str, other_url: str, change: str, predicates: str
) -> dict[str, Any]:
    from ddp_even import EvenLoader

    def planned(url: str, **reader_kwargs: Any) -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url,
            BATCH,
            "truncate",
            sharding="rows",
            reader_kwargs={"seed": 3, **reader_kwargs},
        )

    def footers(batch_size: int) -> EvenLoader[Any]:
        from petastorm import make_batch_reader
        from petastorm.pytorch import BatchedDataLoader

        def one_pass() -> Any:
            reader = make_batch_reader(
                url, num_epochs=1, cur_shard=rank, shard_count=world_size, workers_count=2
            )
            return BatchedDataLoader(reader, batch_size=batch_size)

        return EvenLoader(one_pass, "truncate")

    if change == "predicate":
        keep_all, keep_all_too = _keep_all_two_ways(predicates)
    saved_by, loaded_by = {
        "seed": (lambda: planned(url), lambda: planned(url, seed=4)),
        "predicate": (
            lambda: planned(url, predicate=keep_all),
            lambda: planned(url, predicate=keep_all_too),
        ),
        "data": (lambda: planned(url), lambda: planned(other_url)),
        "batch_size": (lambda: footers(BATCH), lambda: footers(2 * BATCH)),
    }[change]
    stopped = saved_by()
    state = None
    for step, _ in enumerate(stopped, start=1):
        if step == 1:
            state = stopped.state_dict()
            break
    resumed = loaded_by()
    trained: list[list[int]] = []
    try:
        assert state is not None
        resumed.load_state_dict(state)
        trained = [_ids(batch) for batch in resumed]
    except ValueError as error:
        return {"error": str(error), "trained": trained}
    return {"error": None, "trained": trained}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("change", "predicates"),
    [
        *((change, "expression") for change in ("seed", "predicate", "data")),
        pytest.param("predicate", "petastorm", marks=pytest.mark.petastorm),
        # The wrapped loop whose batch size changes is petastorm's own.
        pytest.param("batch_size", "petastorm", marks=pytest.mark.petastorm),
    ],
)
@pytest.mark.multirank
def test_a_state_of_other_data_or_order_is_refused_on_every_rank_naming_what_differs(
    tmp_path: Path, change: str, predicates: str
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    # The same row-group sizes, other rows: the plan alone cannot tell the two apart.
    other_url = write_plain_dataset(tmp_path / "other", SIZES, partition_by=None)
    Path(other_url.removeprefix("file://"), "part-00001.parquet").rename(
        Path(other_url.removeprefix("file://"), "part-00001b.parquet")
    )
    results = run_ranks(_state_loaded_elsewhere, 2, url, other_url, change, predicates, timeout=250)
    for result in results:
        assert result["trained"] == [], "refused before any step"
        assert result["error"] is not None, result
        assert f"whose {change} differs" in result["error"]


# --- a reader that keeps part of a hive-partitioned directory (case 4) -----------------------


def _partition_kept(rank: int, world_size: int, url: str, how: str) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.predicates import in_lambda
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader

    keep = (
        {"filters": [("part", "=", 1)]}
        if how == "filters"
        else {"predicate": in_lambda(["part"], lambda part: part == 1)}
    )

    def one_pass() -> Any:
        reader = make_batch_reader(
            url, num_epochs=1, cur_shard=rank, shard_count=world_size, workers_count=2, **keep
        )
        return BatchedDataLoader(reader, batch_size=2)

    loader: EvenLoader[Any] = EvenLoader(one_pass, "truncate")
    epochs = [[_ids(batch) for batch in loader] for _ in range(2)]
    return {"epochs": epochs, "stats": loader.stats.as_dict()}


@pytest.mark.petastorm
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["filters", "partition-predicate"])
@pytest.mark.multirank
def test_a_reader_keeping_one_partition_runs_as_built_on_every_rank(
    tmp_path: Path, how: str
) -> None:
    # Partition 1 holds row groups of 5 and 3 rows (ids 10-17): rank 0 reads 5 rows (3 batches
    # of 2), rank 1 reads 3 (2 batches); truncate takes 2 steps on both.
    url = write_plain_dataset(tmp_path / "ds", [[4, 6], [5, 3], [7, 2]], partition_by="part")
    results = run_ranks(_partition_kept, 2, url, how, timeout=200)
    for rank, result in enumerate(results):
        kept = [10, 11, 12, 13, 14] if rank == 0 else [15, 16, 17]
        for epoch in result["epochs"]:
            assert len(epoch) == 2, (rank, epoch)
            assert [row for batch in epoch for row in batch] == (kept[:4] if rank == 0 else kept)
        assert result["stats"] == results[0]["stats"]


# --- the usual loop over a file rewritten between epochs (case 3) ----------------------------


def _rewritten_between_epochs(
    rank: int, world_size: int, url: str, mode: str, rows_after: int
) -> dict[str, Any]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch.distributed as dist
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader

    def one_pass() -> Any:
        reader = make_batch_reader(
            url, num_epochs=1, cur_shard=rank, shard_count=world_size, workers_count=2
        )
        return BatchedDataLoader(reader, batch_size=BATCH)

    loader: EvenLoader[Any] = EvenLoader(one_pass, mode)
    epochs = [[_ids(batch) for batch in loader]]
    dist.barrier()
    if rank == 0:  # the second file's one row group, rewritten with another number of rows
        ids = np.arange(100, 100 + rows_after, dtype=np.int64)
        table = pa.table({"id": ids, "value": (ids * 0.5).astype(np.float32), "label": ids % 3})
        pq.write_table(table, url.removeprefix("file://") + "/part-00001.parquet")
    dist.barrier()
    epochs.append([_ids(batch) for batch in loader])
    return {"epochs": epochs, "stats": [stats.as_dict() for stats in loader.history]}


@pytest.mark.petastorm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["truncate", "cycle"])
@pytest.mark.parametrize("rows_after", [1, 14], ids=["shrunk", "grown"])
@pytest.mark.multirank
def test_footer_lengths_are_worked_out_again_when_a_file_changes_between_epochs(
    tmp_path: Path, mode: str, rows_after: int
) -> None:
    # Round robin over 2 ranks: rank 0 reads row groups 0 (5 rows) and 2 (the second file's),
    # rank 1 row group 1 (6 rows: 2 batches of 4).
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    results = run_ranks(_rewritten_between_epochs, 2, url, mode, rows_after, timeout=250)
    after = [-(-(5 + rows_after) // BATCH), 2]
    steps = min(after) if mode == "truncate" else max(after)
    stats = results[0]["stats"][1]
    for rank, result in enumerate(results):
        assert len(result["epochs"][1]) == steps == stats["steps"][rank], (rank, result)
        assert result["stats"] == results[0]["stats"]
        if mode == "cycle":
            seen = {row for batch in result["epochs"][1] for row in batch}
            wanted = set(range(5)) | set(range(100, 100 + rows_after)) if rank == 0 else None
            assert wanted is None or seen == wanted, "every row of the new data, none missed"
    assert stats["dropped_batches"] == (
        tuple(own - steps for own in after) if mode == "truncate" else (0, 0)
    )
    assert stats["lost_rows"] == (0, 0)


# --- a dataset with a _metadata summary, rewritten (case 6) ----------------------------------


def _rewrite_with_ids_from(root: Path, start: int) -> None:
    """The same files and row-group sizes as SIZES, with ids counted from ``start``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for index, sizes in enumerate(SIZES):
        path = root / f"part-{index:05d}.parquet"
        with pq.ParquetWriter(path, pq.read_schema(path)) as writer:
            for size in sizes:
                ids = np.arange(start, start + size, dtype=np.int64)
                columns = {"id": ids, "value": (ids * 0.5).astype(np.float32), "label": ids % 3}
                writer.write_table(pa.table(columns), row_group_size=size)
                start += size


@pytest.mark.petastorm
def test_a_summary_dataset_rewritten_misses_the_count_cache_and_refuses_an_old_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from petastorm.predicates import in_lambda

    from ddp_even.arrow.passes import make_shard_factory
    from ddp_even.errors import PlanMismatchError
    from tests.helpers.shard_reads import write_summary_metadata

    monkeypatch.setenv("DDP_EVEN_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "ds"
    url = write_plain_dataset(root, SIZES)
    write_summary_metadata(root, common=True)
    below_eight = in_lambda(["id"], lambda ids: ids < 8)

    def kept() -> int:
        plan, _ = make_shard_factory(url, 0, 1, BATCH, predicate=below_eight)
        return plan.total_rows

    assert kept() == 8
    _, old = make_shard_factory(url, 0, 1, BATCH)
    time.sleep(0.01)  # a later modification time on any file system
    _rewrite_with_ids_from(root, 100)  # the same sizes, no id below 8 any more
    write_summary_metadata(root, common=True)
    assert kept() == 0, "counted anew: the cached count (8) belonged to the old data"
    with pytest.raises(PlanMismatchError, match="was rewritten since it was planned"):
        old(0)


# --- property: a resumed epoch is the uninterrupted one, or the state is refused ------------


CHANGES = ("none", "seed", "shuffle_rows", "predicate", "batch_size", "data")
RESUME_MODES = ("truncate", "cycle", "pad", "join")
RESUME_SHARDINGS = ("round_robin", "row_groups", "rows", "replicate")


def _write_resume_datasets(root: Path) -> tuple[str, str]:
    """The dataset, and another with the same files and row-group sizes but other ids."""
    url = write_plain_dataset(root / "ds", SIZES)
    other = write_plain_dataset(root / "other", SIZES)
    _rewrite_with_ids_from(Path(other.removeprefix("file://")), 100)
    return url, other


def _resume_case(
    url: str,
    other: str,
    mode: str,
    sharding: str,
    change: str,
    fraction: float,
    joinables: tuple[Any, ...] = (),
    fewest_on_any_rank: Callable[[int], int] = int,
) -> dict[str, Any]:
    """An uninterrupted epoch; the same epoch stopped at ``fraction`` of its steps and its state
    loaded into a loader built with ``change``; what the resumed loader did (or its refusal).
    ``joinables``: join mode's DDP model (with a process group), which takes a step per batch:
    Join's shadowing needs the ranks still iterating to run the model. ``fewest_on_any_rank``:
    the fewest steps any rank takes (join's differ), so that every rank stops at the same step."""
    from petastorm.predicates import in_lambda

    from ddp_even import EvenLoader

    def loader(changed: bool) -> EvenLoader[Any]:
        kwargs: dict[str, Any] = {"seed": 5, "shuffle_rows": True}
        predicate = in_lambda(["id"], lambda ids: ids >= 0)
        batch_size, dataset = 3, url
        if changed and change == "seed":
            kwargs["seed"] = 6
        if changed and change == "shuffle_rows":
            kwargs["shuffle_rows"] = False
        if changed and change == "predicate":
            predicate = in_lambda(["id"], lambda ids: ids > -1)
        if changed and change == "batch_size":
            batch_size = 4
        if changed and change == "data":
            dataset = other
        return EvenLoader.from_parquet(
            dataset,
            batch_size,
            mode,
            sharding=sharding,
            predicate=predicate,
            reader_kwargs=kwargs,
            joinables=joinables if mode == "join" else (),
        )

    def trained(batches: Iterable[Any]) -> Iterator[list[int]]:
        for batch in batches:
            if mode == "join":
                joinables[0](torch.ones(1, 1)).sum().backward()
            yield _ids(batch)

    whole = list(trained(loader(False)))
    stop = round(fraction * fewest_on_any_rank(len(whole)))
    stopped = loader(False)
    state = stopped.state_dict()
    for step, _ in enumerate(trained(stopped), start=1):
        if step == stop:
            state = stopped.state_dict()
            break
    resumed = loader(True)
    try:
        resumed.load_state_dict(state)
    except ValueError as error:
        return {"stop": stop, "refused": str(error)}
    return {"stop": stop, "refused": None, "rest": list(trained(resumed)), "whole": whole}


def _check_resumed(case: tuple[str, str, str, float], outcomes: list[dict[str, Any]]) -> None:
    """Every rank resumed the uninterrupted epoch exactly, or every rank refused alike."""
    change = case[2]
    assert len({outcome["stop"] for outcome in outcomes}) == 1, case
    stop = outcomes[0]["stop"]
    if change == "none":
        for outcome in outcomes:
            assert outcome["refused"] is None, (case, outcome["refused"])
            assert outcome["rest"] == outcome["whole"][stop:], case
    elif stop > 0:
        refusals = {outcome["refused"] for outcome in outcomes}
        assert len(refusals) == 1, (case, refusals)
        assert re.search(r"differs from this one's|other settings", refusals.pop() or ""), case
    # Between epochs (stop 0) nothing was read: the next epoch may start with other settings.


@pytest.mark.petastorm
@pytest.mark.multirank  # slow: three real petastorm loaders per example
@pytest.mark.timeout(600)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    # Join needs a DDP model, so a process group: the 2-rank test below covers it.
    mode=st.sampled_from([mode for mode in RESUME_MODES if mode != "join"]),
    sharding=st.sampled_from(RESUME_SHARDINGS),
    change=st.sampled_from(CHANGES),
    fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_a_resumed_epoch_is_the_uninterrupted_one_or_the_state_is_refused(
    tmp_path_factory: pytest.TempPathFactory,
    mode: str,
    sharding: str,
    change: str,
    fraction: float,
) -> None:
    url, other = _write_resume_datasets(tmp_path_factory.mktemp("property"))
    case = (mode, sharding, change, fraction)
    _check_resumed(case, [_resume_case(url, other, *case)])


def _resume_cases_on_ranks(
    rank: int, world_size: int, url: str, other: str, cases: list[tuple[str, str, str, float]]
) -> list[dict[str, Any]]:
    import torch.distributed as dist

    def fewest_on_any_rank(steps: int) -> int:
        fewest = torch.tensor([steps])
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        return int(fewest.item())

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    return [
        _resume_case(url, other, *case, joinables=(model,), fewest_on_any_rank=fewest_on_any_rank)
        for case in cases
    ]


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_on_two_ranks_random_changes_resume_exactly_or_are_refused_alike(tmp_path: Path) -> None:
    """The property above on 2 gloo ranks: cases drawn at random (the seed is in the failure),
    all run in one job, each rank's outcome compared with the other's."""
    seed = int(os.environ.get("RESUME_CASES_SEED", random.randrange(2**32)))
    draw = random.Random(seed)
    cases = [
        (
            draw.choice(RESUME_MODES),
            draw.choice(RESUME_SHARDINGS),
            draw.choice(CHANGES),
            draw.random(),
        )
        for _ in range(20)
    ]
    url, other = _write_resume_datasets(tmp_path)
    try:
        per_rank = run_ranks(_resume_cases_on_ranks, 2, url, other, cases, timeout=300)
        for index, case in enumerate(cases):
            _check_resumed(case, [outcomes[index] for outcomes in per_rank])
    except Exception as error:
        # Draw the same cases again with RESUME_CASES_SEED=<seed>.
        raise AssertionError(f"cases drawn with seed {seed}: {cases}") from error


def _resume_a_factory(rank: int, world_size: int, url: str, seeded: bool) -> dict[str, Any]:
    """A factory over petastorm's DataLoader, stopped after 2 steps and resumed by a new loader:
    with petastorm's defaults (shuffled row groups, 10 threads) or seeded on one thread."""
    from petastorm import make_reader
    from petastorm.pytorch import DataLoader

    from ddp_even import EvenLoader
    from tests.helpers.logs import ddp_even_messages

    warnings = ddp_even_messages(logging.WARNING)
    options: dict[str, Any] = {"seed": 7, "workers_count": 1} if seeded else {}

    def loader() -> EvenLoader[Any]:
        return EvenLoader(
            lambda: DataLoader(
                make_reader(url, cur_shard=rank, shard_count=world_size, num_epochs=1, **options),
                batch_size=2,
            ),
            "truncate",
        )

    stopped = loader()
    for step, _ in enumerate(stopped, start=1):
        if step == 2:
            state = stopped.state_dict()
            break
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [_ids(batch) for batch in resumed]
    return {"warnings": warnings, "rest": rest}


@pytest.mark.petastorm
@pytest.mark.timeout(240)
@pytest.mark.multirank
def test_resuming_a_reader_that_cannot_replay_warns_once_on_rank_0_with_the_recipe(
    tmp_path: Path,
) -> None:
    """Petastorm's defaults hand row groups out in another order every pass: the resumed rest
    is not the interrupted run's, and rank 0 says so once, naming the deterministic recipe."""
    url = write_plain_dataset(tmp_path / "data", [[4, 4, 4, 4]])
    defaults = run_ranks(_resume_a_factory, 2, url, False, timeout=200)
    seeded = run_ranks(_resume_a_factory, 2, url, True, timeout=200)
    replay_warnings = [
        [message for message in rank["warnings"] if "is not the interrupted run's" in message]
        for rank in defaults
    ]
    assert len(replay_warnings[0]) == 1 and replay_warnings[1] == []
    assert "it shuffles row groups without a seed" in replay_warnings[0][0]
    assert "reader_kwargs={'seed': 7}" in replay_warnings[0][0]
    for rank in seeded:
        assert not [m for m in rank["warnings"] if "is not the interrupted run's" in m]
    # Both resumed and trained the rest of the epoch (2 row groups of 4 per rank: 4 steps).
    assert [len(rank["rest"]) for rank in defaults + seeded] == [2, 2, 2, 2]


def _resume_from_parquet(rank: int, world_size: int, url: str, seeded: bool) -> dict[str, Any]:
    """``from_parquet`` stopped after 2 steps and resumed by a new loader: with the readers'
    defaults (row groups shuffled without a seed) or a seed; and an uninterrupted epoch."""
    from ddp_even import EvenLoader
    from tests.helpers.logs import ddp_even_messages

    warnings = ddp_even_messages(logging.WARNING)

    def loader() -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url, 2, "truncate", reader_kwargs={"seed": 7} if seeded else None
        )

    uninterrupted = [_ids(batch) for batch in loader()]
    stopped, before = loader(), []
    for batch in stopped:
        before.append(_ids(batch))
        if len(before) == 2:
            state = stopped.state_dict()
            break
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [_ids(batch) for batch in resumed]
    return {"warnings": warnings, "epoch": before + rest, "uninterrupted": uninterrupted}


@pytest.mark.timeout(240)
@pytest.mark.multirank
def test_a_planned_reader_shuffling_without_a_seed_warns_on_resume_and_a_seeded_one_is_exact(
    tmp_path: Path,
) -> None:
    url = write_plain_dataset(tmp_path / "data", [[4, 4, 4, 4, 4, 4, 4, 4]])
    defaults = run_ranks(_resume_from_parquet, 2, url, False, timeout=200)
    seeded = run_ranks(_resume_from_parquet, 2, url, True, timeout=200)
    replay_warnings = [
        [message for message in rank["warnings"] if "is not the interrupted run's" in message]
        for rank in defaults
    ]
    assert len(replay_warnings[0]) == 1 and replay_warnings[1] == [], replay_warnings
    assert "without a seed" in replay_warnings[0][0]
    assert "reader_kwargs={'seed': 7}" in replay_warnings[0][0]
    for rank in seeded:
        assert not [m for m in rank["warnings"] if "is not the interrupted run's" in m]
        assert rank["epoch"] == rank["uninterrupted"]


# --- a predicate's cached counts, in a new job after an edit --------------------------------

# The user's module, with either kind of predicate.
KEEP_BELOW_MODULE = {
    "petastorm": """
from petastorm.predicates import in_lambda

LIMIT = {limit}


def keep(ids):
    return ids < LIMIT


PREDICATE = in_lambda(["id"], keep)
""",
    "expression": """
import pyarrow.compute as pc

LIMIT = {limit}

PREDICATE = pc.field("id") < LIMIT
""",
}


def _job_with_a_module_predicate(
    rank: int, world_size: int, url: str, module_path: str
) -> dict[str, Any]:
    """A job whose predicate comes from the user's own module (as a process pool needs it):
    one cycle epoch on every rank, and what ddp_even said about the count cache."""
    import importlib.util

    from ddp_even import EvenLoader
    from tests.helpers.logs import ddp_even_messages

    messages = ddp_even_messages(logging.INFO)
    spec = importlib.util.spec_from_file_location("user_predicates", module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loader = EvenLoader.from_parquet(url, BATCH, "cycle", predicate=module.PREDICATE)
    trained = sorted({row for batch in loader for row in _ids(batch)})
    cached = any("from the cache" in message for message in messages)
    return {"trained": trained, "cached": cached}


@pytest.mark.timeout(400)
@pytest.mark.multirank
@pytest.mark.parametrize("edit", ["predicate", "summary-dataset"])
@pytest.mark.parametrize("predicates", PREDICATES)
def test_a_new_job_after_an_edit_counts_anew_and_trains_what_is_kept_on_every_rank(
    tmp_path: Path, edit: str, predicates: str
) -> None:
    """Case 5 (a predicate edited in the user's module) and case 6 (a dataset with a
    ``_metadata`` summary rewritten with other values): the second job on 2 ranks misses the
    first job's cached counts and trains exactly the rows kept now, with no rank failing."""
    from tests.helpers.shard_reads import write_summary_metadata

    root = tmp_path / "ds"
    url = write_plain_dataset(root, SIZES)
    if edit == "summary-dataset":
        write_summary_metadata(root, common=True)
    env = {"DDP_EVEN_CACHE_DIR": str(tmp_path / "cache")}
    first = tmp_path / "first.py"
    first.write_text(KEEP_BELOW_MODULE[predicates].replace("{limit}", "12"))

    def job(module: Path) -> list[dict[str, Any]]:
        return run_ranks(_job_with_a_module_predicate, 2, url, str(module), env=env, timeout=200)

    before = job(first)
    assert sorted(row for rank in before for row in rank["trained"]) == list(range(12))
    again = job(first)
    assert any(rank["cached"] for rank in again), "an unchanged job reuses the counts"
    if edit == "predicate":
        changed = tmp_path / "edited.py"  # a new job imports the edited file
        changed.write_text(KEEP_BELOW_MODULE[predicates].replace("{limit}", "15"))
        kept = list(range(15))
    else:
        time.sleep(0.01)  # a later modification time on any file system
        _rewrite_with_ids_from(root, 5)  # the same sizes; ids 5..21, so 7 of them below 12
        write_summary_metadata(root, common=True)
        changed, kept = first, list(range(5, 12))
    after = job(changed)
    assert not any(rank["cached"] for rank in after), "the stale counts were used"
    assert sorted(row for rank in after for row in rank["trained"]) == kept
