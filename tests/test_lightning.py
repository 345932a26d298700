"""EvenLoader inside a real PyTorch Lightning ``Trainer(strategy="ddp")``, 2 CPU ranks.

The test runs ``examples/train_lightning.py`` as a subprocess: Lightning starts rank 1 itself
(a subprocess of the script) and every rank writes a JSON file per run. One job trains, one
after the other, in truncate, cycle, pad and share with a loader factory and with
``from_parquet`` (only the latter where petastorm is not installed), validating after every
epoch in pad mode, share after training in share (a metric synced at every step); a second job
tries
join mode, which must end on every rank, with a clear error, not hang.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.lightning_and_accelerate import (
    FEATURES,
    PYTHON,
    REPO,
    SOURCES,
    check_share_rows,
    expected_epoch,
    launch,
    planned,
    read_ranks,
    shard_batches,
    skip_without,
    source_runs,
    write_regression_dataset,
)

# In one worker (scripts/test.sh's --dist loadgroup), so that the module's one job runs once,
# not once in each worker that gets one of its tests.
pytestmark = [
    pytest.mark.multirank,
    pytest.mark.xdist_group("lightning"),
    pytest.mark.skipif(sys.platform != "linux", reason="Linux"),
]


@pytest.fixture(autouse=True, scope="module")
def _lightning_installed() -> None:
    skip_without("lightning")


EXAMPLE = REPO / "examples" / "train_lightning.py"
WORLD_SIZE = 2
BATCH_SIZE = 8
EPOCHS = 3
# Rank 0 gets row groups 0, 2, 4 (54 rows, 7 batches), rank 1 row groups 1, 3 (12 rows, 2):
# share takes 5 steps, rank 0 sending 2 batches, rank 1 padding the last step.
ROW_GROUP_SIZES = (30, 5, 20, 7, 4)
MODES = ("truncate", "cycle", "pad", "share")
RUNS = source_runs(MODES)


def _command(data_url: str, results: Path, modes: list[str], sources: list[str]) -> list[str]:
    command = [PYTHON, str(EXAMPLE), "--data", data_url, "--results", str(results)]
    command += ["--epochs", str(EPOCHS), "--batch-size", str(BATCH_SIZE)]
    command += ["--devices", str(WORLD_SIZE)]
    for mode in modes:
        command += ["--mode", mode]
    for source in sources:
        command += ["--source", source]
    return command


@pytest.fixture(scope="module")
def data_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_regression_dataset(tmp_path_factory.mktemp("skewed"), ROW_GROUP_SIZES)


@pytest.fixture(scope="module")
def trained(data_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Lightning job: the runs of RUNS, one after the other, on the same 2 ranks."""
    workdir = tmp_path_factory.mktemp("lightning")
    results = workdir / "results"
    expected_files = [
        f"{mode}-{source}-rank{rank}.json"
        for mode in MODES
        for source in SOURCES
        for rank in range(WORLD_SIZE)
    ]
    command = _command(data_url, results, list(MODES), list(SOURCES))
    launch(command, results, expected_files, timeout=200, cwd=workdir)
    return results


@pytest.mark.timeout(250)
@pytest.mark.parametrize(("mode", "source"), RUNS)
def test_every_epoch_has_the_right_steps_on_every_rank(
    trained: Path, mode: str, source: str
) -> None:
    ranks = read_ranks(trained, f"{mode}-{source}", WORLD_SIZE)
    expected = expected_epoch(
        mode, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE, planned=planned(mode, source)
    )
    for rank, result in enumerate(ranks):
        assert result["error"] is None
        assert (result["rank"], result["world_size"]) == (rank, WORLD_SIZE)
        # EvenLoaderStats made Lightning's DDP model average through ddp_even's hook.
        assert result["comm_hooks"] == ["allreduce_hook"], result["comm_hooks"]
        history = result["history"]
        assert [epoch["epoch"] for epoch in history] == list(range(EPOCHS))
        for epoch in history:
            assert {name: epoch[name] for name in expected} == expected, f"rank {rank}"
            if mode == "share":
                check_share_rows(epoch, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE)
        # Lightning ran exactly the steps the loader handed out.
        assert result["global_step"] == EPOCHS * expected["steps"][0]
    # The statistics are gathered, so equal everywhere; DDP kept the replicas equal.
    assert ranks[0]["history"] == ranks[1]["history"]
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.timeout(250)
@pytest.mark.parametrize(("mode", "source"), RUNS)
def test_validation_in_pad_mode_logs_the_exact_mean_over_the_whole_dataset(
    trained: Path, data_url: str, mode: str, source: str
) -> None:
    """Whatever the training's mode, validation (pad, or share after share) sees every row
    once: the metric logged at the last epoch is the final model's mean squared error over the
    whole dataset."""
    table = pq.read_table(data_url.removeprefix("file://"))
    features = np.stack([table.column(name).to_numpy() for name in FEATURES], axis=1)
    labels = table.column("label").to_numpy()
    for result in read_ranks(trained, f"{mode}-{source}", WORLD_SIZE):
        *weights, bias = result["weights"]
        exact = float(np.mean((features.astype(np.float64) @ weights + bias - labels) ** 2))
        validation = result["validation"]
        # A torchmetrics metric skipping padding, and a mean logged with sync_dist=True at
        # every step (padding weighted 0): both exact, up to float32 sums.
        assert validation["val_mse"] == pytest.approx(exact, rel=1e-5)
        assert validation["val_mse_mean_epoch"] == pytest.approx(exact, rel=1e-5)
        # Every validation epoch took the same steps on both ranks, padding the short shard
        # (share: handing it batches, padding the last step).
        val_mode = "share" if mode == "share" else "pad"
        expected = expected_epoch(
            val_mode, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE, planned=planned(val_mode, source)
        )
        assert len(result["val_history"]) == EPOCHS
        for epoch in result["val_history"]:
            assert {name: epoch[name] for name in expected} == expected
            if val_mode == "share":
                check_share_rows(epoch, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE)


