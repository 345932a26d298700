"""Where a dataset lives: a URL, path or list of files resolved to the filesystem that reads it.

``filesystem=`` is used as given; else paths and ``file://`` URLs are the local disk,
``s3://``, ``gs://``, ``hdfs://`` pyarrow's own filesystems, other schemes fsspec's. S3 and
GCS take pyarrow's option names or s3fs's / gcsfs's (renamed here: neither is needed) and the
endpoint from ``AWS_ENDPOINT_URL`` / ``STORAGE_EMULATOR_HOST``, which pyarrow does not read.
Paths are petastorm 0.12.1's, so a plan names files as petastorm does: without one trailing
slash, a ``file://`` URL's path not unquoted, a plain path absolute, ``bucket/key`` on object
stores, what ``_strip_protocol`` gives on fsspec (the private fsspec's ``url_to_fs`` uses).

Example:
    >>> resolve_dataset(["/data/a.parquet", "/data/b.parquet"]).describe()
    '2 files from /data/a.parquet'
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import textwrap
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode, urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ddp_even.errors import DatasetError

__all__ = ["DatasetLocation", "ResolvedDataset", "Storage", "StorageOptions", "resolve_dataset"]

#: A dataset: a URL or a local path (directory or file), or a list of files.
DatasetLocation = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
#: Options for the filesystem of a URL, as given to petastorm / fsspec (``storage_options``).
StorageOptions = Mapping[str, Any]

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

_BUCKET_SCHEMES = ("s3", "s3a", "s3n", "gs", "gcs", "abfs", "abfss", "az")
# s3fs's (boto3's, botocore's Config's) names for pyarrow's S3FileSystem parameters; pyarrow
# refuses the rest, and names them.
_S3FS_NAMES = {
    **{"key": "access_key", "secret": "secret_key", "token": "session_token", "anon": "anonymous"},
    **{"aws_access_key_id": "access_key", "aws_secret_access_key": "secret_key"},
    **{"aws_session_token": "session_token", "region_name": "region"},
    **{"read_timeout": "request_timeout"},
}
# google-cloud-cpp retries transient errors for 15 minutes by default: an unreachable endpoint
# would look like a hang. Seconds; storage_options retry_time_limit overrides it.
_GCS_RETRY_TIME_LIMIT_S = 30.0
# How long the GCE metadata server may take to answer the probe for default credentials
# (google-auth waits about as long); off Google Cloud nothing answers.
_METADATA_PROBE_S = 1.0
_S3_CREDENTIALS = (
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) or AWS_PROFILE in the "
    "environment, or storage_options key / secret / token"
)
_S3_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_GCS_CREDENTIALS = (
    "GOOGLE_APPLICATION_CREDENTIALS (a service-account key file) or gcloud's default credentials "
    "('gcloud auth application-default login'), or for a public bucket storage_options "
    "token='anon' (--storage-option token=anon)"
)


@dataclass(frozen=True)
class FailureHints:
    """What to tell people to check when a request fails."""

    credentials: str
    endpoint: str
    endpoint_setting: str


@dataclass(frozen=True)
class Storage:
    """Lists directories and reads Parquet metadata where a dataset lives.

    Paths are the filesystem's own (``/path`` on HDFS). A file's stamp is its size and
    modification time. Methods raise what pyarrow raises, but :meth:`kind`,
    :meth:`list_directory` and :meth:`stamps` a :class:`DatasetError` (:meth:`explain`).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": [1, 2, 3]}), f"{root}/a.parquet", row_group_size=2)
        >>> storage = resolve_dataset(root).storage
        >>> storage.kind(root), storage.read_footer(f"{root}/a.parquet").num_rows
        ('directory', 3)
        >>> files, subdirectories = storage.list_directory(root)
        >>> files == dict(zip(["a.parquet"], storage.stamps([f"{root}/a.parquet"]))), subdirectories
        (True, [])
    """

    #: The pyarrow filesystem (for an fsspec one, its ``.handler.fs`` is that).
    filesystem: pafs.FileSystem
    #: A path as people write it: a URL for remote storage, the path for local files.
    url: Callable[[str], str]
    #: What to check when a request fails; None for the local disk.
    hints: FailureHints | None
    #: Whether a path's first part is a bucket (``bucket/key``).
    has_buckets: bool

    @property
    def concurrency(self) -> int:
        """How many listings or metadata reads (small requests that release the GIL) may run at
        once: 16 on the local disk, measured fine; 24 elsewhere, where more requests in flight
        hide latency, and pyarrow's S3 client keeps 25 connections (more would only queue)."""
        return 16 if self.hints is None else 24

    def kind(self, path: str) -> Literal["file", "directory", "missing"]:
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
        """A Parquet file's footer, in two requests: the object's size, then its last 64 KiB
        (pyarrow reads more only for a larger footer)."""
        with self.filesystem.open_input_file(path) as file:
            return pq.read_metadata(file)

    def read_summary(self, path: str) -> pq.FileMetaData:
        """A summary file (``_metadata``, ``_common_metadata``): all metadata, read whole in one
        request rather than a tail and then the rest."""
        with self.filesystem.open_input_file(path) as file:
            return pq.read_metadata(pa.BufferReader(file.read()))

    def explain(self, error: BaseException, path: str) -> DatasetError | None:
        """A one-line :class:`DatasetError` for a remote storage failure (credentials,
        reachability, a bucket or path missing), None for others."""
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
            return self.filesystem.get_file_info(where)
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


