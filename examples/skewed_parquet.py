"""The skewed Parquet dataset and the process exit the trainer examples share.

``write_skewed_dataset`` writes one file with one row group per size (float columns x0..x3
and a linear label with noise), so that petastorm's round robin gives ranks very different
numbers of rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FEATURES = ("x0", "x1", "x2", "x3")
LABEL = "label"


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
    with pq.ParquetWriter(directory / "part-00000.parquet", table.schema) as writer:
        start = 0
        for size in row_group_sizes:
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size
