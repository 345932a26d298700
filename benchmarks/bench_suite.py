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
not reap), how long the workers had nothing left to run while another still ran tests (summed
over the workers: the cost of the order the tests are handed out in), and the ratio to the
first variant; the targets: the fast tier under 30 s, the whole
suite, and so each other tier, within 10 minutes. The three tiers are the three runs of
``scripts/test.sh``: the timing tests (``-m timing``) run last, by themselves.

A second table says where the first variant's CPU time goes: each test file's tests with every
process they started (``benchmarks/suite_cpu.py``, loaded into each run), the costliest first,
and what is outside the tests (test processes starting and collecting, pytest's own process,
anything else running). The JSON has every file's median.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import psutil
from rich.console import Console
from rich.table import Table

from benchmarks.report import warn_if_loaded, write_results
from benchmarks.suite_cpu import LOG_VARIABLE

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Tier:
    """A part of the suite as ``scripts/test.sh`` runs it."""

    markers: str
    target_s: float
    warm_up: bool


# How many of the costliest test files the CPU table names.
SHOWN_FILES = 12

TIERS = {
    "fast": Tier("not multirank and not spark and not benchmark", target_s=30.0, warm_up=True),
    "ranks": Tier(
        "(multirank or spark) and not timing and not benchmark and not load",
        target_s=600.0,
        warm_up=False,
    ),
    "timing": Tier(
        "timing and (multirank or spark) and not benchmark and not load",
        target_s=600.0,
        warm_up=False,
    ),
    "benchmarks": Tier("benchmark or load", target_s=600.0, warm_up=False),
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


@dataclass(frozen=True)
class Run:
    """One run of a tier: its wall time, the machine's CPU time, and each test file's."""

    wall_s: float
    cpu_s: float
    # Per test file, the CPU time of its tests with all they started (benchmarks/suite_cpu.py).
    cpu_by_file: dict[str, float]
    # Summed over the workers, how long each had nothing left to run while another still ran
    # tests: what a worse order of handing out the tests costs (tests/conftest.py).
    idle_at_end_s: float


def run_once(tier: Tier, workers: int, tests: tuple[str, ...]) -> Run:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", tier.markers]
    command += ["-n", str(workers), "--dist", "loadgroup", "-p", "benchmarks.suite_cpu", *tests]
    with tempfile.TemporaryDirectory(prefix="ddp-even-suite-") as directory:
        log = Path(directory, "cpu.jsonl")
        env = {**environment(), LOG_VARIABLE: str(log)}
        busy_before = machine_busy_s()
        started = time.perf_counter()
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
        wall = time.perf_counter() - started
        cpu = machine_busy_s() - busy_before
        if done.returncode != 0:
            raise click.ClickException(f"-n {workers}: pytest failed:\n{done.stdout[-3000:]}")
        lines = log.read_text().splitlines() if log.exists() else []
    cpu_by_file: dict[str, float] = collections.defaultdict(float)
    last_end: dict[str, float] = {}
    for line in lines:
        record = json.loads(line)
        cpu_by_file[record["test"].split("::", 1)[0]] += record["cpu_s"]
        last_end[record["worker"]] = max(last_end.get(record["worker"], 0.0), record["ended"])
    end = max(last_end.values(), default=0.0)
    idle_at_end = sum(end - ended for ended in last_end.values())
    return Run(wall, cpu, dict(cpu_by_file), idle_at_end)


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent not idle since it started."""
    times = psutil.cpu_times()
    # Guest time is counted in user time already; steal time is another machine's.
    return sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq"))


def median_by_file(runs: list[Run]) -> dict[str, float]:
    """Each test file's median CPU time over ``runs``, the costliest first."""
    files = {name for run in runs for name in run.cpu_by_file}
    medians = {
        name: statistics.median(run.cpu_by_file.get(name, 0.0) for run in runs) for name in files
    }
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


def cpu_table(cpu_by_file: dict[str, float], machine_cpu_s: float, workers: int) -> Table:
    """Where a run's CPU time goes: the costliest test files, then the rest."""
    table = Table(title=f"CPU time by test file (-n {workers}, median), with all its tests started")
    for column in ("test file", "CPU s", "share of the machine's"):
        table.add_column(column, justify="left" if column == "test file" else "right")
    rows = list(cpu_by_file.items())[:SHOWN_FILES]
    others = list(cpu_by_file.values())[SHOWN_FILES:]
    if others:
        rows.append((f"{len(others)} other files", sum(others)))
    outside = machine_cpu_s - sum(cpu_by_file.values())
    # Test processes starting and collecting, pytest's own process, and anything else running.
    rows.append(("outside the tests", outside))
    for name, seconds in rows:
        table.add_row(
            name, f"{seconds:.1f}", f"{seconds / machine_cpu_s:.0%}" if machine_cpu_s else ""
        )
    return table


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
    times: dict[int, list[Run]] = {count: [] for count in workers}
    for round_number in range(1, rounds + 1):
        for count in workers:
            run = run_once(chosen, count, tests)
            console.print(f"round {round_number}/{rounds}, -n {count}: {run.wall_s:.1f} s")
            times[count].append(run)
    load_after = os.getloadavg()[0]
    baseline = statistics.median(run.wall_s for run in times[workers[0]])
    runs = []
    for count in workers:
        walls = [run.wall_s for run in times[count]]
        runs.append(
            {
                "workers": count,
                "median_s": statistics.median(walls),
                "min_s": min(walls),
                "max_s": max(walls),
                "cpu_median_s": statistics.median(run.cpu_s for run in times[count]),
                "idle_at_end_median_s": statistics.median(
                    run.idle_at_end_s for run in times[count]
                ),
                "ratio_to_first": statistics.median(walls) / baseline,
                "wall_s": walls,
                "cpu_by_file_median_s": median_by_file(times[count]),
            }
        )
    title = f"-m {chosen.markers!r}, median of {rounds} interleaved rounds"
    table = Table(title=title)
    under = f"under {chosen.target_s:.0f} s"
    columns = (
        "workers",
        "median s",
        "min s",
        "max s",
        "machine CPU s",
        "workers idle at the end s",
        "ratio to first",
        under,
    )
    for column in columns:
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(
            f"-n {run['workers']}",
            f"{run['median_s']:.1f}",
            f"{run['min_s']:.1f}",
            f"{run['max_s']:.1f}",
            f"{run['cpu_median_s']:.1f}",
            f"{run['idle_at_end_median_s']:.1f}",
            f"{run['ratio_to_first']:.2f}",
            "[green]yes[/]" if run["median_s"] < chosen.target_s else "[red]no[/]",
        )
    table.caption = f"load average before/after: {load_before:.1f}/{load_after:.1f}"
    console.print(table)
    console.print(cpu_table(runs[0]["cpu_by_file_median_s"], runs[0]["cpu_median_s"], workers[0]))
    warn_if_loaded(console, max(load_before, load_after), "the times include waiting for a CPU")
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