@dataclass(frozen=True)
class ResolvedDataset:
    """A dataset argument resolved: the storage it lives on and its paths there.

    ``is_list`` says whether a list of files was given (a list keeps its order; a one-element
    list is read as that path, as pyarrow does).

    Example:
        >>> resolved = resolve_dataset("file:///data/train/")
        >>> resolved.paths, resolved.is_list, resolved.storage.hints is None
        (('/data/train',), False, True)
    """

    storage: Storage
    paths: tuple[str, ...]
    is_list: bool

    def describe(self) -> str:
        """The dataset for people: its URL, or how many files a list holds."""
        if self.is_list and len(self.paths) > 1:
            return f"{len(self.paths)} files from {self.storage.url(self.paths[0])}"
        return self.storage.url(self.paths[0])


def resolve_dataset(
    dataset: DatasetLocation | ResolvedDataset,
    *,
    storage_options: StorageOptions | None = None,
    filesystem: Any = None,
) -> ResolvedDataset:
    """The filesystem for ``dataset`` (a URL, a local path, a list of files on one filesystem,
    or one resolved already, returned as it is) and its paths there; no request is made.
    Credentials that ``storage_options`` do not give come from the environment, as the cloud
    SDKs read it; ``filesystem`` is a ready ``pyarrow.fs`` or fsspec filesystem instead.

    Example:
        >>> import fsspec
        >>> in_memory = fsspec.filesystem("memory")
        >>> memory = resolve_dataset("memory://datasets/train", filesystem=in_memory)
        >>> memory.paths, memory.describe()
        (('/datasets/train',), 'memory:///datasets/train')
    """
    if isinstance(dataset, ResolvedDataset):
        return dataset
    given = [dataset] if isinstance(dataset, str | os.PathLike) else dataset
    items, is_list = [os.fspath(item) for item in given], given is dataset
    if not items:
        raise DatasetError("the list of dataset files is empty: pass at least one Parquet file")
    places = {_split(item)[:2] for item in items}
    if len(places) > 1:
        raise DatasetError(
            f"the listed files are on {len(places)} filesystems ({', '.join(items[:3])}...): "
            "a dataset is read through one; list files with one scheme and one bucket or host"
        )
    (scheme, netloc), local = places.pop(), _split(items[0])[0] in ("", "file")
    built, hints = pafs.LocalFileSystem(), None
    if filesystem is not None:
        if storage_options:
            raise ValueError(
                "pass storage_options or filesystem=, not both: storage options configure the "
                "filesystem ddp_even builds from the URL, a filesystem object is used as it is"
            )
        built, hints = _given(filesystem)
    elif not local:
        built, hints = _build_filesystem(items[0], scheme, dict(storage_options or {}))
    fsspec_filesystem = getattr(getattr(built, "handler", None), "fs", None)
    to_url: Callable[[str], str] = str
    if fsspec_filesystem is not None:
        paths = [fsspec_filesystem._strip_protocol(item) for item in items]
        to_url = fsspec_filesystem.unstrip_protocol
    elif local:
        paths = [path if scheme else os.path.abspath(path) for _, _, path in map(_split, items)]
    elif scheme in ("hdfs", "viewfs"):
        paths, to_url = [_split(item)[2] for item in items], f"{scheme}://{netloc}".__add__
    else:
        paths, to_url = [netloc + _split(item)[2] for item in items], f"{scheme}://".__add__
    paths = [path[:-1] if len(path) > 1 and path.endswith("/") else path for path in paths]
    storage = Storage(built, to_url, hints, scheme in _BUCKET_SCHEMES)
    return ResolvedDataset(storage, tuple(paths), is_list)


