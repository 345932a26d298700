"""Elastic resume: an epoch interrupted on 4 ranks finishes on 3, every row read once.

Phase 1 trains a DDP model on 4 gloo ranks over ``EvenLoader.from_parquet`` and stops after
``STOP_AT`` steps, keeping each rank's loader state and the model (as a preempted job's last
checkpoint would). Phase 2 starts 3 new ranks that load those states and finish the epoch: the
rows no rank had read are re-planned over the 3 ranks. Real petastorm readers, real Parquet.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_even import EvenLoader
from ddp_even.planning import plan_shards
from ddp_even.planning.pass_order import PassOrder
from ddp_even.planning.plans import plan_rows
from tests.helpers.datasets import flat_sizes, write_plain_dataset
from tests.helpers.logs import ddp_even_messages
from tests.helpers.spawn import run_ranks

SIZES = [[30, 7, 55], [12, 90, 3], [41, 20, 9, 33]]
TOTAL = sum(flat_sizes(SIZES))
BATCH = 8
STOP_AT = 5
IN_PLAN_ORDER = {"shuffle_row_groups": False}
# Row groups and rows shuffled by ddp_even with a seed, four threads: also an order it knows.
SEEDED = {"seed": 7, "shuffle_row_groups": True, "shuffle_rows": True}


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=25),
    old_world=st.integers(1, 9),
    new_world=st.integers(1, 9),
    batch=st.integers(1, 7),
    step=st.integers(0, 30),
    sharding=st.sampled_from(["round_robin", "row_groups", "rows"]),
)
def test_the_unread_rows_are_replanned_once_each(
    sizes: list[int], old_world: int, new_world: int, batch: int, step: int, sharding: Any
) -> None:
    old = plan_shards(sizes, old_world, batch, sharding=sharding)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    read: Counter[int] = Counter()
    for rank in range(old_world):
        ranges = {g: (a, b) for g, a, b in old.row_ranges_of(rank)}
        rows = [
            starts[g] + row
            for g in old.shards[rank]
            for row in range(*ranges.get(g, (0, sizes[g])))
        ]
        read.update(rows[: min(step, old.batches_per_rank[rank]) * batch])
    unread = old.unread_rows(sizes, step, PassOrder(), epoch=0)
    rest = plan_rows(unread, sizes, new_world, batch)
    replanned: Counter[int] = Counter()
    for rank in range(new_world):
        for group, start, stop in rest.row_ranges_of(rank):
            assert group in rest.shards[rank]
            replanned.update(starts[group] + row for row in range(start, stop))
    assert read + replanned == Counter(range(sum(sizes))), "every row once, read or re-planned"
    assert max(rest.rows_per_rank) - min(rest.rows_per_rank) <= 1


def train(
    rank: int,
    world_size: int,
    url: str,
    mode: str,
    sharding: str,
    states: list[dict[str, Any]] | None,
    stop_at: int | None = STOP_AT,
    reader_kwargs: dict[str, Any] = IN_PLAN_ORDER,
) -> dict[str, Any]:
    messages = ddp_even_messages(logging.DEBUG)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = EvenLoader.from_parquet(
        url,
        BATCH,
        mode,
        sharding=sharding,  # type: ignore[arg-type]
        joinables=[model] if mode == "join" else (),
        reader_kwargs=reader_kwargs,
    )
    if states is not None:
        loader.load_state_dict(states[rank])  # one of the old ranks' states: the same step
        model.module.load_state_dict(states[rank]["model"])
    ids: list[int] = []
    for steps, batch in enumerate(loader, start=1):
        loss = model(batch["value"].reshape(-1, 1).float() / 100).pow(2).mean()
        optimizer.zero_grad()
        (loss * loader.batch_weight).backward()
        optimizer.step()
        if not loader.padding:  # pad mode: a copy of a row already trained on
            ids += [int(row) for row in batch["id"]]
        if states is None and steps == stop_at:
            state = loader.state_dict()
            state["model"] = {k: v.clone() for k, v in model.module.state_dict().items()}
            return {"ids": ids, "state": state}
    stats = loader.stats.as_dict()
    next_epoch = [int(row) for batch in loader if not loader.padding for row in batch["id"]]
    return {
        "ids": ids,
        "messages": messages,
        "stats": stats,
        "length": len(loader),
        "next_epoch_ids": next_epoch,
        "next_stats": loader.stats.as_dict(),
    }


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_plain_dataset(tmp_path_factory.mktemp("elastic") / "data", SIZES)


@pytest.mark.multirank
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("mode", "sharding"),
    # Pad over petastorm's round robin: rank 3's 4 batches end before the stop, it pads. Share
    # over it (17/6/12/4 batches): rank 3 has run out and receives rank 0's by then.
    [
        ("truncate", "rows"),
        ("join", "row_groups"),
        ("pad", "round_robin"),
        ("share", "round_robin"),
    ],
    ids=str,
)
def test_an_epoch_stopped_on_4_ranks_finishes_on_3(url: str, mode: str, sharding: str) -> None:
    options = (url, mode, sharding)
    first = run_ranks(train, 4, *options, None, STOP_AT, IN_PLAN_ORDER, timeout=200)
    states = [run["state"] for run in first]
    assert {state["step"] for state in states} == {STOP_AT}
    second = run_ranks(train, 3, *options, states[:3], STOP_AT, IN_PLAN_ORDER, timeout=200)
    stats = second[0]["stats"]
    assert stats["resumed_at_step"] == STOP_AT and stats["resumed_from_world_size"] == 4
    assert stats["epoch"] == 0 and stats["world_size"] == 3
    trained = Counter(row for run in first + second for row in run["ids"])
    assert max(trained.values()) == 1, "no row trained on twice"
    dropped = sum(stats["dropped_rows"])
    assert sum(trained.values()) + dropped == TOTAL, "the rest: trained, or dropped and counted"
    if mode in ("join", "pad", "share"):
        assert dropped == 0 and sorted(trained) == list(range(TOTAL)), "every row once"
    else:
        assert max(stats["dropped_batches"]) <= 1
    # The next epoch is a whole one, planned for 3 ranks.
    for run in second:
        assert run["next_stats"]["epoch"] == 1
        assert run["next_stats"]["resumed_at_step"] is None
    next_epoch = Counter(row for run in second for row in run["next_epoch_ids"])
    assert max(next_epoch.values()) == 1
    assert sum(next_epoch.values()) + sum(second[0]["next_stats"]["dropped_rows"]) == TOTAL


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_share_cut_mid_hand_over_resumes_exactly_on_as_many_ranks(url: str) -> None:
    options = (url, "share", "round_robin")
    uninterrupted = run_ranks(train, 4, *options, None, None, timeout=200)
    first = run_ranks(train, 4, *options, None, timeout=200)
    resumed = run_ranks(train, 4, *options, [run["state"] for run in first], timeout=200)
    plan = plan_shards(flat_sizes(SIZES), 4, BATCH, sharding="round_robin")
    assert plan.batches_per_rank[3] < STOP_AT, "rank 3 ran out before the cut"
    assert len(first[3]["ids"]) > plan.rows_per_rank[3], "and trained on another rank's rows"
    for rank in range(4):
        # The same batches and statistics as the uninterrupted run's.
        assert first[rank]["ids"] + resumed[rank]["ids"] == uninterrupted[rank]["ids"]
        assert resumed[rank]["stats"] == {
            **uninterrupted[rank]["stats"],
            "resumed_at_step": STOP_AT,
        }


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_what_cannot_resume_on_another_number_of_ranks_says_why(url: str) -> None:
    states = [run["state"] for run in run_ranks(train, 2, url, "truncate", "rows", None)]
    # This process is a job of one rank.
    for words, loader in (
        (
            "cycle mode repeats rows",
            EvenLoader.from_parquet(
                url, BATCH, "cycle", sharding="rows", reader_kwargs=IN_PLAN_ORDER
            ),
        ),
        (
            "row groups are shuffled without a seed",
            EvenLoader.from_parquet(url, BATCH, "truncate", sharding="rows"),
        ),
        (
            "with sharding='replicate' every rank reads every row",
            EvenLoader.from_parquet(url, BATCH, "truncate", sharding="replicate"),
        ),
        (
            "other settings",
            EvenLoader.from_parquet(
                url, BATCH, "truncate", sharding="row_groups", reader_kwargs=IN_PLAN_ORDER
            ),
        ),
    ):
        with pytest.raises(ValueError, match=words):
            loader.load_state_dict(states[0])
    resumed = EvenLoader.from_parquet(
        url, BATCH, "truncate", sharding="rows", reader_kwargs=IN_PLAN_ORDER
    )
    resumed.load_state_dict(states[1])
    rows = [int(row) for batch in resumed for row in batch["id"]]
    assert resumed.stats.resumed_from_world_size == 2
    again = resumed.state_dict()
    assert again["epoch"] == 1 and again["step"] == 0
    # A state saved inside an epoch that itself resumed elsewhere is refused.
    nested = dict(states[1], resumed_from_world_size=4)
    with pytest.raises(ValueError, match="had itself resumed"):
        EvenLoader.from_parquet(
            url, BATCH, "truncate", sharding="rows", reader_kwargs=IN_PLAN_ORDER
        ).load_state_dict(nested)
    assert len(rows) == len(set(rows))


def _torchrun(
    ranks: int, out: Path, url: str, mode: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    job = Path(__file__).parent / "helpers" / "elastic_job.py"
    command = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",
        "--monitor-interval=0.2",
        str(job),
        str(out),
        url,
        mode,
        *extra,
    ]
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=200, check=False
    )


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.long
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("mode", "sharding"),
    # Share over the round robin (17/6/12/4 batches): rank 3 runs out at the checkpoint.
    [("join", ()), ("share", ("--round-robin",))],
    ids=["join", "share"],
)
def test_a_job_killed_on_4_ranks_under_torchrun_finishes_its_epoch_on_3(
    url: str, tmp_path: Path, mode: str, sharding: tuple[str, ...]
) -> None:
    from tests.helpers.elastic_job import _common_checkpoint_step

    killed = _torchrun(4, tmp_path, url, mode, "--kill", *sharding)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    step = _common_checkpoint_step(tmp_path)
    assert step is not None and step > 0
    before = [torch.load(tmp_path / f"ckpt-{step}-rank{rank}.pt")["trained"] for rank in range(4)]
    resumed = _torchrun(3, tmp_path, url, mode, *sharding)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = [json.loads((tmp_path / f"trained-{rank}.json").read_text()) for rank in range(3)]
    trained = sorted(row for ids in before + after for row in ids)
    assert trained == list(range(TOTAL)), "every row of the epoch trained on exactly once"
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["resumed_at_step"] == step and stats["resumed_from_world_size"] == 4


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_on_as_many_ranks_a_planned_reader_starts_where_it_stopped(url: str) -> None:
    uninterrupted = run_ranks(train, 2, url, "truncate", "rows", None, None, timeout=120)
    first = run_ranks(train, 2, url, "truncate", "rows", None, timeout=120)
    states = [run["state"] for run in first]
    resumed = run_ranks(train, 2, url, "truncate", "rows", states, timeout=120)
    rows_per_rank = TOTAL // 2
    for rank in range(2):
        # The same batches and statistics as the uninterrupted run's.
        assert first[rank]["ids"] + resumed[rank]["ids"] == uninterrupted[rank]["ids"]
        assert resumed[rank]["stats"] == {
            **uninterrupted[rank]["stats"],
            "resumed_at_step": STOP_AT,
        }
        # Reading cost: only the rows not yet trained on.
        unread = rows_per_rank - STOP_AT * BATCH
        assert f"this rank reads only its {unread} rows not yet read" in " ".join(
            resumed[rank]["messages"]
        )
        assert "read 0 batch(es) of this rank's source again" in " ".join(resumed[rank]["messages"])


# Rows the readers of this process produced (before a rank's range is cut from a row group).
_PRODUCED: list[int] = []


def _record(rows: Any) -> Any:
    """A petastorm transform that notes which rows were read (reading threads: this process)."""
    _PRODUCED.extend(int(row) for row in rows["id"])
    return rows


def resume_in_one_job(rank: int, world_size: int, url: str) -> dict[str, Any]:
    """An uninterrupted epoch, the same epoch stopped after ``STOP_AT`` steps, and its resume
    by a new loader: three loaders in one job, reading with ``SEEDED``."""
    from petastorm.transform import TransformSpec

    messages = ddp_even_messages(logging.DEBUG)

    def loader() -> EvenLoader[Any]:
        options = {**SEEDED, "transform_spec": TransformSpec(_record)}
        return EvenLoader.from_parquet(
            url, BATCH, "truncate", sharding="rows", reader_kwargs=options
        )

    whole = loader()
    uninterrupted = [[int(row) for row in batch["id"]] for batch in whole]
    stopped = loader()
    epoch = iter(stopped)
    for _ in range(STOP_AT):
        next(epoch)
    state = stopped.state_dict()
    epoch.close()  # its reader stopped and joined: no more rows produced
    _PRODUCED.clear()
    resumed = loader()
    resumed.load_state_dict(state)
    after = [[int(row) for row in batch["id"]] for batch in resumed]
    return {
        "uninterrupted": uninterrupted,
        "uninterrupted_stats": whole.stats.as_dict(),
        "resumed": after,
        "resumed_stats": resumed.stats.as_dict(),
        "produced": list(_PRODUCED),
        "messages": messages,
    }


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_seeded_threaded_reader_resumes_where_it_stopped_reading_only_the_rest(
    url: str,
) -> None:
    runs = run_ranks(resume_in_one_job, 2, url, timeout=200)
    sizes = flat_sizes(SIZES)
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    for run in runs:
        # The same batches and statistics as the uninterrupted run's.
        assert run["resumed"] == run["uninterrupted"][STOP_AT:]
        assert run["resumed_stats"] == {**run["uninterrupted_stats"], "resumed_at_step": STOP_AT}
        assert "read 0 batch(es) of this rank's source again" in " ".join(run["messages"])
        # What the reader produced (the transform sees the rank's rows of each row group it
        # reads): every row not yet trained on, once, and nothing of a row group trained on
        # before.
        untrained = [row for batch in run["uninterrupted"][STOP_AT:] for row in batch]
        groups = sorted(set(group_of[untrained].tolist()))
        in_those_groups = {
            row for group in groups for row in range(starts[group], starts[group] + sizes[group])
        }
        produced = Counter(run["produced"])
        assert set(produced.values()) == {1}
        assert set(untrained) <= set(produced) <= in_those_groups
    first_batch = runs[0]["uninterrupted"][0]
    assert first_batch != sorted(first_batch), "the test must shuffle"


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_seeded_threaded_epoch_stopped_on_3_ranks_finishes_on_2_every_row_once(
    url: str,
) -> None:
    first = run_ranks(train, 3, url, "join", "rows", None, STOP_AT, SEEDED, timeout=200)
    states = [run["state"] for run in first]
    second = run_ranks(train, 2, url, "join", "rows", states[:2], STOP_AT, SEEDED, timeout=200)
    stats = second[0]["stats"]
    assert stats["resumed_at_step"] == STOP_AT and stats["resumed_from_world_size"] == 3
    trained = sorted(row for run in first + second for row in run["ids"])
    assert trained == list(range(TOTAL)), "every row of the epoch trained on exactly once"
    assert first[0]["ids"] != sorted(first[0]["ids"]), "the test must shuffle"
