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


# Each part of the package and its layer, from the bottom (docs/design.md, "Where things live").
# A module imports only from its own layer or below; the most specific prefix names its layer.
LAYERS: dict[str, int] = {
    "errors": 0,
    "names": 0,
    "checks": 0,
    "process_group": 0,
    "modes": 0,
    "mode_stats": 0,
    "share_plan": 0,
    "agreement.wire": 0,
    "planning": 1,
    "storage": 2,
    "parquet": 3,
    "liveness": 4,
    "agreement": 5,
    "sources": 6,
    "runtime": 7,
    "resume": 8,
    "petastorm": 9,
    "arrow": 9,
    "loader": 10,
    "integrations": 11,
    "cli": 11,
    "": 12,  # the package itself, and python -m ddp_even
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(part for part in parts if part != "__init__")


def _layer(module: str) -> int:
    name = module.removeprefix("ddp_even").lstrip(".")
    if name == "__main__":
        return LAYERS[""]
    matching = [prefix for prefix in LAYERS if name == prefix or name.startswith(prefix + ".")]
    return LAYERS[max(matching, key=len)] if matching else LAYERS[""]


def _imports() -> dict[str, set[str]]:
    """Every module's ddp_even imports, type-only ones and those inside functions included, as
    module names (``from ddp_even.x import y`` is ``ddp_even.x.y`` where that is a module)."""
    modules = {
        "ddp_even." + _module_name(path) if _module_name(path) else "ddp_even": path
        for path in _modules()
    }
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("ddp_even"):
                    for alias in node.names:
                        full = f"{node.module}.{alias.name}"
                        imported.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                imported |= {
                    alias.name for alias in node.names if alias.name.startswith("ddp_even")
                }
        found[name] = {module for module in imported if module in modules and module != name}
    return found


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = [
        f"{module} imports {imported}"
        for module, imports in _imports().items()
        for imported in sorted(imports)
        if _layer(imported) > _layer(module)
    ]
    assert upward == []


def test_no_imports_go_round_in_a_circle() -> None:
    graph = _imports()
    circles = set()

    def visit(module: str, path: list[str]) -> None:
        for imported in graph[module]:
            if imported in path:
                circle = path[path.index(imported) :]
                start = circle.index(min(circle))
                circles.add(" -> ".join(circle[start:] + circle[:start]))
            elif len(path) < 12:
                visit(imported, [*path, imported])

    for module in graph:
        visit(module, [module])
    assert sorted(circles) == []
