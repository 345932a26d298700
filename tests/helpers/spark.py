"""One real local Spark for the tests, and skewed data written through petastorm's Spark doors.

- :func:`start_spark`: ``local[2]`` (two task slots: ``TorchDistributor(local_mode=False)``
  runs one barrier task per rank, all at once), UI and progress bars off, a small driver, two
  shuffle partitions, the converter's cache directory set. Started once per test run (the
  ``spark`` fixture in ``tests/conftest.py``); spawned ranks never start one, they read what
  it wrote.
- :func:`skewed_dataframe`: partition ``k`` holds ``sizes[k]`` rows, with ``id`` consecutive
  across partitions in partition order and ``value = id * 0.5``. Built in the JVM alone (no
  Python workers), so that writing it is quick.
- :func:`materialize_unischema`: the same rows, plus a ``vec`` ndarray (``NdarrayCodec``),
  written with ``materialize_dataset`` and a Unischema whose scalars use ``ScalarCodec``.
- :func:`round_robin_ids`: what petastorm's sharding gives each rank, read with pyarrow alone
  from the files in the order petastorm numbers their row groups: the expectation the tests
  hold ddp_even (and petastorm) to.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pyarrow.parquet as pq

__all__ = [
    "VEC_SIZE",
    "java_available",
    "local_path",
    "materialize_unischema",
    "round_robin_ids",
    "row_group_ids",
    "shard_ids",
    "skewed_dataframe",
    "sorted_data_files",
    "start_spark",
]

#: Length of the ``vec`` field of :func:`materialize_unischema`.
VEC_SIZE = 4


def java_available() -> bool:
    """Whether a Java runtime for Spark is on this machine."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").exists():
        return True
    return shutil.which("java") is not None


def start_spark(cache_dir: Path) -> Any:
    """A local Spark session whose converter cache is ``cache_dir``.

    ``PYSPARK_PYTHON`` is this interpreter: ``materialize_dataset`` runs a Python job (the row
    groups per file) and Spark's Python workers must import the same packages.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from petastorm.spark import SparkDatasetConverter
    from pyspark.sql import SparkSession

    spark = (
        # Two task slots: the barrier-mode TorchDistributor tests run 2 ranks as 2 tasks at once.
        SparkSession.builder.master("local[2]")
        .appName("ddp_even-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "512m")
        .config("spark.sql.shuffle.partitions", "2")
        # Quick start on two cores: the JIT's first tier only, one GC thread.
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # Set on the session, not the builder: Spark warns about non-Spark keys given at launch.
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, cache_dir.resolve().as_uri())
    return spark


def skewed_dataframe(spark: Any, sizes: Sequence[int]) -> Any:
    """A DataFrame of ``len(sizes)`` partitions; partition ``k`` has ``sizes[k]`` rows.

    One row per partition (``spark.range``), each exploded into its own id range: narrow
    transformations keep the partitions, and partition ``k`` is written as ``part-0000k``.
    """
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    lasts = [start + size - 1 for start, size in zip(starts, sizes, strict=True)]

    def array(values: Sequence[int]) -> str:
        return "array(" + ", ".join(f"cast({value} as bigint)" for value in values) + ")"

    partition = "cast(id + 1 as int)"
    return (
        spark.range(0, len(sizes), 1, len(sizes))
        .selectExpr(
            f"explode(sequence(element_at({array(starts)}, {partition}), "
            f"element_at({array(lasts)}, {partition}))) as id"
        )
        .selectExpr("id", "cast(id as double) * 0.5 as value")
    )


def _unischema() -> Any:
    from petastorm.codecs import NdarrayCodec, ScalarCodec
    from petastorm.unischema import Unischema, UnischemaField
    from pyspark.sql.types import FloatType, LongType

    return Unischema(
        "DdpEvenSparkSchema",
        [
            UnischemaField("id", np.int64, (), ScalarCodec(LongType()), False),
            UnischemaField("value", np.float32, (), ScalarCodec(FloatType()), False),
            UnischemaField("vec", np.float32, (VEC_SIZE,), NdarrayCodec(), False),
        ],
    )


def materialize_unischema(spark: Any, directory: Path, sizes: Sequence[int]) -> str:
    """Write a Unischema dataset with ``materialize_dataset``, one file per entry of ``sizes``.

    Rows are encoded in the driver (``dict_to_spark_row``) and each file's rows are one local
    DataFrame; the union keeps one partition per DataFrame. Returns the ``file://`` URL.
    """
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import dict_to_spark_row

    schema = _unischema()
    spark_schema = schema.as_spark_schema()
    url = directory.resolve().as_uri()
    frames = []
    start = 0
    for size in sizes:
        rows = [
            dict_to_spark_row(
                schema,
                {"id": i, "value": np.float32(i * 0.5), "vec": np.full(VEC_SIZE, i, np.float32)},
            )
            for i in range(start, start + size)
        ]
        # One partition per file whatever the session's parallelism (local[2] would cut
        # each local DataFrame in two).
        frames.append(spark.createDataFrame(rows, spark_schema).coalesce(1))
        start += size
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.union(other)
    with materialize_dataset(spark, url, schema, row_group_size_mb=1):
        frame.write.mode("overwrite").parquet(url)
    return url


def local_path(url: str) -> str:
    """The local path of a ``file:`` URL (Spark writes ``file:/x`` or ``file:///x``)."""
    return urlparse(url).path if url.startswith("file:") else url


def sorted_data_files(url: str) -> list[str]:
    """A dataset directory's data files as petastorm orders them: sorted paths; ``_*`` and
    ``.*`` files (``_SUCCESS``, ``_common_metadata``, Hadoop's ``.crc``) are not data."""
    root = Path(local_path(url))
    return sorted(
        str(path)
        for path in root.iterdir()
        if not path.name.startswith(("_", ".")) and path.is_file()
    )


def row_group_ids(files: Sequence[str]) -> list[list[int]]:
    """The ``id`` values of every row group, numbered through ``files`` in the order given
    (petastorm's global row-group order), read with pyarrow."""
    groups: list[list[int]] = []
    for file in files:
        parquet = pq.ParquetFile(local_path(file))
        for index in range(parquet.num_row_groups):
            groups.append(parquet.read_row_group(index, columns=["id"])["id"].to_pylist())
    return groups


def shard_ids(groups: Sequence[Sequence[int]], shards: Sequence[Sequence[int]]) -> list[list[int]]:
    """Sorted ids per rank, when rank ``r`` reads row groups ``shards[r]``."""
    return [sorted(i for index in shard for i in groups[index]) for shard in shards]


def round_robin_ids(files: Sequence[str], world_size: int) -> list[list[int]]:
    """Sorted ``id`` values petastorm's shard ``r`` of ``world_size`` reads, for every ``r``:
    row group ``i`` (numbered through ``files`` in the order given) goes to ``i % world_size``."""
    groups = row_group_ids(files)
    shards = [range(rank, len(groups), world_size) for rank in range(world_size)]
    return shard_ids(groups, shards)