def _given(filesystem: Any) -> tuple[pafs.FileSystem, FailureHints]:
    """A ``pyarrow.fs`` filesystem as it is, an fsspec one through ``FSSpecHandler``."""
    fsspec = sys.modules.get("fsspec")
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        hints = _hints(f"the {type(filesystem).__name__} filesystem")
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), hints
    if not isinstance(filesystem, pafs.FileSystem):
        raise TypeError(
            "filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
            f"{type(filesystem).__name__}: for a legacy pyarrow.filesystem one pass what it "
            "wraps (S3FSWrapper's .fs) or its pyarrow.fs equal (pyarrow.fs.LocalFileSystem())"
        )
    return filesystem, _hints(f"the {filesystem.type_name} filesystem you passed")


def _build_filesystem(
    url: str, scheme: str, options: dict[str, Any]
) -> tuple[pafs.FileSystem, FailureHints]:
    if scheme in ("hdfs", "viewfs"):
        # pyarrow takes user, kerb_ticket, replication, ... from the URI's query; other keys
        # (and extra_conf's) are Hadoop settings.
        query = urlencode({**options, **options.pop("extra_conf", {})})
        try:
            filesystem, _ = pafs.FileSystem.from_uri(urlparse(url)._replace(query=query).geturl())
        except (OSError, ValueError) as error:
            raise DatasetError(
                f"{url}: cannot open HDFS ({one_line(error)}): it needs Hadoop's libhdfs and Java "
                "(HADOOP_HOME, JAVA_HOME, CLASSPATH=$(hadoop classpath --glob)) and a namenode at "
                "the URL's host and port"
            ) from error
        return filesystem, _hints("HDFS's namenode in the URL (or fs.defaultFS)")
    if scheme not in ("s3", "s3a", "s3n", "gs", "gcs"):
        return _given(_fsspec(url, scheme, options))
    s3 = scheme.startswith("s3")
    kind = pafs.S3FileSystem if s3 else pafs.GcsFileSystem
    kwargs, hints = _s3(options) if s3 else _gcs(options, url)
    try:
        return kind(**kwargs), hints
    except (TypeError, ValueError, OSError) as error:  # pyarrow's message names the option
        raise DatasetError(
            f"{url}: the storage options do not build a pyarrow.fs.{kind.__name__} ({error}): "
            "use its parameter names or s3fs's / gcsfs's, or pass filesystem= one you built"
        ) from error


def _s3(options: dict[str, Any]) -> tuple[dict[str, Any], FailureHints]:
    """s3fs's options (botocore's ``client_kwargs`` and ``config_kwargs`` among them) as
    pyarrow's S3FileSystem parameters, and what to check when a request fails."""
    client, config = options.pop("client_kwargs", None), options.pop("config_kwargs", None)
    given = {**options, **(client or {}), **(config or {})}
    kwargs = {_S3FS_NAMES.get(key, key): value for key, value in given.items()}
    hints = _endpoint(kwargs, "S3", "AWS S3", _S3_CREDENTIALS, *_S3_ENDPOINT_VARIABLES)
    if not kwargs.pop("use_ssl", True):  # s3fs's (an endpoint's own scheme still wins)
        kwargs.setdefault("scheme", "http")
    retries = kwargs.pop("retries", None)  # botocore's: only the attempts bound a request
    if isinstance(retries, Mapping) and "max_attempts" in retries:
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(int(retries["max_attempts"]))
    return kwargs, hints


