"""A training job that checkpoints and resumes, for ``torchrun --max-restarts``.

Run with ``torchrun --nproc-per-node N --max-restarts M tests/helpers/resume_job.py OUT
[--kill]``, or call :func:`uninterrupted` on ranks in a process group. For each mode in turn
it trains two epochs over per-rank lists of batches of sample ids (uneven lengths),
checkpointing model, optimizer and loader every ``CHECKPOINT_EVERY`` steps into ``OUT``. With
``--kill``, attempt ``k`` (torchrun's restart count) SIGKILLs rank ``VICTIM`` mid-epoch in the
``k``-th mode, so every mode is interrupted once; the restarted job skips the modes already
done and resumes the interrupted one from its last checkpoint. Each rank writes what it
trained on (``trained-<mode>-<rank>.json``: per epoch, the sample ids of each step, truncated
back to the checkpoint on resume) and the final weights (``weights-<mode>-<rank>.json``).
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

MODES = ("truncate", "cycle", "join")
LENGTHS = (7, 11, 4, 9)
CHECKPOINT_EVERY = 2
VICTIM = 1
# The step of epoch 1 at which the victim is killed, per mode (not on a checkpoint step).
KILL_AT = {"truncate": 3, "cycle": 7, "join": 5}
EPOCHS = 2


def shard(rank: int) -> list[list[int]]:
    return [[rank * 1000 + index] for index in range(LENGTHS[rank])]


def _write(path: Path, document: Any) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(document))
    partial.rename(path)


def _save(path: Path, checkpoint: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    torch.save(checkpoint, partial)
    partial.rename(path)


def _latest_checkpoint(out: Path, mode: str, rank: int) -> Path | None:
    """Rank 0's newest checkpoint step, and this rank's newest at or before it.

    A rank that ran out of data in join mode stopped checkpointing earlier: its older state
    resumes it correctly (it agrees on the step with the others, then reads past its shard).
    """

    def steps(of_rank: int) -> list[tuple[int, int]]:
        found = []
        for path in out.glob(f"ckpt-{mode}-*-*-rank{of_rank}.pt"):
            _, _, epoch, step, _ = path.stem.split("-")
            found.append((int(epoch), int(step)))
        return sorted(found)

    newest = steps(0)
    if not newest:
        return None
    mine = [point for point in steps(rank) if point <= newest[-1]]
    if not mine:
        return None
    epoch, step = mine[-1]
    return out / f"ckpt-{mode}-{epoch}-{step}-rank{rank}.pt"


def run_mode(out: Path, mode: str, rank: int, kill: bool, attempt: int) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(1, 1)
    checkpoint_path = _latest_checkpoint(out, mode, rank)
    checkpoint = torch.load(checkpoint_path) if checkpoint_path is not None else None
    if checkpoint is not None:
        module.load_state_dict(checkpoint["model"])
    model = torch.nn.parallel.DistributedDataParallel(module)  # every replica: rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    joinables = [model] if mode == "join" else ()
    loader: EvenLoader[Any] = EvenLoader(shard(rank), mode, joinables=joinables, timeout=60)
    log_path = out / f"trained-{mode}-{rank}.json"
    trained: list[list[list[int]]] = [[] for _ in range(EPOCHS)]
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])
        # What was trained on up to the checkpoint; later steps are trained on again.
        trained = checkpoint["trained"]
    for epoch in range(loader.state_dict()["epoch"], EPOCHS):
        for batch in loader:
            inputs = torch.tensor(batch, dtype=torch.float32).reshape(-1, 1) / 1000
            loss = (model(inputs) - 1.0).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trained[epoch].append(batch)
            _write(log_path, trained)
            step = loader.state_dict()["step"]
            if step % CHECKPOINT_EVERY == 0:
                _save(
                    out / f"ckpt-{mode}-{epoch}-{step}-rank{rank}.pt",
                    {
                        "model": module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "loader": loader.state_dict(),
                        "trained": trained,
                    },
                )
            killed_now = attempt < len(MODES) and MODES[attempt] == mode
            if kill and rank == VICTIM and killed_now and (epoch, step) == (1, KILL_AT[mode]):
                os.kill(os.getpid(), signal.SIGKILL)
    _write(log_path, trained)
    weights = [value for param in model.parameters() for value in param.reshape(-1).tolist()]
    _write(out / f"weights-{mode}-{rank}.json", weights)


def uninterrupted(rank: int, world_size: int, out: Path) -> None:
    """The reference: every mode trained without a kill, on ranks already in a process group
    (``tests/helpers/spawn.py``'s, whose fork server has imported torch: no torchrun attempt
    and four fresh interpreters for it)."""
    torch.set_num_threads(1)
    run_modes(out, rank, kill=False, attempt=0)


def run_modes(out: Path, rank: int, kill: bool, attempt: int) -> None:
    """Every mode in turn but those a lost attempt finished (its final weights are written)."""
    for mode in MODES:
        if (out / f"weights-{mode}-{rank}.json").exists():
            continue  # done before a restart
        run_mode(out, mode, rank, kill, attempt)
        dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    kill = "--kill" in sys.argv[2:]
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A store namespace per attempt: with torch 2.13, gloo's rendezvous on a restart otherwise
    # finds the lost attempt's addresses in torchrun's store and fails to connect.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt-{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    run_modes(out, dist.get_rank(), kill, attempt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
