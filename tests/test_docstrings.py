"""Every example in the library's docstrings runs, and every public name carries one."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from types import ModuleType

import pytest

import ddp_even

MODULES = [
    importlib.import_module(info.name)
    for info in pkgutil.walk_packages(ddp_even.__path__, prefix="ddp_even.")
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", [ddp_even, *MODULES], ids=lambda module: module.__name__)
def test_docstring_examples_run(module: ModuleType) -> None:
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    result = doctest.testmod(module, optionflags=flags)
    assert result.failed == 0


@pytest.mark.parametrize("name", ddp_even.__all__)
def test_every_public_name_has_an_example(name: str) -> None:
    documented = getattr(ddp_even, name).__doc__ or ""
    assert "Example" in documented, f"{name} needs a docstring with an example"
