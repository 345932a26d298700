"""The package's layout holds by test, not by inspection: small modules, one home per dependency.

* No module over 450 lines: a reader sees a module's one job from its name.
* petastorm is imported only under ``ddp_even/petastorm/`` (its private attributes are listed
  and checked there, ``tests/test_petastorm_contract.py``).
* ``ddp_even/planning/`` imports neither torch, petastorm, pyarrow nor ddp_even's storage,
  Parquet or petastorm code: it is arithmetic over row-group sizes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ddp_even"
MAX_LINES = 450


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported_roots(path: Path) -> set[str]:
    """The top-level packages a module imports, wherever the import statement is."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_is_over_450_lines() -> None:
    lengths = {
        str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in _modules()
    }
    assert len(lengths) > 30
    assert {name: lines for name, lines in lengths.items() if lines > MAX_LINES} == {}


def test_petastorm_is_imported_only_under_ddp_even_petastorm() -> None:
    importers = [
        path.relative_to(PACKAGE) for path in _modules() if "petastorm" in _imported_roots(path)
    ]
    assert importers, "the adapters import petastorm"
    assert [str(path) for path in importers if path.parts[0] != "petastorm"] == []


def test_planning_imports_no_torch_petastorm_or_storage() -> None:
    """Statically, each module; and what importing the package pulls in, in a fresh process."""
    outside = {"torch", "petastorm", "pyarrow", "fsspec"}
    reading = ("ddp_even.storage", "ddp_even.parquet", "ddp_even.petastorm")
    planning = sorted((PACKAGE / "planning").glob("*.py"))
    assert planning
    found = {}
    for path in planning:
        tree = ast.parse(path.read_text())
        modules = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        }
        wrong = sorted(_imported_roots(path) & outside) + sorted(
            module for module in modules if module.startswith(reading)
        )
        if wrong:
            found[str(path.relative_to(PACKAGE))] = wrong
    assert found == {}
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, ddp_even.planning; print(*sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [
        name for name in imported if name.split(".")[0] in outside or name.startswith(reading)
    ] == []
