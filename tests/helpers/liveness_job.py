"""A training loop that pauses, dies or freezes at one point, on one rank: the liveness tests'.

With ``ddp`` every step is a real DDP step (one all-reduce of the gradients, an optimizer
step); without, the loop has no collective of its own and whoever waits for a peer waits in
ddp_even. Rank ``r``'s shard has ``6 + 2 r`` batches, so truncate takes 6 steps an epoch; two
epochs. The points (:data:`POINTS`):

* ``before_first_epoch``: the loader is made, its first ``for`` not yet begun (a long set-up);
* ``between_epochs``: after the first epoch's loop, before the second's;
* ``between_steps``: after the second batch of the first epoch was handed out (the training
  step, a checkpoint, an evaluation);
* ``inside_step``: inside the loader, while its source reads the fourth batch (a slow read);
* ``last_step``: after the first epoch's last batch was handed out, before the loop asks for
  the next (when the epoch's statistics are gathered);
* ``inside_backward`` (with ``ddp`` only): in the third step, just before ``backward()``, so that
  the others wait for it in DDP's own all-reduce of the gradients.

And ``before_loader`` (not among :data:`POINTS`): before the loader is made, for a rank whose
set-up ends after another rank's fault (the ``await_fault`` action).

Shapes: ``known`` (a sized sequence: one agreement per epoch, then checks of the sources every
16 steps and after the last) and ``windows`` (a factory: an agreement before every step).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

POINTS = (
    "before_first_epoch",
    "between_epochs",
    "between_steps",
    "inside_step",
    "last_step",
    "inside_backward",
)
EPOCHS = 2
STEPS = 6


@dataclass(frozen=True)
class Act:
    """What ``victim`` does at ``point`` (in the first epoch only)."""

    point: str
    victim: int
    # "pause" (sleeps ``seconds``), "kill" (SIGKILL to itself), "stop" (SIGSTOP to itself,
    # continued ``seconds`` later by a helper process) or "hold_gil" (one call into C that keeps
    # the GIL for several seconds: no other thread of the process runs meanwhile) or
    # "await_fault" (waits until another rank's fault has begun, then ``seconds`` more).
    action: str
    seconds: float = 0.0


@dataclass(frozen=True)
class Job:
    """Two epochs of ``mode`` (truncate, or join with the DDP model as its joinable) in
    ``shape``, doing ``acts`` on the way."""

    acts: tuple[Act, ...]
    shape: str = "known"
    timeout: float = 2.0
    ddp: bool = False
    # The loop registers ``ddp_even.allreduce_hook`` on the DDP model itself.
    hook: bool = False
    mode: str = "truncate"


def shard_of(rank: int) -> list[list[int]]:
    return [[rank * 1000 + index] for index in range(STEPS + 2 * rank)]


def expected_epochs(rank: int) -> list[list[list[int]]]:
    """What every epoch hands out on ``rank`` (truncate: the first :data:`STEPS` batches)."""
    return [shard_of(rank)[:STEPS]] * EPOCHS


class _Shard(Sequence[list[int]]):
    """A rank's batches with a known length, whose read of one batch may do the act."""

    def __init__(self, batches: list[list[int]], on_read: Any) -> None:
        self._batches = batches
        self._on_read = on_read

    def __len__(self) -> int:
        return len(self._batches)

    @overload
    def __getitem__(self, index: int) -> list[int]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[list[int]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, int):
            self._on_read(index)
        return self._batches[index]


# Before a SIGSTOP: two beats (of a 2 s timeout's) so that the heartbeat says where it froze.
SETTLE_S = 1.0


