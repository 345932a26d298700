"""Busy is never dead at scale: many ranks on 2 cores beside a CPU hog, a short timeout.

The ranks are all alive and working; what is slow is the machine: creating ddp_even's gloo
group (a full mesh of W(W - 1)/2 connections), connecting to the job's store and the store's
answers, with W processes and a busy loop sharing two cores. None of that is a peer going
silent, so no rank may be named and every rank finishes its epoch.

``python -m tests.test_busy_at_scale W TIMEOUT HOGS`` runs the job once and prints the outcome
(the reproduction of the issue, at sizes a test cannot afford).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.soak import busy_machine
from tests.helpers.spawn import RankError, run_ranks

TIMEOUT = 2.0
# The largest world the multi-rank tier affords on 2 cores (20 s idle, a minute under load).
WORLD_SIZE = 16


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
    with busy_machine(hogs):
        return run_ranks(
            train_one_epoch,
            world_size,
            timeout,
            timeout=limit_s,
            tcp_store=True,
            capture_exceptions=True,
        )


# The load it makes is its point: never beside the timing tests, and one at a time with the
# scale benchmark's smoke run (which bounds how soon it names a killed rank).
@pytest.mark.multirank
@pytest.mark.load
@pytest.mark.xdist_group("load")
@pytest.mark.timeout(300)
def test_no_live_rank_is_named_at_scale_beside_a_cpu_hog() -> None:
    """16 ranks, a 2 s timeout, a busy loop beside them: every rank takes the epoch's 6 steps
    (cycle: the longest shard's), none raises, none is named."""
    results = run_job(WORLD_SIZE, TIMEOUT, hogs=1, limit_s=240)
    longest = max(3 + rank % 4 for rank in range(WORLD_SIZE))
    for rank, result in enumerate(results):
        assert not isinstance(result, RankError), (rank, result)
        assert result["error"] is None, (rank, result)
        assert result["steps"] == longest, (rank, result)


def _fault_when_creating(fault: str, fault_file: str) -> None:
    """SIGKILL or SIGSTOP this process as its thread that creates ddp_even's group enters
    gloo's rendezvous (the others are in theirs), writing the time to ``fault_file`` first; a
    stopped one is continued 10 s later."""
    import os
    import signal
    import subprocess
    import threading

    import torch.distributed as dist

    from ddp_even.agreement.control_group import _CREATOR

    new_group = dist.new_group

    def faulted(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == _CREATOR:
            if fault == "stop":
                subprocess.Popen(["sh", "-c", f"sleep 10; kill -CONT {os.getpid()}"])
            with open(fault_file, "w") as written:
                written.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return new_group(*args, **kwargs)

    dist.new_group = faulted


def lost_while_creating(
    rank: int, world_size: int, victim: int, fault: str, fault_file: str
) -> dict[str, Any]:
    import torch

    from ddp_even import EvenLoader, PeerTimeoutError

    if rank == victim:
        _fault_when_creating(fault, fault_file)
    loader = EvenLoader([torch.zeros(1)] * 4, mode="truncate", timeout=TIMEOUT)
    try:
        steps = len(list(loader))
    except PeerTimeoutError as error:
        return {
            "missing": list(error.missing_ranks),
            "states": dict(error.states),
            "late": error.late,
            "at": time.time(),
            "message": str(error),
        }
    return {"steps": steps}


@pytest.mark.multirank
@pytest.mark.timing
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "victim", "state"), [("kill", 1, "dead"), ("stop", 2, "stalled"), ("kill", 0, "dead")]
)
def test_a_rank_lost_while_the_group_is_created_is_named(
    fault: str, victim: int, state: str, tmp_path: Path
) -> None:
    """Gloo's rendezvous waits under the training group's timeout (20 s here): a rank killed or
    frozen inside it is named from the heartbeats by every survivor, within ``timeout`` + 5 s
    of the fault (rank 0's death takes the store with it: named as the store's host). The
    bound runs from the fault, not the loader's start: on a busy machine the set-up before the
    rendezvous alone took 4.5 s."""
    fault_file = tmp_path / "fault"
    results = run_ranks(
        lost_while_creating,
        3,
        victim,
        fault,
        str(fault_file),
        timeout=90,
        capture_exceptions=True,
        pg_timeout=20,
        tcp_store=True,
    )
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(result, dict) and "missing" in result, (rank, result)
        assert result["missing"] == [victim], (rank, result)
        assert result["states"] == {victim: state}, (rank, result)
        assert not result["late"], (rank, result)
        assert result["at"] - float(fault_file.read_text()) <= TIMEOUT + 5, (rank, result)
    if fault == "stop":
        late = results[victim]
        assert isinstance(late, dict) and late.get("late"), late


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
