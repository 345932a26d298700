"""EvenLoader inside a real Hugging Face accelerate loop, 2 CPU ranks under torchrun.

One torchrun job runs ``examples/train_accelerate.py`` in every mode, one after the other:
truncate, cycle, pad, share and join with a loader factory and with ``from_parquet``, and
accelerate's own recipe (``accelerate-join``: a plain petastorm loader inside torch's ``Join``);
where petastorm is not installed, only ``from_parquet``. After each, an evaluation in pad mode
(in share after share). Each rank writes a JSON file per run; the test checks them against
counts worked out from the row-group sizes, and the evaluation against the final model's exact
mean squared error over the whole dataset.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.datasets import shard_rows
from tests.helpers.lightning_and_accelerate import (
    FEATURES,
    PETASTORM_INSTALLED,
    REPO,
    SOURCES,
    TORCHRUN,
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
    pytest.mark.xdist_group("accelerate"),
    pytest.mark.skipif(sys.platform != "linux", reason="Linux"),
]


@pytest.fixture(autouse=True, scope="module")
def _accelerate_installed() -> None:
    skip_without("accelerate")


EXAMPLE = REPO / "examples" / "train_accelerate.py"
WORLD_SIZE = 2
BATCH_SIZE = 8
EPOCHS = 3
# Rank 0 gets row groups 0, 2, 4 (54 rows, 7 batches), rank 1 row groups 1, 3 (12 rows, 2):
# share takes 5 steps, rank 0 sending 2 batches, rank 1 padding the last step.
ROW_GROUP_SIZES = (30, 5, 20, 7, 4)
MODES = ("truncate", "cycle", "pad", "share", "join")
EVEN_RUNS = source_runs(MODES)
# accelerate's own recipe, over a plain petastorm loader.
PLAIN_RUNS = [pytest.param("accelerate-join", "plain", marks=pytest.mark.petastorm)]
DATA = "data"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("accelerate")
    data_url = write_regression_dataset(workdir / DATA, ROW_GROUP_SIZES)
    results = workdir / "results"
    runs = [(mode, source) for mode in MODES for source in SOURCES]
    modes = list(MODES)
    if PETASTORM_INSTALLED:
        runs.append(("accelerate-join", "plain"))
        modes.append("accelerate-join")
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(WORLD_SIZE), str(EXAMPLE)]
    command += ["--data", data_url, "--results", str(results)]
    command += ["--epochs", str(EPOCHS), "--batch-size", str(BATCH_SIZE)]
    for mode in modes:
        command += ["--mode", mode]
    for source in SOURCES:
        command += ["--source", source]
    expected_files = [
        f"{mode}-{source}-rank{rank}.json" for mode, source in runs for rank in range(WORLD_SIZE)
    ]
    launch(command, results, expected_files, timeout=200, cwd=workdir)
    return results


@pytest.mark.timeout(250)
@pytest.mark.parametrize(("mode", "source"), EVEN_RUNS)
def test_every_rank_trains_the_planned_steps(trained: Path, mode: str, source: str) -> None:
    ranks = read_ranks(trained, f"{mode}-{source}", WORLD_SIZE)
    expected = expected_epoch(
        mode, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE, planned=planned(mode, source)
    )
    for rank, result in enumerate(ranks):
        # Accelerator(cpu=True) made the torchrun processes one gloo job.
        assert result["distributed_type"] == "DistributedType.MULTI_CPU"
        assert (result["rank"], result["world_size"]) == (rank, WORLD_SIZE)
        history = result["history"]
        assert [epoch["epoch"] for epoch in history] == list(range(EPOCHS))
        for epoch in history:
            assert {name: epoch[name] for name in expected} == expected, f"rank {rank}"
            if mode == "share":
                check_share_rows(epoch, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE)
        # What the training loop itself counted on this rank.
        assert result["steps"] == [expected["steps"][rank]] * EPOCHS
        assert result["rows"] == [epoch["samples"][rank] for epoch in history]
        if mode != "share":  # share's rows: which batches travel is the plan's choice
            assert result["rows"] == [expected["samples"][rank]] * EPOCHS
    assert ranks[0]["history"] == ranks[1]["history"]
    # DDP (and, in join mode, Join's final broadcast) kept the replicas equal.
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.timeout(250)
@pytest.mark.parametrize(("mode", "source"), [*EVEN_RUNS, *PLAIN_RUNS])
def test_evaluation_in_pad_mode_is_exact(trained: Path, mode: str, source: str) -> None:
    """After every run, pad mode (share after share) evaluates the final model on every row
    once: the metric is its exact mean squared error over the whole dataset, on every rank."""
    table = pq.read_table(trained.parent / DATA)
    features = np.stack([table.column(name).to_numpy() for name in FEATURES], axis=1)
    labels = table.column("label").to_numpy()
    eval_mode = "share" if mode == "share" else "pad"
    expected = expected_epoch(
        eval_mode, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE, planned=planned(eval_mode, source)
    )
    for result in read_ranks(trained, f"{mode}-{source}", WORLD_SIZE):
        *weights, bias = result["weights"]
        exact = float(np.mean((features.astype(np.float64) @ weights + bias - labels) ** 2))
        assert result["eval_mse"] == pytest.approx(exact, rel=1e-5)
        assert result["eval_rows"] == sum(ROW_GROUP_SIZES)
        (evaluation,) = result["eval_history"]
        assert {name: evaluation[name] for name in expected} == expected
        if eval_mode == "share":
            check_share_rows(evaluation, ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE)


@pytest.mark.petastorm
@pytest.mark.timeout(250)
def test_accelerates_own_join_recipe_trains_every_row_once(trained: Path) -> None:
    ranks = read_ranks(trained, "accelerate-join-plain", WORLD_SIZE)
    batches = shard_batches(ROW_GROUP_SIZES, WORLD_SIZE, BATCH_SIZE)
    for rank, result in enumerate(ranks):
        assert result["history"] == []  # no EvenLoader, no statistics
        assert result["steps"] == [len(batches[rank])] * EPOCHS
        assert result["rows"] == [shard_rows(list(ROW_GROUP_SIZES), WORLD_SIZE, rank)] * EPOCHS
    assert ranks[0]["weights"] == ranks[1]["weights"]
