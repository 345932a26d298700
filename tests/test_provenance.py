"""What a reused count was computed from: code by what it does, settings by name.

A predicate defined in the user's own module (what a process pool needs) was keyed by
``dill.dumps``, which pickles such a function by reference: an edited predicate kept its old
cached counts, ``len()`` was wrong and the epoch died mid-way. Code is now identified by its
bytecode, constants, closure, defaults and the globals it reads, in every process alike.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import operator
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ddp_even.arrow.passes import make_shard_factory
from ddp_even.planning.provenance import (
    Provenance,
    UnidentifiableError,
    Untold,
    code_identity,
)
from tests.helpers.datasets import write_plain_dataset

PREDICATE_MODULE = """
from petastorm.predicates import in_lambda

LIMIT = {limit}


def keep(ids):
    # Rows below the limit, as a pandas Series of booleans.
    return ids < LIMIT


PREDICATE = in_lambda(["id"], keep)
"""


def _module(path: Path, source: str) -> ModuleType:
    """``source`` as a fresh module ``user_predicates`` (as a new job imports the user's edited
    file: the same module name, the file's current text)."""
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("user_predicates", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.petastorm
def test_an_edited_module_function_has_another_identity(tmp_path: Path) -> None:
    before = _module(tmp_path / "a.py", PREDICATE_MODULE.format(limit=10))
    again = _module(tmp_path / "b.py", PREDICATE_MODULE.format(limit=10))
    edited = _module(tmp_path / "c.py", PREDICATE_MODULE.format(limit=11))
    reformatted = _module(
        tmp_path / "d.py",
        PREDICATE_MODULE.format(limit=10).replace("# Rows below", "\n\n# Rows under"),
    )
    assert code_identity(before.PREDICATE) == code_identity(again.PREDICATE)
    assert code_identity(before.PREDICATE) != code_identity(edited.PREDICATE), "a global read"
    assert code_identity(before.PREDICATE) == code_identity(reformatted.PREDICATE), (
        "comments and line numbers are not code"
    )


def test_closures_defaults_and_bodies_count() -> None:
    def threshold(limit: int) -> Any:
        return lambda ids: ids < limit

    def with_default(ids: Any, limit: int = 3) -> Any:
        return ids < limit

    def with_other_default(ids: Any, limit: int = 4) -> Any:
        return ids < limit

    def other_body(ids: Any, limit: int = 3) -> Any:
        return ids <= limit

    assert code_identity(threshold(3)) == code_identity(threshold(3))
    assert code_identity(threshold(3)) != code_identity(threshold(4))
    assert code_identity(with_default) != code_identity(with_other_default)
    assert code_identity(with_default) != code_identity(other_body)


RECORDING_MODULE = """
SEEN = []
KEPT = (1, 2, 3)


def record(rows):
    # A transform that notes what it read: SEEN grows while the job runs.
    SEEN.extend(rows)
    return [row for row in rows if row in KEPT]
"""


def test_a_global_the_function_changes_counts_by_type_an_immutable_one_by_value(
    tmp_path: Path,
) -> None:
    module = _module(tmp_path / "r.py", RECORDING_MODULE)
    before = code_identity(module.record)
    module.record([1, 5])
    assert module.SEEN == [1, 5]
    assert code_identity(module.record) == before, "what it recorded is not what it computes"
    module.KEPT = (1, 2)
    assert code_identity(module.record) != before, "an immutable global it reads is data"


@pytest.mark.petastorm
def test_the_identity_is_the_same_in_another_process(tmp_path: Path) -> None:
    here = _module(tmp_path / "user_predicates.py", PREDICATE_MODULE.format(limit=10))
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import user_predicates; "
        "from ddp_even.planning.provenance import code_identity; "
        "print(code_identity(user_predicates.PREDICATE).hex())"
    )
    # Another interpreter with other string hashes than this one (sets, dicts, ids differ).
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    there = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    assert there == code_identity(here.PREDICATE).hex() and len(there) == 64


def test_provenance_names_every_part_that_differs_and_every_part_untold() -> None:
    saved = Provenance.of(data=b"footers", seed=7, predicate=lambda ids: ids > 0)
    assert saved.compare(Provenance.from_dict(saved.as_dict())) == ([], [])
    changed = Provenance.of(data=b"footers", seed=8, predicate=None)
    assert saved.compare(changed) == (["seed", "predicate"], [])
    assert Provenance.of(data=b"x").compare(Provenance.of(data=b"x", seed=1)) == (["seed"], [])
    hidden = Provenance.of(data=b"footers", seed=Untold("a process pool"), predicate=None)
    assert saved.compare(hidden) == (["predicate"], ["seed"])
    assert hidden.untold() == {"seed": "a process pool"}
    assert Provenance.from_dict(hidden.as_dict()).compare(hidden) == ([], ["seed"])


@pytest.mark.petastorm
@pytest.mark.timeout(120)
def test_an_edited_predicate_misses_the_count_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DDP_EVEN_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="ddp_even")
    url = write_plain_dataset(tmp_path / "ds", [[10, 20], [15]])

    def rows_kept(limit: int, name: str) -> tuple[int, list[str]]:
        module = _module(tmp_path / f"{name}.py", PREDICATE_MODULE.format(limit=limit))
        caplog.clear()
        plan, _ = make_shard_factory(url, 0, 1, 4, predicate=module.PREDICATE)
        return plan.total_rows, [record.getMessage() for record in caplog.records]

    rows, said = rows_kept(12, "first")
    assert rows == 12 and not any("from the cache" in line for line in said)
    rows, said = rows_kept(12, "same")
    assert rows == 12 and any("from the cache" in line for line in said)
    rows, said = rows_kept(20, "edited")
    assert rows == 20, "the edited predicate keeps 20 rows; stale counts said 12"
    assert not any("from the cache" in line for line in said)


