"""The test-suite benchmark runs end to end on a test file of its own (no timings asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.bench_suite import main

pytestmark = pytest.mark.benchmark


@pytest.fixture(autouse=True)
def _only_xdist(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs load xdist alone: the other installed plugins would only slow their start."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "xdist.plugin")


BUSY_CHILD = """
import subprocess
import sys

BUSY = "import time\\nwhile time.process_time() < 0.3: pass"


def test_busy_child():
    subprocess.run([sys.executable, "-c", BUSY], check=True)
"""


@pytest.mark.timeout(120)
def test_it_times_each_worker_count_and_counts_each_files_cpu(tmp_path: Path) -> None:
    # Two tiny test files, so that this checks the benchmark in seconds, not the suite: one
    # starts a child that burns 0.3 s of CPU, the other does nothing.
    (tmp_path / "test_child.py").write_text(BUSY_CHILD)
    (tmp_path / "test_idle.py").write_text("def test_idle():\n    pass\n")
    out = tmp_path / "suite.json"
    arguments = ["--rounds", "1", "--workers", "0", "--workers", "1", "--tests", str(tmp_path)]
    done = CliRunner().invoke(main, [*arguments, "--out", str(out)])
    assert done.exit_code == 0, done.output
    runs = json.loads(out.read_text())["runs"]
    assert [run["workers"] for run in runs] == [0, 1]
    assert runs[0]["ratio_to_first"] == 1.0
    assert "-n 1" in done.output
    for run in runs:
        assert len(run["wall_s"]) == 1 and run["median_s"] == run["wall_s"][0] > 0
        by_file = {Path(name).name: cpu for name, cpu in run["cpu_by_file_median_s"].items()}
        # The child's 0.3 s, counted under the file that ran it (a reaped child's time comes
        # in clock ticks: 0.49 s once for 0.5 s), within what the whole machine spent; the
        # other file's test did nothing.
        assert 0.27 <= by_file["test_child.py"] <= run["cpu_median_s"], run
        assert by_file["test_idle.py"] < 0.1, run
        assert list(by_file) == ["test_child.py", "test_idle.py"], "costliest first"
    assert "CPU time by test file" in done.output and "outside the tests" in done.output


MARKED_TESTS = """
from pathlib import Path

import pytest


def test_fast():
    (Path(__file__).parent / "fast.ran").touch()


@pytest.mark.multirank
def test_ranks():
    (Path(__file__).parent / "ranks.ran").touch()


@pytest.mark.multirank
@pytest.mark.timing
def test_timing():
    (Path(__file__).parent / "timing.ran").touch()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", ["fast", "ranks", "timing"])
def test_a_tier_runs_only_its_tests(tmp_path: Path, tier: str) -> None:
    tests = tmp_path / "test_marked.py"
    tests.write_text(MARKED_TESTS)
    out = tmp_path / "suite.json"
    arguments = ["--tier", tier, "--rounds", "1", "--workers", "0", "--tests", str(tests)]
    done = CliRunner().invoke(main, [*arguments, "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert json.loads(out.read_text())["config"]["tier"] == tier
    assert sorted(path.name for path in tmp_path.glob("*.ran")) == [f"{tier}.ran"]


def test_a_failing_run_is_reported_with_pytest_s_output(tmp_path: Path) -> None:
    tests = tmp_path / "test_failing.py"
    tests.write_text("def test_wrong():\n    assert 1 + 1 == 3\n")
    done = CliRunner().invoke(main, ["--workers", "0", "--tests", str(tests)])
    assert done.exit_code == 1
    assert "-n 0: pytest failed" in done.output and "test_wrong" in done.output
