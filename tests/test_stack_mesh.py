"""A 2-D device mesh (``dp`` by ``tp``, 2 by 2 on 4 gloo ranks): the recipe of docs/stacks.md.

The model is tensor parallel over ``tp`` (``parallelize_module``: its first Linear split by
columns, its second by rows) and sharded by FSDP2 over ``dp``. Both tp ranks of a dp rank read
that dp rank's shard; EvenLoader agrees over ``group=mesh.get_group("dp")``. One job trains in
truncate, cycle and pad and tries join; the test checks that the tp ranks got identical batches
at every step, that pad covered every row once per tp position, and the gathered weights
against the same steps trained in one process.

4 ranks on 2 cores: one job for every mode.
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
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("stack-mesh")]

WORLD_SIZE = 4
DP, TP = 2, 2
BATCH_SIZE = 4
# dp rank 0: ids 0..27, 7 batches; dp rank 1: ids 28..37, 3 batches (the last of 2).
SHARDS = ((0, 28), (28, 38))
MODES = ("truncate", "cycle", "pad")


def _train(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    # The shard of this rank's dp coordinate: the same on both of its tp ranks.
    shard = id_batches(*SHARDS[dp_rank], BATCH_SIZE)
    results: dict[str, Any] = {"coordinates": (dp_rank, mesh.get_local_rank("tp"))}
    for mode in MODES:
        seen = Seen()
        model = make_model()
        # Tensor parallel over tp: the first Linear split by columns, the second by rows.
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])  # and sharded over dp
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        # The steps agreed over dp: the tp ranks of a dp rank read the same batches.
        loader = EvenLoader(shard, mode=mode, group=mesh.get_group("dp"))
        for batch in loader:
            features, labels = to_tensors(batch)
            loss = torch.nn.functional.mse_loss(model(features), labels)
            (loss * loader.batch_weight).backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.add(batch, loader)
        seen.keep_weights(p.full_tensor() for p in model.parameters())
        results[mode] = seen
    results["join"] = _join_errors(mesh, shard, model)
    return results


def _join_errors(mesh: Any, shard: Any, model: torch.nn.Module) -> list[tuple[str, str]]:
    """What join mode says over the dp group, with the 2-D model as a joinable and without."""
    errors = []
    for joinables in ([model], []):
        try:
            EvenLoader(shard, mode="join", group=mesh.get_group("dp"), joinables=joinables)
        except Exception as exc:
            errors.append((type(exc).__name__, str(exc)))
        else:
            errors.append(("", "accepted"))
    return errors


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_ranks(_train, WORLD_SIZE, timeout=150)


def _by_coordinates(trained: list[dict[str, Any]], mode: str) -> dict[tuple[int, int], Seen]:
    return {result["coordinates"]: result[mode] for result in trained}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", MODES)
def test_the_tp_ranks_of_a_dp_rank_get_identical_batches(
    trained: list[dict[str, Any]], mode: str
) -> None:
    # The mesh's layout: rank = dp * TP + tp.
    assert [result["coordinates"] for result in trained] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ran = _by_coordinates(trained, mode)
    steps = {"truncate": 3, "cycle": 7, "pad": 7}[mode]
    for dp_rank in range(DP):
        first, second = ran[dp_rank, 0], ran[dp_rank, 1]
        assert len(first.ids) == steps
        assert first.ids == second.ids
        assert first.padding == second.padding
        assert first.batch_weights == second.batch_weights


@pytest.mark.timeout(180)
def test_pad_covers_every_row_once_per_tp_position(trained: list[dict[str, Any]]) -> None:
    ran = _by_coordinates(trained, "pad")
    for tp_rank in range(TP):
        real = ran[0, tp_rank].real_rows() + ran[1, tp_rank].real_rows()
        assert sorted(real) == list(range(38))
    assert ran[1, 0].padding == [False] * 3 + [True] * 4


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", MODES)
def test_the_2d_model_trained_the_steps_as_one_process_would(
    trained: list[dict[str, Any]], mode: str
) -> None:
    ran = _by_coordinates(trained, mode)
    steps = [
        [[] if ran[dp, 0].padding[step] else ran[dp, 0].ids[step] for dp in range(DP)]
        for step in range(len(ran[0, 0].ids))
    ]
    expected = reference_weights(steps, pad=mode == "pad")
    for result in ran.values():
        assert result.weights == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.timeout(180)
def test_join_is_refused_at_construction(trained: list[dict[str, Any]]) -> None:
    """Join shadows DDP's all-reduces; a tensor-parallel, FSDP2-sharded model is no torch
    ``Joinable``, and without one join mode is refused: docs/stacks.md quotes both errors."""
    for result in trained:
        (as_joinable, kind), (without, message) = result["join"]
        assert as_joinable == "TypeError" and "Joinable" in kind and "use pad" in kind
        assert without == "ValueError" and "joinables" in message


def test_docs_show_this_recipe() -> None:
    assert_documented("A 2-D device mesh", [Path(__file__)])
