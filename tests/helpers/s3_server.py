"""A local S3-compatible server for tests and benchmarks: moto's, as a subprocess.

``start_s3_server()`` runs moto's server (``tests/helpers/s3_server_main.py``) on a free port
of 127.0.0.1, waits until it answers, creates an IAM user allowed everything on S3 and then
switches IAM authentication on, so that wrong credentials are refused as AWS refuses them. The
returned :class:`S3Server` gives the endpoint, the (fake, moto-made) credentials, an
environment with them, a pyarrow filesystem for writing test data, and
:meth:`S3Server.recording`, which counts the requests the server received (moto's own recorder,
so the counts come from the server side).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["RecordedRequest", "RequestLog", "S3Server", "start_s3_server", "upload_directory"]

REGION = "us-east-1"
_START_TIMEOUT_S = 60.0
# Where ``python -m tests.helpers.s3_server_main`` finds the tests' package.
_REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server recorded it."""

    method: str
    #: ``bucket/key`` (``bucket`` for bucket-level requests such as listings).
    path: str
    query: str

    @property
    def is_listing(self) -> bool:
        return self.method == "GET" and "list-type" in self.query


@dataclass
class RequestLog:
    """Requests received while :meth:`S3Server.recording` was open (filled when it closes)."""

    requests: list[RecordedRequest] = field(default_factory=list)

    def to(self, path: str) -> list[RecordedRequest]:
        """Requests for one object (``bucket/key``)."""
        return [request for request in self.requests if request.path == path]

    def by_method(self) -> Counter[str]:
        return Counter(
            "LIST" if request.is_listing else request.method for request in self.requests
        )

    def reads_per_object(self) -> Counter[str]:
        """Requests (HEAD and GET, listings excluded) per object."""
        return Counter(request.path for request in self.requests if not request.is_listing)


@dataclass
class S3Server:
    """A running moto server and the credentials it accepts."""

    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen[bytes]
    workdir: Path

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def env(self) -> dict[str, str]:
        """The standard AWS variables for this server's credentials (not its endpoint)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def storage_options(self) -> dict[str, Any]:
        """s3fs-style options naming the endpoint (credentials come from the environment)."""
        return {"client_kwargs": {"endpoint_url": self.endpoint}}

    def filesystem(self) -> Any:
        """A pyarrow S3 filesystem on this server that may create buckets (for writing data)."""
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=REGION,
            endpoint_override=self.endpoint.split("://", 1)[1],
            scheme="http",
            allow_bucket_creation=True,
        )

    @contextlib.contextmanager
    def recording(self) -> Iterator[RequestLog]:
        """Count the requests the server receives inside the ``with`` block."""
        log = RequestLog()
        self._post("/moto-api/recorder/reset-recording")
        self._post("/moto-api/recorder/start-recording")
        try:
            yield log
        finally:
            self._post("/moto-api/recorder/stop-recording")
        with urllib.request.urlopen(
            f"{self.endpoint}/moto-api/recorder/download-recording", timeout=60
        ) as response:
            lines = response.read().decode().splitlines()
        for line in lines:
            entry = json.loads(line)
            url = urlsplit(entry["url"])
            log.requests.append(
                RecordedRequest(entry["method"], unquote(url.path).lstrip("/"), url.query)
            )

    def stop(self) -> None:
        """Stop the server and remove its folder (its log and recordings)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _post(self, path: str, data: bytes = b"") -> None:
        request = urllib.request.Request(
            f"{self.endpoint}{path}",
            data=data,
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=30):
            pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (at the time of asking)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_s3_server() -> S3Server:
    """Start moto's server with IAM authentication on; stop it with :meth:`S3Server.stop`."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="ddp-even-s3-"))
    env = dict(os.environ, MOTO_RECORDER_FILEPATH=str(workdir / "recording.jsonl"))
    for variable in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        env.pop(variable, None)
    with (workdir / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.helpers.s3_server_main",
                "-H",
                "127.0.0.1",
                "-p",
                str(port),
            ],
            cwd=_REPOSITORY,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = S3Server(endpoint, "", "", process, workdir)
    try:
        _wait_until_up(server)
        server.access_key, server.secret_key = _create_user(endpoint)
        # From here on every request must be signed with known credentials.
        server._post("/moto-api/reset-auth", b"0")
    except BaseException:
        server.stop()
        raise
    return server


def _wait_until_up(server: S3Server) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if server.process.poll() is not None:
            log = (server.workdir / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"moto server exited with {server.process.returncode}:\n{log}")
        try:
            with urllib.request.urlopen(f"{server.endpoint}/moto-api/", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"moto server not up after {_START_TIMEOUT_S:g}s") from None
            time.sleep(0.1)


def _create_user(endpoint: str) -> tuple[str, str]:
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam.create_user(UserName="ddp-even-tests")
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
    }
    iam.put_user_policy(
        UserName="ddp-even-tests", PolicyName="s3", PolicyDocument=json.dumps(policy)
    )
    key = iam.create_access_key(UserName="ddp-even-tests")["AccessKey"]
    return str(key["AccessKeyId"]), str(key["SecretAccessKey"])


def upload_directory(server: S3Server, local: Path, destination: str) -> str:
    """Copy a local dataset directory to ``bucket/prefix`` and return its ``s3://`` URL."""
    import pyarrow.fs

    filesystem = server.filesystem()
    bucket = destination.split("/", 1)[0]
    if filesystem.get_file_info(bucket).type == pyarrow.fs.FileType.NotFound:
        filesystem.create_dir(bucket)
    pyarrow.fs.copy_files(
        str(local),
        destination,
        source_filesystem=pyarrow.fs.LocalFileSystem(),
        destination_filesystem=filesystem,
    )
    return f"s3://{destination}"
