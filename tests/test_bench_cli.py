"""The CLI benchmark runs end to end (no timings asserted: the structure of what it writes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = [pytest.mark.benchmark, pytest.mark.petastorm]


@pytest.mark.timeout(120)
def test_it_times_every_command_and_writes_json(tmp_path: Path) -> None:
    # Imported here, not at collection: the benchmark loads the demo example and its imports.
    from benchmarks.bench_cli import COMMANDS, main

    out = tmp_path / "cli.json"
    done = CliRunner().invoke(main, ["--repeats", "1", "--out", str(out)])
    assert done.exit_code == 0, done.output
    runs = json.loads(out.read_text())["runs"]
    assert [run["command"] for run in runs] == [what for what, _, _ in COMMANDS]
    for run in runs:
        assert len(run["times_s"]) == 1 and run["median_s"] == run["times_s"][0] > 0
    assert "plan of the demo data" in done.output