def _gcs(kwargs: dict[str, Any], url: str) -> tuple[dict[str, Any], FailureHints]:
    hints = _endpoint(kwargs, "GCS", "Google Cloud", _GCS_CREDENTIALS, "STORAGE_EMULATOR_HOST")
    if "project" in kwargs:
        kwargs["project_id"] = kwargs.pop("project")
    if kwargs.get("token") in ("anon", "google_default"):  # other tokens: pyarrow refuses them
        kwargs["anonymous"] = kwargs.pop("token") == "anon"
    limit = kwargs.get("retry_time_limit", _GCS_RETRY_TIME_LIMIT_S)
    if not isinstance(limit, datetime.timedelta):  # gcsfs and the command line give seconds
        kwargs["retry_time_limit"] = datetime.timedelta(seconds=float(limit))
    # Without credentials every request would retry for retry_time_limit before saying "Could
    # not create a OAuth2 access token", and planning makes several: look for them first, as
    # google-cloud-cpp does (given, the environment, gcloud's default ones, a GCE metadata server).
    gcloud = Path(os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud")
    if not (
        kwargs.get("anonymous")
        or kwargs.get("access_token")
        or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        or os.environ.get("STORAGE_EMULATOR_HOST")
        or (gcloud / "application_default_credentials.json").is_file()
        or _metadata_server_answers()
    ):
        raise DatasetError(
            f"{url}: no Google Cloud credentials found: use {_GCS_CREDENTIALS}; for an emulator "
            "set STORAGE_EMULATOR_HOST"
        )
    return kwargs, hints


def _metadata_server_answers() -> bool:
    """Whether a GCE metadata server answers, as google-auth probes it (by address: resolving
    metadata.google.internal off Google Cloud can take seconds)."""
    host = os.environ.get("GCE_METADATA_ROOT") or os.environ.get("GCE_METADATA_HOST")
    request = urllib.request.Request(
        f"http://{host or '169.254.169.254'}/computeMetadata/v1/",
        headers={"Metadata-Flavor": "Google"},
    )
    try:
        with urllib.request.urlopen(request, timeout=_METADATA_PROBE_S) as answer:
            return bool(answer.headers.get("Metadata-Flavor") == "Google")
    except (OSError, ValueError):  # urllib's URLError is an OSError
        return False


def _fsspec(url: str, scheme: str, options: Mapping[str, Any]) -> Any:
    try:
        import fsspec.core  # type: ignore[import-untyped]

        return fsspec.core.url_to_fs(url, **options)[0]
    except ImportError as error:  # fsspec itself, or the package for the scheme
        registry = sys.modules.get("fsspec.registry")
        known = registry.known_implementations.get(scheme, {}) if registry else {}
        package = known.get("class", "fsspec").split(".", 1)[0]
        raise DatasetError(
            f"{url}: no filesystem for {scheme}:// is installed ({error}): pip install {package}"
            + (" (or the extra ddp_even[remote])" if package == "adlfs" else "")
        ) from error
    except ValueError as error:  # "Protocol not known"
        raise DatasetError(
            f"{url}: no filesystem knows {scheme}:// URLs ({error}): use s3://, gs://, hdfs://, "
            "abfs://, a file:// URL or a local path, or pass filesystem= (a pyarrow.fs or "
            "fsspec filesystem)"
        ) from error
    except TypeError as error:  # the filesystem's message names the option
        raise DatasetError(
            f"{url}: the storage options do not build the {scheme}:// filesystem ({error}): "
            "use its parameter names, or pass filesystem= one you built"
        ) from error


def _hints(filesystem: str) -> FailureHints:
    """What to check where the filesystem's own credentials and endpoint are not known here."""
    return FailureHints(f"the credentials of {filesystem}", filesystem, "the URL and options")


def _endpoint(
    kwargs: dict[str, Any], store: str, cloud: str, credentials: str, *variables: str
) -> FailureHints:
    """``endpoint_url`` or else the first of ``variables`` set, put into ``kwargs`` as pyarrow's
    ``endpoint_override`` and ``scheme``; what to check when a request fails."""
    endpoint, source = kwargs.pop("endpoint_url", None), "storage_options endpoint_url"
    for variable in variables:
        if endpoint is None and os.environ.get(variable):
            endpoint, source = os.environ[variable], variable
    if endpoint is not None and "endpoint_override" not in kwargs:
        parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        kwargs["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
        kwargs.setdefault("scheme", parsed.scheme)
    where = cloud if endpoint is None else f"the {store} endpoint {endpoint} set by {source}"
    setting = f"{variables[-1]} or storage_options endpoint_url"
    return FailureHints(f"the credentials: {credentials}", where, setting)


def _split(text: str) -> tuple[str, str, str]:
    """A URL's scheme, host and path; a plain path has no scheme or host."""
    if "://" not in text and not text.startswith("file:"):
        return "", "", text
    url = urlparse(text)
    return url.scheme.lower(), url.netloc, url.path
