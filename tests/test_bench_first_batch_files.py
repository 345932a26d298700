"""The first-batch file count runs end to end on 2 ranks (no count asserted beyond its shape)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

pytestmark = [pytest.mark.benchmark, pytest.mark.petastorm, pytest.mark.multirank]


@pytest.mark.timeout(240)
def test_it_lists_the_files_each_path_enters() -> None:
    from benchmarks.first_batch_files import PATHS, main

    done = CliRunner().invoke(main, [])
    assert done.exit_code == 0, done.output
    for path in PATHS:
        assert f"{path}: " in done.output
    # Each path enters the loader itself and reads through a source of its own.
    assert done.output.count("  loader.py") == len(PATHS)
    assert "  petastorm/sources.py" in done.output
    assert "  arrow/reader.py" in done.output
