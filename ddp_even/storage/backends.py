"""What a dataset is read through: the :class:`Storage` interface and its two kinds.

Planning (``datasets.py``) lists directories and reads Parquet metadata through a
:class:`Storage`: :class:`LocalStorage` for the local disk (which petastorm opens itself), or
:class:`ArrowStorage` over any ``pyarrow.fs`` filesystem (S3, GCS, HDFS, fsspec ones). An
:class:`ArrowStorage` turns failures about access, reachability and missing buckets into a
one-line :class:`~ddp_even.errors.DatasetError` that says what to check
(:class:`FailureHints`).
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ddp_even.errors import DatasetError

__all__ = ["ArrowStorage", "FailureHints", "FileKind", "LocalStorage", "Storage"]

#: What a path is on its storage.
FileKind = Literal["file", "directory", "missing"]

# Footers and listings are small requests that release the GIL. Local reads were measured fine
# with 16 threads; object stores hide latency with more requests in flight, but pyarrow's S3
# client keeps 25 connections per filesystem, so more threads than that would only queue.
_LOCAL_CONCURRENCY = 16
_REMOTE_CONCURRENCY = 24


# Words in pyarrow's (AWS SDK, google-cloud-cpp, libhdfs) and fsspec's error messages.
_ACCESS_DENIED_WORDS = (
    "ACCESS_DENIED",
    "AccessDenied",
    "INVALID_ACCESS_KEY_ID",
    "InvalidAccessKeyId",
    "SIGNATURE_DOES_NOT_MATCH",
    "SignatureDoesNotMatch",
    "EXPIRED_TOKEN",
    "ExpiredToken",
    "INVALID_CLIENT_TOKEN_ID",
    "UNRECOGNIZED_CLIENT",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "AuthorizationFailure",
    "AuthenticationFailed",
    "Forbidden",
)
_UNREACHABLE_WORDS = (
    "NETWORK_CONNECTION",
    "REQUEST_TIMEOUT",
    "curlCode",
    "Couldn't connect",
    "Couldn't resolve",
    "Connection refused",
    "timed out",
    "Timeout was reached",
    "DEADLINE_EXCEEDED",
    "UNAVAILABLE",
)
_NO_BUCKET_WORDS = ("NO_SUCH_BUCKET", "NoSuchBucket", "bucket does not exist")
_NO_CREDENTIALS_WORDS = (
    "Could not create a OAuth2 access token",
    "Could not automatically determine credentials",
    "Unable to locate credentials",
    "NoCredentialsError",
)
# Reasons quoted in a message stop at the end of the sentence that passes this length.
_REASON_LENGTH = 160


@dataclass(frozen=True)
class FailureHints:
    """What to tell people to check when a request fails."""

    credentials: str
    endpoint: str
    endpoint_setting: str


class Storage(ABC):
    """Lists directories and reads Parquet metadata where a dataset lives.

    Paths are the filesystem's own: absolute paths on the local disk, ``bucket/key`` on object
    stores, ``/path`` on HDFS. They are also the names petastorm gives the files it reads.
    Methods raise ``OSError`` / ``ValueError`` as the filesystem does; :meth:`explain` turns
    the ones about access, reachability and missing buckets into a :class:`DatasetError`.

    Example:
        >>> from ddp_even.storage import resolve_dataset
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": [1, 2, 3]}), f"{root}/a.parquet", row_group_size=2)
        >>> storage = resolve_dataset(root).storage
        >>> storage.is_local, storage.kind(root), storage.kind(f"{root}/a.parquet")
        (True, 'directory', 'file')
    """

    #: The URL scheme (``"file"`` for the local disk).
    scheme: str
    #: How many listings or metadata reads may run at once.
    concurrency: int

    @property
    def is_local(self) -> bool:
        """True for the local disk read without ``filesystem=``: petastorm opens it itself.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> resolve_dataset("/data/train").storage.is_local
            True
        """
        return self.filesystem is None

    @property
    @abstractmethod
    def filesystem(self) -> pafs.FileSystem | None:
        """The pyarrow filesystem, or None for the local disk.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> import pyarrow.fs
            >>> local = resolve_dataset("/data", filesystem=pyarrow.fs.LocalFileSystem())
            >>> local.storage.filesystem.type_name
            'local'
        """

    def open_input_file(self, path: str) -> Any:
        """A random-access file of ``path``, to read column chunks (a predicate's scan).

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> import tempfile
            >>> path = f"{tempfile.mkdtemp()}/a.parquet"
            >>> pq.write_table(pa.table({"x": [1, 2, 3]}), path)
            >>> with resolve_dataset(path).storage.open_input_file(path) as source:
            ...     pq.ParquetFile(source).metadata.num_rows
            3
        """
        return (self.filesystem or pafs.LocalFileSystem()).open_input_file(path)

    @abstractmethod
    def kind(self, path: str) -> FileKind:
        """Whether ``path`` is a file, a directory, or missing.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> resolve_dataset("/").storage.kind("/no/such/path")
            'missing'
        """

    @abstractmethod
    def list_directory(self, path: str) -> tuple[dict[str, str], list[str]]:
        """The files directly in ``path``, each with its stamp (see :meth:`stamps`), and the
        names of its subdirectories; in one listing.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> import pathlib, tempfile
            >>> root = pathlib.Path(tempfile.mkdtemp())
            >>> (root / "a.parquet").touch(); (root / "part=1").mkdir()
            >>> files, subdirectories = resolve_dataset(str(root)).storage.list_directory(str(root))
            >>> list(files), subdirectories
            (['a.parquet'], ['part=1'])
        """

    @abstractmethod
    def stamps(self, paths: Sequence[str]) -> list[str]:
        """Each file's size and modification time, as text: a file rewritten has another.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> import tempfile
            >>> path = f"{tempfile.mkdtemp()}/a.parquet"
            >>> with open(path, "wb") as file:
            ...     _ = file.write(b"12345")
            >>> resolve_dataset(path).storage.stamps([path])[0].startswith("5:")
            True
        """

    @abstractmethod
    def read_footer(self, path: str) -> pq.FileMetaData:
        """A Parquet file's footer, reading the file's tail.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> import tempfile
            >>> path = f"{tempfile.mkdtemp()}/a.parquet"
            >>> pq.write_table(pa.table({"x": [1, 2, 3]}), path, row_group_size=2)
            >>> resolve_dataset(path).storage.read_footer(path).num_row_groups
            2
        """

    @abstractmethod
    def read_summary(self, path: str) -> pq.FileMetaData:
        """A summary file (``_metadata``, ``_common_metadata``), read whole in one request.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> import tempfile
            >>> path = f"{tempfile.mkdtemp()}/_common_metadata"
            >>> pq.write_metadata(pa.schema([("x", pa.int64())]), path)
            >>> resolve_dataset(path).storage.read_summary(path).num_columns
            1
        """

    @abstractmethod
    def url(self, path: str) -> str:
        """``path`` as people write it: a URL for remote storage, the path for local files.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> resolve_dataset("s3://bucket/train", storage_options={"anon": True}).storage.url(
            ...     "bucket/train/a.parquet")
            's3://bucket/train/a.parquet'
        """

    def explain(self, error: BaseException, path: str) -> DatasetError | None:
        """A one-line :class:`DatasetError` for a storage failure, None for other errors.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> s3 = resolve_dataset("s3://bucket/train", storage_options={"anon": True}).storage
            >>> print(s3.explain(OSError("AWS Error ACCESS_DENIED during HeadObject"), "bucket/x"))
            s3://bucket/x: access denied (ACCESS_DENIED): check the credentials: ...
        """
        return None

    def missing(self, path: str) -> DatasetError:
        """The error for a ``path`` that does not exist.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> print(resolve_dataset("/").storage.missing("/no/such/path"))
            /no/such/path does not exist: check the path or URL
        """
        return DatasetError(f"{self.url(path)} does not exist: check the path or URL")


class LocalStorage(Storage):
    """The local disk, read the way pyarrow 14's legacy local filesystem (petastorm's) reads it."""

    scheme = "file"
    concurrency = _LOCAL_CONCURRENCY

    @property
    def filesystem(self) -> None:
        return None

    def kind(self, path: str) -> FileKind:
        if os.path.isdir(path):
            return "directory"
        return "file" if os.path.exists(path) else "missing"

    def list_directory(self, path: str) -> tuple[dict[str, str], list[str]]:
        files: dict[str, str] = {}
        subdirectories: list[str] = []
        with os.scandir(path) as entries:
            for entry in entries:
                # os.walk (what the legacy filesystem uses) counts a symlink to a directory as one.
                if entry.is_dir():
                    subdirectories.append(entry.name)
                else:
                    files[entry.name] = _stamp(entry.stat().st_size, entry.stat().st_mtime_ns)
        return files, subdirectories

    def stamps(self, paths: Sequence[str]) -> list[str]:
        return [_stamp(info.st_size, info.st_mtime_ns) for info in map(os.stat, paths)]

    def read_footer(self, path: str) -> pq.FileMetaData:
        return pq.read_metadata(path)

    def read_summary(self, path: str) -> pq.FileMetaData:
        return pq.read_metadata(path)

    def url(self, path: str) -> str:
        return path


class ArrowStorage(Storage):
    """Any ``pyarrow.fs`` filesystem: S3, GCS, HDFS, fsspec ones through ``FSSpecHandler``."""

    def __init__(
        self,
        filesystem: pafs.FileSystem,
        scheme: str,
        to_url: Callable[[str], str],
        hints: FailureHints,
        *,
        has_buckets: bool = False,
    ) -> None:
        self._filesystem = filesystem
        self.scheme = scheme
        self.concurrency = _REMOTE_CONCURRENCY
        self._to_url = to_url
        self._hints = hints
        self._has_buckets = has_buckets

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self._filesystem

    def kind(self, path: str) -> FileKind:
        try:
            info = self._filesystem.get_file_info(path)
        except OSError as error:
            raise self._failure(error, path) from error
        if info.type == pafs.FileType.Directory:
            return "directory"
        return "missing" if info.type == pafs.FileType.NotFound else "file"

    def list_directory(self, path: str) -> tuple[dict[str, str], list[str]]:
        try:
            infos = self._filesystem.get_file_info(pafs.FileSelector(path))
        except OSError as error:
            raise self._failure(error, path) from error
        files = {
            info.base_name: _stamp(info.size, info.mtime_ns)
            for info in infos
            if info.type != pafs.FileType.Directory
        }
        directories = [info.base_name for info in infos if info.type == pafs.FileType.Directory]
        return files, directories

    def stamps(self, paths: Sequence[str]) -> list[str]:
        try:
            infos = self._filesystem.get_file_info(list(paths))
        except OSError as error:
            raise self._failure(error, paths[0]) from error
        return [_stamp(info.size, info.mtime_ns) for info in infos]

    def read_footer(self, path: str) -> pq.FileMetaData:
        # pyarrow reads the last 64 KiB in one request and a second only for a larger footer;
        # opening costs one more (the object's size), so a data file costs two requests.
        with self._filesystem.open_input_file(path) as file:
            return pq.read_metadata(file)

    def read_summary(self, path: str) -> pq.FileMetaData:
        # A summary file is all metadata: one whole read instead of a tail and then the rest.
        with self._filesystem.open_input_file(path) as file:
            data = file.read()
        return pq.read_metadata(pa.BufferReader(data))

    def url(self, path: str) -> str:
        return self._to_url(path)

    def explain(self, error: BaseException, path: str) -> DatasetError | None:
        text = " ".join(str(error).split())
        reason = _short_reason(error, text)
        url = self.url(path)
        if _mentions(text, _NO_CREDENTIALS_WORDS):
            return DatasetError(
                f"{url}: no credentials to authenticate with ({reason}): check "
                f"{self._hints.credentials}"
            )
        if isinstance(error, PermissionError) or _mentions(text, _ACCESS_DENIED_WORDS):
            return DatasetError(f"{url}: access denied ({reason}): check {self._hints.credentials}")
        if isinstance(error, ConnectionError | TimeoutError) or _mentions(text, _UNREACHABLE_WORDS):
            return DatasetError(
                f"{url}: cannot reach {self._hints.endpoint} ({reason}): check "
                f"{self._hints.endpoint_setting} and the network"
            )
        if self._has_buckets and _mentions(text, _NO_BUCKET_WORDS):
            return self._no_bucket(path)
        if isinstance(error, FileNotFoundError):
            return self.missing(path)
        return None

    def missing(self, path: str) -> DatasetError:
        if self._has_buckets:
            bucket = path.split("/", 1)[0]
            if bucket == path or self.kind(bucket) == "missing":
                return self._no_bucket(path)
        return super().missing(path)

    def _no_bucket(self, path: str) -> DatasetError:
        bucket = path.split("/", 1)[0]
        return DatasetError(
            f"{self.url(path)}: bucket {bucket!r} does not exist: check the bucket name in the "
            f"URL (and that {self._hints.endpoint} is the right endpoint)"
        )

    def _failure(self, error: OSError, path: str) -> DatasetError:
        explained = self.explain(error, path)
        if explained is not None:
            return explained
        reason = _short_reason(error, " ".join(str(error).split()))
        return DatasetError(
            f"{self.url(path)} cannot be listed ({reason}): check the URL and the storage options"
        )


def _stamp(size: int | None, mtime_ns: int | None) -> str:
    return f"{size}:{mtime_ns}"


def _mentions(text: str, words: Sequence[str]) -> bool:
    return any(word in text for word in words)


def _short_reason(error: BaseException, text: str) -> str:
    """The gist of a storage error, in whole sentences."""
    aws = re.search(r"AWS Error (\w+)", text)
    if aws:
        curl = re.search(r"curlCode: \d+, [^.;]*", text)
        return f"{aws.group(1)}, {curl.group(0)}" if curl else aws.group(1)
    google = re.fullmatch(r"google::cloud::Status\((.*)\)", text)
    if google:  # its code and message, without the wrapper
        return _first_sentences(google.group(1))
    return f"{type(error).__name__}: {_first_sentences(text)}" if text else type(error).__name__


def _first_sentences(text: str) -> str:
    """``text`` up to the end of the sentence that reaches ``_REASON_LENGTH`` characters.

    Example:
        >>> _first_sentences("Short. " * 40).count("Short.")
        23
    """
    end = 0
    for sentence in re.finditer(r".+?(?:\.(?=\s)|$)", text):
        end = sentence.end()
        if end >= _REASON_LENGTH:
            break
    return text[:end].strip()
