"""The CLI benchmark runs end to end (no timings asserted: the structure of what it writes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_it_times_every_command_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_cli", "--repeats", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [run["command"] for run in runs] == [what for what, _, _ in COMMANDS]
    for run in runs:
        assert len(run["times_s"]) == 1 and run["median_s"] == run["times_s"][0] > 0
    assert "plan of the demo data" in done.stdout
