"""What pyarrow 14's legacy ``ParquetManifest`` (which petastorm 0.12.1 uses) finds under a
dataset directory: its data files in petastorm's order, and its summary files.

A directory is walked level by level (every directory of a level listed at once: partitions
are siblings): names starting with ``_`` or ``.``, ``*.crc`` and ``_SUCCESS`` are skipped,
names ending in ``_metadata`` / ``_common_metadata`` are summary files, subdirectories must be
hive partitions (``key=value``), and all data files are sorted by full path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddp_even.errors import DatasetError

if TYPE_CHECKING:
    from ddp_even.storage import Storage

#: ``[list_directory(path) for path in paths]``, listed concurrently (the caller's pool).
ListAll = Callable[[Callable[[str], Any], Sequence[str]], list[Any]]

__all__ = ["DirectoryLayout"]


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
                        f"{url(directory)} holds both data files and subdirectories: petastorm "
                        "cannot read that layout; move the files into a partition directory "
                        "(key=value)"
                    )
                for name in partitions:
                    if "=" not in name:
                        raise DatasetError(
                            f"{url(directory)}/{name} is not a hive partition directory "
                            "(key=value): petastorm cannot read it; rename it or start its name "
                            "with '_'"
                        )
                    next_level.append(f"{directory}/{name}")
                data_files.extend(level_files)
            level = next_level
        for kind, found in (("_metadata", metadata_paths), ("_common_metadata", common_paths)):
            if len(found) > 1:
                raise DatasetError(
                    f"several {kind} files under {url(root)} "
                    f"({', '.join(url(path) for path in sorted(found))}): petastorm would use an "
                    "arbitrary one; keep only the one at the dataset root"
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


def _silently_excluded(name: str) -> bool:
    return (
        name.endswith(".crc")
        or name.endswith("_$folder$")
        or name.startswith((".", "_"))
        or name == "_SUCCESS"
    )


def _private_directory(name: str) -> bool:
    return name.startswith(("_", ".")) and "=" not in name
