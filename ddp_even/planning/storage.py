"""Where a dataset lives: the filesystem that lists and reads it, from a URL and the user's options.

Planning (``datasets.py``) lists directories and reads Parquet metadata through a
:class:`Storage`; the planned readers (``readers.py``) hand petastorm the *same* filesystem,
wrapped as the legacy ``pyarrow.filesystem`` object petastorm 0.12.1 needs
(:func:`legacy_filesystem`), so petastorm names its files exactly as the plan does.

Which filesystem reads a dataset, first match wins:

- ``filesystem=``: a ``pyarrow.fs.FileSystem`` as it is; an fsspec filesystem through
  ``pyarrow.fs.FSSpecHandler``; a legacy ``pyarrow.filesystem`` wrapper (``S3FSWrapper``) is
  unwrapped to the fsspec filesystem inside it.
- ``file://`` URLs and paths: the local disk (petastorm's own local filesystem reads them).
- ``s3://`` (``s3a``, ``s3n``), ``gs://`` (``gcs``) and ``hdfs://`` (``viewfs``): pyarrow's own
  filesystems, configured from ``storage_options`` (the keys s3fs / gcsfs take, or pyarrow's own
  parameter names) and the standard environment (``AWS_*`` including ``AWS_ENDPOINT_URL``,
  ``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``, Hadoop's configuration).
- any other scheme (``abfs://``, ``az://``, ``memory://``, ...): the fsspec filesystem registered
  for it, given ``storage_options``.

Why ddp_even builds the filesystem rather than petastorm: given a URL and ``storage_options``,
petastorm 0.12.1 hands pyarrow 14 an fsspec filesystem, pyarrow then takes its new Dataset API
and rejects petastorm's ``validate_schema=``; and pyarrow's legacy ``S3FSWrapper`` breaks on
every asynchronous (current) s3fs. docs/remote-storage.md has the details.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import posixpath
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = [
    "DatasetError",
    "DatasetLocation",
    "ResolvedDataset",
    "Storage",
    "StorageOptions",
    "legacy_filesystem",
    "resolve_dataset",
]

logger = logging.getLogger("ddp_even")

#: A dataset: a URL or a local path (directory or file), or a list of files.
DatasetLocation = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
#: Options for the filesystem of a URL, as given to petastorm / fsspec (``storage_options``).
StorageOptions = Mapping[str, Any]
#: What a path is on its storage.
FileKind = Literal["file", "directory", "missing"]

# Footers and listings are small requests that release the GIL. Local reads were measured fine
# with 16 threads; object stores hide latency with more requests in flight, but pyarrow's S3
# client keeps 25 connections per filesystem, so more threads than that would only queue.
_LOCAL_CONCURRENCY = 16
_REMOTE_CONCURRENCY = 24

_S3_SCHEMES = ("s3", "s3a", "s3n")
_GCS_SCHEMES = ("gs", "gcs")
_HDFS_SCHEMES = ("hdfs", "viewfs")

# pyarrow 14's S3FileSystem and GcsFileSystem parameters, accepted under their own names.
_S3_PARAMETERS = frozenset(
    {
        "access_key",
        "secret_key",
        "session_token",
        "anonymous",
        "role_arn",
        "session_name",
        "external_id",
        "load_frequency",
        "region",
        "request_timeout",
        "connect_timeout",
        "scheme",
        "endpoint_override",
        "background_writes",
        "default_metadata",
        "proxy_options",
        "allow_bucket_creation",
        "allow_bucket_deletion",
        "retry_strategy",
    }
)
# The names s3fs (and boto3's client_kwargs) give the same settings.
_S3FS_NAMES = {
    "key": "access_key",
    "secret": "secret_key",
    "token": "session_token",
    "anon": "anonymous",
    "aws_access_key_id": "access_key",
    "aws_secret_access_key": "secret_key",
    "aws_session_token": "session_token",
    "region_name": "region",
}
_GCS_PARAMETERS = frozenset(
    {
        "anonymous",
        "access_token",
        "target_service_account",
        "credential_token_expiration",
        "default_bucket_location",
        "scheme",
        "endpoint_override",
        "default_metadata",
        "retry_time_limit",
        "project_id",
    }
)
_HDFS_PARAMETERS = frozenset(
    {"user", "replication", "buffer_size", "default_block_size", "kerb_ticket", "extra_conf"}
)
_FLOAT_PARAMETERS = frozenset({"connect_timeout", "request_timeout", "retry_time_limit"})
# google-cloud-cpp retries transient errors for 15 minutes by default: an unreachable endpoint
# would look like a hang. Seconds; storage_options retry_time_limit overrides it.
_GCS_RETRY_TIME_LIMIT_S = 30.0
_BOOL_PARAMETERS = frozenset(
    {"anonymous", "background_writes", "allow_bucket_creation", "allow_bucket_deletion"}
)

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


class DatasetError(ValueError):
    """The dataset cannot be planned: missing, unreachable, not Parquet, or laid out so petastorm
    fails too.

    The message is one line: it names the path or URL and says what to do.

    Example:
        >>> from ddp_even.planning.datasets import read_row_groups
        >>> try:
        ...     read_row_groups("/no/such/dataset")
        ... except DatasetError as error:
        ...     print(error)
        /no/such/dataset does not exist: check the path or URL
    """


@dataclass(frozen=True)
class _Hints:
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
            >>> resolve_dataset("/data/train").storage.is_local
            True
        """
        return self.filesystem is None

    @property
    @abstractmethod
    def filesystem(self) -> pafs.FileSystem | None:
        """The pyarrow filesystem, or None for the local disk.

        Example:
            >>> import pyarrow.fs
            >>> local = resolve_dataset("/data", filesystem=pyarrow.fs.LocalFileSystem())
            >>> local.storage.filesystem.type_name
            'local'
        """

    @abstractmethod
    def kind(self, path: str) -> FileKind:
        """Whether ``path`` is a file, a directory, or missing.

        Example:
            >>> resolve_dataset("/").storage.kind("/no/such/path")
            'missing'
        """

    @abstractmethod
    def list_directory(self, path: str) -> tuple[list[str], list[str]]:
        """Names of the files and of the subdirectories directly in ``path``.

        Example:
            >>> import pathlib, tempfile
            >>> root = pathlib.Path(tempfile.mkdtemp())
            >>> (root / "a.parquet").touch(); (root / "part=1").mkdir()
            >>> resolve_dataset(str(root)).storage.list_directory(str(root))
            (['a.parquet'], ['part=1'])
        """

    @abstractmethod
    def read_footer(self, path: str) -> pq.FileMetaData:
        """A Parquet file's footer, reading the file's tail.

        Example:
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
            >>> resolve_dataset("s3://bucket/train", storage_options={"anon": True}).storage.url(
            ...     "bucket/train/a.parquet")
            's3://bucket/train/a.parquet'
        """

    def explain(self, error: BaseException, path: str) -> DatasetError | None:
        """A one-line :class:`DatasetError` for a storage failure, None for other errors.

        Example:
            >>> s3 = resolve_dataset("s3://bucket/train", storage_options={"anon": True}).storage
            >>> print(s3.explain(OSError("AWS Error ACCESS_DENIED during HeadObject"), "bucket/x"))
            s3://bucket/x: access denied (ACCESS_DENIED): check the credentials: ...
        """
        return None

    def missing(self, path: str) -> DatasetError:
        """The error for a ``path`` that does not exist.

        Example:
            >>> print(resolve_dataset("/").storage.missing("/no/such/path"))
            /no/such/path does not exist: check the path or URL
        """
        return DatasetError(f"{self.url(path)} does not exist: check the path or URL")


