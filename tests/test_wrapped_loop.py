"""The loop users already have, ``EvenLoader(lambda: BatchedDataLoader(make_batch_reader(url,
cur_shard=rank, shard_count=world_size)))``, guarded like ``from_parquet``: on real gloo ranks,
real Parquet files, real petastorm readers, a DDP model taking optimizer steps.

* Readers whose shards leave row groups unread, or read some twice while others are skipped,
  stop every rank with the same :class:`~ddp_even.ShardCoverageError` before the first step,
  in every mode and epoch shape, whether the user passes a factory, a loader or a reader.
  Every rank reading every row group (no sharding) trains.
* Process-pool readers (``reader_pool_type="process"``) train in every mode, wrapped (beside
  ``from_parquet``'s own reader on the same job); a resume of such a loop is refused, since the
  pool hides its workers' settings, unless ``strict=False``.
* A resumed epoch is the uninterrupted one on every rank, in every mode, also with a rank
  whose shard is empty (pad: it pads with another rank's batch before and after the resume).
* A resume into a loop built otherwise is refused alike on every rank, in every mode.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_even.modes import MODES
from tests.helpers.datasets import shard_ids, shard_row_groups, write_plain_dataset
from tests.helpers.spawn import run_ranks

pytestmark = [pytest.mark.petastorm, pytest.mark.multirank]

WORLD_SIZE = 2
SIZES = [30, 30, 30, 30, 20, 10]
BATCH = 8


def _trained(loader: Any, model: Any, steps: list[list[int]] | None = None) -> list[list[int]]:
    """The ``id`` values of every batch, each trained on by the DDP ``model`` (pad: weighted),
    appended to ``steps`` as they come."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    seen = [] if steps is None else steps
    for batch in loader:
        loss = model(batch["value"].reshape(-1, 1).float()).pow(2).mean()
        (loss * loader.batch_weight).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append([int(value) for value in batch["id"]])
    return seen


def _outcome(make_loader: Any, model: Any) -> dict[str, Any]:
    """What the loader ``make_loader()`` builds trained on, or the error it stopped with and
    after how many steps."""
    steps: list[list[int]] = []
    try:
        _trained(make_loader(), model, steps)
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error), "steps": len(steps)}
    return {"error": None, "ids": sorted(i for batch in steps for i in batch), "steps": len(steps)}


# ---------------------------------------------------------------------------------------------
# Shards that leave rows unread


#: name -> (cur_shard, shard_count) per rank (None: no sharding), how it is passed, mode, options
COVERAGE_CASES: dict[str, tuple[Any, str, str, dict[str, Any]]] = {
    "shard_count=3": ({0: (0, 3), 1: (1, 3)}, "factory", "truncate", {}),
    "shard_count=4": ({0: (0, 4), 1: (1, 4)}, "factory", "truncate", {}),
    "cur_shard=0 on every rank": ({0: (0, 2), 1: (0, 2)}, "factory", "truncate", {}),
    "one rank unsharded": ({0: (0, 2), 1: None}, "factory", "truncate", {}),
    "cycle": ({0: (0, 3), 1: (1, 3)}, "factory", "cycle", {}),
    "pad": ({0: (0, 3), 1: (1, 3)}, "factory", "pad", {}),
    "join": ({0: (0, 3), 1: (1, 3)}, "factory", "join", {}),
    "sync_every=2": ({0: (0, 3), 1: (1, 3)}, "factory", "truncate", {"sync_every": 2}),
    "a predicate": ({0: (0, 3), 1: (1, 3)}, "factory", "truncate", {"predicate": True}),
    "a loader passed in": ({0: (0, 3), 1: (1, 3)}, "loader", "truncate", {}),
    "a reader passed in": ({0: (0, 3), 1: (1, 3)}, "reader", "cycle", {}),
    # Accepted: the ranks read the dataset once between them, or all of it each.
    "cur_shard=rank, shard_count=2": ({0: (0, 2), 1: (1, 2)}, "factory", "join", {}),
    "no sharding": ({0: None, 1: None}, "factory", "join", {}),
}


