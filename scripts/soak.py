"""Soak: the multi-rank scenario suites again and again under load, until one hangs.

    .venv/bin/python scripts/soak.py --runs 200                 # the long soak
    .venv/bin/python scripts/soak.py --runs 3 --suite every-mode   # CI's short one

Each run is one pytest process over a suite of multi-rank tests (gloo ranks started by
``tests/helpers/spawn.py``) with a fresh seed in ``DDP_EVEN_SOAK_SEED``: the scenarios then
pause at random for a few milliseconds between steps and inside their sources
(``tests/helpers/jitter.py``), and the every-mode petastorm cases run on 2, 3 and 4 ranks in
turn. CPU hogs (busy loops, one per ``--hogs``) and disk hogs (writing and syncing files, one per
``--io-hogs``) run beside it the whole time.

Every run has a hard timeout (``--run-timeout``), and the tests have their own (a hung rank
makes ``run_ranks`` dump every rank's Python stacks and the last lines ddp_even logged on every
rank). A run is a **hang** when it ran past its timeout or a test timed out, a **failure** when
a test failed otherwise. The soak stops at the first hang (and at the first failure, unless
``--keep-going``), keeps that run's whole output in ``--out``, and prints how to repeat it
(its seed and world size). At the end: a table of runs, passes, failures, hangs and seconds
(median and slowest), and the same as JSON in ``--out``. Exit status 1 if any run hung or
failed.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent

#: Named suites: the multi-rank scenarios that have hung, or could.
SUITES: dict[str, list[str]] = {
    "every-mode": ["tests/test_petastorm.py::test_petastorm_loaders_in_every_mode"],
    "footer-lengths": ["tests/test_footer_lengths.py"],
    # A rank killed, frozen or paused inside DDP's all-reduce, named through allreduce_hook.
    "gradient-hook": ["tests/test_gradient_hook.py"],
    "planned": ["tests/test_planned_loader.py"],
    # Share's hand-over: batches sent between ranks while every rank trains, resumed mid-way.
    "share": [
        "tests/test_share.py",
        "tests/test_resume_elastic.py::test_an_epoch_stopped_on_4_ranks_finishes_on_3[share-round_robin]",
        "tests/test_resume_elastic.py::test_share_cut_mid_hand_over_resumes_exactly_on_as_many_ranks",
    ],
    "resume": [
        "tests/test_resume.py::test_epochs_resumed_by_new_processes_continue_where_they_stopped"
    ],
    # The loop users already have: shards checked, process pools, resumes, and every way of
    # leaving it early (no reader left running at exit).
    "wrapped": [
        "tests/test_wrapped_loop.py",
        "tests/test_clean_exit.py::test_a_petastorm_loop_left_early_in_every_way_exits_cleanly",
    ],
}
# Words in pytest's output that mean a test hung rather than failed.
_HANG_WORDS = ("run_ranks timed out", "Timeout (0:", "+++ Timeout +++")


@dataclass
class Run:
    index: int
    seed: int
    world_size: int
    suite: str
    seconds: float
    outcome: str  # "pass", "fail" or "hang"


@dataclass
class Soak:
    runs: list[Run] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for run in self.runs if run.outcome == outcome)


def _busy() -> None:
    while True:
        pass


def _disk_busy(directory: str) -> None:
    block = os.urandom(1 << 20)
    path = Path(directory, f"hog-{os.getpid()}")
    while True:
        with path.open("wb") as file:
            for _ in range(64):
                file.write(block)
            file.flush()
            os.fsync(file.fileno())
        path.unlink()


@contextlib.contextmanager
def busy_machine(cpu: int, disk: int = 0) -> Iterator[None]:
    """``cpu`` busy loops and ``disk`` loops writing and syncing 64 MiB, each in a process of
    its own, while the block runs (the soak's, and the scale benchmark's faults')."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ddp-even-soak-hog-") as directory:
        procs = [context.Process(target=_busy, daemon=True) for _ in range(cpu)]
        procs += [
            context.Process(target=_disk_busy, args=(directory,), daemon=True) for _ in range(disk)
        ]
        for proc in procs:
            proc.start()
        try:
            yield
        finally:
            for proc in procs:
                proc.kill()
                proc.join()


def _run_once(
    index: int, suite: str, seed: int, world_size: int, timeout: float, out: Path
) -> tuple[Run, str]:
    env = {
        **os.environ,
        "DDP_EVEN_SOAK_SEED": str(seed),
        "DDP_EVEN_SOAK_WORLD_SIZE": str(world_size),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "pytest", *SUITES[suite], "-x", "-q", "-p", "no:cacheprovider"]
    began = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        output = done.stdout + done.stderr
        if done.returncode == 0:
            outcome = "pass"
        elif any(words in output for words in _HANG_WORDS):
            outcome = "hang"
        else:
            outcome = "fail"
    except subprocess.TimeoutExpired as expired:
        output = _text(expired.stdout) + _text(expired.stderr)
        output += f"\n[soak] the run passed its hard timeout of {timeout:g} s and was killed\n"
        outcome = "hang"
    run = Run(index, seed, world_size, suite, round(time.monotonic() - began, 2), outcome)
    if outcome != "pass":
        (out / f"run-{index}-{outcome}.log").write_text(output)
    return run, output


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _table(soak: Soak, hogs: int, io_hogs: int) -> Table:
    table = Table(title=f"soak: {hogs} CPU hog(s), {io_hogs} disk hog(s), {os.cpu_count()} cores")
    for column in ("suite", "runs", "pass", "fail", "hang", "median s", "slowest s"):
        table.add_column(column, justify="left" if column == "suite" else "right")
    for suite in sorted({run.suite for run in soak.runs}):
        runs = [run for run in soak.runs if run.suite == suite]
        seconds = [run.seconds for run in runs]
        table.add_row(
            suite,
            str(len(runs)),
            *(str(sum(run.outcome == what for run in runs)) for what in ("pass", "fail", "hang")),
            f"{statistics.median(seconds):.1f}",
            f"{max(seconds):.1f}",
        )
    return table


@click.command()
@click.option("--runs", type=click.IntRange(min=1), help="Stop after this many runs.")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), help="Or after this long.")
@click.option(
    "--suite",
    "suites",
    type=click.Choice(sorted(SUITES)),
    multiple=True,
    help="Suites to cycle through (repeatable; default: all).",
)
@click.option("--hogs", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--io-hogs", type=click.IntRange(min=0), default=1, show_default=True)
@click.option(
    "--world-sizes", default="2,3,4", show_default=True, help="Of the every-mode suite, in turn."
)
@click.option("--run-timeout", type=float, default=600.0, show_default=True, help="Seconds a run.")
@click.option("--seed", type=int, help="The first run's seed (then +1 a run); random by default.")
@click.option("--keep-going", is_flag=True, help="Go on after a failure (never after a hang).")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=ROOT / "bench-results" / "soak",
    show_default=True,
)
def main(
    runs: int | None,
    minutes: float | None,
    suites: tuple[str, ...],
    hogs: int,
    io_hogs: int,
    world_sizes: str,
    run_timeout: float,
    seed: int | None,
    keep_going: bool,
    out: Path,
) -> None:
    """Run the multi-rank suites under load until one hangs (see the module docstring)."""
    if runs is None and minutes is None:
        raise click.UsageError("say how long to soak: --runs N or --minutes M")
    sizes = [int(size) for size in world_sizes.split(",")]
    if any(size < 2 for size in sizes):
        raise click.BadParameter("world sizes must be 2 or more", param_hint="--world-sizes")
    chosen = list(suites) or sorted(SUITES)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    first_seed = seed if seed is not None else random.randrange(1 << 30)
    deadline = None if minutes is None else time.monotonic() + minutes * 60
    soak = Soak()
    began = time.monotonic()
    with busy_machine(hogs, io_hogs):
        index = 0
        while (runs is None or index < runs) and (deadline is None or time.monotonic() < deadline):
            suite = chosen[index % len(chosen)]
            run_seed = first_seed + index
            # In turn, so that a short soak (CI's) runs each world size once.
            world_size = sizes[index // len(chosen) % len(sizes)] if suite == "every-mode" else 4
            run, output = _run_once(index, suite, run_seed, world_size, run_timeout, out)
            soak.runs.append(run)
            console.print(
                f"run {index}: {suite}, {world_size} ranks, seed {run_seed}: "
                f"{run.outcome} in {run.seconds:.1f} s"
            )
            index += 1
            if run.outcome == "hang" or (run.outcome == "fail" and not keep_going):
                console.print(output[-6000:], markup=False, highlight=False)
                console.print(
                    f"[bold red]{run.outcome}[/] (whole output: {out}/run-{run.index}-"
                    f"{run.outcome}.log). Repeat it: DDP_EVEN_SOAK_SEED={run.seed} "
                    f"DDP_EVEN_SOAK_WORLD_SIZE={run.world_size} {sys.executable} -m pytest "
                    f"{' '.join(SUITES[run.suite])}"
                )
                break
    Console().print(_table(soak, hogs, io_hogs))
    summary = {
        "runs": len(soak.runs),
        "passes": soak.count("pass"),
        "failures": soak.count("fail"),
        "hangs": soak.count("hang"),
        "seconds": round(time.monotonic() - began, 1),
        "hogs": hogs,
        "io_hogs": io_hogs,
        "cores": os.cpu_count(),
        "each": [asdict(run) for run in soak.runs],
    }
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    Console().print(
        f"runs {summary['runs']}, hangs {summary['hangs']}, failures {summary['failures']}, "
        f"seconds {summary['seconds']}",
        highlight=False,
    )
    sys.exit(1 if summary["hangs"] or summary["failures"] else 0)


if __name__ == "__main__":
    main()
