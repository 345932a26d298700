"""The filesystem for a URL's scheme, built from ``storage_options`` and the environment.

- ``s3://`` (``s3a``, ``s3n``), ``gs://`` (``gcs``) and ``hdfs://`` (``viewfs``): pyarrow's own
  filesystems, configured from ``storage_options`` (the keys s3fs / gcsfs take, or pyarrow's own
  parameter names, text from the command line coerced to numbers and booleans) and the standard
  environment (``AWS_*`` including ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``,
  ``STORAGE_EMULATOR_HOST``, Hadoop's configuration).
- any other scheme (``abfs://``, ``az://``, ``memory://``, ...): the fsspec filesystem registered
  for it, given ``storage_options``.

Each comes with the :class:`~ddp_even.storage.backends.FailureHints` that say which
credentials and endpoint settings to check when a request fails.

Why ddp_even builds the filesystem rather than petastorm: given a URL and ``storage_options``,
petastorm 0.12.1 hands pyarrow 14 an fsspec filesystem, pyarrow then takes its new Dataset API
and rejects petastorm's ``validate_schema=``; and pyarrow's legacy ``S3FSWrapper`` breaks on
every asynchronous (current) s3fs. docs/remote-storage.md has the details.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from ddp_even.errors import DatasetError
from ddp_even.storage.backends import FailureHints
from ddp_even.storage.locations import ParsedLocation

__all__ = [
    "GCS_SCHEMES",
    "HDFS_SCHEMES",
    "S3_SCHEMES",
    "fsspec_filesystem",
    "fsspec_hints",
    "gcs_filesystem",
    "hdfs_filesystem",
    "s3_filesystem",
]

S3_SCHEMES = ("s3", "s3a", "s3n")
GCS_SCHEMES = ("gs", "gcs")
HDFS_SCHEMES = ("hdfs", "viewfs")

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
# How long the GCE metadata server may take to answer the probe for default credentials
# (google-auth waits about as long); off Google Cloud nothing answers.
_METADATA_PROBE_S = 1.0
_BOOL_PARAMETERS = frozenset(
    {"anonymous", "background_writes", "allow_bucket_creation", "allow_bucket_deletion"}
)


def s3_filesystem(options: dict[str, Any], url: str) -> tuple[pafs.FileSystem, FailureHints]:
    """pyarrow's S3 filesystem from s3fs-style or pyarrow options and the ``AWS_*`` environment."""
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
    hints = FailureHints(
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


def gcs_filesystem(options: dict[str, Any], url: str) -> tuple[pafs.FileSystem, FailureHints]:
    """pyarrow's GCS filesystem from gcsfs-style or pyarrow options and the environment."""
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
    if not _gcs_has_credentials(kwargs):
        # Without this check every request would retry for retry_time_limit before saying
        # "Could not create a OAuth2 access token", and planning makes several.
        raise DatasetError(
            f"{url}: no Google Cloud credentials found: set GOOGLE_APPLICATION_CREDENTIALS to a "
            "service-account key file or run 'gcloud auth application-default login'; for a "
            "public bucket pass storage_options token='anon' (--storage-option token=anon), "
            "for an emulator set STORAGE_EMULATOR_HOST"
        )
    hints = FailureHints(
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


def _gcs_has_credentials(kwargs: Mapping[str, Any]) -> bool:
    """Whether google-cloud-cpp has credentials to use: given, in the environment, gcloud's
    application default credentials, or a GCE metadata server (on Google Cloud)."""
    if kwargs.get("anonymous") or kwargs.get("access_token"):
        return True
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or os.environ.get("STORAGE_EMULATOR_HOST"):
        return True
    gcloud = os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud"
    if (Path(gcloud) / "application_default_credentials.json").is_file():
        return True
    return _metadata_server_answers()


def _metadata_server_answers() -> bool:
    """Whether a GCE metadata server answers, as google-auth probes it (by address: resolving
    metadata.google.internal off Google Cloud can take seconds)."""
    import urllib.request  # here: only this probe needs it, and every plan imports this module

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


def hdfs_filesystem(
    location: ParsedLocation, options: dict[str, Any], url: str
) -> tuple[pafs.FileSystem, FailureHints]:
    """HDFS's filesystem for the namenode in ``location`` (or Hadoop's ``fs.defaultFS``)."""
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
    hints = FailureHints(
        credentials="the Kerberos ticket (KRB5CCNAME, storage_options kerb_ticket) or user",
        endpoint=f"the namenode {kwargs['host']}:{kwargs['port']}",
        endpoint_setting="the host and port in the URL (or fs.defaultFS)",
    )
    return filesystem, hints


def fsspec_filesystem(url: str, scheme: str, options: dict[str, Any]) -> Any:
    """The fsspec filesystem registered for ``scheme``, given ``options``."""
    try:
        import fsspec.core  # type: ignore[import-untyped]
    except ImportError as error:
        raise DatasetError(
            f"{url}: reading {scheme}:// URLs needs fsspec: pip install fsspec"
        ) from error
    try:
        filesystem, _ = fsspec.core.url_to_fs(url, **options)
    except ImportError as error:
        package = _fsspec_package(scheme)
        raise DatasetError(
            f"{url}: no filesystem for {scheme}:// is installed ({error}): pip install "
            f"{package}" + (" (or the extra ddp_even[remote])" if package == "adlfs" else "")
        ) from error
    except ValueError as error:
        raise DatasetError(
            f"{url}: no filesystem knows {scheme}:// URLs ({error}): use s3://, gs://, "
            "hdfs://, abfs://, a file:// URL or a local path, or pass filesystem= (a pyarrow.fs "
            "or fsspec filesystem)"
        ) from error
    except TypeError as error:
        raise DatasetError(
            f"{url}: storage_options {sorted(options)} do not fit the {scheme}:// "
            f"filesystem ({error}): check their names"
        ) from error
    return filesystem


def _fsspec_package(scheme: str) -> str:
    from fsspec.registry import known_implementations  # type: ignore[import-untyped]

    implementation = known_implementations.get(scheme, {}).get("class", "")
    return str(implementation).split(".", 1)[0] or f"the fsspec implementation of {scheme}://"


def fsspec_hints(name: str, filesystem: Any) -> FailureHints:
    """What to check when the fsspec filesystem for ``name``:// fails."""
    return FailureHints(
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
