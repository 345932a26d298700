"""Fixtures shared by the test modules.

``spark``: one real local Spark session for the whole run (``local[2]``, UI off, a small
driver), started by the first test that asks for it and stopped at the end. Tests that use it
are marked ``spark``. Without a Java runtime they are skipped, except under CI (``CI`` set),
where a missing Java is a failure: CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.spark import java_available, start_spark


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
