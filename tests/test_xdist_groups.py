"""``scripts/test.sh`` keeps the tests of one ``xdist_group`` in one worker process.

The local S3 server is started once per process that asks for it (``tests/conftest.py``), so
the fast tests start one server only while pytest-xdist honours the groups. It stopped doing so,
silently, under pytest 9 (constraints.txt pins pytest 8 for that): this fails first if it does
again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GROUPED_TESTS = """
import os

import pytest


@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("case", range(6))
def test_grouped(case):
    with open(f"{case}.worker", "w") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"])
"""


@pytest.mark.timeout(120)
def test_a_group_runs_in_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED_TESTS)
    pytest_command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # xdist alone: the other installed plugins would only slow each process's start.
    only_xdist = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTEST_PLUGINS": "xdist.plugin"}
    done = subprocess.run(
        [*pytest_command, "-n", "2", "--dist", "loadgroup", "test_grouped.py"],
        cwd=tmp_path,
        env={**os.environ, **only_xdist},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    written = list(tmp_path.glob("*.worker"))
    assert len(written) == 6, done.stdout[-3000:]
    workers = {path.read_text() for path in written}
    assert len(workers) == 1, f"the group ran in workers {sorted(workers)}: see constraints.txt"


@pytest.mark.parametrize(
    "fixture", ["s3", pytest.param("spark", marks=pytest.mark.spark)], ids=["s3", "spark"]
)
def test_the_tests_of_a_shared_server_are_in_its_group(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    """tests/conftest.py groups the tests of the S3 server and of the Spark session, so that
    one worker starts each; the spark case runs with the spark tests, where they are collected."""
    users = [item for item in request.session.items if fixture in getattr(item, "fixturenames", ())]
    if not users:
        pytest.skip(f"no test of this selection uses the {fixture} fixture")
    ungrouped = [
        item.nodeid
        for item in users
        if [mark.args for mark in item.iter_markers("xdist_group")] != [(fixture,)]
    ]
    assert not ungrouped, f"not in xdist_group({fixture!r}) alone: {ungrouped[:5]}"
