"""Busy is never dead at scale (issue 64): many ranks on 2 cores beside a CPU hog, a short timeout.

The ranks are all alive and working; what is slow is the machine: creating ddp_even's gloo
group (a full mesh of W(W - 1)/2 connections), connecting to the job's store and the store's
answers, with W processes and a busy loop sharing two cores. None of that is a peer going
silent, so no rank may be named and every rank finishes its epoch.

``python -m tests.test_busy_at_scale W TIMEOUT HOGS`` runs the job once and prints the outcome
(the reproduction of the issue, at sizes a test cannot afford).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.spawn import RankError, run_ranks

TIMEOUT = 2.0
# The largest world the multi-rank tier affords on 2 cores (a run takes about a minute there).
WORLD_SIZE = 12


def _busy() -> None:
    while True:
        pass


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` busy loops beside the block, in processes of their own (as scripts/soak.py)."""
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_busy, daemon=True) for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def train_one_epoch(rank: int, world_size: int, timeout: float) -> dict[str, Any]:
    """A user's loop: uneven shards in cycle mode, a tiny DDP model averaging through
    ``allreduce_hook``; what this rank saw, or the error it raised."""
    import torch

    from ddp_even import EvenLoader, PeerTimeoutError, allreduce_hook

    began = time.monotonic()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = [torch.full((2, 1), float(rank))] * (3 + rank % 4)
    loader = EvenLoader(shard, mode="cycle", timeout=timeout)
    steps = 0
    try:
        for batch in loader:
            optimizer.zero_grad()
            model(batch).sum().backward()
            optimizer.step()
            steps += 1
    except PeerTimeoutError as error:
        return {"steps": steps, "error": str(error), "missing": list(error.missing_ranks)}
    return {"steps": steps, "error": None, "seconds": time.monotonic() - began}


def run_job(world_size: int, timeout: float, hogs: int, limit_s: float) -> list[Any]:
    with cpu_hogs(hogs):
        return run_ranks(
            train_one_epoch,
            world_size,
            timeout,
            timeout=limit_s,
            tcp_store=True,
            capture_exceptions=True,
        )


@pytest.mark.multirank
@pytest.mark.timing
@pytest.mark.timeout(300)
def test_no_live_rank_is_named_at_scale_beside_a_cpu_hog() -> None:
    """12 ranks, a 2 s timeout, a busy loop beside them: every rank takes the epoch's 6 steps
    (cycle: the longest shard's), none raises, none is named."""
    results = run_job(WORLD_SIZE, TIMEOUT, hogs=1, limit_s=240)
    longest = max(3 + rank % 4 for rank in range(WORLD_SIZE))
    for rank, result in enumerate(results):
        assert not isinstance(result, RankError), (rank, result)
        assert result["error"] is None, (rank, result)
        assert result["steps"] == longest, (rank, result)


if __name__ == "__main__":
    world, seconds, hog_count = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    limit = float(sys.argv[4]) if len(sys.argv) > 4 else 300.0
    started = time.monotonic()
    outcomes = run_job(world, seconds, hog_count, limit_s=limit)
    errors = [
        (rank, result) for rank, result in enumerate(outcomes) if isinstance(result, RankError)
    ]
    named = [
        (rank, result["error"][:400])
        for rank, result in enumerate(outcomes)
        if not isinstance(result, RankError) and result["error"]
    ]
    ok = len(outcomes) - len(errors) - len(named)
    seconds_taken = time.monotonic() - started
    lines = [f"W={world} timeout={seconds} hogs={hog_count}: {ok} finished, {seconds_taken:.1f} s"]
    lines += [f"{rank} {str(error)[:600]}" for rank, error in errors[:5] + named[:5]]
    sys.stdout.write("\n".join(lines) + "\n")
