"""How fast ``ddp-even`` answers: its help, its version, and a plan of the demo data.

    .venv/bin/python -m benchmarks.bench_cli      # a table, and bench-results/cli.json

Each command runs as a user runs it, a fresh process of the installed ``ddp-even`` script
(``.venv/bin/ddp-even``) with its output piped, ``--repeats`` times after one untimed run (the
first reads the files from disk; later ones find them in the page cache, as a user's second
command does). The plan is of the demo dataset (what ``examples/train.py --demo`` writes, here
to a temporary directory) on 4 ranks with batches of 16, as ``scripts/demo.sh``
suggests. Targets: help under 0.5 s, a plan of the demo data under 1.5 s (medians). The load
average is printed beside them: on a busy machine, a start-up time is mostly waiting for a CPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from benchmarks.report import warn_if_loaded, write_results

ROOT = Path(__file__).resolve().parent.parent
# The examples are scripts, not a package: their folder on sys.path, as when they run.
sys.path.insert(0, str(ROOT / "examples"))

from train import write_demo_dataset  # noqa: E402


@dataclass(frozen=True)
class CliConfig:
    repeats: int
    ranks: int = 4
    batch_size: int = 16


# (what, arguments after ``ddp-even``, target median in seconds); DATA is the demo dataset.
DATA = "{data}"
COMMANDS = (
    ("plan --help", ("plan", "--help"), 0.5),
    ("--version", ("--version",), 0.5),
    ("plan of the demo data", ("plan", DATA, "--world-size", "4", "--batch-size", "16"), 1.5),
)


def ddp_even_script() -> Path:
    """The ``ddp-even`` console script beside this interpreter (the one the README runs)."""
    script = Path(sys.executable).parent / "ddp-even"
    if not script.exists():
        raise click.ClickException(f"{script} is missing: install ddp_even (scripts/install.sh)")
    return script


def seconds_of(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(command)} failed:\n{done.stderr}")
    return elapsed


@click.command()
@click.option("--repeats", type=click.IntRange(1), default=11, show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/cli.json"),
    show_default=True,
)
def main(repeats: int, out: Path) -> None:
    """Median wall time of ddp-even's help, version and a plan of the demo data."""
    console = Console() if sys.stdout.isatty() else Console(width=120)
    script = ddp_even_script()
    config = CliConfig(repeats)
    load_before = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as workdir:
        data = Path(workdir) / "demo-data"
        write_demo_dataset(data)
        for what, arguments, target in COMMANDS:
            command = [str(script), *(str(data) if arg == DATA else arg for arg in arguments)]
            seconds_of(command)  # untimed: the first run reads the files from disk
            times = [seconds_of(command) for _ in range(repeats)]
            runs.append(
                {
                    "command": what,
                    "target_s": target,
                    "median_s": statistics.median(times),
                    "min_s": min(times),
                    "max_s": max(times),
                    "times_s": times,
                }
            )
    load_after = os.getloadavg()[0]
    table = Table(title=f"ddp-even start-up, median of {repeats} fresh processes")
    for column in ("command", "median s", "min s", "max s", "target s", "met"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for run in runs:
        met = run["median_s"] < run["target_s"]
        table.add_row(
            run["command"],
            f"{run['median_s']:.3f}",
            f"{run['min_s']:.3f}",
            f"{run['max_s']:.3f}",
            f"{run['target_s']:g}",
            "[green]yes[/]" if met else "[red]no[/]",
        )
    table.caption = f"load average before/after: {load_before:.1f}/{load_after:.1f}"
    console.print(table)
    warn_if_loaded(console, max(load_before, load_after), "start-up times wait for a CPU")
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
