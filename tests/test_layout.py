"""The package's layout holds by test, not by inspection: small modules, one home per dependency.

* No module over 450 lines: a reader sees a module's one job from its name.
* petastorm is imported only under ``ddp_even/petastorm/`` (its private attributes are listed
  and checked there, ``tests/test_petastorm_contract.py``).
* ``ddp_even/planning/`` imports neither torch nor petastorm: ``ddp-even plan`` starts
  without them.
"""

from __future__ import annotations

import ast
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


def test_planning_imports_no_torch_and_no_petastorm() -> None:
    planning = sorted((PACKAGE / "planning").glob("*.py"))
    assert planning
    assert {
        str(path.relative_to(PACKAGE)): sorted(_imported_roots(path) & {"torch", "petastorm"})
        for path in planning
        if _imported_roots(path) & {"torch", "petastorm"}
    } == {}
