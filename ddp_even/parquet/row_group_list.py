"""The list of a dataset's row groups built from what its metadata says: the rows of each row
group of each file (files without row groups left out), from footers or a ``_metadata`` summary
(:mod:`ddp_even.parquet.metadata` reads them), and the digest that names a footer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ddp_even.errors import DatasetError
from ddp_even.parquet.layout import DirectoryLayout, petastorm_too
from ddp_even.planning.row_groups import MetadataSource, RowGroups

if TYPE_CHECKING:
    from ddp_even.storage import Storage

__all__ = ["build", "footer_digest", "footer_sizes", "from_summary"]


def footer_sizes(footer: pq.FileMetaData) -> list[int]:
    return [footer.row_group(k).num_rows for k in range(footer.num_row_groups)]


def from_summary(
    layout: DirectoryLayout, metadata: pq.FileMetaData, metadata_path: str
) -> RowGroups:
    """``_metadata`` lists row groups with their file paths relative to its directory. No
    footer is read: the summary's digest and each data file's stamp name the data instead."""
    data_files = layout.data_files
    sizes_by_file: dict[str, list[int]] = {}
    for k in range(metadata.num_row_groups):
        row_group = metadata.row_group(k)
        file_path = row_group.column(0).file_path
        sizes_by_file.setdefault(file_path, []).append(row_group.num_rows)
    base = posixpath.normpath(posixpath.dirname(metadata_path))
    listed = [
        (path, sizes_by_file[relative])
        for path in data_files
        if (relative := posixpath.relpath(path, base)) in sizes_by_file
    ]
    if not listed:
        raise DatasetError(
            f"{metadata_path} lists no row group of the data files next to it (its file paths: "
            f"{sorted(sizes_by_file)[:3]}): nothing would be read"
            f"{petastorm_too('petastorm would read nothing too')}; write it with file paths set "
            "(FileMetaData.set_file_path) or delete it"
        )
    row_groups = build([path for path, _ in listed], [sizes for _, sizes in listed], "_metadata")
    return dataclasses.replace(
        row_groups,
        summary_digest=footer_digest(metadata),
        file_stamps=tuple(layout.stamps[path] for path in row_groups.files),
    )


def footer_digest(footer: pq.FileMetaData) -> bytes:
    """16 bytes naming a file's footer (its schema, row groups and statistics): a file rewritten
    with other rows has another."""
    serialized = pa.BufferOutputStream()
    footer.write_metadata_file(serialized)
    return hashlib.blake2b(serialized.getvalue().to_pybytes(), digest_size=16).digest()


def build(
    paths: list[str],
    sizes: list[list[int]],
    source: MetadataSource,
    storage: Storage | None = None,
    footers: Sequence[pq.FileMetaData] | None = None,
) -> RowGroups:
    kept_files = [index for index, file_sizes in enumerate(sizes) if file_sizes]
    kept = [(paths[index], sizes[index]) for index in kept_files]
    if not kept:
        where = paths[0] if storage is None else storage.url(paths[0])
        raise DatasetError(
            f"no row groups in {where if len(paths) == 1 else f'{len(paths)} files'}: "
            "there is nothing to read; check that the dataset was written completely"
        )
    counts = np.array([len(file_sizes) for _, file_sizes in kept], dtype=np.int64)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    total = int(counts.sum())
    return RowGroups(
        files=tuple(path for path, _ in kept),
        file_of=np.repeat(np.arange(len(kept), dtype=np.int64), counts),
        index_in_file=np.arange(total, dtype=np.int64) - starts,
        num_rows=np.fromiter(
            (n for _, file_sizes in kept for n in file_sizes), dtype=np.int64, count=total
        ),
        source=source,
        footer_digests=(
            None if footers is None else tuple(footer_digest(footers[i]) for i in kept_files)
        ),
    )