def _keep_all(ids: Any) -> Any:
    return ids >= 0


def _coverage_worker(rank: int, world_size: int, url: str) -> dict[str, dict[str, Any]]:
    from petastorm import make_batch_reader
    from petastorm.predicates import in_lambda
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    outcomes = {}
    for name, (shards, passed, mode, options) in COVERAGE_CASES.items():
        reader_options: dict[str, Any] = {"num_epochs": 1, "workers_count": 2}
        if shards[rank] is not None:
            reader_options["cur_shard"], reader_options["shard_count"] = shards[rank]
        loader_options = dict(options)
        if loader_options.pop("predicate", False):
            reader_options["predicate"] = in_lambda(["id"], _keep_all)
        if mode == "join":
            loader_options["joinables"] = [model]

        def one_pass(reader_options: dict[str, Any] = reader_options) -> Any:
            return BatchedDataLoader(make_batch_reader(url, **reader_options), batch_size=BATCH)

        source: Any = one_pass
        if passed == "loader":
            source = one_pass()
        elif passed == "reader":
            source = make_batch_reader(url, **reader_options)
        outcomes[name] = _outcome(
            lambda source=source, mode=mode, options=loader_options: EvenLoader(
                source, mode, **options
            ),
            model,
        )
        if passed == "reader":
            source.stop()
            source.join()
    return outcomes


