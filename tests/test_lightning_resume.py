"""Resuming through Lightning's own checkpoints, mid-epoch, with an EvenLoader as train loader.

Lightning 2.x keeps the ``state_dict()`` of every train dataloader that has ``state_dict`` and
``load_state_dict`` (``lightning.fabric.utilities.types._Stateful``) in its checkpoint (key
``loops.fit_loop.state_dict.combined_loader``, rank 0's, as only rank 0 writes the file) and
hands it to ``load_state_dict`` on every rank when ``trainer.fit(ckpt_path=...)`` resumes. One
job (``tests/helpers/lightning_resume_job.py``, 2 CPU ranks, ``strategy="ddp"``) trains each
mode and source uninterrupted, then stops at a checkpoint (``ModelCheckpoint(
every_n_train_steps=K)``) and resumes from it in a fresh fit: mid first epoch, mid second
epoch and at the last batch of the second epoch. The resumed job must train exactly the
uninterrupted job's batches, in order, on every rank, end with its weights, and report its
statistics. The ``parquet`` source (``EvenLoader.from_parquet`` with seeded row-group and row
shuffles read by three threads) resumes mid second epoch.

Share adds the hand-over: every rank takes 7 steps an epoch (the 14 batches over 2 ranks), and
once rank 1 has run out of its 5 batches rank 0 hands it every other one of its own. Its
positions fall inside that hand-over (mid first and second epoch, and its last batch), and
right after rank 1's last own batch, where the resumed epoch replays its hand-overs and then
goes on. Its loader knows no length (but from a plan), so Lightning reads ahead in every epoch
of a list as of a factory.

Lightning alone resumes exactly only where the loader's position at the checkpoint is the one
Lightning resumes at; the ``recipe`` variant adds
``ddp_even.integrations.lightning.EvenLoaderCheckpoints``, which rewrites the saved loader
state to Lightning's position, and resumes exactly everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.datasets import shard_ids, write_plain_dataset
from tests.helpers.lightning_and_accelerate import PYTHON, REPO, launch, read_ranks, skip_without
from tests.helpers.lightning_resume_data import BATCH_SIZE, BATCHES, EPOCHS, PARQUET_ROW_GROUPS

# In one worker (scripts/test.sh's --dist loadgroup), so that the module's one job runs once,
# not once in each worker that gets one of its tests.
pytestmark = [
    pytest.mark.petastorm,
    pytest.mark.multirank,
    pytest.mark.xdist_group("lightning-resume"),
    pytest.mark.skipif(sys.platform != "linux", reason="Linux"),
]


@pytest.fixture(autouse=True, scope="module")
def _lightning_installed() -> None:
    skip_without("lightning")


JOB = REPO / "tests" / "helpers" / "lightning_resume_job.py"
WORLD_SIZE = len(BATCHES)
MODES = ("truncate", "cycle", "share")
# "list": the loader knows its length once an epoch has started; "factory" never does.
SOURCES = ("list", "factory")
# Global steps to checkpoint and stop at: mid first epoch, mid second epoch (in cycle, rank 1
# is then in its repeated pass) and the last batch of the second epoch (5 steps an epoch in
# truncate, 9 in cycle, 7 in share). Share's fall between its epochs' two hand-overs (steps 6
# and 13), right after rank 1's last own batch (12), and at the second epoch's last batch (14).
SAVE_AT = {"truncate": (3, 7, 10), "cycle": (7, 15, 18), "share": (6, 12, 13, 14)}
# The parquet source (as many batches per rank as BATCHES): mid second epoch only; in cycle
# also right after rank 1 handed out its own shard's last batch (step 14), where a resumed
# first pass is the shard's empty tail and must start over; in share the same two positions of
# its hand-over.
PARQUET_SAVE_AT = {"truncate": (7,), "cycle": (14, 15), "share": (12, 13)}
WEIGHT_TOLERANCE = 1e-6

READ_AHEAD = (
    "Lightning's fetcher reads one batch ahead when len(loader) is unknown as an epoch starts "
    "(every epoch of a factory, the first of a list): the "
    "saved loader state counts that untrained batch, and the resumed run skips it"
)
OPEN_EPOCH = (
    "at the last batch of an epoch whose length Lightning knew (no read-ahead) the loader, "
    "asked for nothing more, still holds the epoch open: the resumed loader's first iter() "
    "ends that epoch with no batches, and Lightning's next epoch gets none"
)


def _steps_per_epoch(mode: str) -> int:
    if mode == "share":
        return -(-sum(BATCHES) // WORLD_SIZE)
    return min(BATCHES) if mode == "truncate" else max(BATCHES)


def _lightning_alone_fails(mode: str, source: str, step: int) -> str | None:
    """Why Lightning alone resumes wrongly at ``step``, or None where it resumes exactly."""
    steps = _steps_per_epoch(mode)
    saving_epoch = (step - 1) // steps
    # A plan's length is known at once; a list's from its first epoch's agreement on.
    list_length_known = saving_epoch >= 1
    length_known = source == "parquet" or (source == "list" and list_length_known)
    if step % steps == 0:  # the epoch's last batch
        return OPEN_EPOCH if length_known else None
    return None if length_known else READ_AHEAD


CASES = [
    *((mode, source, step) for mode in MODES for source in SOURCES for step in SAVE_AT[mode]),
    *((mode, "parquet", step) for mode in MODES for step in PARQUET_SAVE_AT[mode]),
]
LIGHTNING_ALONE = [
    pytest.param(
        *case,
        marks=[pytest.mark.xfail(reason=reason, strict=True, raises=AssertionError)]
        if (reason := _lightning_alone_fails(*case))
        else [],
    )
    for case in CASES
]


def _shard(rank: int) -> list[list[int]]:
    """Rank ``rank``'s batches of sample ids, as the job builds them: ids ``rank * 1000 + i``,
    ``BATCH_SIZE`` a batch, the last batch one short."""
    ids = [rank * 1000 + index for index in range(BATCHES[rank] * BATCH_SIZE - 1)]
    return [ids[start : start + BATCH_SIZE] for start in range(0, len(ids), BATCH_SIZE)]


def _giver(batch: list[int]) -> int:
    """The rank whose shard ``batch`` is from."""
    return batch[0] // 1000


def _epoch_ids(mode: str, rank: int) -> list[list[int]]:
    """The sample ids of every step of an epoch on ``rank``."""
    shard = _shard(rank)
    if mode != "share":
        return [shard[step % len(shard)] for step in range(_steps_per_epoch(mode))]
    # Each rank hands out its own batches first; once rank 1 has run out, rank 0 reads two at
    # each step, keeps the older and sends the newer (14 batches: no padding).
    long, short = _shard(0), _shard(1)
    rest = long[len(short) :]
    return shard[: len(short)] + rest[rank::WORLD_SIZE]


def _expected_ids(mode: str, rank: int) -> list[list[int]]:
    """The sample ids of every step of the whole run on ``rank``."""
    return _epoch_ids(mode, rank) * EPOCHS


def _expected_stats(mode: str, epoch: int) -> dict[str, Any]:
    """An uninterrupted epoch's ``EpochStats.as_dict()`` (per-rank fields as JSON lists)."""
    steps = _steps_per_epoch(mode)
    ranks = range(WORLD_SIZE)
    shards = [_shard(rank) for rank in ranks]
    trained = [_epoch_ids(mode, rank) for rank in ranks]
    received = [[batch for batch in trained[rank] if _giver(batch) != rank] for rank in ranks]
    sent = [[batch for got in received for batch in got if _giver(batch) == rank] for rank in ranks]
    own = [min(steps, len(shard)) for shard in shards]
    repeated = [steps - own[rank] - len(received[rank]) for rank in ranks]
    return {
        "epoch": epoch,
        "mode": mode,
        "world_size": WORLD_SIZE,
        "steps": [steps] * WORLD_SIZE,
        "own_batches": own,
        "repeated_batches": repeated,
        "passes": [-(-(own[rank] + repeated[rank]) // len(shards[rank])) for rank in ranks],
        "samples": [sum(map(len, batches)) for batches in trained],
        "truncated": [len(shards[rank]) > own[rank] + len(sent[rank]) for rank in ranks],
        "padded_batches": [0] * WORLD_SIZE,
        "padded_rows": [0] * WORLD_SIZE,
        "sent_batches": [len(batches) for batches in sent],
        "sent_rows": [sum(map(len, batches)) for batches in sent],
        "received_batches": [len(batches) for batches in received],
        "received_rows": [sum(map(len, batches)) for batches in received],
        "dropped_batches": None,
        "dropped_rows": None,
        "lost_rows": None,
        "sharding": None,
        "resumed_at_step": None,
        "resumed_from_world_size": None,
        "oversampling": sum(repeated) / sum(own),
    }


def _ids(result: dict[str, Any]) -> list[list[int]]:
    return [step["ids"] for step in result["steps"]]


def _lightning_positions(result: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [(step["epoch"], step["batch_idx"], step["global_step"]) for step in result["steps"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Lightning job: every case, one after the other, on the same 2 ranks."""
    workdir = tmp_path_factory.mktemp("lightning-resume")
    out = workdir / "results"
    data_url = write_plain_dataset(workdir / "data", PARQUET_ROW_GROUPS)
    command = [PYTHON, str(JOB), "--results", str(out), "--data", data_url]
    expected_files = []
    for mode in MODES:
        for source in (*SOURCES, "parquet"):
            save_at = PARQUET_SAVE_AT[mode] if source == "parquet" else SAVE_AT[mode]
            command += ["--case", f"{mode}:{source}:{','.join(map(str, save_at))}"]
            runs = ["full"] + [
                f"{kind}{step}-{variant}"
                for step in save_at
                for variant in ("lightning", "recipe")
                for kind in ("stop", "resume")
            ]
            expected_files += [
                f"{mode}-{source}-{run}-rank{rank}.json"
                for run in runs
                for rank in range(WORLD_SIZE)
            ]
    launch(command, out, expected_files, timeout=200, cwd=workdir)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mode", MODES)
def test_the_uninterrupted_run(results: Path, mode: str, source: str) -> None:
    steps = _steps_per_epoch(mode)
    ranks = read_ranks(results, f"{mode}-{source}-full", WORLD_SIZE)
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world_size"]) == (rank, WORLD_SIZE)
        assert _ids(result) == _expected_ids(mode, rank)
        assert _lightning_positions(result) == [
            (step // steps, step % steps, step) for step in range(EPOCHS * steps)
        ]
        # The loader numbered its epochs as Lightning did (sampler.set_epoch).
        assert result["history"] == [_expected_stats(mode, epoch) for epoch in range(EPOCHS)]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    if mode == "share":
        shards = [_shard(rank) for rank in range(WORLD_SIZE)]
        _check_every_row_once(ranks, [row for shard in shards for batch in shard for row in batch])


def _check_every_row_once(ranks: list[dict[str, Any]], rows: list[int]) -> None:
    """Share: each epoch trains each of ``rows`` (every shard's) once over the ranks, in
    ``ceil(B / W)`` steps on each, without padding (B = 14 batches over 2 ranks), and its
    statistics add up: a shard's batches are those its rank handed out and those it sent, a
    rank's steps its own batches, those it received and its padding."""
    steps = _steps_per_epoch("share")
    for epoch in range(EPOCHS):
        trained = [_ids(result)[epoch * steps : (epoch + 1) * steps] for result in ranks]
        assert [len(batches) for batches in trained] == [steps] * WORLD_SIZE
        assert sorted(row for batches in trained for batch in batches for row in batch) == sorted(
            rows
        ), f"epoch {epoch}"
        stats = ranks[0]["history"][epoch]
        assert stats["padded_batches"] == [0] * WORLD_SIZE
        for rank, batches in enumerate(BATCHES):
            assert stats["own_batches"][rank] + stats["sent_batches"][rank] == batches
            assert (
                stats["own_batches"][rank]
                + stats["received_batches"][rank]
                + stats["padded_batches"][rank]
                == steps
            )


@pytest.mark.timeout(250)
@pytest.mark.parametrize("mode", MODES)
def test_the_uninterrupted_parquet_run(results: Path, mode: str) -> None:
    steps = _steps_per_epoch(mode)
    ranks = read_ranks(results, f"{mode}-parquet-full", WORLD_SIZE)
    for rank, result in enumerate(ranks):
        own = set(shard_ids(PARQUET_ROW_GROUPS, WORLD_SIZE, rank))
        epochs = [_ids(result)[epoch * steps : (epoch + 1) * steps] for epoch in range(EPOCHS)]
        # Share hands rows to the other rank (checked below, over both).
        for ids in [] if mode == "share" else epochs:
            trained = [row for batch in ids for row in batch]
            assert set(trained) <= own
            if mode == "cycle":
                assert set(trained) == own, "cycle trains every own row"
            else:
                assert len(trained) == len(set(trained)), "no row twice in truncate"
        assert epochs[0] != epochs[1], "each epoch shuffles with a seed of its own"
        assert [stats["sharding"] for stats in result["history"]] == ["round_robin"] * EPOCHS
    assert ranks[0]["weights"] == ranks[1]["weights"]
    if mode == "share":
        _check_every_row_once(ranks, list(range(sum(PARQUET_ROW_GROUPS[0]))))


def _check_resumed(results: Path, mode: str, source: str, step: int, variant: str) -> None:
    steps = _steps_per_epoch(mode)
    name = f"{mode}-{source}"
    first_epoch, resumed_at = divmod(step, steps)
    full_runs = read_ranks(results, f"{name}-full", WORLD_SIZE)
    stopped_runs = read_ranks(results, f"{name}-stop{step}-{variant}", WORLD_SIZE)
    resumed_runs = read_ranks(results, f"{name}-resume{step}-{variant}", WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        full, stopped, resumed = full_runs[rank], stopped_runs[rank], resumed_runs[rank]
        # The stopped run trained up to its checkpoint, taken by ModelCheckpoint at `step`.
        assert stopped["checkpoint_global_step"] == step
        assert [trained["global_step"] for trained in stopped["steps"]] == list(range(step))
        # Lightning saved rank 0's loader state (only rank 0 writes the checkpoint), and every
        # rank loaded it: the states are equal in these modes (the epoch and the step).
        (state,) = stopped["checkpoint_loader_states"]
        assert (state["format"], state["rank"]) == ("ddp_even.EvenLoader", 0)
        # Lightning resumed where it stopped. (Not its batch_idx: resumed from the last batch
        # of an epoch of unknown length, Lightning 2.6 counts the next epoch's batch_idx on
        # from the previous epoch's, whatever the loader.)
        assert [(trained["epoch"], trained["global_step"]) for trained in resumed["steps"]] == [
            (done // steps, done) for done in range(step, EPOCHS * steps)
        ], f"rank {rank}"
        # The batches trained before the checkpoint and after it are the whole run's.
        assert _ids(stopped) + _ids(resumed) == _ids(full), f"rank {rank}"
        assert (
            max(abs(a - b) for a, b in zip(resumed["weights"], full["weights"], strict=True))
            <= WEIGHT_TOLERANCE
        )
        # The loader's statistics cover the epochs Lightning ran after resuming, numbered as
        # Lightning numbers them, and equal the uninterrupted run's but for resumed_at_step.
        lightning_epochs = sorted({trained["epoch"] for trained in resumed["steps"]})
        assert [stats["epoch"] for stats in resumed["history"]] == lightning_epochs
        assert lightning_epochs == list(range(first_epoch, EPOCHS))
        for stats in resumed["history"]:
            at = resumed_at if stats["epoch"] == first_epoch and resumed_at else None
            assert stats == {**full["history"][stats["epoch"]], "resumed_at_step": at}
        # The saved position is where Lightning resumed.
        assert (state["epoch"], state["step"]) == (first_epoch, resumed_at)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "source", "step"), CASES)
def test_resuming_with_the_trained_steps_callback(
    results: Path, mode: str, source: str, step: int
) -> None:
    _check_resumed(results, mode, source, step, "recipe")


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "source", "step"), LIGHTNING_ALONE)
def test_resuming_with_lightning_alone(results: Path, mode: str, source: str, step: int) -> None:
    _check_resumed(results, mode, source, step, "lightning")
