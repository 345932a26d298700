"""A dataset's row groups read from its Parquet metadata, as petastorm 0.12.1 lists them
(without petastorm, without reading any data).

The files are a directory's as :mod:`ddp_even.parquet.layout` walks it, or a list's in the order
given. The row groups (``petastorm.etl.dataset_metadata.load_row_groups``) come from the first
source that exists:

- a ``_metadata`` summary with row groups: for each data file, as many row groups as the
  summary lists for it (files it does not list are skipped);
- a ``_common_metadata`` (or row-group-less ``_metadata``) carrying petastorm's
  ``num_row_groups_per_file`` key: that many row groups per file, files in sorted order;
- otherwise every file's footer.

Footers are read with the storage's bounded concurrency; a data file costs at most two requests
(its size, then its tail), a ``_metadata`` summary one read in all.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import posixpath
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ddp_even.errors import DatasetError
from ddp_even.parquet.layout import DirectoryLayout, check_one_schema, petastorm_too
from ddp_even.parquet.nulls import NullColumns
from ddp_even.planning.row_groups import (
    ROW_GROUPS_PER_FILE_KEY,
    MetadataSource,
    Progress,
    RowGroups,
)
from ddp_even.storage import (
    DatasetLocation,
    ResolvedDataset,
    Storage,
    StorageOptions,
    resolve_dataset,
)

__all__ = ["changed_files", "changed_row_groups", "footer_digest", "read_row_groups"]

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def read_row_groups(
    dataset: DatasetLocation | ResolvedDataset,
    *,
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
    progress: Progress | None = None,
    nulls: NullColumns | None = None,
) -> RowGroups:
    """List a dataset's row groups in petastorm's global order, from metadata only.

    ``dataset`` is what you would pass to ``make_reader`` / ``make_batch_reader``: a URL
    (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ...) or a local path to a
    directory or file, or a list of files (the order of a list is kept, as petastorm keeps it).
    ``storage_options`` / ``filesystem`` say how to reach remote storage (see
    :func:`~ddp_even.storage.resolve_dataset`); ``progress(done, total)`` is called as
    metadata files are read; ``nulls`` is given every footer (or summary) read. Raises
    :class:`DatasetError` for a missing path or bucket, denied access, an unreachable endpoint,
    a file that is not Parquet, a layout petastorm rejects, or a dataset without row groups.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=4)
        >>> read_row_groups(f"file://{root}").num_rows.tolist()
        [4, 4, 2]
    """
    resolved = resolve_dataset(dataset, storage_options=storage_options, filesystem=filesystem)
    reader = MetadataReader(resolved.storage, progress, nulls)
    if not resolved.is_list or len(resolved.paths) == 1:
        # pyarrow treats a one-element list as that single path (file or directory).
        return reader.read_location(resolved.paths[0])
    return reader.from_footers(list(resolved.paths), listed=True)


def changed_row_groups(
    resolved: ResolvedDataset, planned: RowGroups, indices: Sequence[int]
) -> str | None:
    """Which of row groups ``indices`` no longer have the rows ``planned`` lists, or None.

    Lists the dataset again (:func:`changed_files`: a file added or removed changes every
    rank's plan), reads again the footers of the files holding them (only those whose stamp
    changed, where listed) and returns a sentence naming the file added or gone, the first row
    group whose file now has another number of rows in it or too few row groups, or a file
    rewritten (its footer changed); None when all of them match.
    """
    files_changed = changed_files(resolved, planned)
    if files_changed is not None:
        return files_changed
    file_numbers = sorted({int(planned.file_of[index]) for index in indices})
    storage = resolved.storage
    if not file_numbers:
        return None  # no row group to check (a rank without rows)
    if planned.file_stamps is not None:
        now = storage.stamps([planned.files[number] for number in file_numbers])
        file_numbers = [
            number
            for number, stamp in zip(file_numbers, now, strict=True)
            if stamp != planned.file_stamps[number]
        ]
        if not file_numbers:
            return None
    reader = MetadataReader(storage, None)
    paths = [planned.files[number] for number in file_numbers]
    footers = dict(zip(file_numbers, reader.read_footers(paths, listed=False), strict=True))
    for index in sorted(indices):
        footer = footers.get(int(planned.file_of[index]))
        if footer is None:
            continue
        in_file, counted = int(planned.index_in_file[index]), int(planned.num_rows[index])
        where = f"row group {index} ({storage.url(planned.path_of(index))} #{in_file})"
        if in_file >= footer.num_row_groups:
            return f"{where} is gone: its file has {footer.num_row_groups} row groups now"
        rows = footer.row_group(in_file).num_rows
        if rows != counted:
            return f"{where} has {rows} rows now, the plan counted {counted}"
    for number, footer in footers.items():
        path = storage.url(planned.files[number])
        if planned.footer_digests is None:
            # Planned from a summary: no footer to compare, and the file was written again.
            return f"{path} was rewritten since it was planned (its size or time changed)"
        if footer_digest(footer) != planned.footer_digests[number]:
            # Same rows per row group, other data: counts of a row predicate may be wrong now.
            return f"{path} was rewritten since it was planned (its footer changed)"
    return None


def changed_files(resolved: ResolvedDataset, planned: RowGroups) -> str | None:
    """A sentence naming a data file added to the dataset's directory since ``planned`` was
    listed, or one gone from it; None when the directory holds the planned files.

    The directory is listed again as planning lists it. A list of files has no other files; a
    ``_metadata`` summary names the files read (one it does not name is not read, as when
    planned). A new file without rows changes nothing (planning skips such files too).
    """
    if resolved.is_list and len(resolved.paths) > 1:
        return None
    if planned.source == "_metadata" or tuple(planned.files) == tuple(resolved.paths):
        return None  # the summary's files, or a single file
    storage = resolved.storage
    reader = MetadataReader(storage, None)
    layout = DirectoryLayout.scan(
        resolved.paths[0], storage, functools.partial(reader.map, report=False)
    )
    listed, planned_files = set(layout.data_files), set(planned.files)
    gone = [path for path in planned.files if path not in listed]
    if gone:
        return f"{storage.url(gone[0])} is gone from the dataset since it was planned"
    added = [path for path in layout.data_files if path not in planned_files]
    added = [path for path in added if _has_rows(reader, path)]
    if not added:
        return None
    count = f"{len(added)} new file{'s' if len(added) > 1 else ''}"
    return f"{storage.url(added[0])} was added to the dataset after it was planned ({count})"


def _has_rows(reader: MetadataReader, path: str) -> bool:
    """Whether a file found since planning holds row groups (planning skipped one without);
    a file that is not Parquet counts as new data too (planning would refuse it now)."""
    try:
        return bool(reader.read_footer(path).num_row_groups > 0)
    except DatasetError:
        return True


class MetadataReader:
    """Reads one dataset's listings and metadata through its storage, in parallel."""

    def __init__(
        self, storage: Storage, progress: Progress | None, nulls: NullColumns | None = None
    ) -> None:
        self.storage = storage
        self.progress = progress
        self.nulls = nulls

    def read_location(self, path: str) -> RowGroups:
        kind = self.storage.kind(path)
        if kind == "missing":
            raise self.storage.missing(path)
        if kind == "file":
            return self.from_footers([path], listed=False)
        layout = DirectoryLayout.scan(path, self.storage, functools.partial(self.map, report=False))
        metadata = self.read_summary(layout.metadata_path) if layout.metadata_path else None
        common_path = layout.common_metadata_path or layout.metadata_path
        if metadata is None and common_path is None:
            stamped = self.from_footers(layout.data_files, listed=False)
            return dataclasses.replace(
                stamped, file_stamps=tuple(layout.stamps[path] for path in stamped.files)
            )
        if metadata is not None and metadata.num_row_groups > 0:
            assert layout.metadata_path is not None
            if self.nulls is not None:
                self.nulls.add(metadata)
            return _from_summary(layout, metadata, layout.metadata_path)
        assert common_path is not None
        common = metadata if common_path == layout.metadata_path else self.read_summary(common_path)
        return self.from_row_group_counts(layout.data_files, common, common_path, root=path)

    def map(
        self, function: Callable[[_Item], _Result], items: Sequence[_Item], report: bool
    ) -> list[_Result]:
        """``[function(item) for item in items]`` with at most ``storage.concurrency`` at once.

        The first failure cancels what has not started and is raised.
        """
        total = len(items)
        progress = self.progress if report else None
        if total <= 1 and progress is None:
            # A thread costs more than one file's metadata on a busy machine.
            return [function(item) for item in items]
        workers = max(1, min(self.storage.concurrency, total))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ddp-even-meta") as pool:
            futures = [pool.submit(function, item) for item in items]
            pending = set(futures)
            while pending:
                if progress is not None:
                    progress(total - len(pending), total)
                # Reporting, it looks every 0.1 s; else it waits until all are done or one fails.
                timeout = None if progress is None else 0.1
                done, pending = wait(pending, timeout=timeout, return_when=FIRST_EXCEPTION)
                failed = [future for future in futures if future in done and future.exception()]
                if failed:
                    for future in futures:
                        future.cancel()
                    # The earliest in input order: the same dataset gives the same error.
                    failed[0].result()
            if progress is not None:
                progress(total, total)
            return [future.result() for future in futures]

    def read_footer(self, path: str, listed: bool = False) -> pq.FileMetaData:
        try:
            return self.storage.read_footer(path)
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
            raise self.storage.explain(error, path) or self._unreadable(
                error, path, listed
            ) from error

    def _unreadable(self, error: BaseException, path: str, listed: bool) -> DatasetError:
        if listed and isinstance(error, OSError):
            # Only now ask what the path is: a listed file costs no extra request otherwise.
            kind = self.storage.kind(path)
            if kind == "directory":
                return DatasetError(
                    f"{self.storage.url(path)} is not a file: a list must name Parquet files "
                    "(pass a directory on its own instead)"
                )
            if kind == "missing":
                return self.storage.missing(path)
        return DatasetError(
            f"{self.storage.url(path)} is not a readable Parquet file ({error}); remove it from "
            "the dataset, or start its name with '_' or '.' so that it is skipped"
            f"{petastorm_too('petastorm skips such names too')}"
        )

    def read_summary(self, path: str) -> pq.FileMetaData:
        try:
            summary = self.storage.read_summary(path)
        except (OSError, ValueError) as error:
            raise self.storage.explain(error, path) or DatasetError(
                f"{self.storage.url(path)} is not a readable Parquet summary file ({error})"
                f"{petastorm_too('petastorm cannot open the dataset either')}: delete or "
                "regenerate it"
            ) from error
        if self.progress is not None:
            self.progress(1, 1)
        return summary

    def read_footers(self, paths: Sequence[str], listed: bool) -> list[pq.FileMetaData]:
        footers = self.map(lambda path: self.read_footer(path, listed), paths, report=True)
        if self.nulls is not None:
            for footer in footers:
                self.nulls.add(footer)
        return footers

    def from_footers(self, paths: list[str], listed: bool) -> RowGroups:
        footers = self.read_footers(paths, listed)
        sizes = [_footer_sizes(footer) for footer in footers]
        check_one_schema(paths, footers, self.storage.url)
        return _build(paths, sizes, "footers", self.storage, footers)

    def from_row_group_counts(
        self, data_files: Sequence[str], common: pq.FileMetaData, common_path: str, root: str
    ) -> RowGroups:
        """petastorm's own key: the number of row groups per file; sizes come from the footers."""
        url = self.storage.url
        key_values = common.metadata or {}
        if ROW_GROUPS_PER_FILE_KEY not in key_values:
            raise DatasetError(
                f"{url(common_path)} has no row-group counts "
                f"({ROW_GROUPS_PER_FILE_KEY.decode()})"
                f"{petastorm_too('petastorm fails on this dataset too')}: delete the file (the "
                "footers then give the row groups)"
                f"{petastorm_too('or regenerate it with petastorm-generate-metadata.py')}"
            )
        counts: dict[str, int] = json.loads(key_values[ROW_GROUPS_PER_FILE_KEY].decode())
        relative = {path: posixpath.relpath(path, root) for path in data_files}
        for path in data_files:
            if relative[path] not in counts:
                raise DatasetError(
                    f"{url(path)} is missing from the row-group counts in {url(common_path)}"
                    f"{petastorm_too('petastorm fails with KeyError')}: delete "
                    f"{url(common_path)} (the footers then give the row groups)"
                    f"{petastorm_too('or regenerate it with petastorm-generate-metadata.py')}"
                )
        footers = self.read_footers(data_files, listed=False)
        sizes = []
        for path, footer in zip(data_files, footers, strict=True):
            count = counts[relative[path]]
            if count > footer.num_row_groups:
                raise DatasetError(
                    f"{url(common_path)} says {url(path)} has {count} row groups but its footer "
                    f"has {footer.num_row_groups}: regenerate the metadata"
                )
            sizes.append(_footer_sizes(footer)[:count])
        check_one_schema(data_files, footers, url)
        return _build(list(data_files), sizes, "_common_metadata", self.storage, footers)


def _footer_sizes(footer: pq.FileMetaData) -> list[int]:
    return [footer.row_group(k).num_rows for k in range(footer.num_row_groups)]


def _from_summary(
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
    row_groups = _build([path for path, _ in listed], [sizes for _, sizes in listed], "_metadata")
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


def _build(
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
