"""The row groups of a Parquet dataset, numbered exactly as petastorm 0.12.1 numbers them.

Petastorm shards, and this package plans, by *global row-group index*: the position of a row
group in the list petastorm builds when it opens a dataset. That list comes from Parquet
metadata only, so it can be rebuilt here without petastorm and without reading any data:

1. The files. A directory is walked like pyarrow 14's legacy ``ParquetManifest`` (which
   petastorm 0.12.1 uses): names starting with ``_`` or ``.``, ``*.crc`` and ``_SUCCESS``
   are skipped, names ending in ``_metadata`` / ``_common_metadata`` are summary files,
   subdirectories must be hive partitions (``key=value``), and all data files are sorted by
   full path. A list of files keeps the order given.
2. The row groups (``petastorm.etl.dataset_metadata.load_row_groups``), from the first source
   that exists:

   - a ``_metadata`` summary with row groups: for each data file, as many row groups as the
     summary lists for it (files it does not list are skipped);
   - a ``_common_metadata`` (or row-group-less ``_metadata``) carrying petastorm's
     ``num_row_groups_per_file`` key: that many row groups per file, files in sorted order;
   - otherwise every file's footer.

Only local datasets (``file://`` URLs and paths) are supported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

import numpy as np
import numpy.typing as npt
import pyarrow.parquet as pq

__all__ = ["DatasetError", "RowGroup", "RowGroups", "read_row_groups"]

#: Where the row-group list came from.
MetadataSource = Literal["footers", "_metadata", "_common_metadata", "sizes"]

#: A dataset: a ``file://`` URL or a local path (directory or file), or a list of files.
DatasetLocation = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

# The key petastorm's materialize_dataset writes into _common_metadata
# (petastorm.etl.dataset_metadata.ROW_GROUPS_PER_FILE_KEY); copied so that planning does not
# import petastorm. tests/test_plan.py checks that the two agree.
ROW_GROUPS_PER_FILE_KEY = b"dataset-toolkit.num_row_groups_per_file.v1"

# Footers are small reads that release the GIL; petastorm reads them with a thread pool too.
_FOOTER_THREADS = 16


class DatasetError(ValueError):
    """The dataset cannot be planned: missing, not Parquet, or laid out so petastorm fails too.

    The message names the path and says what to do.

    Example:
        >>> try:
        ...     read_row_groups("/no/such/dataset")
        ... except DatasetError as error:
        ...     print(error)
        /no/such/dataset does not exist: check the path or URL
    """


@dataclass(frozen=True)
class RowGroup:
    """One row group, as petastorm addresses it.

    Example:
        >>> RowGroup(path="/data/part-0.parquet", index_in_file=1, global_index=3, num_rows=100)
        RowGroup(path='/data/part-0.parquet', index_in_file=1, global_index=3, num_rows=100)
    """

    #: Absolute path of the Parquet file holding it.
    path: str
    #: Its position among the file's row groups.
    index_in_file: int
    #: Its position in petastorm's dataset-wide list: the number petastorm shards by.
    global_index: int
    #: Rows in it, from the footer or summary metadata.
    num_rows: int


@dataclass(frozen=True, eq=False)
class RowGroups:
    """All row groups of a dataset in petastorm's global order, as read-only numpy columns.

    Row group ``i`` lives in ``files[file_of[i]]`` at position ``index_in_file[i]`` and has
    ``num_rows[i]`` rows. Columns rather than objects keep 100,000 row groups cheap to plan.

    Example:
        >>> groups = RowGroups.from_sizes([100, 250, 80])
        >>> len(groups), groups.total_rows, groups[1].num_rows
        (3, 430, 250)
    """

    #: Data files holding at least one listed row group, in the order their row groups appear.
    files: tuple[str, ...]
    #: Per row group: index into ``files``.
    file_of: npt.NDArray[np.int64]
    #: Per row group: position in its file.
    index_in_file: npt.NDArray[np.int64]
    #: Per row group: number of rows.
    num_rows: npt.NDArray[np.int64]
    #: Where the list came from (``"sizes"`` for :meth:`from_sizes`).
    source: MetadataSource = "footers"

    def __post_init__(self) -> None:
        columns = (self.file_of, self.index_in_file, self.num_rows)
        if len({len(column) for column in columns}) != 1:
            raise ValueError("file_of, index_in_file and num_rows must have the same length")
        for column in columns:
            column.setflags(write=False)

    @classmethod
    def from_sizes(cls, num_rows: Sequence[int] | npt.ArrayLike) -> RowGroups:
        """Row groups with the given sizes and no files: for planning what-ifs and benchmarks.

        Example:
            >>> RowGroups.from_sizes([5, 7]).num_rows.tolist()
            [5, 7]
        """
        sizes = np.array(num_rows, dtype=np.int64).reshape(-1)
        if (sizes < 0).any():
            raise ValueError("row-group sizes must be >= 0")
        zeros = np.zeros(len(sizes), dtype=np.int64)
        return cls(
            files=("<sizes>",),
            file_of=zeros,
            index_in_file=np.arange(len(sizes), dtype=np.int64),
            num_rows=sizes,
            source="sizes",
        )

    def __len__(self) -> int:
        return len(self.num_rows)

    def __getitem__(self, global_index: int) -> RowGroup:
        return RowGroup(
            path=self.files[int(self.file_of[global_index])],
            index_in_file=int(self.index_in_file[global_index]),
            global_index=range(len(self))[global_index],
            num_rows=int(self.num_rows[global_index]),
        )

    @property
    def total_rows(self) -> int:
        """Rows in the whole dataset.

        Example:
            >>> RowGroups.from_sizes([3, 4]).total_rows
            7
        """
        return int(self.num_rows.sum())


def read_row_groups(dataset: DatasetLocation) -> RowGroups:
    """List a dataset's row groups in petastorm's global order, from metadata only.

    ``dataset`` is what you would pass to ``make_reader`` / ``make_batch_reader``: a
    ``file://`` URL or a local path to a directory or file, or a list of files (the order of a
    list is kept, as petastorm keeps it). Raises :class:`DatasetError` for a missing path, a
    file that is not Parquet, a layout petastorm rejects, or a dataset without row groups.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=4)
        >>> read_row_groups(f"file://{root}").num_rows.tolist()
        [4, 4, 2]
    """
    if isinstance(dataset, str | os.PathLike):
        return _read_location(_local_path(dataset))
    items = list(dataset)
    if not items:
        raise DatasetError("the list of dataset files is empty: pass at least one Parquet file")
    paths = [_local_path(item) for item in items]
    if len(paths) == 1:
        # pyarrow treats a one-element list as that single path (file or directory).
        return _read_location(paths[0])
    for path in paths:
        if not os.path.isfile(path):
            raise DatasetError(
                f"{path} is not a file: a list must name Parquet files "
                "(pass a directory on its own instead)"
            )
    return _from_footers(paths)


def _local_path(location: str | os.PathLike[str]) -> str:
    text = os.fspath(location)
    if "://" in text or text.startswith("file:"):
        parsed = urlparse(text)
        if parsed.scheme.lower() != "file":
            raise DatasetError(
                f"{text}: only local datasets can be planned (file:// URLs or paths), "
                f"not {parsed.scheme}://"
            )
        # Like petastorm (fs_utils.get_dataset_path): the URL path is used as is, not unquoted.
        path = parsed.path
    else:
        path = os.path.abspath(text)
    # petastorm's normalize_dir_url drops one trailing slash.
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def _read_location(path: str) -> RowGroups:
    if not os.path.exists(path):
        raise DatasetError(f"{path} does not exist: check the path or URL")
    if not os.path.isdir(path):
        return _from_footers([path])
    layout = _DirectoryLayout.scan(path)
    metadata = _read_summary(layout.metadata_path) if layout.metadata_path else None
    common_path = layout.common_metadata_path or layout.metadata_path
    if metadata is None and common_path is None:
        return _from_footers(layout.data_files)
    if metadata is not None and metadata.num_row_groups > 0:
        assert layout.metadata_path is not None
        return _from_summary(layout.data_files, metadata, layout.metadata_path)
    assert common_path is not None
    common = metadata if common_path == layout.metadata_path else _read_summary(common_path)
    return _from_row_group_counts(layout.data_files, common, common_path, root=path)


@dataclass(frozen=True)
class _DirectoryLayout:
    """What pyarrow's legacy ParquetManifest finds under a dataset directory."""

    data_files: list[str]
    metadata_path: str | None
    common_metadata_path: str | None

    @classmethod
    def scan(cls, root: str) -> _DirectoryLayout:
        data_files: list[str] = []
        metadata_paths: list[str] = []
        common_paths: list[str] = []
        pending = [root]
        while pending:
            directory = pending.pop()
            files, subdirectories = _list_directory(directory)
            level_files = []
            for name in files:
                full = f"{directory}/{name}"
                # The order of these checks is pyarrow's: a summary file is recognised even
                # where a hidden-file rule would otherwise skip it.
                if name.endswith("_common_metadata"):
                    common_paths.append(full)
                elif name.endswith("_metadata"):
                    metadata_paths.append(full)
                elif not _silently_excluded(name):
                    level_files.append(full)
            partitions = [name for name in subdirectories if not _private_directory(name)]
            if level_files and partitions:
                raise DatasetError(
                    f"{directory} holds both data files and subdirectories: petastorm cannot "
                    "read that layout; move the files into a partition directory (key=value)"
                )
            for name in partitions:
                if "=" not in name:
                    raise DatasetError(
                        f"{directory}/{name} is not a hive partition directory (key=value): "
                        "petastorm cannot read it; rename it or start its name with '_'"
                    )
                pending.append(f"{directory}/{name}")
            data_files.extend(level_files)
        for kind, found in (("_metadata", metadata_paths), ("_common_metadata", common_paths)):
            if len(found) > 1:
                raise DatasetError(
                    f"several {kind} files under {root} ({', '.join(sorted(found))}): petastorm "
                    "would use an arbitrary one; keep only the one at the dataset root"
                )
        if not data_files:
            raise DatasetError(f"{root} holds no Parquet data files: check the path")
        # The manifest sorts by full path once all levels are listed.
        data_files.sort()
        return cls(
            data_files=data_files,
            metadata_path=metadata_paths[0] if metadata_paths else None,
            common_metadata_path=common_paths[0] if common_paths else None,
        )


