"""What the examples share about their datasets: the skewed demo data, and checks that fail in
one line.

``write_skewed_dataset`` writes one file with one row group per size (float columns x0..x3
and a linear label with noise), so that petastorm's round robin gives ranks very different
numbers of rows. ``keep_demo_dataset`` writes an example's demo dataset where it is asked to,
reuses it when it is already there, and refuses any other dataset: no example overwrites data
it did not write. ``dataset_url`` turns ``--data`` into a URL, or into one line (``Error: ...``)
on every rank when the dataset cannot be read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ddp_even.parquet import DatasetError, read_row_groups

FEATURES = ("x0", "x1", "x2", "x3")
LABEL = "label"
DEMO_FILE = "part-00000.parquet"


def write_skewed_dataset(directory: Path, row_group_sizes: tuple[int, ...]) -> None:
    """One Parquet file, one row group per size: label = x @ (2, -1, 0.5, 3) + 1 + noise."""
    rng = np.random.default_rng(0)
    rows = sum(row_group_sizes)
    features = rng.standard_normal((rows, len(FEATURES))).astype(np.float32)
    labels = features @ np.array([2.0, -1.0, 0.5, 3.0], np.float32) + 1.0
    labels += rng.normal(0.0, 0.1, rows).astype(np.float32)
    columns: dict[str, Any] = {name: features[:, i] for i, name in enumerate(FEATURES)}
    columns[LABEL] = labels
    table = pa.table(columns)
    directory.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(directory / DEMO_FILE, table.schema) as writer:
        start = 0
        for size in row_group_sizes:
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size


def keep_demo_dataset(
    directory: Path,
    row_group_sizes: tuple[int, ...],
    write: Callable[[Path], None] | None = None,
) -> None:
    """Make sure ``directory`` holds the demo dataset of ``row_group_sizes``.

    A new or empty directory gets one (``write(directory)``, by default
    ``write_skewed_dataset``); a directory that already holds
    it is used as it is; anything else is refused with a ``click.UsageError`` that says what is
    there, so that no example replaces a dataset it did not write.
    """
    if not directory.exists() or not any(directory.iterdir()):
        if write is None:
            write_skewed_dataset(directory, row_group_sizes)
        else:
            write(directory)
        return
    found = _row_group_sizes(directory)
    if found == list(row_group_sizes):
        return
    what = (
        f"a dataset of {sum(found)} rows in {len(found)} row groups"
        if found is not None
        else "other files"
    )
    raise click.UsageError(
        f"{directory} holds {what}, not this example's demo dataset ({sum(row_group_sizes)} "
        f"rows in {len(row_group_sizes)} row groups); give --data a new or empty directory"
    )


def dataset_url(data: str) -> str:
    """``data`` as a petastorm URL (a local path as ``file://``), once its metadata reads.

    A dataset that cannot be read is a ``click.ClickException``: one line, ``Error: ...``, on
    every rank, instead of a traceback from deep inside the first reader.
    """
    url = data if "://" in data else Path(data).resolve().as_uri()
    try:
        read_row_groups(url)
    except DatasetError as error:
        raise click.ClickException(str(error)) from error
    return url


def _row_group_sizes(directory: Path) -> list[int] | None:
    """The row-group sizes of the demo file, when ``directory`` holds that file and only it."""
    if [path.name for path in directory.iterdir()] != [DEMO_FILE]:
        return None
    metadata = pq.read_metadata(directory / DEMO_FILE)
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
