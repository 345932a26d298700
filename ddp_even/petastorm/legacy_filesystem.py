"""The legacy ``pyarrow.filesystem`` interface petastorm 0.12.1 reads through, for users who
build petastorm readers themselves on remote data (docs/remote-storage.md): pyarrow 14 takes
the legacy dataset path petastorm's ``validate_schema=`` needs only for a legacy filesystem.
Over ``resolve_dataset(url, ...).storage.filesystem``, petastorm names its files as a plan of
the same URL does.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs
from pyarrow.filesystem import FileSystem as LegacyFileSystem

__all__ = ["ArrowLegacyFileSystem"]


class ArrowLegacyFileSystem(LegacyFileSystem):  # type: ignore[misc]  # pyarrow is untyped
    """A ``pyarrow.fs`` ``filesystem`` as a legacy one: what pyarrow 14's legacy
    ``ParquetDataset`` and petastorm's readers call (``isdir``, ``isfile``, ``walk``, ``open``
    to read); it pickles (for petastorm's process pool) when ``filesystem`` does.

    Example:
        >>> import pyarrow.fs
        >>> legacy = ArrowLegacyFileSystem(pyarrow.fs.LocalFileSystem())
        >>> legacy.isdir("/tmp"), legacy.pathsep
        (True, '/')
    """

    def __init__(self, filesystem: pafs.FileSystem) -> None:
        self.filesystem = filesystem

    def _type(self, path: str) -> Any:
        return self.filesystem.get_file_info(path).type

    def isdir(self, path: str) -> bool:
        return bool(self._type(path) == pafs.FileType.Directory)

    def isfile(self, path: str) -> bool:
        return bool(self._type(path) == pafs.FileType.File)

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        # Lazily, top down as os.walk: pyarrow's manifest takes only the first level of each.
        infos = self.filesystem.get_file_info(pafs.FileSelector(path))
        names = [info.base_name for info in infos if info.type == pafs.FileType.Directory]
        files = [info.base_name for info in infos if info.type != pafs.FileType.Directory]
        yield path, names, files
        for name in names:
            yield from self.walk(posixpath.join(path, name))

    def open(self, path: str, mode: str = "rb") -> Any:
        if mode != "rb":
            raise OSError(f"ddp_even reads datasets only; cannot open {path} with mode {mode}")
        return self.filesystem.open_input_file(path)
