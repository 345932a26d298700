"""A local Google Cloud Storage emulator for tests: ``gcp-storage-emulator``, as a subprocess.

``start_gcs_server()`` runs the emulator in memory on a free port of 127.0.0.1, waits until it
answers and creates a bucket. The returned :class:`GcsServer` gives the ``storage_options``
that point ddp_even's ``gs://`` filesystem (pyarrow's ``GcsFileSystem``) at it, and a pyarrow
filesystem for writing test data. The emulator checks no credentials: the tests read it
anonymously (``token="anon"``), the way a public bucket is read.

``metadata_server()`` stands in for a Google Cloud VM's metadata server, the only source of
credentials on many VMs: it answers the probe for one and hands out an access token, on
127.0.0.1, to whoever honours ``GCE_METADATA_ROOT`` (google-cloud-cpp and google-auth do).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from tests.helpers.s3_server import free_port

__all__ = ["GcsServer", "MetadataServer", "metadata_server", "start_gcs_server"]

_START_TIMEOUT_S = 60.0


@dataclass
class GcsServer:
    """A running emulator and its bucket."""

    host: str
    bucket: str
    process: subprocess.Popen[bytes]
    workdir: Path

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}"

    def storage_options(self) -> dict[str, Any]:
        """What ``from_parquet(..., storage_options=...)`` takes to read ``gs://`` here."""
        return {"endpoint_url": self.endpoint, "token": "anon"}

    def filesystem(self) -> pafs.GcsFileSystem:
        """pyarrow's GCS filesystem on the emulator, for writing test data."""
        return pafs.GcsFileSystem(anonymous=True, scheme="http", endpoint_override=self.host)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_gcs_server(bucket: str = "ddp-even") -> GcsServer:
    """Start the emulator with ``bucket`` in it; stop it with :meth:`GcsServer.stop`."""
    host = f"127.0.0.1:{free_port()}"
    workdir = Path(tempfile.mkdtemp(prefix="ddp-even-gcs-"))
    with (workdir / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gcp_storage_emulator",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                host.rsplit(":", 1)[1],
                "--in-memory",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = GcsServer(host, bucket, process, workdir)
    try:
        _create_bucket_when_up(server)
    except BaseException:
        server.stop()
        raise
    return server


def _create_bucket_when_up(server: GcsServer) -> None:
    request = urllib.request.Request(
        f"{server.endpoint}/storage/v1/b?project=ddp-even",
        data=json.dumps({"name": server.bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if server.process.poll() is not None:
            log = (server.workdir / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the GCS emulator exited with {server.process.returncode}:\n{log}")
        try:
            with urllib.request.urlopen(request, timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"GCS emulator not up after {_START_TIMEOUT_S:g}s") from None
            time.sleep(0.1)


@dataclass
class MetadataServer:
    """A running stand-in for a VM's metadata server, and the paths asked of it."""

    host: str
    paths: list[str] = field(default_factory=list)


@contextlib.contextmanager
def metadata_server() -> Iterator[MetadataServer]:
    """A metadata server answering as Google Cloud's does, with the VM's service account and a
    token for it, while the block runs."""
    answers = {
        "/computeMetadata/v1/": {},
        "/computeMetadata/v1/instance/service-accounts/default/": {
            "email": "vm@ddp-even.iam.gserviceaccount.com",
            "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
            "aliases": ["default"],
        },
        "/computeMetadata/v1/instance/service-accounts/vm@ddp-even.iam.gserviceaccount.com/token": {
            "access_token": "the-vm-token",
            "expires_in": 3600,
            "token_type": "Bearer",
        },
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            served.paths.append(path)
            if self.headers.get("Metadata-Flavor") != "Google" or path not in answers:
                self.send_error(404)
                return
            body = json.dumps(answers[path]).encode()
            self.send_response(200)
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    served = MetadataServer(f"127.0.0.1:{httpd.server_address[1]}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)
