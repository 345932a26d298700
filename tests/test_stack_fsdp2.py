"""FSDP2 (``fully_shard`` on a 1-D CPU mesh), 2 gloo ranks over uneven shards: the recipe of
docs/stacks.md.

One job trains a real FSDP2 model in truncate, cycle and pad, each rank's list of batches
wrapped in an EvenLoader, and tries join. Each rank reports the ids of every step; the test
checks them against the shards (equal steps, pad every row once) and the gathered weights
against the same steps trained in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_even import EvenLoader
from tests.helpers.spawn import run_ranks
from tests.helpers.stacks import (
    LR,
    Seen,
    assert_documented,
    id_batches,
    make_model,
    reference_weights,
    to_tensors,
)

# One process runs the module (scripts/test.sh: -n 3 --dist loadgroup): its job starts once.
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("stack-fsdp2")]

WORLD_SIZE = 2
BATCH_SIZE = 4
# Rank 0: ids 0..35, 9 batches of 4; rank 1: ids 36..45, 3 batches (the last of 2).
SHARDS = ((0, 36), (36, 46))
MODES = ("truncate", "cycle", "pad")


def _train(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    shard = id_batches(*SHARDS[rank], BATCH_SIZE)  # this rank's batches: 9 on one, 3 on the other
    results: dict[str, Any] = {}
    for mode in MODES:
        seen = Seen()
        model = make_model()
        # Each Linear its own FSDP unit (its parameters gathered just before its forward),
        # then the root.
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        loader = EvenLoader(shard, mode=mode)  # or a function that returns a fresh loader
        for batch in loader:
            features, labels = to_tensors(batch)
            loss = torch.nn.functional.mse_loss(model(features), labels)
            # 0 for padding, else the batch's share of the step's real rows (1.0 in truncate
            # and cycle): FSDP2's reduce-scatter averages over the ranks, as DDP does.
            (loss * loader.batch_weight).backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.add(batch, loader)
        # full_tensor() all-gathers each sharded parameter: every rank, the same order.
        seen.keep_weights(p.full_tensor() for p in model.parameters())
        results[mode] = seen
    results["join"] = _join_errors(shard, model)
    return results


def _join_errors(shard: Any, model: torch.nn.Module) -> list[tuple[str, str]]:
    """What join mode says on an FSDP2 model: with it as a joinable, and with none."""
    errors = []
    for joinables in ([model], []):
        try:
            EvenLoader(shard, mode="join", joinables=joinables)
        except Exception as exc:
            errors.append((type(exc).__name__, str(exc)))
        else:
            errors.append(("", "accepted"))
    return errors


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_ranks(_train, WORLD_SIZE, timeout=90)


def _shard_ids(rank: int) -> list[list[int]]:
    return [batch["id"].tolist() for batch in id_batches(*SHARDS[rank], BATCH_SIZE)]


@pytest.mark.timeout(120)
def test_truncate_takes_the_shortest_shards_steps(trained: list[dict[str, Any]]) -> None:
    for rank in range(WORLD_SIZE):
        result = trained[rank]["truncate"]
        assert result.ids == _shard_ids(rank)[:3]
        assert result.padding == [False] * 3


@pytest.mark.timeout(120)
def test_cycle_starts_the_short_shard_again(trained: list[dict[str, Any]]) -> None:
    assert trained[0]["cycle"].ids == _shard_ids(0)
    assert trained[1]["cycle"].ids == _shard_ids(1) * 3


@pytest.mark.timeout(120)
def test_pad_trains_every_row_once_in_equal_steps(trained: list[dict[str, Any]]) -> None:
    ran = [trained[rank]["pad"] for rank in range(WORLD_SIZE)]
    assert [len(result.ids) for result in ran] == [9, 9]
    assert ran[1].padding == [False] * 3 + [True] * 6
    assert sorted(ran[0].real_rows() + ran[1].real_rows()) == list(range(46))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_trained_the_steps_as_one_process_would(
    trained: list[dict[str, Any]], mode: str
) -> None:
    ran = [trained[rank][mode] for rank in range(WORLD_SIZE)]
    steps = [
        [[] if padding[step] else ids[step] for ids, padding in ((r.ids, r.padding) for r in ran)]
        for step in range(len(ran[0].ids))
    ]
    expected = reference_weights(steps, pad=mode == "pad")
    for result in ran:
        assert result.weights == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.timeout(120)
def test_join_is_refused_at_construction_on_every_rank(trained: list[dict[str, Any]]) -> None:
    """An FSDP2 model is no torch ``Joinable`` (only DDP and ZeroRedundancyOptimizer are), and
    join mode without one is refused: docs/stacks.md quotes both errors."""
    for rank in range(WORLD_SIZE):
        (as_joinable, kind), (without, message) = trained[rank]["join"]
        assert as_joinable == "TypeError" and "Joinable" in kind and "use pad" in kind
        assert without == "ValueError" and "joinables" in message


def test_docs_show_this_recipe() -> None:
    assert_documented("FSDP2", [Path(__file__)])
