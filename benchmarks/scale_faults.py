"""bench_scale's faults: the last rank SIGKILLed, or SIGSTOPped, among W; when each survivor
raised what.

* :func:`kill_phase`: the last rank kills itself just before its third ``backward()``, the DDP
  model averaging through ``ddp_even.allreduce_hook``: the others wait for it in DDP's
  all-reduce, and name it ``dead``.
* :func:`stop_phase`: the last rank stops itself (SIGSTOP) after its second batch, a loop
  agreeing every step and without a collective of its own: the others wait for it in ddp_even's
  agreement, and name it ``stalled``; a helper continues it ``timeout`` + 8 s later.

Each writes when the fault began to ``<workdir>/fault_at``, and returns what this rank raised
(:func:`outcome`); :func:`fault_summary` checks the survivors' outcomes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def outcome(error: Exception | None) -> dict[str, Any]:
    from ddp_even import PeerTimeoutError

    if error is None:
        return {"error": None}
    if not isinstance(error, PeerTimeoutError):
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    return {
        "error": "PeerTimeoutError",
        "at": time.time(),
        "missing": list(error.missing_ranks),
        "states": {str(key): value for key, value in error.states.items()},
    }


def _mark_fault(here: Path) -> None:
    (here / "fault_at").write_text(repr(time.time()))


def kill_phase(rank: int, world_size: int, shard: list[Any], here: Path, timeout: float) -> Any:
    import torch
    import torch.distributed as dist

    from ddp_even import EvenLoader, allreduce_hook

    hooked = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    hooked.register_comm_hook(None, allreduce_hook)
    loader = EvenLoader(shard, "truncate", timeout=timeout)
    dist.barrier()
    try:
        for step, batch in enumerate(loader):
            loss = hooked(batch).sum()
            if step == 2 and rank == world_size - 1:
                _mark_fault(here)
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
    except Exception as error:
        return outcome(error)
    return outcome(None)


def stop_phase(rank: int, world_size: int, here: Path, timeout: float) -> Any:
    import torch
    import torch.distributed as dist

    from ddp_even import EvenLoader

    loader = EvenLoader([torch.zeros(1)] * 8, "truncate", sync_every=1, timeout=timeout)
    dist.barrier()
    try:
        for step, _ in enumerate(loader):
            if step == 1 and rank == world_size - 1:
                # A stopped process cannot continue itself: a helper does.
                subprocess.Popen(["sh", "-c", f"sleep {timeout + 8}; kill -CONT {os.getpid()}"])
                _mark_fault(here)
                os.kill(os.getpid(), signal.SIGSTOP)
    except Exception as error:
        return outcome(error)
    return outcome(None)


def fault_summary(
    outcomes: list[dict[str, Any]], victim: int, state: str, fault_at: float | None
) -> dict[str, Any]:
    """Whether every survivor named ``victim`` in ``state``, and the fault's time to the last."""
    named = all(
        result["error"] == "PeerTimeoutError"
        and result["missing"] == [victim]
        and result["states"] == {str(victim): state}
        for result in outcomes
    )
    summary: dict[str, Any] = {"named": named}
    if named and fault_at is not None:
        summary["to_last_error_s"] = max(result["at"] for result in outcomes) - fault_at
    else:
        summary["outcomes"] = sorted({str(result) for result in outcomes})[:3]
    return summary
