"""Run ``examples/train.py`` as 2-node torchrun jobs on loopback and count the clean exits.

Each job is two torchrun agents on the local machine (node ranks 0 and 1, 2 workers each, 4 ranks),
meeting through torchrun's c10d rendezvous on a free loopback port. Every worker trains one
short epoch over a small skewed dataset in one EvenLoader mode, destroys the process group and
leaves through the interpreter's ordinary shutdown (no ``os._exit``). A job is clean when both
agents exit 0 and no output holds "terminate called".

    .venv/bin/python -m benchmarks.clean_exit_runs --runs 10     # 10 jobs per mode, 30 in all

Why: ddp_even kept its gloo groups alive past ``destroy_process_group()``, and a gloo worker
thread that released the last collective's tensors after the interpreter had begun finalizing
aborted the finished worker (SIGABRT, "terminate called without an active exception"): about
one such job in four on a 2-core machine, before ddp_even released its groups at exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MODES = ("truncate", "cycle", "join")
NODES = 2
WORKERS_PER_NODE = 2
# Rows per row group: petastorm's round robin gives the 4 ranks 17, 7, 7 and 2 rows.
ROW_GROUP_SIZES = (12, 3, 7, 2, 5, 4)
BATCH_SIZE = 4
# After one agent has exited, how long the other may take: an agent whose peer failed waits in
# the rendezvous for minutes.
_PEER_GRACE_S = 15.0
# Launcher variables this process may have inherited (from a torchrun of its own, say).
_LAUNCH_VARIABLES = frozenset(
    [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ]
)


@dataclass(frozen=True)
class JobOutcome:
    """One 2-node job: each agent's exit status (None: ended by a signal, such as the kill at
    the time limit), and the agents' output."""

    returncodes: tuple[int | None, ...]
    output: str
    seconds: float

    @property
    def clean(self) -> bool:
        return all(code == 0 for code in self.returncodes) and "terminate called" not in self.output


def write_dataset(directory: Path) -> str:
    """The skewed dataset (the examples' own writer); its ``file://`` URL."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from skewed_parquet import write_skewed_dataset
    finally:
        sys.path.remove(str(REPO / "examples"))
    write_skewed_dataset(directory, ROW_GROUP_SIZES)
    return directory.resolve().as_uri()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def train_command(data_url: str, mode: str, node_rank: int, port: int) -> list[str]:
    return [
        TORCHRUN,
        f"--nnodes={NODES}",
        f"--nproc-per-node={WORKERS_PER_NODE}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=clean-exit-{port}",
        str(TRAIN),
        *("--data", data_url, "--mode", mode, "--epochs", "1"),
        *("--batch-size", str(BATCH_SIZE)),
    ]


def run_two_node_job(data_url: str, mode: str, workdir: Path, timeout: float) -> JobOutcome:
    """One job: both agents started at once; whatever is left after ``timeout`` s is killed."""
    env = {name: value for name, value in os.environ.items() if name not in _LAUNCH_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    port = free_port()
    started = time.monotonic()
    logs = [workdir / f"node{node}.log" for node in range(NODES)]
    agents = []
    try:
        for node, log in enumerate(logs):
            with log.open("wb") as out:
                agents.append(
                    subprocess.Popen(
                        train_command(data_url, mode, node, port),
                        cwd=workdir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # killed whole, workers included
                    )
                )
        _wait(agents, started + timeout)
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    output = "\n".join(log.read_text(errors="replace") for log in logs)
    codes = tuple(agent.returncode if agent.returncode >= 0 else None for agent in agents)
    return JobOutcome(codes, output, time.monotonic() - started)


def _wait(agents: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
    """Until every agent has exited, ``_PEER_GRACE_S`` after the first, or ``deadline``."""
    while any(agent.poll() is None for agent in agents):
        now = time.monotonic()
        if any(agent.poll() is not None for agent in agents):
            deadline = min(deadline, now + _PEER_GRACE_S)
        if now >= deadline:
            return
        time.sleep(0.1)


@click.command()
@click.option(
    "--runs", type=click.IntRange(min=1), default=10, show_default=True, help="Jobs per mode."
)
@click.option("--mode", "modes", multiple=True, type=click.Choice(MODES), default=MODES)
@click.option("--timeout", type=float, default=180.0, show_default=True, help="Seconds a job.")
def main(runs: int, modes: tuple[str, ...], timeout: float) -> None:
    """Run 2-node torchrun jobs of examples/train.py, mode after mode; exit 1 on any unclean."""
    clean = 0
    with tempfile.TemporaryDirectory(prefix="ddp-even-clean-exit-") as temporary:
        data_url = write_dataset(Path(temporary) / "data")
        for mode in modes:
            for index in range(runs):
                workdir = Path(temporary) / f"{mode}-{index}"
                workdir.mkdir()
                outcome = run_two_node_job(data_url, mode, workdir, timeout)
                clean += outcome.clean
                print(
                    f"{mode} {index + 1}/{runs}: exit codes {outcome.returncodes}, "
                    f"{outcome.seconds:.1f} s{'' if outcome.clean else ', NOT CLEAN'}",
                    flush=True,
                )
                if not outcome.clean:
                    print(outcome.output[-4000:], flush=True)
    total = runs * len(modes)
    print(f"{clean} of {total} 2-node jobs exited cleanly")
    sys.exit(0 if clean == total else 1)


if __name__ == "__main__":
    main()
