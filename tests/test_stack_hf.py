"""Hugging Face ``datasets`` streaming, split by node over unequal Parquet files, 2 gloo ranks
under accelerate: the recipe of docs/stacks.md, in the lane of today's stack (``recipes``
extra; skipped where ``datasets`` is missing).

``split_dataset_by_node`` gives each rank whole files when the files divide evenly among the
ranks: unequal files, unequal shards (checked here first, in one process). One job trains an
accelerate-prepared (DDP) model on each rank's split wrapped in an EvenLoader in each mode
(share: the rank with data hands batches to the one that ran out), then evaluates pad's model
exactly in pad mode, ``accelerator.reduce`` at every step (``gather_for_metrics``
cannot drop duplicates of an iterable without a length). The test checks every row once in
equal steps (share: ceil(B / W) of them, padding only at the last), and the evaluation
against the final model's mean squared error over every row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddp_even import EvenLoader
from tests.helpers.spawn import run_ranks
from tests.helpers.stacks import (
    LR,
    Seen,
    assert_documented,
    features_of,
    make_model,
    need,
    to_tensors,
    write_id_files,
)

need("datasets")

# One process runs the module (scripts/test.sh: -n 3 --dist loadgroup): its job starts once.
pytestmark = pytest.mark.xdist_group("stack-hf")

WORLD_SIZE = 2
BATCH_SIZE = 16
# Six files among 2 ranks: whole files, every other one (900 and 60 rows).
FILE_SIZES = (400, 30, 300, 20, 200, 10)
TOTAL_ROWS = sum(FILE_SIZES)
# Pad last: the model the evaluation runs on.
MODES = ("truncate", "cycle", "join", "share", "pad")
# The job reads no hub: local files only, its cache in the test's folder.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_id_files(tmp_path_factory.mktemp("hf") / "data", FILE_SIZES)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {**OFFLINE, "HF_HOME": str(tmp_path_factory.mktemp("hf-home"))}


@pytest.mark.timeout(60)
def test_split_dataset_by_node_gives_ranks_unequal_shards(
    files: list[str], hf_home: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in hf_home.items():
        monkeypatch.setenv(name, value)
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    stream = load_dataset("parquet", data_files=files, split="train", streaming=True)
    rows = [
        sorted(row["id"] for row in split_dataset_by_node(stream, rank, WORLD_SIZE))
        for rank in range(WORLD_SIZE)
    ]
    assert rows == [_shard(rank) for rank in range(WORLD_SIZE)]
    # 57 batches of 16 against 4: unwrapped, rank 1 leaves DDP's all-reduce after 4 steps.
    assert [len(rank_rows) for rank_rows in rows] == [900, 60]


def _train_and_evaluate(rank: int, world_size: int, files: list[str]) -> dict[str, Any]:
    # What `accelerate launch` (or torchrun) sets; run_ranks started the gloo group already.
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2"
    )
    from accelerate import Accelerator
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)  # MULTI_CPU over gloo (docs/trainers.md)
    stream = load_dataset("parquet", data_files=files, split="train", streaming=True)
    split = split_dataset_by_node(
        stream, rank=accelerator.process_index, world_size=accelerator.num_processes
    )
    results: dict[str, Any] = {"distributed_type": str(accelerator.distributed_type)}
    for mode in MODES:
        seen = Seen()
        net = make_model()
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))

        # Join shadows the all-reduces of the prepared (DDP) model for the rank that ran out.
        joinables = [model] if mode == "join" else []
        # A fresh DataLoader over this rank's split for each pass.
        loader = EvenLoader(
            lambda: DataLoader(split, batch_size=BATCH_SIZE), mode=mode, joinables=joinables
        )
        for batch in loader:
            features, labels = to_tensors(batch)
            loss = torch.nn.functional.mse_loss(model(features), labels)
            # 0 for padding, else the batch's share of the step's real rows (pad) or batches
            # (share); 1.0 in the other modes. DDP's average is then the step's mean loss's
            # gradient.
            accelerator.backward(loss * loader.batch_weight)
            optimizer.step()
            optimizer.zero_grad()
            seen.add(batch, loader)
        seen.keep_weights(model.parameters())
        results[mode] = seen
    # The last mode's (pad's) model, evaluated on every row once.
    results["evaluation"] = _evaluate(accelerator, model, lambda: DataLoader(split, batch_size=64))
    return results


def _evaluate(accelerator: Any, model: torch.nn.Module, one_pass: Any) -> dict[str, Any]:
    evaluation = EvenLoader(one_pass, mode="pad")
    squared_error = torch.zeros((), dtype=torch.float64)
    rows = torch.zeros((), dtype=torch.int64)
    evaluated: list[int] = []
    with torch.no_grad():
        for batch in evaluation:
            features, labels = to_tensors(batch)
            error = ((model(features) - labels).double() ** 2).sum()
            count = torch.tensor(len(labels))
            if evaluation.padding:  # this rank's split ran out: the batch counts for nothing
                error, count = torch.zeros_like(error), torch.zeros_like(count)
            # Every rank takes every step of pad mode: a collective here never waits alone.
            squared_error += accelerator.reduce(error, reduction="sum")
            rows += accelerator.reduce(count, reduction="sum")
            evaluated += [] if evaluation.padding else batch["id"].tolist()
    return {"mse": float(squared_error / rows), "rows": int(rows), "ids": evaluated}


@pytest.fixture(scope="module")
def trained(files: list[str], hf_home: dict[str, str]) -> list[dict[str, Any]]:
    return run_ranks(_train_and_evaluate, WORLD_SIZE, files, env=hf_home, timeout=120)


def _shard(rank: int) -> list[int]:
    """The ids of rank ``rank``'s split in the order it reads them: every other file."""
    starts = np.cumsum((0, *FILE_SIZES))
    own = range(rank, len(FILE_SIZES), WORLD_SIZE)
    return [int(i) for f in own for i in range(starts[f], starts[f + 1])]