class _LocalStorage(Storage):
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

    def list_directory(self, path: str) -> tuple[list[str], list[str]]:
        files: list[str] = []
        subdirectories: list[str] = []
        with os.scandir(path) as entries:
            for entry in entries:
                # os.walk (what the legacy filesystem uses) counts a symlink to a directory as one.
                (subdirectories if entry.is_dir() else files).append(entry.name)
        return files, subdirectories

    def read_footer(self, path: str) -> pq.FileMetaData:
        return pq.read_metadata(path)

    def read_summary(self, path: str) -> pq.FileMetaData:
        return pq.read_metadata(path)

    def url(self, path: str) -> str:
        return path


class _ArrowStorage(Storage):
    """Any ``pyarrow.fs`` filesystem: S3, GCS, HDFS, fsspec ones through ``FSSpecHandler``."""

    def __init__(
        self,
        filesystem: pafs.FileSystem,
        scheme: str,
        to_url: Callable[[str], str],
        hints: _Hints,
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

    def list_directory(self, path: str) -> tuple[list[str], list[str]]:
        try:
            infos = self._filesystem.get_file_info(pafs.FileSelector(path))
        except OSError as error:
            raise self._failure(error, path) from error
        files = [info.base_name for info in infos if info.type != pafs.FileType.Directory]
        directories = [info.base_name for info in infos if info.type == pafs.FileType.Directory]
        return files, directories

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


def _mentions(text: str, words: Sequence[str]) -> bool:
    return any(word in text for word in words)


def _short_reason(error: BaseException, text: str) -> str:
    aws = re.search(r"AWS Error (\w+)", text)
    if aws:
        curl = re.search(r"curlCode: \d+, [^.;]*", text)
        return f"{aws.group(1)}, {curl.group(0)}" if curl else aws.group(1)
    return f"{type(error).__name__}: {text[:160]}" if text else type(error).__name__


@dataclass(frozen=True)
class ResolvedDataset:
    """A dataset argument resolved: the storage it lives on and its paths there.

    ``is_list`` says whether a list of files was given (a list keeps its order; a one-element
    list is read as that path, as pyarrow does).

    Example:
        >>> resolved = resolve_dataset("file:///data/train/")
        >>> resolved.paths, resolved.is_list, resolved.storage.is_local
        (('/data/train',), False, True)
        >>> resolved.petastorm_paths
        '/data/train'
    """

    storage: Storage
    paths: tuple[str, ...]
    is_list: bool

    @property
    def petastorm_paths(self) -> str | list[str]:
        """What petastorm's ``Reader`` takes as its dataset path: a path or a list of them.

        Example:
            >>> resolve_dataset(["/d/a.parquet", "/d/b.parquet"]).petastorm_paths
            ['/d/a.parquet', '/d/b.parquet']
        """
        return list(self.paths) if self.is_list else self.paths[0]

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
    items, is_list = _items(dataset)
    if filesystem is not None:
        if storage_options:
            raise ValueError(
                "pass storage_options or filesystem=, not both: storage options configure the "
                "filesystem ddp_even builds from the URL, a filesystem object is used as it is"
            )
        return _with_filesystem(items, is_list, filesystem)
    parsed = [_parse(item) for item in items]
    places = {(url.scheme, url.netloc) for url in parsed}
    if len(places) > 1:
        raise DatasetError(
            f"the listed files are on {len(places)} filesystems ({', '.join(items[:3])}...): "
            "petastorm reads one; list files with one scheme and one bucket or host"
        )
    scheme = parsed[0].scheme
    options = dict(storage_options or {})
    if scheme in ("", "file"):
        if options:
            logger.debug("ddp_even: storage_options ignored for the local dataset %s", items[0])
        return ResolvedDataset(_LocalStorage(), tuple(_local_path(item) for item in items), is_list)
    if scheme in _S3_SCHEMES + _GCS_SCHEMES:
        storage = _object_store(scheme, options, items[0])
        return ResolvedDataset(storage, tuple(_bucket_path(url) for url in parsed), is_list)
    if scheme in _HDFS_SCHEMES:
        storage = _hdfs_storage(parsed[0], options, items[0])
        return ResolvedDataset(storage, tuple(_trim(url.path) for url in parsed), is_list)
    return _with_fsspec(items, is_list, scheme, options)


def _items(dataset: DatasetLocation) -> tuple[list[str], bool]:
    if isinstance(dataset, str | os.PathLike):
        return [os.fspath(dataset)], False
    items = [os.fspath(item) for item in dataset]
    if not items:
        raise DatasetError("the list of dataset files is empty: pass at least one Parquet file")
    return items, True


@dataclass(frozen=True)
class _ParsedLocation:
    """A URL's parts; a plain path has an empty scheme and netloc."""

    scheme: str
    netloc: str
    path: str
    hostname: str | None = None
    port: int | None = None
    username: str | None = None


def _parse(text: str) -> _ParsedLocation:
    if "://" not in text and not text.startswith("file:"):
        return _ParsedLocation("", "", text)
    parsed = urlparse(text)
    return _ParsedLocation(
        parsed.scheme.lower(),
        parsed.netloc,
        parsed.path,
        parsed.hostname,
        parsed.port,
        parsed.username,
    )


def _trim(path: str) -> str:
    # petastorm's normalize_dir_url drops one trailing slash.
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def _local_path(text: str) -> str:
    location = _parse(text)
    # Like petastorm (fs_utils.get_dataset_path): a URL's path is used as is, not unquoted.
    return _trim(location.path if location.scheme else os.path.abspath(text))


def _bucket_path(location: _ParsedLocation) -> str:
    return _trim(location.netloc + location.path)


def _object_store(scheme: str, options: dict[str, Any], url: str) -> _ArrowStorage:
    if scheme in _S3_SCHEMES:
        filesystem, hints = _s3_filesystem(options, url)
    else:
        filesystem, hints = _gcs_filesystem(options, url)
    return _ArrowStorage(
        filesystem, scheme, lambda path: f"{scheme}://{path}", hints, has_buckets=True
    )


def _s3_filesystem(options: dict[str, Any], url: str) -> tuple[pafs.FileSystem, _Hints]:
    client = dict(options.pop("client_kwargs", None) or {})
    config = dict(options.pop("config_kwargs", None) or {})
    endpoint_option = options.pop("endpoint_url", None) or client.pop("endpoint_url", None)
    use_ssl = options.pop("use_ssl", client.pop("use_ssl", None))
    kwargs: dict[str, Any] = {}
    for source, where in ((options, "storage_options"), (client, "client_kwargs")):
        for key, value in source.items():
            name = _S3FS_NAMES.get(key, key)
            if name not in _S3_PARAMETERS:
                raise _unknown_option(url, f"{where}[{key!r}]", _S3_PARAMETERS | set(_S3FS_NAMES))
            kwargs[name] = value
    if "connect_timeout" in config:
        kwargs["connect_timeout"] = config.pop("connect_timeout")
    if "read_timeout" in config:
        kwargs["request_timeout"] = config.pop("read_timeout")
    retries = config.pop("retries", None)
    if isinstance(retries, Mapping) and "max_attempts" in retries:
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(
            max_attempts=int(retries["max_attempts"])
        )
    if config:
        raise _unknown_option(
            url, f"config_kwargs[{sorted(config)[0]!r}]", {"connect_timeout", "read_timeout"}
        )
    endpoint_source = "storage_options endpoint_url"
    endpoint = endpoint_option
    for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if endpoint is None and os.environ.get(variable):
            endpoint, endpoint_source = os.environ[variable], variable
    if endpoint is not None and "endpoint_override" not in kwargs:
        kwargs.update(_endpoint_parts(str(endpoint)))
    if use_ssl is not None and "scheme" not in kwargs:
        kwargs["scheme"] = "https" if _as_bool("use_ssl", use_ssl) else "http"
    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        # pyarrow 14's S3 client does not read these itself.
        if "region" not in kwargs and os.environ.get(variable):
            kwargs["region"] = os.environ[variable]
    hints = _Hints(
        credentials=(
            "the credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) "
            "or AWS_PROFILE in the environment, or storage_options key / secret / token"
        ),
        endpoint=(
            f"the S3 endpoint {endpoint} set by {endpoint_source}"
            if endpoint
            else f"AWS S3 in region {kwargs.get('region', 'us-east-1')}"
        ),
        endpoint_setting="AWS_ENDPOINT_URL or storage_options endpoint_url",
    )
    return _build(pafs.S3FileSystem, kwargs, url), hints


def _gcs_filesystem(options: dict[str, Any], url: str) -> tuple[pafs.FileSystem, _Hints]:
    kwargs: dict[str, Any] = {}
    endpoint = options.pop("endpoint_url", None)
    endpoint_source = "storage_options endpoint_url"
    if endpoint is None and os.environ.get("STORAGE_EMULATOR_HOST"):
        endpoint, endpoint_source = os.environ["STORAGE_EMULATOR_HOST"], "STORAGE_EMULATOR_HOST"
    if "project" in options:
        kwargs["project_id"] = options.pop("project")
    token = options.pop("token", None)
    if token == "anon":
        kwargs["anonymous"] = True
    elif token not in (None, "google_default"):
        raise DatasetError(
            f"{url}: storage option token={token!r} is not supported for gs://: pyarrow reads "
            "credentials from GOOGLE_APPLICATION_CREDENTIALS (a service-account key file); set "
            "it, or pass token='anon' for a public bucket, or filesystem=gcsfs.GCSFileSystem(...)"
        )
    for key, value in options.items():
        if key not in _GCS_PARAMETERS:
            raise _unknown_option(
                url, f"storage_options[{key!r}]", _GCS_PARAMETERS | {"project", "token"}
            )
        kwargs[key] = value
    if endpoint is not None and "endpoint_override" not in kwargs:
        kwargs.update(_endpoint_parts(str(endpoint)))
    kwargs.setdefault("retry_time_limit", _GCS_RETRY_TIME_LIMIT_S)
    hints = _Hints(
        credentials=(
            "GOOGLE_APPLICATION_CREDENTIALS (a service-account key file) or the default "
            "gcloud credentials, or storage_options token='anon' for a public bucket"
        ),
        endpoint=(
            f"the GCS endpoint {endpoint} set by {endpoint_source}"
            if endpoint
            else "Google Cloud Storage"
        ),
        endpoint_setting="STORAGE_EMULATOR_HOST or storage_options endpoint_url",
    )
    return _build(pafs.GcsFileSystem, kwargs, url), hints


def _hdfs_storage(location: _ParsedLocation, options: dict[str, Any], url: str) -> _ArrowStorage:
    kwargs: dict[str, Any] = {
        # "default": the namenode of fs.defaultFS in the Hadoop configuration.
        "host": location.hostname or "default",
        "port": location.port or (8020 if location.hostname else 0),
    }
    if location.username:
        kwargs["user"] = location.username
    for key, value in options.items():
        if key not in _HDFS_PARAMETERS:
            raise _unknown_option(url, f"storage_options[{key!r}]", _HDFS_PARAMETERS)
        kwargs[key] = value
    try:
        filesystem = pafs.HadoopFileSystem(**kwargs)
    except OSError as error:
        reason = " ".join(str(error).split())[:200]
        if "libhdfs" in reason or "JAVA_HOME" in reason or "jvm" in reason.lower():
            raise DatasetError(
                f"{url}: hdfs:// needs Hadoop's libhdfs and Java ({reason}): install Hadoop, "
                "set HADOOP_HOME and JAVA_HOME, CLASSPATH=$(hadoop classpath --glob), and "
                "ARROW_LIBHDFS_DIR if libhdfs.so is elsewhere"
            ) from error
        raise DatasetError(
            f"{url}: cannot connect to the namenode {kwargs['host']}:{kwargs['port']} "
            f"({reason}): check the host and port in the URL, or the Hadoop configuration"
        ) from error
    prefix = f"{location.scheme}://{location.netloc}"
    hints = _Hints(
        credentials="the Kerberos ticket (KRB5CCNAME, storage_options kerb_ticket) or user",
        endpoint=f"the namenode {kwargs['host']}:{kwargs['port']}",
        endpoint_setting="the host and port in the URL (or fs.defaultFS)",
    )
    return _ArrowStorage(filesystem, location.scheme, lambda path: prefix + path, hints)


def _with_fsspec(
    items: list[str], is_list: bool, scheme: str, options: dict[str, Any]
) -> ResolvedDataset:
    try:
        import fsspec.core  # type: ignore[import-untyped]
    except ImportError as error:
        raise DatasetError(
            f"{items[0]}: reading {scheme}:// URLs needs fsspec: pip install fsspec"
        ) from error
    try:
        filesystem, _ = fsspec.core.url_to_fs(items[0], **options)
    except ImportError as error:
        package = _fsspec_package(scheme)
        raise DatasetError(
            f"{items[0]}: no filesystem for {scheme}:// is installed ({error}): pip install "
            f"{package}" + (" (or the extra ddp_even[remote])" if package == "adlfs" else "")
        ) from error
    except ValueError as error:
        raise DatasetError(
            f"{items[0]}: no filesystem knows {scheme}:// URLs ({error}): use s3://, gs://, "
            "hdfs://, abfs://, a file:// URL or a local path, or pass filesystem= (a pyarrow.fs "
            "or fsspec filesystem)"
        ) from error
    except TypeError as error:
        raise DatasetError(
            f"{items[0]}: storage_options {sorted(options)} do not fit the {scheme}:// "
            f"filesystem ({error}): check their names"
        ) from error
    return _fsspec_dataset(items, is_list, filesystem, scheme)


def _fsspec_package(scheme: str) -> str:
    from fsspec.registry import known_implementations  # type: ignore[import-untyped]

    implementation = known_implementations.get(scheme, {}).get("class", "")
    return str(implementation).split(".", 1)[0] or f"the fsspec implementation of {scheme}://"


def _fsspec_dataset(
    items: list[str], is_list: bool, filesystem: Any, scheme: str
) -> ResolvedDataset:
    protocols = filesystem.protocol
    name = scheme or (protocols if isinstance(protocols, str) else protocols[0])
    hints = _Hints(
        credentials=(
            "the credentials: for Azure AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, "
            "AZURE_STORAGE_CONNECTION_STRING or storage_options account_name / account_key / "
            "sas_token"
            if name in ("abfs", "abfss", "az")
            else f"the credentials {type(filesystem).__name__} reads (storage_options or its "
            "environment variables)"
        ),
        endpoint=f"the {name} service",
        endpoint_setting="the storage options and the URL",
    )
    storage = _ArrowStorage(
        pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)),
        name,
        filesystem.unstrip_protocol,
        hints,
        has_buckets=name in ("abfs", "abfss", "az", "gcs", "gs", "s3"),
    )
    paths = tuple(_trim(filesystem._strip_protocol(item)) for item in items)
    return ResolvedDataset(storage, paths, is_list)


