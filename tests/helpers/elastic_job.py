"""A planned job that is preempted on N ranks and finishes its epoch on another number.

Run with ``torchrun --nproc-per-node N tests/helpers/elastic_job.py OUT URL MODE [--kill]
[--round-robin]``. Trains one epoch of a DDP model over ``EvenLoader.from_parquet(URL,
sharding="rows")`` (``--round-robin``: petastorm's round robin of row groups, uneven shards) read
with seeded row-group and row shuffles by three reader threads (an order ddp_even computes),
checkpointing model, optimizer, loader and the ids trained so far every
``CHECKPOINT_EVERY`` steps into ``OUT`` (``ckpt-<step>-rank<r>.pt``). With ``--kill`` rank
``VICTIM`` SIGKILLs itself at step ``KILL_AT``. Started again with another number of ranks, rank
``r`` resumes from old rank ``r``'s checkpoint at the newest step every old rank saved, and
writes the ids it trains on in the rest of the epoch (padding left out) to ``trained-<r>.json``
and the epoch's statistics to ``stats.json`` (rank 0).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_even import EvenLoader

BATCH = 8
CHECKPOINT_EVERY = 2
VICTIM = 1
KILL_AT = 5


def _common_checkpoint_step(out: Path) -> int | None:
    """The newest step every rank of the earlier job saved a checkpoint at."""
    by_rank: dict[int, set[int]] = {}
    for path in out.glob("ckpt-*-rank*.pt"):
        step, rank = path.stem.removeprefix("ckpt-").split("-rank")
        by_rank.setdefault(int(rank), set()).add(int(step))
    if not by_rank:
        return None
    common = set.intersection(*by_rank.values())
    return max(common) if common else None


def main() -> None:
    out, url, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    kill = "--kill" in sys.argv[4:]
    sharding = "round_robin" if "--round-robin" in sys.argv[4:] else "rows"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = torch.nn.Linear(1, 1)
    step_to_resume = _common_checkpoint_step(out)
    checkpoint: dict[str, Any] | None = None
    if step_to_resume is not None:
        checkpoint = torch.load(out / f"ckpt-{step_to_resume}-rank{rank}.pt")
        module.load_state_dict(checkpoint["model"])
    model = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = EvenLoader.from_parquet(
        url,
        BATCH,
        mode,
        sharding=sharding,
        joinables=[model] if mode == "join" else (),
        reader_kwargs={"seed": 3, "shuffle_rows": True},
        timeout=60,
    )
    trained: list[int] = []
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])
    for batch in loader:
        loss = model(batch["value"].reshape(-1, 1).float() / 100).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not loader.padding:
            trained += [int(row) for row in batch["id"]]
        step = loader.state_dict()["step"]
        if checkpoint is None and step % CHECKPOINT_EVERY == 0:
            state = {
                "model": module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(),
                "trained": list(trained),
            }
            partial = out / f"ckpt-{step}-rank{rank}.partial"
            torch.save(state, partial)
            partial.rename(out / f"ckpt-{step}-rank{rank}.pt")
        if kill and rank == VICTIM and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
    if checkpoint is not None:
        (out / f"trained-{rank}.json").write_text(json.dumps(trained))
        if rank == 0:
            (out / "stats.json").write_text(json.dumps(loader.stats.as_dict()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