def act_now(act: Act, marks: Path) -> None:
    """Do ``act`` here, writing when it began to ``marks`` first."""
    if act.action == "stop":
        # What a frozen peer was doing is what its last heartbeat said: a rank that froze
        # right after a change is described as it was up to one beat before.
        time.sleep(SETTLE_S)
    (marks / f"fault-{act.victim}-{act.point}").write_text(repr(time.time()))
    if act.action == "pause":
        time.sleep(act.seconds)
    elif act.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif act.action == "stop":
        # A stopped process cannot continue itself: a helper in its process group does.
        subprocess.Popen(["sh", "-c", f"sleep {act.seconds}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    elif act.action == "await_fault":
        while not any(mark.name != f"fault-{act.victim}-{act.point}" for mark in marks.iterdir()):
            time.sleep(0.02)
        time.sleep(act.seconds)
    elif act.action == "hold_gil":
        # A regular expression that backtracks 2**27 times: 5 to 20 s in C, the GIL held.
        re.match(r"(a+)+$", "a" * 27 + "b")
    else:
        raise ValueError(act.action)


def run_job(rank: int, world_size: int, job: Job, marks: str, group: Any = None) -> dict[str, Any]:
    """Two epochs in truncate mode; each act's victim does it at its point."""
    import torch

    from ddp_even import EvenLoader, PeerTimeoutError

    here = Path(marks)
    epoch_now = [0]

    def at(point: str) -> None:
        for act in job.acts:
            if act.victim == rank and act.point == point and epoch_now[0] == 0:
                act_now(act, here)

    def on_read(index: int) -> None:
        if index == 3:
            at("inside_step")

    batches = shard_of(rank)
    source: Any
    if job.shape == "known":
        source = _Shard(batches, on_read)
    else:

        def one_pass() -> Iterator[list[int]]:
            for index, batch in enumerate(batches):
                on_read(index)
                yield batch

        source = one_pass
    sync_every = 1 if job.shape == "windows" else None
    step, model = _step_function(job.ddp, job.hook)
    at("before_loader")
    loader: EvenLoader[Any] = EvenLoader(
        source,
        job.mode,  # type: ignore[arg-type]
        sync_every=sync_every,
        group=group,
        timeout=job.timeout,
        joinables=[model] if job.mode == "join" else (),
    )
    seen: list[list[list[int]]] = []
    began = time.time()
    try:
        at("before_first_epoch")
        for epoch in range(EPOCHS):
            epoch_now[0] = epoch
            seen.append([])
            for batch in loader:
                seen[-1].append(batch)
                inputs = torch.tensor(batch, dtype=torch.float32).reshape(-1, 1)
                step(inputs, lambda: at("inside_backward") if len(seen[-1]) == 3 else None)
                if len(seen[-1]) == 2:
                    at("between_steps")
                if len(seen[-1]) == STEPS:
                    at("last_step")
            at("between_epochs")
    except PeerTimeoutError as error:
        return {
            "error": "PeerTimeoutError",
            "at": time.time(),
            "missing": error.missing_ranks,
            "states": error.states,
            "late": error.late,
            "timeout": error.timeout,
            "message": str(error),
            "seen": seen,
        }
    return {"error": None, "seen": seen, "seconds": time.time() - began}


def run_on_ranks(
    job: Job, world_size: int = 2, **kwargs: Any
) -> tuple[list[Any], dict[tuple[int, str], float]]:
    """``job`` on ``world_size`` spawned ranks (``run_ranks``' keywords, exceptions captured):
    each rank's result, and when each fault began, by (victim, point), on the victim's clock.

    The fault times go through a temporary folder, removed before this returns.
    """
    # Here, not at the top: torchrun runs this file as a script, where ``tests`` is no package.
    from tests.helpers.spawn import run_ranks

    with tempfile.TemporaryDirectory(prefix="ddp-even-faults-") as marks:
        results = run_ranks(run_job, world_size, job, marks, capture_exceptions=True, **kwargs)
        faults = {}
        for mark in Path(marks).glob("fault-*"):
            _, victim, point = mark.name.split("-", 2)
            faults[int(victim), point] = float(mark.read_text())
    return results, faults


def _step_function(ddp: bool, hook: bool) -> tuple[Any, Any]:
    """One training step, ``step(inputs, before_backward)``: a real DDP step, or a short sleep
    with no collective; and the DDP model (None without)."""
    import torch

    import ddp_even

    if not ddp:
        return lambda inputs, before_backward: time.sleep(0.002), None
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    if hook:
        model.register_comm_hook(None, ddp_even.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(inputs: Any, before_backward: Any) -> None:
        loss = model(inputs / 1000).pow(2).mean()
        optimizer.zero_grad()
        before_backward()
        loss.backward()
        optimizer.step()

    return step, model


def main() -> None:
    """Under torchrun: ``liveness_job.py OUT JOB_JSON``; each rank writes ``OUT/result-<rank>``."""
    import json
    import sys

    import torch.distributed as dist

    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    job = Job(
        tuple(Act(**act) for act in spec.pop("acts")),
        **spec,
    )
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = run_job(rank, dist.get_world_size(), job, str(out))
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
