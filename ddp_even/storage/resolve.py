"""Where a dataset lives: the storage that lists and reads it, from a URL and the user's options.

Planning (``ddp_even/planning/row_groups.py``) lists directories and reads Parquet metadata
through the :class:`Storage` that :func:`resolve_dataset` finds; the pyarrow reader
(``ddp_even/arrow/reader.py``) reads the row groups through the *same* storage, so it names the
files exactly as the plan does.

Which filesystem reads a dataset, first match wins:

- ``filesystem=``: a ``pyarrow.fs.FileSystem`` as it is; an fsspec filesystem through
  ``pyarrow.fs.FSSpecHandler``; a legacy ``pyarrow.filesystem`` wrapper (``S3FSWrapper``) is
  unwrapped to the fsspec filesystem inside it.
- ``file://`` URLs and paths: the local disk (petastorm's own local filesystem reads them).
- ``s3://`` (``s3a``, ``s3n``), ``gs://`` (``gcs``) and ``hdfs://`` (``viewfs``): pyarrow's own
  filesystems, configured from ``storage_options`` and the standard environment
  (``filesystems.py``).
- any other scheme (``abfs://``, ``az://``, ``memory://``, ...): the fsspec filesystem registered
  for it, given ``storage_options``.

One fsspec private is relied on: ``AbstractFileSystem._strip_protocol``, a URL's path on its
filesystem (the same as fsspec's own ``url_to_fs`` uses; ``tests/test_remote_storage.py``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from ddp_even.errors import DatasetError
from ddp_even.storage.backends import ArrowStorage, FailureHints, LocalStorage, Storage
from ddp_even.storage.filesystems import (
    GCS_SCHEMES,
    HDFS_SCHEMES,
    S3_SCHEMES,
    fsspec_filesystem,
    fsspec_hints,
    gcs_filesystem,
    hdfs_filesystem,
    s3_filesystem,
)
from ddp_even.storage.locations import (
    DatasetLocation,
    ParsedLocation,
    bucket_path,
    dataset_items,
    local_path,
    parse_location,
    trim_path,
)

__all__ = [
    "SCHEMES",
    "DatasetLocation",
    "ResolvedDataset",
    "Storage",
    "StorageOptions",
    "resolve_dataset",
]

logger = logging.getLogger("ddp_even")

#: Options for the filesystem of a URL, as given to petastorm / fsspec (``storage_options``).
StorageOptions = Mapping[str, Any]


@dataclass(frozen=True)
class ResolvedDataset:
    """A dataset argument resolved: the storage it lives on and its paths there.

    ``is_list`` says whether a list of files was given (a list keeps its order; a one-element
    list is read as that path, as pyarrow does).

    Example:
        >>> resolved = resolve_dataset("file:///data/train/")
        >>> resolved.paths, resolved.is_list, resolved.storage.is_local
        (('/data/train',), False, True)
    """

    storage: Storage
    paths: tuple[str, ...]
    is_list: bool

    def describe(self) -> str:
        """The dataset for people: its URL, or how many files a list holds.

        Example:
            >>> resolve_dataset("s3://bucket/train", storage_options={"anon": True}).describe()
            's3://bucket/train'
        """
        if self.is_list and len(self.paths) > 1:
            return f"{len(self.paths)} files from {self.storage.url(self.paths[0])}"
        return self.storage.url(self.paths[0])


def resolve_dataset(
    dataset: DatasetLocation,
    *,
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
) -> ResolvedDataset:
    """Find the filesystem for ``dataset`` and its paths there; no request is made.

    ``dataset`` is a URL (``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ``file://``, any
    fsspec scheme) or a local path, or a list of files on one filesystem. ``storage_options``
    configure the filesystem built for the URL (s3fs-style keys such as ``key``, ``secret``,
    ``endpoint_url``, ``client_kwargs``, ``config_kwargs`` for S3; pyarrow's parameter names
    work too); ``filesystem`` is a ready ``pyarrow.fs.FileSystem`` or fsspec filesystem instead.
    Credentials not given come from the environment, as the cloud SDKs read it. Raises
    :class:`DatasetError` for a scheme with no installed filesystem or options it cannot take.

    Example:
        >>> resolve_dataset("s3://bucket/train/", storage_options={
        ...     "endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s"}).paths
        ('bucket/train',)
        >>> import fsspec
        >>> in_memory = fsspec.filesystem("memory")
        >>> memory = resolve_dataset("memory://datasets/train", filesystem=in_memory)
        >>> memory.paths, memory.storage.url(memory.paths[0])
        (('/datasets/train',), 'memory:///datasets/train')
    """
    items, is_list = dataset_items(dataset)
    if filesystem is not None:
        if storage_options:
            raise ValueError(
                "pass storage_options or filesystem=, not both: storage options configure the "
                "filesystem ddp_even builds from the URL, a filesystem object is used as it is"
            )
        return _with_filesystem(items, is_list, filesystem)
    parsed = [parse_location(item) for item in items]
    places = {(url.scheme, url.netloc) for url in parsed}
    if len(places) > 1:
        raise DatasetError(
            f"the listed files are on {len(places)} filesystems ({', '.join(items[:3])}...): "
            "a dataset is read through one; list files with one scheme and one bucket or host"
        )
    scheme = parsed[0].scheme
    options = dict(storage_options or {})
    resolve = SCHEMES.get(scheme)
    if resolve is None:
        return _fsspec_dataset(items, is_list, fsspec_filesystem(items[0], scheme, options), scheme)
    storage, paths = resolve(items, parsed, options)
    return ResolvedDataset(storage, paths, is_list)


def _local(
    items: list[str], parsed: list[ParsedLocation], options: dict[str, Any]
) -> tuple[Storage, tuple[str, ...]]:
    if options:
        logger.debug("ddp_even: storage_options ignored for the local dataset %s", items[0])
    return LocalStorage(), tuple(local_path(item) for item in items)


def _object_store(
    items: list[str], parsed: list[ParsedLocation], options: dict[str, Any]
) -> tuple[Storage, tuple[str, ...]]:
    scheme = parsed[0].scheme
    if scheme in S3_SCHEMES:
        filesystem, hints = s3_filesystem(options, items[0])
    else:
        filesystem, hints = gcs_filesystem(options, items[0])
    storage = ArrowStorage(
        filesystem, scheme, lambda path: f"{scheme}://{path}", hints, has_buckets=True
    )
    return storage, tuple(bucket_path(url) for url in parsed)


def _hdfs(
    items: list[str], parsed: list[ParsedLocation], options: dict[str, Any]
) -> tuple[Storage, tuple[str, ...]]:
    location = parsed[0]
    filesystem, hints = hdfs_filesystem(location, options, items[0])
    prefix = f"{location.scheme}://{location.netloc}"
    storage = ArrowStorage(filesystem, location.scheme, lambda path: prefix + path, hints)
    return storage, tuple(trim_path(url.path) for url in parsed)


#: How each URL scheme reaches its storage, from ``(urls, parsed urls, storage options)``;
#: any other scheme (``abfs://``, ``az://``, ``memory://``...) goes to the fsspec filesystem
#: registered for it. A new scheme is one entry here and its filesystem in ``filesystems.py``.
SCHEMES: dict[
    str,
    Callable[[list[str], list[ParsedLocation], dict[str, Any]], tuple[Storage, tuple[str, ...]]],
] = {
    "": _local,
    "file": _local,
    **dict.fromkeys(S3_SCHEMES + GCS_SCHEMES, _object_store),
    **dict.fromkeys(HDFS_SCHEMES, _hdfs),
}


def _fsspec_dataset(
    items: list[str], is_list: bool, filesystem: Any, scheme: str
) -> ResolvedDataset:
    protocols = filesystem.protocol
    name = scheme or (protocols if isinstance(protocols, str) else protocols[0])
    hints = fsspec_hints(name, filesystem)
    storage = ArrowStorage(
        pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)),
        name,
        filesystem.unstrip_protocol,
        hints,
        has_buckets=name in ("abfs", "abfss", "az", "gcs", "gs", "s3"),
    )
    paths = tuple(trim_path(filesystem._strip_protocol(item)) for item in items)
    return ResolvedDataset(storage, paths, is_list)


def _unwrap_legacy(filesystem: Any) -> Any:
    """The filesystem inside a legacy ``pyarrow.filesystem`` wrapper (``S3FSWrapper``, which
    petastorm users hand their readers)."""
    legacy = sys.modules.get("pyarrow.filesystem")
    if legacy is None or not isinstance(filesystem, legacy.FileSystem):
        return filesystem
    adapted = getattr(filesystem, "filesystem", None)
    if isinstance(adapted, pafs.FileSystem):
        return adapted
    if isinstance(filesystem, legacy.LocalFileSystem):
        return pafs.LocalFileSystem()
    inner = getattr(filesystem, "fs", None)
    if inner is None:
        raise TypeError(
            f"cannot read through the legacy {type(filesystem).__name__}: pass a "
            "pyarrow.fs.FileSystem or an fsspec filesystem"
        )
    return inner


def _with_filesystem(items: list[str], is_list: bool, filesystem: Any) -> ResolvedDataset:
    filesystem = _unwrap_legacy(filesystem)
    if not isinstance(filesystem, pafs.FileSystem):
        fsspec = sys.modules.get("fsspec")
        if fsspec is None or not isinstance(filesystem, fsspec.AbstractFileSystem):
            raise TypeError(
                "filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
                f"{type(filesystem).__name__}"
            )
        return _fsspec_dataset(items, is_list, filesystem, parse_location(items[0]).scheme)
    parsed = [parse_location(item) for item in items]
    scheme = parsed[0].scheme
    local = filesystem.type_name == "local"
    paths: list[str] = []
    for location in parsed:
        if location.scheme in ("", "file"):
            paths.append(trim_path(os.path.abspath(location.path) if local else location.path))
        elif location.scheme in HDFS_SCHEMES:
            paths.append(trim_path(location.path))
        else:
            paths.append(bucket_path(location))
    hints = FailureHints(
        credentials=f"the credentials of the {filesystem.type_name} filesystem you passed",
        endpoint=f"the {filesystem.type_name} filesystem you passed",
        endpoint_setting="how that filesystem was built",
    )

    def to_url(path: str) -> str:
        return path if scheme in ("", "file") else f"{scheme}://{path}"

    storage = ArrowStorage(
        filesystem,
        scheme or filesystem.type_name,
        to_url,
        hints,
        has_buckets=filesystem.type_name in ("s3", "gcs"),
    )
    return ResolvedDataset(storage, tuple(paths), is_list)
