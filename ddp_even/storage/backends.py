"""What a dataset is read through: :class:`Storage`, over one ``pyarrow.fs`` filesystem.

Planning lists and reads metadata through it, the pyarrow reader opens row groups through it,
so both name files alike.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ddp_even.errors import DatasetError

__all__ = ["FailureHints", "FileKind", "Storage", "one_line"]

#: What a path is on its storage.
FileKind = Literal["file", "directory", "missing"]

# Footers and listings are small requests that release the GIL. Local reads were measured fine
# with 16 threads; object stores hide latency with more requests in flight, but pyarrow's S3
# client keeps 25 connections per filesystem, so more threads than that would only queue.
_LOCAL_CONCURRENCY = 16
_REMOTE_CONCURRENCY = 24
_LOCAL = pafs.LocalFileSystem()

# pyarrow raises a plain OSError for every store failure: the words of the AWS SDK's,
# google-cloud-cpp's and fsspec's messages tell them apart.
_ACCESS_DENIED = re.compile(
    r"access.?denied|invalid.?(access.?key|client.?token)|signature.?does.?not|expired.?token|"
    r"unrecognized.?client|permission.?denied|unauthenticated|authori[sz]ation.?fail|"
    r"authentication.?fail|forbidden|OAuth2 access token|(determine|locate) credentials",
    re.IGNORECASE,
)
_UNREACHABLE = re.compile(
    r"network.?connection|request.?timeout|curlCode|couldn't (connect|resolve)|unavailable|"
    r"connection refused|timed out|timeout was reached|deadline.?exceeded",
    re.IGNORECASE,
)
_NO_BUCKET = re.compile(r"no.?such.?bucket|bucket does not exist", re.IGNORECASE)


@dataclass(frozen=True)
class FailureHints:
    """What to tell people to check when a request fails."""

    credentials: str
    endpoint: str
    endpoint_setting: str


@dataclass(frozen=True)
class Storage:
    """Lists directories and reads Parquet metadata where a dataset lives.

    Paths are the filesystem's own: absolute on the local disk, ``bucket/key`` on object
    stores, ``/path`` on HDFS. A file's stamp is its size and modification time. Methods raise
    ``OSError`` / ``ValueError`` as pyarrow does; :meth:`explain` turns those about
    credentials, reachability and buckets into a :class:`DatasetError`.

    Example:
        >>> from ddp_even.storage import resolve_dataset
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": [1, 2, 3]}), f"{root}/a.parquet", row_group_size=2)
        >>> storage = resolve_dataset(root).storage
        >>> storage.kind(root), storage.read_footer(f"{root}/a.parquet").num_rows
        ('directory', 3)
        >>> files, subdirectories = storage.list_directory(root)
        >>> files == dict(zip(["a.parquet"], storage.stamps([f"{root}/a.parquet"]))), subdirectories
        (True, [])
        >>> print(storage.missing("/no/such/path"))
        /no/such/path does not exist: check the path or URL
    """

    #: The pyarrow filesystem, or None for the local disk read without ``filesystem=``.
    filesystem: pafs.FileSystem | None
    #: A path as people write it: a URL for remote storage, the path for local files.
    url: Callable[[str], str]
    #: What to check when a request fails; None for the local disk.
    hints: FailureHints | None
    #: Whether a path's first part is a bucket (``bucket/key``).
    has_buckets: bool

    @property
    def concurrency(self) -> int:
        """How many listings or metadata reads may run at once."""
        return _LOCAL_CONCURRENCY if self.filesystem is None else _REMOTE_CONCURRENCY

    def open_input_file(self, path: str) -> Any:
        """A random-access file of ``path``, to read column chunks and row groups."""
        return (self.filesystem or _LOCAL).open_input_file(path)

    def kind(self, path: str) -> FileKind:
        """Whether ``path`` is a file, a directory, or missing."""
        found = self._info(path, path).type
        if found == pafs.FileType.Directory:
            return "directory"
        return "missing" if found == pafs.FileType.NotFound else "file"

    def list_directory(self, path: str) -> tuple[dict[str, str], list[str]]:
        """The files directly in ``path`` with their stamps, and its subdirectories' names, in
        one listing (a symlink to a directory counts as one, as in ``os.walk``)."""
        infos = self._info(pafs.FileSelector(path), path)
        directory = pafs.FileType.Directory
        files = {info.base_name: _stamp(info) for info in infos if info.type != directory}
        return files, [info.base_name for info in infos if info.type == directory]

    def stamps(self, paths: Sequence[str]) -> list[str]:
        """Each file's stamp, as text: a file rewritten has another."""
        return [_stamp(info) for info in self._info(list(paths), paths[0])]

    def read_footer(self, path: str) -> pq.FileMetaData:
        """A Parquet file's footer, reading the file's tail."""
        # pyarrow reads the last 64 KiB in one request and a second only for a larger footer;
        # opening costs one more (the object's size), so a data file costs two requests.
        with self.open_input_file(path) as file:
            return pq.read_metadata(file)

    def read_summary(self, path: str) -> pq.FileMetaData:
        """A summary file (``_metadata``, ``_common_metadata``), read whole in one request
        instead of a tail and then the rest: a summary file is all metadata."""
        with self.open_input_file(path) as file:
            return pq.read_metadata(pa.BufferReader(file.read()))

    def explain(self, error: BaseException, path: str) -> DatasetError | None:
        """A one-line :class:`DatasetError` for a remote storage failure, None for others.

        Example:
            >>> from ddp_even.storage import resolve_dataset
            >>> s3 = resolve_dataset("s3://bucket/train", storage_options={"anon": True}).storage
            >>> print(s3.explain(OSError("AWS Error ACCESS_DENIED during HeadObject"), "bucket/x"))
            s3://bucket/x: access denied (OSError: AWS Error ACCESS_DENIED during HeadObject): ...
        """
        hints, text = self.hints, " ".join(str(error).split())
        if hints is None:  # the local disk: the caller's message about the file says more
            return None
        url, reason = self.url(path), one_line(error)
        if isinstance(error, PermissionError) or _ACCESS_DENIED.search(text):
            return DatasetError(f"{url}: access denied ({reason}): check {hints.credentials}")
        if isinstance(error, ConnectionError | TimeoutError) or _UNREACHABLE.search(text):
            return DatasetError(
                f"{url}: cannot reach {hints.endpoint} ({reason}): check "
                f"{hints.endpoint_setting} and the network"
            )
        no_bucket = self.has_buckets and _NO_BUCKET.search(text)
        return self.missing(path) if no_bucket or isinstance(error, FileNotFoundError) else None

    def missing(self, path: str) -> DatasetError:
        """The error for a ``path`` that does not exist (on an object store: or its bucket)."""
        bucket = path.split("/", 1)[0]
        if self.has_buckets and (bucket == path or self.kind(bucket) == "missing"):
            return DatasetError(
                f"{self.url(path)}: bucket {bucket!r} does not exist: check the bucket name in "
                f"the URL (and that {self.hints.endpoint if self.hints else 'it'} is the right "
                "endpoint)"
            )
        return DatasetError(f"{self.url(path)} does not exist: check the path or URL")

    def _info(self, where: Any, path: str) -> Any:
        """``get_file_info(where)``, a failure explained in one line that names ``path``."""
        try:
            return (self.filesystem or _LOCAL).get_file_info(where)
        except OSError as error:
            raise self.explain(error, path) or DatasetError(
                f"{self.url(path)} cannot be listed ({one_line(error)}): check the path or URL, "
                "its permissions and the storage options"
            ) from error


def _stamp(info: pafs.FileInfo) -> str:
    return f"{info.size}:{info.mtime_ns}"


def one_line(error: BaseException) -> str:
    """The error's type and first 200 characters, on one line (pyarrow's can run to pages)."""
    return f"{type(error).__name__}: {textwrap.shorten(str(error), 200, placeholder=' ...')}"
