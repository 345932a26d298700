"""bench_scale's faults: the last rank SIGKILLed, or SIGSTOPped, among W; when each survivor
raised what.

* :func:`kill_phase`: the last rank kills itself just before its third ``backward()``, the DDP
  model averaging through ``ddp_even.allreduce_hook``: the others wait for it in DDP's
  all-reduce, and name it ``dead``.
* :func:`stop_phase`: the last rank stops itself (SIGSTOP) after its second batch, a loop
  agreeing every step and without a collective of its own: the others wait for it in ddp_even's
  agreement, and name it ``stalled``; a helper continues it ``timeout`` + 8 s later.
* :func:`parquet_kill_phase`: a fresh job's first loader (so ddp_even's group is created under
  the short ``timeout``, beside the CPU hogs) reads the Parquet dataset in cycle mode, with
  from_parquet's pyarrow reader or petastorm's own (``make_batch_reader``, one worker,
  ``cur_shard``/``shard_count``); the last rank kills itself before its third ``backward()``.

The fault phases run beside CPU hogs (``scripts/soak.py``'s busy loops,
:func:`scripts.soak.busy_machine`): a live rank starved of CPU must not be named, only the victim.

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
        "message": str(error)[:600],
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


def parquet_kill_phase(
    rank: int, world_size: int, dataset: Path, here: Path, timeout: float, reader: str
) -> Any:
    import torch

    from ddp_even import EvenLoader, allreduce_hook

    hooked = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    hooked.register_comm_hook(None, allreduce_hook)
    loader: Any
    if reader == "petastorm":
        from petastorm import make_batch_reader
        from petastorm.pytorch import BatchedDataLoader

        url = dataset.resolve().as_uri()

        def one_pass() -> Any:
            return BatchedDataLoader(
                make_batch_reader(
                    url, num_epochs=1, workers_count=1, cur_shard=rank, shard_count=world_size
                ),
                batch_size=4,
            )

        loader = EvenLoader(one_pass, "cycle", timeout=timeout)
    else:
        loader = EvenLoader.from_parquet(str(dataset), 4, "cycle", timeout=timeout)
    # The error's time is taken where it is raised: leaving the loop then closes the epoch's
    # readers (petastorm's, on 34 processes sharing 2 cores, take seconds), timed apart.
    batches = iter(loader)
    result = outcome(None)
    steps = 0
    try:
        for step, batch in enumerate(batches):
            steps = step + 1
            loss = hooked(batch["x"].reshape(-1, 1).float()).sum()
            if step == 2 and rank == world_size - 1:
                _mark_fault(here)
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                loss.backward()
            except Exception as error:
                result = outcome(error)
                raise
    except Exception as error:
        if result["error"] is None:  # raised by the loader itself
            result = outcome(error)
    del batches
    if "at" in result:
        result["closed_s"] = time.time() - result["at"]
        result["steps"] = steps  # batches it had when it raised: behind the others, or not
    return result


def fault_summary(
    outcomes: list[dict[str, Any]], victim: int, state: str, fault_at: float | None
) -> dict[str, Any]:
    """Whether every survivor named ``victim`` in ``state``, and the fault's time to the last."""
    wrong = [
        result
        for result in outcomes
        if not (
            result["error"] == "PeerTimeoutError"
            and result["missing"] == [victim]
            and result["states"] == {str(victim): state}
        )
    ]
    named = not wrong
    summary: dict[str, Any] = {"named": named}
    if named and fault_at is not None:
        summary["to_last_error_s"] = max(result["at"] for result in outcomes) - fault_at
        closed = [result["closed_s"] for result in outcomes if "closed_s" in result]
        if closed:
            summary["closing_readers_s"] = max(closed)
            last = max(outcomes, key=lambda result: result["at"])
            summary["last_survivors_batches"] = last["steps"]
    else:
        summary["outcomes"] = sorted({str(result) for result in wrong or outcomes})[:3]
    return summary
