"""Fixtures shared by the test modules.

``spark``: one real local Spark session for the whole run (``local[2]``, UI off, a small
driver), started by the first test that asks for it and stopped at the end. Tests that use it
are marked ``spark`` (by their modules) and put in one ``xdist_group`` here, so that
``scripts/test.sh`` (``-n 3 --dist loadgroup``) starts one session, not one per process.
Without a Java runtime they are skipped, except under CI (``CI`` set), where a missing Java is
a failure: CI must run them.

``s3``: one local S3-compatible server for the whole run (moto's, as a subprocess), with its
credentials in the standard AWS variables while it runs. Every test that uses it is marked
``s3`` here, so that ``-m s3`` selects the remote-storage tests and none is forgotten, and put
in one ``xdist_group``, so that ``-n 3 --dist loadgroup`` (``scripts/test.sh --fast``) starts
one server, not one per process.

Without petastorm (``scripts/test.sh --latest``: today's numpy and pyarrow), the modules that
import it at their top are not collected, and the tests marked ``petastorm`` are deselected
there (``-m "not petastorm"``): every other test runs.

Predicate counts (``DDP_EVEN_CACHE_DIR``) and the temporary files of the processes the tests
start (``TMPDIR``) go to the run's temporary folder: the tests leave nothing in the user's
``~/.cache/ddp_even`` or in ``/tmp``.
"""

from __future__ import annotations

import ast
import gc
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Before torch is imported: its default of one intra-op thread per core makes the pytest-xdist
# workers and the ranks they start, several processes on a few cores, spin against each other
# (torchrun sets the same for the same reason). On 2 cores, the fast tests at -n 3 took 104 s
# of user CPU without it and 83 s with it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers.s3_server import S3Server, start_s3_server
from tests.helpers.spark import java_available, start_spark

# What petastorm brings (pandas, pyspark) and its adapters that import it as they load.
_NEEDS_PETASTORM = (
    "petastorm",
    "pandas",
    "pyspark",
    "ddp_even.petastorm.sources",
    "ddp_even.petastorm.reading",
    "ddp_even.petastorm.pools",
)


def _imports_petastorm_at_its_top(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(name.startswith(_NEEDS_PETASTORM) for name in names):
            return True
    return False


if importlib.util.find_spec("petastorm") is None:
    collect_ignore = [
        path.name
        for path in sorted(Path(__file__).parent.glob("test_*.py"))
        if _imports_petastorm_at_its_top(path)
    ]


def pytest_collection_finish() -> None:
    # What collection imported (torch, petastorm, every test module: hundreds of thousands of
    # objects, none of them garbage) leaves the garbage collector's walks, as in the ranks' fork
    # server (tests/helpers/frozen_heap.py): each full collection of a test process, and the
    # five pytest makes as it ends, walk only what the tests made.
    gc.freeze()


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not java_available():
        message = "the spark tests need a Java runtime (apt-get install openjdk-17-jre-headless)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    session = start_spark(tmp_path_factory.mktemp("spark-converter-cache"))
    yield session
    session.stop()


@pytest.fixture(scope="session", autouse=True)
def _files_stay_in_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the tests and the processes they start write goes to this run's temporary folder,
    which pytest clears away with older runs: predicate counts, not into the user's
    ~/.cache/ddp_even (tests about the cache set their own), and the temporary files of
    started processes (torchrun leaves a torchelastic_* folder per job), not into /tmp."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDP_EVEN_CACHE_DIR", str(tmp_path_factory.mktemp("predicate-counts")))
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
        yield


_AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
)


# Fast-tier files whose tests take seconds each even alone (a process started and waited on, a
# nested pytest, hundreds of in-process scenarios): in their alphabetical place at the end of
# the tier, two of three workers sat idle for 12 s and 27 s of a 181 s run (a loaded machine).
_SECONDS_EACH = {
    "test_no_hang_properties.py",
    "test_petastorm_contract.py",
    "test_store_connection.py",
    "test_xdist_groups.py",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "s3" in fixtures:
            item.add_marker(pytest.mark.s3)
            item.add_marker(pytest.mark.xdist_group("s3"))
        if "spark" in fixtures:
            item.add_marker(pytest.mark.xdist_group("spark"))
    # pytest-xdist hands out the tests outside a group in this order: a long one handed out
    # last would end the run alone while the other workers wait; so would the fast tests that
    # take seconds each (_SECONDS_EACH), which come next. Stable: each part keeps the order of
    # its files.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("long") is None,
            item.path.name not in _SECONDS_EACH,
        )
    )


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """One local S3 server for the session; its credentials in the standard variables."""
    server = start_s3_server()
    saved = {name: os.environ.pop(name, None) for name in _AWS_VARIABLES}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
