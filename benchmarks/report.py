"""What every multi-rank benchmark prints after a table and writes at the end.

``warn_if_loaded`` says when other processes share the machine (the load average above the
CPU count), in the words of what is noise at that benchmark's scale; ``write_results`` writes
the machine, the configuration and the runs as JSON, beside the printed tables.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console


def warn_if_loaded(console: Console, load_average: float, noise: str) -> None:
    """A yellow line when ``load_average`` exceeds the CPUs: ``noise`` says what to disregard."""
    if load_average > (os.cpu_count() or 1):
        console.print(
            f"[yellow]load average {load_average:.1f} on {os.cpu_count()} CPUs: other processes "
            f"share this machine, {noise}[/]"
        )


def write_results(console: Console, out: Path, config: Any, runs: list[Any]) -> None:
    """``out`` as JSON: this machine, ``config`` (a dataclass) and ``runs``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "config": asdict(config),
        "runs": runs,
    }
    out.write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"wrote {out}")
