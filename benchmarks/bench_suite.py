"""How long the tests take, per number of pytest-xdist workers.

    .venv/bin/python -m benchmarks.bench_suite                # the fast tests: a table, and
                                                              # bench-results/suite.json
    .venv/bin/python -m benchmarks.bench_suite --tier ranks --rounds 1   # the multi-rank and
                                                              # Spark tests (about 10 min a run)
    .venv/bin/python -m benchmarks.bench_suite --tier timing --rounds 1 --workers 3 --workers 4

Each variant runs the tier's tests as ``scripts/test.sh`` does: ``pytest -m MARKERS -n WORKERS
--dist loadgroup`` with its environment (bytecode written beside the sources), as a fresh
process, ``--rounds`` times, the variants taken in turn within each round so that the machine's
noise falls on all of them alike. For the fast tier, one untimed run first fills the bytecode
and page caches, as a developer's earlier run has (the multi-rank tier's minutes dwarf that).
The table gives the median wall time, the CPU time of the whole machine while the run lasted
(run the benchmark alone: that is pytest and all it starts; the CPU time of pytest's reaped
children, which this measured before, misses the ranks of the fork server, which pytest does
not reap), and the ratio to the first variant; the targets: the fast tier under 30 s, the whole
suite, and so each other tier, within 10 minutes. The three tiers are the three runs of
``scripts/test.sh``: the timing tests (``-m timing``) run last, by themselves.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import psutil
from rich.console import Console
from rich.table import Table

from benchmarks.report import warn_if_loaded, write_results

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Tier:
    """A part of the suite as ``scripts/test.sh`` runs it."""

    markers: str
    target_s: float
    warm_up: bool


TIERS = {
    "fast": Tier("not multirank and not spark", target_s=30.0, warm_up=True),
    "ranks": Tier("(multirank or spark) and not timing", target_s=600.0, warm_up=False),
    "timing": Tier("timing and (multirank or spark)", target_s=600.0, warm_up=False),
}


@dataclass(frozen=True)
class SuiteConfig:
    tier: str
    rounds: int
    workers: tuple[int, ...]
    tests: tuple[str, ...]


def environment() -> dict[str, str]:
    """This environment as ``scripts/test.sh`` leaves it: Python writes bytecode."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def run_once(tier: Tier, workers: int, tests: tuple[str, ...]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole machine) of one run."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", tier.markers]
    command += ["-n", str(workers), "--dist", "loadgroup", *tests]
    busy_before = machine_busy_s()
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=ROOT, env=environment(), capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - started
    cpu = machine_busy_s() - busy_before
    if done.returncode != 0:
        raise click.ClickException(f"-n {workers}: pytest failed:\n{done.stdout[-3000:]}")
    return wall, cpu


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent not idle since it started."""
    times = psutil.cpu_times()
    # Guest time is counted in user time already; steal time is another machine's.
    return sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq"))


@click.command()
@click.option(
    "--tier",
    type=click.Choice(sorted(TIERS)),
    default="fast",
    show_default=True,
    help="; ".join(f"{name}: -m {tier.markers!r}" for name, tier in TIERS.items())
    + " (scripts/test.sh --fast, and the second and third runs of scripts/test.sh).",
)
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option(
    "--workers",
    type=click.IntRange(0),
    multiple=True,
    default=(2, 3),
    show_default=True,
    help="pytest-xdist workers of a variant (0: none, the tests run in pytest's process); "
    "repeat for several (the first is the baseline).",
)
@click.option(
    "--tests",
    multiple=True,
    help="Test files or folders to run instead of the whole tier (to try the benchmark).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/suite.json"),
    show_default=True,
)
def main(
    tier: str, rounds: int, workers: tuple[int, ...], tests: tuple[str, ...], out: Path
) -> None:
    """Median wall time of a tier of the tests per number of pytest-xdist workers."""
    console = Console() if sys.stdout.isatty() else Console(width=120)
    config = SuiteConfig(tier, rounds, workers, tests)
    chosen = TIERS[tier]
    if chosen.warm_up:
        console.print("one untimed run fills the bytecode and page caches")
        run_once(chosen, workers[0], tests)
    load_before = os.getloadavg()[0]
    times: dict[int, list[tuple[float, float]]] = {count: [] for count in workers}
    for round_number in range(1, rounds + 1):
        for count in workers:
            wall, cpu = run_once(chosen, count, tests)
            console.print(f"round {round_number}/{rounds}, -n {count}: {wall:.1f} s")
            times[count].append((wall, cpu))
    load_after = os.getloadavg()[0]
    baseline = statistics.median(wall for wall, _ in times[workers[0]])
    runs = []
    for count in workers:
        walls = [wall for wall, _ in times[count]]
        runs.append(
            {
                "workers": count,
                "median_s": statistics.median(walls),
                "min_s": min(walls),
                "max_s": max(walls),
                "cpu_median_s": statistics.median(cpu for _, cpu in times[count]),
                "ratio_to_first": statistics.median(walls) / baseline,
                "wall_s": walls,
            }
        )
    title = f"-m {chosen.markers!r}, median of {rounds} interleaved rounds"
    table = Table(title=title)
    under = f"under {chosen.target_s:.0f} s"
    columns = ("workers", "median s", "min s", "max s", "machine CPU s", "ratio to first", under)
    for column in columns:
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(
            f"-n {run['workers']}",
            f"{run['median_s']:.1f}",
            f"{run['min_s']:.1f}",
            f"{run['max_s']:.1f}",
            f"{run['cpu_median_s']:.1f}",
            f"{run['ratio_to_first']:.2f}",
            "[green]yes[/]" if run["median_s"] < chosen.target_s else "[red]no[/]",
        )
    table.caption = f"load average before/after: {load_before:.1f}/{load_after:.1f}"
    console.print(table)
    warn_if_loaded(console, max(load_before, load_after), "the times include waiting for a CPU")
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
