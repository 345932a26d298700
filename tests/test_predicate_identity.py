"""A petastorm-style predicate class edited between jobs misses the count cache and the state.

A predicate object (``get_fields``/``do_include``) was identified by its class name, its state
and its ``__call__``: a ``do_include`` (or a helper it calls) edited between two jobs kept the
first job's cached counts, so the second job's plan counted the old rows and failed mid-epoch
with ``RowCountMismatchError``, and the first job's state loaded into the second without a
``StateMismatchError``. Now the code of every method the predicate is called by, and of every
method those reach through ``self``, is part of its identity.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ddp_even import EvenLoader, StateMismatchError
from ddp_even.planning.provenance import code_identity
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.logs import ddp_even_messages

PREDICATE_MODULE = """
class Base:
    def do_include(self, values):
        return {base}


class KeepBelow(Base):
    def __init__(self, limit):
        self.limit = limit

    def get_fields(self):
        return {{"id"}}

    def do_include(self, values):
        return super().do_include(values) & self._keep(values["id"])

    def _keep(self, ids):
        return {keep}

    @property
    def bound(self):
        return {bound}

    @staticmethod
    def shift():
        return {shift}

    def unused(self):
        return {unused}


PREDICATE = KeepBelow(12)
"""
SAME = {
    "base": 'values["id"] >= 0',
    "keep": "ids < self.limit",
    "bound": "self.limit",
    "shift": "0",
    "unused": "1",
}


def _module(path: Path, **edits: str) -> ModuleType:
    """The predicate module, as a new job imports the user's file (the same module name)."""
    path.write_text(textwrap.dedent(PREDICATE_MODULE.format(**{**SAME, **edits})))
    spec = importlib.util.spec_from_file_location("user_predicate_class", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _identity(tmp_path: Path, name: str, **edits: str) -> bytes:
    return code_identity(_module(tmp_path / f"{name}.py", **edits).PREDICATE)


def test_an_edit_to_any_method_the_predicate_reaches_changes_its_identity(
    tmp_path: Path,
) -> None:
    first = _identity(tmp_path, "first")
    assert _identity(tmp_path, "again") == first, "the same code, another module object"
    # _keep is reached from do_include through self.
    assert _identity(tmp_path, "helper", keep="ids <= self.limit") != first
    # A property and a static method reached from the helper.
    assert _identity(tmp_path, "uses_bound", keep="ids < self.bound") != _identity(
        tmp_path, "bound_edited", keep="ids < self.bound", bound="self.limit + 1"
    )
    assert _identity(tmp_path, "uses_shift", keep="ids < self.limit + self.shift()") != _identity(
        tmp_path, "shift_edited", keep="ids < self.limit + self.shift()", shift="2"
    )
    # The base class's do_include, reached through super().
    assert _identity(tmp_path, "base", base='values["id"] > 0') != first


def _job(url: str, predicate: Any, state: dict[str, Any] | None = None) -> dict[str, Any]:
    loader = EvenLoader.from_parquet(url, 4, "truncate", predicate=predicate)
    if state is not None:
        loader.load_state_dict(state)
    epoch = iter(loader)
    first = next(epoch)
    saved = loader.state_dict()
    ids = [int(i) for i in first["id"]] + [int(i) for batch in epoch for i in batch["id"]]
    return {"length": len(loader), "ids": sorted(ids), "state": saved}


@pytest.mark.timeout(120)
def test_a_job_with_an_edited_predicate_class_counts_again_and_refuses_the_old_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDP_EVEN_CACHE_DIR", str(tmp_path / "cache"))
    url = write_plain_dataset(tmp_path / "ds", [[10, 6], [8]])  # ids 0..23, one rank
    messages = ddp_even_messages()
    first = _job(url, _module(tmp_path / "job1.py").PREDICATE)
    assert first["ids"] == list(range(12)) and first["length"] == 3
    again = _job(url, _module(tmp_path / "job1_again.py").PREDICATE)
    assert again["ids"] == list(range(12))
    assert sum("from the cache" in message for message in messages) == 1, "the same code: cached"
    # Job 2: the user edited the helper do_include calls (ids < 12 -> ids < 20).
    edited = _module(tmp_path / "job2.py", keep="ids < self.limit + 8").PREDICATE
    second = _job(url, edited)
    assert second["ids"] == list(range(20)), "its own rows, not the 12 cached for job 1"
    assert second["length"] == 5
    assert sum("from the cache" in message for message in messages) == 1
    with pytest.raises(StateMismatchError, match="predicate"):
        _job(url, edited, state=first["state"])
