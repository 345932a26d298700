"""petastorm 0.12.1 installed beside pyarrow 15 or later (pip allows it), where it cannot be
imported (``No module named 'pyarrow.filesystem'``): ``from_parquet`` reads plain Parquet all
the same, and ``reader="row"`` (petastorm's) is refused in one line that says why and what to
do.

The lane without petastorm (``scripts/test.sh --latest``) installs petastorm 0.12.1 into a
directory of its own (``.venv-latest/petastorm-0.12.1-beside``, or where
``DDP_EVEN_PETASTORM_BESIDE`` says), which only these tests put on a subprocess's PYTHONPATH:
the environment itself stays without petastorm. Elsewhere (petastorm's own pyarrow 14, or no
such directory) those tests are skipped, saying so. Where no petastorm can be found at all,
``reader="row"`` says to install it, in one line too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddp_even import EvenLoader

REPO = Path(__file__).resolve().parent.parent
BESIDE = Path(
    os.environ.get("DDP_EVEN_PETASTORM_BESIDE", REPO / ".venv-latest" / "petastorm-0.12.1-beside")
)
ROWS = 20

_NEW_PYARROW = pytest.mark.skipif(
    int(pa.__version__.split(".")[0]) < 15,
    reason="petastorm 0.12.1 imports on this pyarrow: nothing to refuse",
)
_BESIDE = pytest.mark.skipif(
    not (BESIDE / "petastorm" / "__init__.py").is_file(),
    reason=f"no petastorm 0.12.1 in {BESIDE} (scripts/test.sh --latest installs it there)",
)

READ = """
import json, sys
from ddp_even import EvenLoader
loader = EvenLoader.from_parquet(sys.argv[1], 4, **json.loads(sys.argv[2]))
print(json.dumps([{"id": b["id"].tolist(), "x": b["x"].tolist()} for b in loader]))
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(BESIDE)}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    table = pa.table({"id": list(range(ROWS)), "x": [row / 2 for row in range(ROWS)]})
    pq.write_table(table, str(tmp_path / "part-0.parquet"), row_group_size=5)
    return str(tmp_path)


@_NEW_PYARROW
@_BESIDE
def test_the_petastorm_there_cannot_be_imported() -> None:
    # What the user has: petastorm found, and failing on import.
    found = _run("-c", "import importlib.util; print(importlib.util.find_spec('petastorm').origin)")
    assert found.stdout.strip() == str(BESIDE / "petastorm" / "__init__.py"), found.stderr
    imported = _run("-c", "import petastorm")
    assert imported.returncode != 0
    assert "No module named 'pyarrow.filesystem'" in imported.stderr.splitlines()[-1]


@_NEW_PYARROW
@_BESIDE
def test_plain_parquet_is_read_all_the_same(dataset: str) -> None:
    read = _run("-c", READ, dataset, "{}")
    assert read.returncode == 0, read.stderr
    batches = json.loads(read.stdout)
    assert [len(batch["id"]) for batch in batches] == [4] * (ROWS // 4)
    rows = sorted(
        (row, x) for batch in batches for row, x in zip(batch["id"], batch["x"], strict=True)
    )
    assert rows == [(row, row / 2) for row in range(ROWS)]


@_NEW_PYARROW
@_BESIDE
def test_petastorms_reader_is_refused_in_one_line(dataset: str) -> None:
    read = _run("-c", READ, dataset, json.dumps({"reader": "row"}))
    assert read.returncode != 0
    last = read.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: reader='row' is petastorm's, and petastorm 0.12.1 is installed but cannot "
        f"be imported with pyarrow {pa.__version__} (No module named 'pyarrow.filesystem'): it "
        "needs pyarrow < 15 and numpy < 2"
    ), last
    assert "read plain Parquet with reader='batch' (the default)" in last
    # Not petastorm's own traceback beneath it: the one line is all there is to read.
    assert "petastorm/utils.py" not in read.stderr
    assert "The above exception" not in read.stderr and "During handling" not in read.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("petastorm") is not None, reason="petastorm is installed here"
)
def test_without_petastorm_reader_row_says_to_install_it(dataset: str) -> None:
    with pytest.raises(ImportError) as refused:
        EvenLoader.from_parquet(dataset, 4, reader="row")
    assert str(refused.value) == (
        "reader='row' is petastorm's and needs petastorm, which is not installed (No module "
        "named 'petastorm'): pip install 'ddp_even[petastorm]' (pyarrow < 15, numpy < 2), or "
        "read plain Parquet with reader='batch' (the default), which needs no petastorm"
    )
    assert refused.value.__suppress_context__