@pytest.mark.multirank
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_trains_the_steps_it_promises(trained: list[dict[str, Any]], mode: str) -> None:
    for result in trained:
        assert result["distributed_type"] == "DistributedType.MULTI_CPU"
    seen = [result[mode] for result in trained]
    # Share: ceil((57 + 4) / 2) steps each.
    steps = {"truncate": [4, 4], "cycle": [57, 57], "pad": [57, 57], "join": [57, 4]}
    steps["share"] = [31, 31]
    assert [len(rank.ids) for rank in seen] == steps[mode]
    own = [_shard(rank) for rank in range(WORLD_SIZE)]
    if mode == "truncate":  # the first 4 batches of each
        assert [rank.real_rows() for rank in seen] == [own[0][:64], own[1]]
    elif mode == "cycle":  # the short split starts again, as often as it takes
        assert seen[0].real_rows() == own[0]
        batches = [own[1][at : at + BATCH_SIZE] for at in range(0, 60, BATCH_SIZE)]
        assert seen[1].ids == (batches * 15)[:57]
    elif mode == "share":  # every row once over the ranks, rank 1 training on rank 0's too
        assert sorted(seen[0].real_rows() + seen[1].real_rows()) == list(range(TOTAL_ROWS))
        assert len(seen[1].real_rows()) > len(own[1])
        # 2 * 31 - 61 = 1 padding batch, at the last step, on the shorter split; that step's
        # one real batch weighs 2, so that DDP's average is its loss's gradient.
        assert seen[1].padding == [False] * 30 + [True] and seen[0].padding == [False] * 31
        assert seen[0].batch_weights == [1.0] * 30 + [2.0]
        assert seen[1].batch_weights == [1.0] * 30 + [0.0]
    else:  # pad and join: every row once
        assert [rank.real_rows() for rank in seen] == own
    if mode == "pad":
        assert seen[1].padding == [False] * 4 + [True] * 53
    # DDP (and in join mode Join's final sync) kept the replicas equal.
    assert seen[0].weights == seen[1].weights


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_evaluation_in_pad_mode_is_exact(trained: list[dict[str, Any]]) -> None:
    model = make_model()
    flat = torch.tensor(trained[0]["pad"].weights)
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    features, labels = features_of(range(TOTAL_ROWS))
    with torch.no_grad():
        predictions = model(torch.from_numpy(features)).squeeze(1).double().numpy()
    exact = float(np.mean((predictions - labels.astype(np.float64)) ** 2))
    evaluated = [result["evaluation"] for result in trained]
    assert sorted(evaluated[0]["ids"] + evaluated[1]["ids"]) == list(range(TOTAL_ROWS))
    for evaluation in evaluated:
        assert evaluation["rows"] == TOTAL_ROWS
        assert evaluation["mse"] == pytest.approx(exact, rel=1e-5)


def test_docs_show_this_recipe() -> None:
    assert_documented("Hugging Face datasets, streaming", [Path(__file__)])