def _list_directory(directory: str) -> tuple[list[str], list[str]]:
    files: list[str] = []
    subdirectories: list[str] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            # os.walk (what the legacy filesystem uses) counts a symlink to a directory as one.
            (subdirectories if entry.is_dir() else files).append(entry.name)
    return files, subdirectories


def _silently_excluded(name: str) -> bool:
    return (
        name.endswith(".crc")
        or name.endswith("_$folder$")
        or name.startswith((".", "_"))
        or name == "_SUCCESS"
    )


def _private_directory(name: str) -> bool:
    return name.startswith(("_", ".")) and "=" not in name


def _read_footer(path: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(
            f"{path} is not a readable Parquet file ({error}); remove it from the dataset "
            "or start its name with '_' or '.' so that petastorm skips it too"
        ) from error


def _read_summary(path: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(path)
    except (OSError, ValueError) as error:
        raise DatasetError(
            f"{path} is not a readable Parquet summary file ({error}); petastorm cannot open "
            "the dataset either: delete or regenerate it"
        ) from error


def _read_footers(paths: Sequence[str]) -> list[pq.FileMetaData]:
    if len(paths) == 1:
        return [_read_footer(paths[0])]
    with ThreadPoolExecutor(max_workers=min(_FOOTER_THREADS, len(paths))) as pool:
        return list(pool.map(_read_footer, paths))


def _footer_sizes(footer: pq.FileMetaData) -> list[int]:
    return [footer.row_group(k).num_rows for k in range(footer.num_row_groups)]


def _from_footers(paths: Sequence[str]) -> RowGroups:
    sizes = [_footer_sizes(footer) for footer in _read_footers(paths)]
    return _build(list(paths), sizes, "footers")


def _from_summary(
    data_files: Sequence[str], metadata: pq.FileMetaData, metadata_path: str
) -> RowGroups:
    """``_metadata`` lists row groups with their file paths relative to its directory."""
    sizes_by_file: dict[str, list[int]] = {}
    for k in range(metadata.num_row_groups):
        row_group = metadata.row_group(k)
        file_path = row_group.column(0).file_path
        sizes_by_file.setdefault(file_path, []).append(row_group.num_rows)
    base = os.path.normpath(os.path.dirname(metadata_path))
    listed = [
        (path, sizes_by_file[relative])
        for path in data_files
        if (relative := os.path.relpath(path, base)) in sizes_by_file
    ]
    if not listed:
        raise DatasetError(
            f"{metadata_path} lists no row group of the data files next to it (its file paths: "
            f"{sorted(sizes_by_file)[:3]}): petastorm would read nothing; write it with "
            "file paths set (FileMetaData.set_file_path) or delete it"
        )
    return _build([path for path, _ in listed], [sizes for _, sizes in listed], "_metadata")


def _from_row_group_counts(
    data_files: Sequence[str], common: pq.FileMetaData, common_path: str, root: str
) -> RowGroups:
    """petastorm's own key: the number of row groups per file; sizes come from the footers."""
    key_values = common.metadata or {}
    if ROW_GROUPS_PER_FILE_KEY not in key_values:
        raise DatasetError(
            f"{common_path} has no row-group counts ({ROW_GROUPS_PER_FILE_KEY.decode()}): "
            "petastorm fails on this dataset too; delete the file or regenerate it with "
            "petastorm-generate-metadata.py"
        )
    counts: dict[str, int] = json.loads(key_values[ROW_GROUPS_PER_FILE_KEY].decode())
    files_and_counts = []
    for path in data_files:
        relative = os.path.relpath(path, root)
        if relative not in counts:
            raise DatasetError(
                f"{path} is missing from the row-group counts in {common_path}: petastorm "
                "fails with KeyError; regenerate the metadata (petastorm-generate-metadata.py)"
            )
        files_and_counts.append((path, counts[relative]))
    footers = _read_footers([path for path, _ in files_and_counts])
    sizes = []
    for (path, count), footer in zip(files_and_counts, footers, strict=True):
        if count > footer.num_row_groups:
            raise DatasetError(
                f"{common_path} says {path} has {count} row groups but its footer has "
                f"{footer.num_row_groups}: regenerate the metadata"
            )
        sizes.append(_footer_sizes(footer)[:count])
    return _build([path for path, _ in files_and_counts], sizes, "_common_metadata")


def _build(paths: list[str], sizes: list[list[int]], source: MetadataSource) -> RowGroups:
    kept = [(path, file_sizes) for path, file_sizes in zip(paths, sizes, strict=True) if file_sizes]
    if not kept:
        raise DatasetError(
            f"no row groups in {paths[0] if len(paths) == 1 else f'{len(paths)} files'}: "
            "petastorm has nothing to read; check that the dataset was written completely"
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
    )