def _with_filesystem(items: list[str], is_list: bool, filesystem: Any) -> ResolvedDataset:
    filesystem = _unwrap_legacy(filesystem)
    if not isinstance(filesystem, pafs.FileSystem):
        fsspec = sys.modules.get("fsspec")
        if fsspec is None or not isinstance(filesystem, fsspec.AbstractFileSystem):
            raise TypeError(
                "filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
                f"{type(filesystem).__name__}"
            )
        return _fsspec_dataset(items, is_list, filesystem, _parse(items[0]).scheme)
    parsed = [_parse(item) for item in items]
    scheme = parsed[0].scheme
    local = filesystem.type_name == "local"
    paths: list[str] = []
    for location in parsed:
        if location.scheme in ("", "file"):
            paths.append(_trim(os.path.abspath(location.path) if local else location.path))
        elif location.scheme in _HDFS_SCHEMES:
            paths.append(_trim(location.path))
        else:
            paths.append(_bucket_path(location))
    hints = _Hints(
        credentials=f"the credentials of the {filesystem.type_name} filesystem you passed",
        endpoint=f"the {filesystem.type_name} filesystem you passed",
        endpoint_setting="how that filesystem was built",
    )

    def to_url(path: str) -> str:
        return path if scheme in ("", "file") else f"{scheme}://{path}"

    storage = _ArrowStorage(
        filesystem,
        scheme or filesystem.type_name,
        to_url,
        hints,
        has_buckets=filesystem.type_name in ("s3", "gcs"),
    )
    return ResolvedDataset(storage, tuple(paths), is_list)