@pytest.mark.timeout(250)
@pytest.mark.parametrize(("mode", "source"), RUNS)
def test_the_callback_logs_every_epoch_to_the_trainers_logger(
    trained: Path, mode: str, source: str
) -> None:
    expected = expected_epoch(
        mode, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE, planned=planned(mode, source)
    )
    # Pad's steps are the longest shard's; share saves the steps beyond ceil(B / W).
    longest = max(map(len, shard_batches(ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE)))
    wanted: dict[str, Any] = {
        "ddp_even/steps_min": min(expected["steps"]),
        "ddp_even/steps_max": max(expected["steps"]),
        "ddp_even/own_batches": sum(expected["own_batches"]),
        "ddp_even/repeated_batches": sum(expected["repeated_batches"]),
        "ddp_even/truncated_ranks": sum(expected["truncated"]),
        "ddp_even/oversampling": pytest.approx(expected["oversampling"]),
        "ddp_even/padded_batches": sum(expected["padded_batches"]),
        "ddp_even/sent_batches": sum(expected["sent_batches"]),
        "ddp_even/received_batches": sum(expected["received_batches"]),
        "ddp_even/steps_saved": longest - expected["steps"][0] if mode == "share" else 0,
    }
    if mode != "share":  # share's rows: which batches travel is the plan's choice
        wanted["ddp_even/samples"] = sum(expected["samples"])
        wanted["ddp_even/padded_rows"] = sum(expected["padded_rows"])
    known_lengths = expected["dropped_batches"] is not None
    if known_lengths:
        wanted["ddp_even/dropped_batches"] = sum(expected["dropped_batches"])
        wanted["ddp_even/dropped_rows"] = sum(expected["dropped_rows"])
    for result in read_ranks(trained, f"{mode}-{source}", WORLD_SIZE):
        logged = result["logged_metrics"]
        assert [metrics["ddp_even/epoch"] for metrics in logged] == list(range(EPOCHS))
        for metrics in logged:
            assert {name: metrics[name] for name in wanted} == wanted
            if mode == "share":  # every row once, plus the padding; what is sent is received
                rows = sum(ROW_GROUP_SIZES) + metrics["ddp_even/padded_rows"]
                assert metrics["ddp_even/samples"] == rows
                assert metrics["ddp_even/sent_rows"] == metrics["ddp_even/received_rows"] > 0
        if not known_lengths:
            assert "ddp_even/dropped_batches" not in logged[0]
    # Rank 0's CSVLogger wrote them.
    metrics_csv = trained / "logs" / f"{mode}-{source}" / "version_0" / "metrics.csv"
    with metrics_csv.open() as file:
        rows = [row for row in csv.DictReader(file) if row["ddp_even/epoch"]]
    assert [int(row["ddp_even/epoch"]) for row in rows] == list(range(EPOCHS))
    assert {int(row["ddp_even/steps_max"]) for row in rows} == {max(expected["steps"])}


@pytest.mark.timeout(90)
def test_join_mode_under_lightning_ends_on_every_rank(data_url: str, tmp_path: Path) -> None:
    """Lightning's per-step broadcast would hang Join: every rank must stop, with a clear error
    (or finish), within the job's short timeout."""
    results = tmp_path / "results"
    expected_files = [
        f"join-{source}-rank{rank}.json" for source in SOURCES for rank in range(WORLD_SIZE)
    ]
    command = _command(data_url, results, ["join"], list(SOURCES))
    launch(command, results, expected_files, timeout=60, cwd=tmp_path)
    for source in SOURCES:
        for result in read_ranks(results, f"join-{source}", WORLD_SIZE):
            error = result["error"]
            if error is None:  # finished: then every shard was trained on once
                expected = expected_epoch(
                    "join", ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE, planned=False
                )
                assert [epoch["steps"] for epoch in result["history"]] == [
                    expected["steps"]
                ] * EPOCHS
                continue
            assert error["type"] == "EvenLoaderError"
            assert "Lightning" in error["message"]
            assert "truncate" in error["message"] and "cycle" in error["message"]
            assert result["global_step"] == 0  # raised at the first epoch, before any step
