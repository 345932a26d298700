"""Checkpoint and resume mid-epoch: the state format, and resumed epochs on real gloo ranks.

A resumed epoch must hand out exactly the batches the uninterrupted run would have handed out
after the checkpoint, with the same statistics, and later epochs must continue the numbering.
The kill test (a real ``torchrun --max-restarts`` job with a SIGKILLed rank) is in
``tests/test_resume_torchrun.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddp_even import EvenLoader
from ddp_even.modes import MODES
from tests.helpers.scenarios import NoJoin, shard, train_step
from tests.helpers.spawn import run_ranks

# ---------------------------------------------------------------------------------------------
# The state format (one process)


def _loader(mode: str = "cycle", **options: Any) -> EvenLoader[Any]:
    joinables = [NoJoin()] if mode == "join" else ()
    return EvenLoader([[1], [2], [3], [4]], mode, joinables=joinables, **options)


@pytest.mark.timeout(30)
def test_the_state_is_plain_data_and_round_trips() -> None:
    loader = _loader()
    epoch = iter(loader)
    next(epoch), next(epoch)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state  # ints and strings only
    assert state["version"] == 4 and state["epoch"] == 0 and state["step"] == 2
    assert state["provenance"] is None, "a list: nothing known of where its batches come from"
    assert state["world_size"] == 1 and state["rank"] == 0
    resumed = _loader()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # before iterating, it says where it will resume
    assert list(resumed) == [[3], [4]]
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["step"] == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_resumed_epoch_has_the_uninterrupted_statistics(mode: str) -> None:
    options: dict[str, Any] = {"steps_per_epoch": 7} if mode == "cycle" else {}
    whole = _loader(mode, **options)
    expected = list(whole)
    interrupted = _loader(mode, **options)
    epoch = iter(interrupted)
    before = [next(epoch) for _ in range(3)]
    state = interrupted.state_dict()
    resumed = _loader(mode, **options)
    resumed.load_state_dict(state)
    assert before + list(resumed) == expected
    uninterrupted = whole.stats.as_dict()
    after = resumed.stats.as_dict()
    assert after.pop("resumed_at_step") == 3 and uninterrupted.pop("resumed_at_step") is None
    assert after == uninterrupted


@pytest.mark.timeout(30)
def test_a_state_saved_between_epochs_starts_the_next_epoch() -> None:
    loader = _loader()
    list(loader)
    resumed = _loader()
    resumed.load_state_dict(loader.state_dict())
    assert list(resumed) == [[1], [2], [3], [4]]
    assert resumed.stats.epoch == 1 and resumed.stats.resumed_at_step is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"version": 99}, "format version 99"),
        ({"format": "something else"}, "not an EvenLoader state"),
        ({"settings": "mode=join steps_per_epoch=None sync_every=1"}, "other settings"),
        ({"world_size": 4}, "saved on 4 ranks, and this job has 1"),
        ({"step": -1}, "step must be an int >= 0"),
    ],
)
def test_a_state_that_does_not_fit_is_refused(change: dict[str, Any], words: str) -> None:
    loader = _loader()
    next(iter(loader))
    state = {**loader.state_dict(), **change}
    with pytest.raises(ValueError, match=words):
        _loader().load_state_dict(state)


@pytest.mark.timeout(30)
def test_a_state_from_another_mode_is_refused() -> None:
    loader = _loader("truncate")
    next(iter(loader))
    with pytest.raises(ValueError, match=r"mode=truncate.*mode=cycle"):
        _loader("cycle").load_state_dict(loader.state_dict())


# ---------------------------------------------------------------------------------------------
# On gloo ranks: interrupted at a checkpoint, resumed by new processes


LENGTHS = (5, 9, 3)


def _source(rank: int, kind: str) -> Any:
    batches = shard(rank, LENGTHS[rank])
    return batches if kind == "list" else (lambda: iter(batches))


def _options(mode: str, model: Any) -> dict[str, Any]:
    return {"joinables": [model]} if mode == "join" else {"timeout": 30}


def _run_case(
    rank: int, mode: str, kind: str, stop_at: int | None, state_dir: Path
) -> dict[str, Any]:
    """Two epochs; with ``stop_at``, checkpoint after every step of epoch 0 and stop at that
    step (the job is lost there); with ``stop_at=None`` and checkpoints, resume from them."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Linear(1, 1)
    saved = state_dir / f"rank-{rank}.pt"
    checkpoint = torch.load(saved) if stop_at is None and saved.exists() else None
    if checkpoint is not None:
        module.load_state_dict(checkpoint["model"])
    # DDP starts every replica from rank 0's weights: a rank that had run out (join) saved
    # its last checkpoint earlier than the others.
    model = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader: EvenLoader[Any] = EvenLoader(_source(rank, kind), mode, **_options(mode, model))
    if checkpoint is not None:
        loader.load_state_dict(checkpoint["loader"])
    seen: list[list[list[int]]] = []
    for epoch in range(loader.state_dict()["epoch"], 2):
        seen.append([])
        for batch in loader:
            train_step(model, optimizer, batch, loader.batch_weight)
            seen[-1].append(batch)
            if stop_at is not None and epoch == 0:
                state = {"loader": loader.state_dict(), "model": module.state_dict()}
                torch.save(state, saved)
                (state_dir / f"seen-{rank}.json").write_text(json.dumps(seen))
                if len(seen[-1]) == stop_at:
                    return {"seen": seen}
    return {
        "seen": seen,
        "stats": [stats.as_dict() for stats in loader.history],
        "weights": [value for param in model.parameters() for value in param.reshape(-1).tolist()],
    }