def _unwrap_legacy(filesystem: Any) -> Any:
    """The filesystem inside a legacy ``pyarrow.filesystem`` wrapper (``S3FSWrapper``...)."""
    legacy = sys.modules.get("pyarrow.filesystem")
    if legacy is None or not isinstance(filesystem, legacy.FileSystem):
        return filesystem
    if isinstance(filesystem, _legacy_adapter_class()):
        adapted: pafs.FileSystem = getattr(filesystem, "filesystem")  # noqa: B009
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


def _endpoint_parts(endpoint: str) -> dict[str, str]:
    parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return {"endpoint_override": parsed.netloc + parsed.path.rstrip("/"), "scheme": parsed.scheme}


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise DatasetError(f"storage option {name}={value!r} must be true or false")


def _coerced(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Values from the command line arrive as text; pyarrow wants numbers and booleans."""
    result = dict(kwargs)
    for name, value in kwargs.items():
        if name in _FLOAT_PARAMETERS and value is not None:
            if isinstance(value, datetime.timedelta):
                continue
            try:
                result[name] = float(value)
            except (TypeError, ValueError) as error:
                raise DatasetError(f"storage option {name}={value!r} must be a number") from error
            if name == "retry_time_limit":
                result[name] = datetime.timedelta(seconds=result[name])
        elif name in _BOOL_PARAMETERS:
            result[name] = _as_bool(name, value)
    return result


def _build(kind: Callable[..., pafs.FileSystem], kwargs: Mapping[str, Any], url: str) -> Any:
    try:
        return kind(**_coerced(kwargs))
    except (TypeError, ValueError, OSError) as error:
        raise DatasetError(
            f"{url}: the storage options do not build a filesystem ({error}): check their "
            "names and values"
        ) from error


def _unknown_option(url: str, option: str, accepted: set[str] | frozenset[str]) -> DatasetError:
    return DatasetError(
        f"{url}: storage option {option} is not understood here; accepted: "
        f"{', '.join(sorted(accepted))} (or pass filesystem= a filesystem built yourself)"
    )


def legacy_filesystem(filesystem: pafs.FileSystem) -> Any:
    """``filesystem`` as the legacy ``pyarrow.filesystem`` object petastorm 0.12.1 reads through.

    pyarrow 14 takes its legacy dataset path (the one petastorm's ``validate_schema=`` needs)
    only for a legacy filesystem; this adapter gives it one that lists and opens files with
    the ``pyarrow.fs`` filesystem planning used. It pickles (for petastorm's process pool)
    when ``filesystem`` does.

    Example:
        >>> import pyarrow.fs
        >>> legacy = legacy_filesystem(pyarrow.fs.LocalFileSystem())
        >>> legacy.isdir("/tmp"), legacy.pathsep
        (True, '/')
    """
    adapter: Any = _legacy_adapter_class()(filesystem)
    return adapter


@functools.cache
def _legacy_adapter_class() -> type:
    """Defined on first use: importing ``pyarrow.filesystem`` is needed only for reading."""
    from pyarrow.filesystem import FileSystem as LegacyFileSystem

    class ArrowLegacyFileSystem(LegacyFileSystem):  # type: ignore[misc]  # pyarrow is untyped
        """What pyarrow 14's legacy ``ParquetDataset`` calls, answered by a ``pyarrow.fs``."""

        pathsep = "/"

        def __init__(self, filesystem: pafs.FileSystem) -> None:
            self.filesystem = filesystem

        def __reduce__(self) -> tuple[Any, tuple[pafs.FileSystem]]:
            return legacy_filesystem, (self.filesystem,)

        def _type(self, path: str) -> Any:
            return self.filesystem.get_file_info(path).type

        def isdir(self, path: str) -> bool:
            return bool(self._type(path) == pafs.FileType.Directory)

        def isfile(self, path: str) -> bool:
            return bool(self._type(path) == pafs.FileType.File)

        def exists(self, path: str) -> bool:
            return bool(self._type(path) != pafs.FileType.NotFound)

        def _isfilestore(self) -> bool:
            return bool(self.filesystem.type_name == "local")

        def ls(self, path: str) -> list[str]:
            return [info.path for info in self.filesystem.get_file_info(pafs.FileSelector(path))]

        def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
            # Lazily, level by level: pyarrow's manifest takes only the first level of each.
            pending = [path]
            while pending:
                directory = pending.pop(0)
                infos = self.filesystem.get_file_info(pafs.FileSelector(directory))
                names = [info.base_name for info in infos if info.type == pafs.FileType.Directory]
                files = [info.base_name for info in infos if info.type != pafs.FileType.Directory]
                yield directory, names, files
                pending.extend(posixpath.join(directory, name) for name in names)

        def open(self, path: str, mode: str = "rb") -> Any:
            if mode != "rb":
                raise OSError(f"ddp_even reads datasets only; cannot open {path} with mode {mode}")
            return self.filesystem.open_input_file(path)

    return ArrowLegacyFileSystem
