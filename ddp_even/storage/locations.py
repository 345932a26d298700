"""A dataset argument taken apart: its URLs' parts, and the paths petastorm will name.

Paths follow petastorm 0.12.1: one trailing slash is dropped, a ``file://`` URL's path is used
as is (not unquoted), a plain path is made absolute, and an object store's path is
``bucket/key``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

from ddp_even.errors import DatasetError

__all__ = [
    "DatasetLocation",
    "ParsedLocation",
    "bucket_path",
    "dataset_items",
    "local_path",
    "parse_location",
    "trim_path",
]

#: A dataset: a URL or a local path (directory or file), or a list of files.
DatasetLocation = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def dataset_items(dataset: DatasetLocation) -> tuple[list[str], bool]:
    """The dataset's URLs or paths as text, and whether a list of files was given."""
    if isinstance(dataset, str | os.PathLike):
        return [os.fspath(dataset)], False
    items = [os.fspath(item) for item in dataset]
    if not items:
        raise DatasetError("the list of dataset files is empty: pass at least one Parquet file")
    return items, True


@dataclass(frozen=True)
class ParsedLocation:
    """A URL's parts; a plain path has an empty scheme and netloc."""

    scheme: str
    netloc: str
    path: str
    hostname: str | None = None
    port: int | None = None
    username: str | None = None


def parse_location(text: str) -> ParsedLocation:
    """The parts of a URL, or a plain path as it is."""
    if "://" not in text and not text.startswith("file:"):
        return ParsedLocation("", "", text)
    parsed = urlparse(text)
    return ParsedLocation(
        parsed.scheme.lower(),
        parsed.netloc,
        parsed.path,
        parsed.hostname,
        parsed.port,
        parsed.username,
    )


def trim_path(path: str) -> str:
    """``path`` without one trailing slash, as petastorm's ``normalize_dir_url`` leaves it."""
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def local_path(text: str) -> str:
    """The local path of a plain path or ``file://`` URL."""
    location = parse_location(text)
    # Like petastorm (fs_utils.get_dataset_path): a URL's path is used as is, not unquoted.
    return trim_path(location.path if location.scheme else os.path.abspath(text))


def bucket_path(location: ParsedLocation) -> str:
    """An object store's path: ``bucket/key``."""
    return trim_path(location.netloc + location.path)
