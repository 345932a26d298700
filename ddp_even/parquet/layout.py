"""What pyarrow 14's legacy ``ParquetManifest`` (which petastorm 0.12.1 uses) finds under a
dataset directory: its data files in petastorm's order, and its summary files; whether the
files share one set of columns (as the legacy ``ParquetDataset`` validated them).

A directory is walked level by level (every directory of a level listed at once: partitions
are siblings): names starting with ``_`` or ``.``, ``*.crc`` and ``_SUCCESS`` are skipped,
names ending in ``_metadata`` / ``_common_metadata`` are summary files, subdirectories must be
hive partitions (``key=value``), and all data files are sorted by full path.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ddp_even.errors import DatasetError

if TYPE_CHECKING:
    from ddp_even.storage import Storage

#: ``[list_directory(path) for path in paths]``, listed concurrently (the caller's pool).
ListAll = Callable[[Callable[[str], Any], Sequence[str]], list[Any]]

__all__ = ["DirectoryLayout", "check_one_schema", "petastorm_too"]


def petastorm_too(said: str) -> str:
    """`` (said)`` where petastorm is installed, else nothing: a message compares with what
    petastorm does only for those who have it (no import: only whether it can be found)."""
    import importlib.util

    return f" ({said})" if importlib.util.find_spec("petastorm") is not None else ""


@dataclass(frozen=True)
class DirectoryLayout:
    """What pyarrow's legacy ParquetManifest finds under a dataset directory."""

    data_files: list[str]
    metadata_path: str | None
    common_metadata_path: str | None
    # Each data file's stamp (size and modification time), from the listing itself.
    stamps: dict[str, str]

    @classmethod
    def scan(cls, root: str, storage: Storage, list_all: ListAll) -> DirectoryLayout:
        url = storage.url
        data_files: list[str] = []
        stamps: dict[str, str] = {}
        metadata_paths: list[str] = []
        common_paths: list[str] = []
        level = [root]
        while level:
            # Every directory of a level is listed at once: partitions are siblings.
            listings = list_all(storage.list_directory, level)
            next_level = []
            for directory, (files, subdirectories) in zip(level, listings, strict=True):
                level_files = []
                for name, stamp in files.items():
                    full = f"{directory}/{name}"
                    stamps[full] = stamp
                    # The order of these checks is pyarrow's: a summary file is recognised even
                    # where a hidden-file rule would otherwise skip it.
                    if name.endswith("_common_metadata"):
                        common_paths.append(full)
                    elif name.endswith("_metadata"):
                        metadata_paths.append(full)
                    elif not _silently_excluded(name):
                        level_files.append(full)
                partitions = sorted(name for name in subdirectories if not _private_directory(name))
                if level_files and partitions:
                    raise DatasetError(
                        f"{url(directory)} holds both data files and subdirectories: a dataset "
                        "directory holds either data files or hive partition directories"
                        f"{petastorm_too('petastorm cannot read it either')}; move the files "
                        "into a partition directory (key=value)"
                    )
                for name in partitions:
                    if "=" not in name:
                        raise DatasetError(
                            f"{url(directory)}/{name} is not a hive partition directory "
                            f"(key=value){petastorm_too('petastorm cannot read it')}: rename "
                            "it, or start its name with '_' so that it is skipped"
                        )
                    next_level.append(f"{directory}/{name}")
                data_files.extend(level_files)
            level = next_level
        for kind, found in (("_metadata", metadata_paths), ("_common_metadata", common_paths)):
            if len(found) > 1:
                raise DatasetError(
                    f"several {kind} files under {url(root)} "
                    f"({', '.join(url(path) for path in sorted(found))}): which holds the "
                    "dataset's row groups is not known"
                    f"{petastorm_too('petastorm would use an arbitrary one')}; keep only the "
                    "one at the dataset root"
                )
        if not data_files:
            raise DatasetError(f"{url(root)} holds no Parquet data files: check the path")
        # The manifest sorts by full path once all levels are listed.
        data_files.sort()
        return cls(
            data_files=data_files,
            metadata_path=metadata_paths[0] if metadata_paths else None,
            common_metadata_path=common_paths[0] if common_paths else None,
            stamps=stamps,
        )


def check_one_schema(
    paths: Sequence[str], footers: Sequence[pq.FileMetaData], url: Callable[[str], str]
) -> None:
    """:class:`DatasetError` naming two files and the columns they differ in, unless every file
    with rows has the columns of the first (by name and type, in any order).

    A batch has one set of columns: files that differ would give batches whose keys change
    mid-epoch, or a ``KeyError`` there. Every rank reads the same footers, so every rank
    raises the same error before the first step.
    """
    with_rows = [
        (path, footer)
        for path, footer in zip(paths, footers, strict=True)
        if footer.num_rows > 0  # a file without rows gives no batch
    ]
    if not with_rows:
        return
    first_path, first_footer = with_rows[0]
    ours = _columns(first_footer)
    for path, footer in with_rows[1:]:
        if footer.schema.equals(first_footer.schema):
            continue  # the same Parquet schema: the same columns (the common case, cheap)
        theirs = _columns(footer)
        said = []
        for name in [*ours, *(name for name in theirs if name not in ours)]:
            if name not in theirs:
                said.append(f"{name} only in {posixpath.basename(url(first_path))}")
            elif name not in ours:
                said.append(f"{name} only in {posixpath.basename(url(path))}")
            elif ours[name] != theirs[name]:
                said.append(f"{name} is {ours[name]} in one, {theirs[name]} in the other")
        if said:
            raise DatasetError(
                f"{url(first_path)} and {url(path)} have different columns ({'; '.join(said)}): "
                "batches need one set of columns; write every file of the dataset with the "
                "same columns and types, or read the files that share them as a list"
            )


def _columns(footer: pq.FileMetaData) -> dict[str, pa.DataType]:
    return {field.name: field.type for field in footer.schema.to_arrow_schema()}


def _silently_excluded(name: str) -> bool:
    # _SUCCESS starts with "_" too.
    return name.endswith((".crc", "_$folder$")) or name.startswith((".", "_"))


def _private_directory(name: str) -> bool:
    return name.startswith(("_", ".")) and "=" not in name
