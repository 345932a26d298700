"""Share mode on 3 gloo ranks, a rank killed (SIGKILL) in the middle of a window that hands
batches over: every survivor raises ``PeerTimeoutError`` naming the dead rank, within the
loader's ``timeout`` + 5 s of its death, and none hangs.

Rank 0 holds 20 batches of 4 MB, ranks 1 and 2 two each; in windows of 4 steps every rank takes
8, rank 0 sending 2 batches to each of the others in the first window and 4 in the second. The
victim kills itself at step 4, just after taking the second window's first batch: the window's
batches are then on their way (a sender killed: the receivers, waiting for them, name it in the
hand-over) or waited for (a receiver killed).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_even import EvenLoader, PeerTimeoutError
from tests.helpers.spawn import RankError, run_ranks

# timing: these tests bound how soon a fault is named; in_memory: lists of tensors only
# (pyproject.toml's markers).
pytestmark = [pytest.mark.multirank, pytest.mark.timing, pytest.mark.in_memory]

COUNTS = (20, 2, 2)
SYNC_EVERY = 4
KILLED_AT = 4
TIMEOUT = 5.0


def _batches(rank: int) -> Any:
    first = sum(COUNTS[:rank])

    def one_pass() -> Any:
        for index in range(first, first + COUNTS[rank]):
            yield {"id": torch.tensor([index]), "x": torch.zeros(1_000_000)}

    return one_pass


def _killed_mid_window(rank: int, world_size: int, victim: int, folder: str) -> dict[str, Any]:
    """One share epoch; ``victim`` writes when it dies, at step ``KILLED_AT``; the others
    report what stopped them, and when."""
    loader = EvenLoader(_batches(rank), mode="share", sync_every=SYNC_EVERY, timeout=TIMEOUT)
    seen: list[tuple[int, bool]] = []
    try:
        for step, batch in enumerate(loader):
            seen.append((int(batch["id"][0]), loader.padding))
            if rank == victim and step == KILLED_AT:
                (Path(folder) / "died").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
    except PeerTimeoutError as error:
        return {
            "missing": error.missing_ranks,
            "states": error.states,
            "message": str(error),
            "at": time.time(),
            "seen": seen,
        }
    return {"missing": None, "seen": seen}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", [0, 1], ids=["sender", "receiver"])
def test_a_rank_killed_mid_hand_over_is_named_by_every_survivor(
    victim: int, tmp_path: Path
) -> None:
    results = run_ranks(
        _killed_mid_window, 3, victim, str(tmp_path), timeout=120, capture_exceptions=True
    )
    died = float((tmp_path / "died").read_text())
    assert results[victim] == RankError(
        "ProcessExited", f"rank {victim} died (signal SIGKILL) without a result"
    )
    survivors = [rank for rank in range(3) if rank != victim]
    for rank in survivors:
        named = results[rank]
        assert isinstance(named, dict), (rank, named)  # ddp_even's error, not gloo's
        assert named["missing"] == (victim,), (rank, named)
        assert named["states"] == {victim: "dead"}, (rank, named)
        assert f"rank(s) {victim} did not answer" in named["message"], (rank, named)
        assert named["at"] - died <= TIMEOUT + 5, (rank, named)
        if victim == 0:  # the receivers were waiting for the dead sender's batches
            assert "did not answer the hand-over of a batch" in named["message"], (rank, named)
    if victim == 1:  # rank 2 trained on rank 0's batches before rank 1 died
        assert any(index < COUNTS[0] for index, _ in results[2]["seen"]), results[2]