def _divisible(divisor: int, ids: Any) -> Any:
    return ids % divisor == 0


def test_partials_and_bound_builtins_count_by_what_they_hold() -> None:
    assert code_identity(functools.partial(_divisible, 2)) != code_identity(
        functools.partial(_divisible, 3)
    )
    assert code_identity(functools.partial(_divisible, 2)) == code_identity(
        functools.partial(_divisible, 2)
    )
    assert code_identity({1, 2}.__contains__) != code_identity({1, 3}.__contains__)
    assert code_identity(operator.itemgetter("a")) != code_identity(operator.itemgetter("b"))
    with pytest.raises(UnidentifiableError, match="does not pickle"):
        code_identity(threading.Lock())


@pytest.mark.petastorm
@pytest.mark.timeout(120)
def test_predicates_differing_in_partial_arguments_are_counted_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs, one after the other, with ``partial(divisible, 2)`` and ``partial(divisible,
    3)``: the second counted its own rows (it once reused the first's counts: a wrong
    ``len()``, then ``RowCountMismatchError`` mid-epoch, in every later job)."""
    from petastorm.predicates import in_lambda

    from ddp_even import EvenLoader

    monkeypatch.setenv("DDP_EVEN_CACHE_DIR", str(tmp_path / "cache"))
    url = write_plain_dataset(tmp_path / "ds", [10, 10, 10])
    for divisor in (2, 3, 2):
        predicate = in_lambda(["id"], functools.partial(_divisible, divisor))
        loader = EvenLoader.from_parquet(url, 4, predicate=predicate)
        kept = [i for i in range(30) if i % divisor == 0]
        assert len(loader) == -(-len(kept) // 4)
        assert sorted(int(i) for batch in loader for i in batch["id"]) == kept
    assert len(list((tmp_path / "cache").iterdir())) == 2, "one entry per predicate"


@pytest.mark.petastorm
@pytest.mark.timeout(120)
def test_a_predicate_that_cannot_be_identified_is_counted_every_time_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from petastorm.predicates import in_lambda

    from ddp_even import EvenLoader
    from tests.helpers.logs import ddp_even_messages

    monkeypatch.setenv("DDP_EVEN_CACHE_DIR", str(tmp_path / "cache"))
    url = write_plain_dataset(tmp_path / "ds", [10, 10])
    lock = threading.Lock()  # held by the predicate: nothing says what it computes with it

    def even(ids: Any) -> Any:
        with lock:
            return ids % 2 == 0

    messages = ddp_even_messages()
    loader = EvenLoader.from_parquet(url, 4, predicate=in_lambda(["id"], even))
    assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(0, 20, 2))
    assert any("not cached" in message and "_thread.lock" in message for message in messages)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