# Join last: in the interrupted run, a rank that ran out before the stop is still shadowing
# the others when they stop, and fails then, as it would in a lost job.
CASES = [
    ("truncate", "factory", 2),
    ("cycle", "list", 6),
    ("cycle", "factory", 4),
    # Ranks 0 and 2 are past their data at the stop: resumed, they read it again to pad.
    ("pad", "factory", 6),
    ("join", "list", 4),
]


def _run_worker(
    rank: int, world_size: int, interrupt: bool, state_root: str
) -> list[dict[str, Any]]:
    return [
        _run_case(
            rank, mode, kind, stop_at if interrupt else None, Path(state_root, f"{mode}-{kind}")
        )
        for mode, kind, stop_at in CASES
    ]


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_epochs_resumed_by_new_processes_continue_where_they_stopped(tmp_path: Path) -> None:
    for mode, kind, _ in CASES:
        (tmp_path / "states" / f"{mode}-{kind}").mkdir(parents=True)
    states = str(tmp_path / "states")
    whole = run_ranks(_run_worker, 3, False, str(tmp_path / "none"), timeout=120)
    run_ranks(_run_worker, 3, True, states, timeout=120, capture_exceptions=True)
    second = run_ranks(_run_worker, 3, False, states, timeout=120)
    for index, (mode, kind, stop_at) in enumerate(CASES):
        for rank in range(3):
            uninterrupted = whole[rank][index]["seen"]
            saved_at = min(stop_at, LENGTHS[rank]) if mode == "join" else stop_at
            before = json.loads(
                (tmp_path / "states" / f"{mode}-{kind}" / f"seen-{rank}.json").read_text()
            )
            assert before == [uninterrupted[0][:saved_at]], (mode, kind, rank)
            resumed = second[rank][index]
            resumed_epoch, next_epoch = resumed["seen"]
            assert resumed_epoch == uninterrupted[0][saved_at:], (mode, kind, rank)
            assert next_epoch == uninterrupted[1]
            stats = [dict(epoch) for epoch in resumed["stats"]]
            expected = [dict(epoch) for epoch in whole[rank][index]["stats"]]
            assert stats[0].pop("resumed_at_step") == stop_at
            expected[0].pop("resumed_at_step")
            assert stats == expected, (mode, kind, rank)
            assert resumed["weights"] == pytest.approx(whole[rank][index]["weights"])


@pytest.mark.timeout(60)
def test_pad_reads_its_shard_again_rather_than_start_at_the_step() -> None:
    """Padding copies the last batch before it: a factory taking ``start_batch`` is still read
    from its start when a pad epoch resumes, here past the end of its data."""
    calls: list[int] = []

    def batches(start_batch: int = 0) -> list[list[int]]:
        calls.append(start_batch)
        return [[index] for index in range(start_batch, 3)]

    whole = list(EvenLoader(batches, mode="pad", steps_per_epoch=6))
    loader = EvenLoader(batches, mode="pad", steps_per_epoch=6)
    epoch = iter(loader)
    seen = [next(epoch) for _ in range(4)]
    resumed = EvenLoader(batches, mode="pad", steps_per_epoch=6)
    resumed.load_state_dict(loader.state_dict())
    calls.clear()
    rest = list(resumed)
    assert calls == [0], "one pass, from its start"
    assert seen + rest == whole == [[0], [1], [2], [2], [2], [2]]
    assert resumed.stats.padded_batches == (3,) and resumed.stats.own_batches == (3,)
    assert [resumed.padding_at(step) for step in (4, 5)] == [True, True]


@pytest.mark.timeout(60)
def test_a_factory_that_starts_at_a_batch_reads_nothing_again() -> None:
    calls: list[int] = []

    def batches(start_batch: int = 0) -> list[list[int]]:
        calls.append(start_batch)
        return [[index] for index in range(start_batch, 10)]

    loader = EvenLoader(batches, mode="truncate")
    epoch = iter(loader)
    seen = [next(epoch) for _ in range(4)]
    state = loader.state_dict()
    resumed = EvenLoader(batches, mode="truncate")
    resumed.load_state_dict(state)
    calls.clear()
    rest = list(resumed)
    assert calls == [4], "one pass, started at the saved step"
    assert seen + rest == [[index] for index in range(10)]
    assert resumed.stats.steps == (10,) and resumed.stats.own_batches == (10,)
    assert resumed.stats.resumed_at_step == 4
    assert resumed.stats.samples == (None,), "rows of the batches not read again are unknown"
    assert list(resumed) == [[index] for index in range(10)] and calls == [4, 0]
