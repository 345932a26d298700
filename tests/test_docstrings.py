"""Every example in the library's docstrings runs, and every public name carries one."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import tempfile
from pathlib import Path

import pytest

import ddp_even

# Names, not modules: importing each one here would load every trainer's integration
# (Lightning alone takes over a second) in every process that merely collects the tests.
MODULE_NAMES = [
    "ddp_even",
    *(info.name for info in pkgutil.walk_packages(ddp_even.__path__, prefix="ddp_even.")),
]
# Petastorm's adapters import it: the lane without petastorm deselects their examples.
MODULES = [
    pytest.param(name, marks=pytest.mark.petastorm)
    if name.startswith("ddp_even.petastorm.") or name == "ddp_even.petastorm"
    else name
    for name in MODULE_NAMES
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(
    module_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The examples write their datasets into tempfile.mkdtemp(), as a reader would: here into
    # this test's folder, which pytest clears away, instead of a new folder in /tmp each run.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    result = doctest.testmod(importlib.import_module(module_name), optionflags=flags)
    assert result.failed == 0


@pytest.mark.parametrize("name", ddp_even.__all__)
def test_every_public_name_has_an_example(name: str) -> None:
    documented = getattr(ddp_even, name).__doc__ or ""
    assert "Example" in documented, f"{name} needs a docstring with an example"