@pytest.mark.timeout(300)
def test_readers_that_leave_row_groups_unread_or_read_twice_stop_every_rank_alike(
    tmp_path: Path,
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    ranks = run_ranks(_coverage_worker, WORLD_SIZE, url, timeout=240)
    everything = set(range(len(SIZES)))
    for name, (shards, _, _, _) in COVERAGE_CASES.items():
        outcomes = [ranks[rank][name] for rank in range(WORLD_SIZE)]
        read = {
            rank: set(
                range(len(SIZES))
                if shards[rank] is None
                else shard_row_groups(len(SIZES), shards[rank][1], shards[rank][0])
            )
            for rank in range(WORLD_SIZE)
        }
        unread = everything - read[0] - read[1]
        # Ranks reading the same row groups read them as every rank would (no sharding),
        # which leaves the rest unread; otherwise the ones they share are read twice.
        twice = read[0] & read[1] if read[0] != read[1] else set()
        if not unread and (not twice or read[0] == read[1] == everything):
            # Accepted: every row once over the ranks (join), or every row on every rank.
            for rank, outcome in enumerate(outcomes):
                assert outcome["error"] is None, (name, outcome)
                expected = (
                    shard_ids(SIZES, 1, 0)
                    if shards[rank] is None
                    else shard_ids(SIZES, WORLD_SIZE, rank)
                )
                assert outcome["ids"] == expected, name
            continue
        assert [outcome["error"] for outcome in outcomes] == ["ShardCoverageError"] * 2, (
            name,
            outcomes,
        )
        assert outcomes[0]["message"] == outcomes[1]["message"], name
        assert all(outcome["steps"] == 0 for outcome in outcomes), "before the first step"
        message = outcomes[0]["message"]
        if unread:
            assert f"row group(s) {sorted(unread)} are read by no rank" in message, message
        for index in sorted(twice):
            assert f"{index} (ranks 0/1)" in message, message
        assert "cur_shard=rank, shard_count=2" in message


# ---------------------------------------------------------------------------------------------
# Process pools


def _process_pool_worker(rank: int, world_size: int, url: str) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader, StateMismatchError

    def one_pass(workers_count: int = 1) -> Any:
        reader = make_batch_reader(
            url,
            num_epochs=1,
            cur_shard=rank,
            shard_count=world_size,
            reader_pool_type="process",
            workers_count=workers_count,
            shuffle_row_groups=False,
        )
        return BatchedDataLoader(reader, batch_size=BATCH)

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    joinables = {"join": [model]}
    outcomes: dict[str, Any] = {}
    for mode in MODES:
        wrapped = EvenLoader(one_pass, mode, joinables=joinables.get(mode, []))
        outcomes[f"wrapped {mode}"] = (_trained(wrapped, model), wrapped.stats.as_dict())
    two = EvenLoader(lambda: one_pass(workers_count=2), "join", joinables=[model])
    outcomes["wrapped join, 2 workers"] = (_trained(two, model), two.stats.as_dict())
    for mode in ("truncate", "join"):
        planned = EvenLoader.from_parquet(
            url,
            BATCH,
            mode,
            reader_kwargs={"seed": 3},
            joinables=joinables.get(mode, []),
        )
        outcomes[f"from_parquet {mode}"] = (_trained(planned, model), planned.stats.as_dict())
    # Resuming: the pool hides its workers' seed and transform, so the state cannot be checked.
    stopped = EvenLoader(one_pass, "truncate")
    epoch = iter(stopped)
    first = [[int(i) for i in next(epoch)["id"]] for _ in range(2)]
    state = stopped.state_dict()
    del epoch
    refused = EvenLoader(one_pass, "truncate")
    refused.load_state_dict(state)
    try:
        _trained(refused, model)
    except StateMismatchError as error:
        outcomes["refused"] = sorted(error.untold)
    anyway = EvenLoader(one_pass, "truncate")
    anyway.load_state_dict(state, strict=False)
    outcomes["resumed anyway"] = first + _trained(anyway, model)
    outcomes["uninterrupted"] = _trained(EvenLoader(one_pass, "truncate"), model)
    return outcomes


@pytest.mark.long
@pytest.mark.timeout(420)
def test_process_pool_readers_train_in_every_mode_and_their_resume_is_refused(
    tmp_path: Path,
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    ranks = run_ranks(_process_pool_worker, WORLD_SIZE, url, timeout=360)
    batches = [-(-len(shard_ids(SIZES, WORLD_SIZE, rank)) // BATCH) for rank in range(WORLD_SIZE)]
    assert len(set(batches)) > 1, "the test needs uneven shards"
    for rank, outcomes in enumerate(ranks):
        own = shard_ids(SIZES, WORLD_SIZE, rank)
        for case in (*(f"wrapped {mode}" for mode in MODES), "wrapped join, 2 workers"):
            seen, stats = outcomes[case]
            ids = sorted(i for batch in seen for i in batch)
            mode = case.split()[1].rstrip(",")
            steps = {"truncate": min(batches), "join": batches[rank]}.get(mode, max(batches))
            assert len(seen) == steps, case
            if mode in ("pad", "join"):
                assert sorted(set(ids)) == own, case  # every row (pad: then padding)
                assert stats["samples"][rank] - stats["padded_rows"][rank] == len(own), case
            elif mode == "cycle":
                assert set(ids) == set(own), case
        for mode in ("truncate", "join"):
            seen, stats = outcomes[f"from_parquet {mode}"]
            assert stats["lost_rows"][rank] == 0, mode
            if mode == "join":
                assert sorted(i for batch in seen for i in batch) == own
        assert {"seed", "transform_spec", "shuffle_rows"} <= set(outcomes["refused"])
        assert outcomes["resumed anyway"] == outcomes["uninterrupted"]


# ---------------------------------------------------------------------------------------------
# A resumed epoch is the uninterrupted one, also with an empty shard


def _resume_worker(rank: int, world_size: int, url: str) -> dict[str, Any]:
    """Every mode over lists; pad, whose rank 2 has no batch at all, also through
    ``from_parquet`` (2 row groups, 3 ranks). Stopped after 2 steps, resumed."""
    from ddp_even import EvenLoader

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    stop = 2
    results: dict[str, Any] = {}
    for mode in MODES:
        joinables = [model] if mode == "join" else []
        # Pad's rank 2 is empty; in the other modes every rank takes at least ``stop`` steps.
        lengths = (5, 3, 0) if mode == "pad" else (5, 3, 3)
        rows = [
            {"id": torch.arange(4) + 100 * rank + 4 * step, "value": torch.ones(4)}
            for step in range(lengths[rank])
        ]
        makers = {"list": functools.partial(EvenLoader, rows, mode, joinables=joinables)}
        if mode == "pad":
            makers["from_parquet"] = functools.partial(
                EvenLoader.from_parquet,
                url,
                4,
                mode,
                sharding="row_groups",
                reader_kwargs={"shuffle_row_groups": False},
            )
        for kind, make in makers.items():
            whole = make()
            expected = _marked(whole, model)
            stopped = make()
            epoch = iter(stopped)
            for _ in range(stop):
                next(epoch)
                model(torch.ones(1, 1)).sum().backward()
            state = stopped.state_dict()
            del epoch
            resumed = make()
            resumed.load_state_dict(state)
            results[f"{mode} {kind}"] = {
                "expected": expected[stop:],
                "got": _marked(resumed, model, start=stop),
                "stats": (whole.stats.as_dict(), resumed.stats.as_dict()),
            }
    return results


def _marked(loader: Any, model: Any, start: int = 0) -> list[tuple[list[int], bool, float]]:
    """Each step's ids, whether it is padding (asked by step, as Lightning asks), its weight."""
    marked = []
    for step, batch in enumerate(loader, start=start):
        model(torch.ones(1, 1)).sum().backward()
        marked.append(
            ([int(i) for i in batch["id"]], loader.padding_at(step), loader.batch_weight_at(step))
        )
    return marked


@pytest.mark.timeout(300)
def test_a_resumed_epoch_is_the_uninterrupted_one_on_every_rank_even_an_empty_one(
    tmp_path: Path,
) -> None:
    # Three ranks, the last with no row group (sharding="row_groups": 2 row groups, 3 ranks).
    url = write_plain_dataset(tmp_path / "ds", [20, 12])
    ranks = run_ranks(_resume_worker, 3, url, timeout=240)
    for rank, results in enumerate(ranks):
        assert len(results) == len(MODES) + 1, sorted(results)
        for case, result in results.items():
            assert result["got"] == result["expected"], (rank, case)
            whole, resumed = result["stats"]
            assert resumed.pop("resumed_at_step") == 2 and whole.pop("resumed_at_step") is None
            assert resumed == whole, (rank, case)


# ---------------------------------------------------------------------------------------------
# A resume into another loop, on every rank and in every mode


def _changed_resume_worker(rank: int, world_size: int, url: str) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader, StateMismatchError

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))

    def loop(mode: str, seed: int = 1, batch_size: int = BATCH) -> Any:
        def one_pass() -> Any:
            reader = make_batch_reader(
                url,
                num_epochs=1,
                cur_shard=rank,
                shard_count=world_size,
                seed=seed,
                shuffle_row_groups=True,
                workers_count=1,
            )
            return BatchedDataLoader(reader, batch_size=batch_size)

        return EvenLoader(one_pass, mode, joinables=[model] if mode == "join" else [])

    outcomes: dict[str, Any] = {}
    for mode in MODES:
        for change, options in {
            "none": {},
            "seed": {"seed": 2},
            "batch_size": {"batch_size": 4},
        }.items():
            whole = _trained(loop(mode), model)
            stopped = loop(mode)
            epoch = iter(stopped)
            for _ in range(2):
                next(epoch)
                model(torch.ones(1, 1)).sum().backward()
            state = stopped.state_dict()
            del epoch
            resumed = loop(mode, **options)
            resumed.load_state_dict(state)
            try:
                rest = _trained(resumed, model)
            except StateMismatchError as error:
                outcomes[f"{mode} {change}"] = ("refused", error.differ)
            else:
                outcomes[f"{mode} {change}"] = ("resumed", rest == whole[2:])
    return outcomes


@pytest.mark.timeout(300)
def test_a_resume_into_another_loop_is_refused_alike_on_every_rank_in_every_mode(
    tmp_path: Path,
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    ranks = run_ranks(_changed_resume_worker, WORLD_SIZE, url, timeout=240)
    for mode in MODES:
        for rank in range(WORLD_SIZE):
            assert ranks[rank][f"{mode} none"] == ("resumed", True), (mode, rank)
            assert ranks[rank][f"{mode} seed"] == ("refused", ("seed",)), (mode, rank)
            assert ranks[rank][f"{mode} batch_size"] == ("refused", ("batch_size",)), (mode, rank)
