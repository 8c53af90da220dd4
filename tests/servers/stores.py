"""Real object-store servers on loopback, one interface for all three schemes.

* ``s3://``: moto's server mode (:mod:`servers.moto_s3`); uploads with boto3.
* ``gs://``: ``gcp-storage-emulator`` (PyPI, pure Python) in a subprocess, in memory;
  uploads with google-cloud-storage. Clients find it through ``STORAGE_EMULATOR_HOST``
  and use no credentials, as against any GCS emulator.
* ``az://``: Azurite, Microsoft's Azure Storage emulator (Node.js, installed from the
  npm registry by ``make venv`` into ``build/azurite``), blob service only, in memory,
  on an ephemeral port; clients use the emulator's well-known development account
  through ``AZURE_STORAGE_CONNECTION_STRING``; uploads with azure-storage-blob.

Each :class:`StoreServer` starts its process on ``127.0.0.1`` and a free port, creates
buckets, uploads files and says which environment a client under test needs (with every
lookup that could leave loopback switched off). The ``store_servers`` fixture starts
each scheme's server at most once per test process.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from servers.moto_s3 import ACCESS_KEY, SECRET_KEY, SESSION_TOKEN, MotoS3Server, s3_environment

#: Every scheme the project serves, in test-parameter order.
STORES = ("s3", "gs", "az")

REPO = Path(__file__).resolve().parents[2]
AZURITE = REPO / "build" / "azurite" / "node_modules" / ".bin" / "azurite-blob"

# Azurite's well-known development account (public, documented by Microsoft); treated
# as a secret in the tests all the same: it must never reach a pickle or a message
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
             "KBHBeksoGMGw==")
# GCS emulators take no credentials; a bearer token passed as an option must still
# never be pickled or printed
GCS_TOKEN = "ya29.pyg-atompack-gcs-token-do-not-leak-89ab"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen | None) -> None:
    if process is not None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class StoreServer:
    """What the tests need of a store server.

    Attributes:
        scheme: ``s3``, ``gs`` or ``az``.
        prefixes: Environment-variable prefixes a client of this store reads; the
            tests unset all of them before setting :meth:`environment`.
        secrets: Credential strings that must never appear in a pickle or a message.
        secret_options: Storage options that carry those credentials explicitly.
    """

    scheme = ""
    prefixes: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    port = 0

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:{port}``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def secret_options(self) -> dict:
        raise NotImplementedError

    def environment(self, credentials: bool = True) -> dict[str, str]:
        """Variables for a client that talks to this server only."""
        raise NotImplementedError

    def options_via(self, endpoint_url: str) -> dict:
        """Storage options that send a client to ``endpoint_url`` instead (a relay)."""
        return {"endpoint_url": endpoint_url}

    def start(self) -> StoreServer:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (no error when it exists)."""
        raise NotImplementedError

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Write one object."""
        raise NotImplementedError

    def delete(self, bucket: str, key: str) -> None:
        """Delete one object."""
        raise NotImplementedError

    def upload_directory(self, root: str | Path, bucket: str, prefix: str) -> list[str]:
        """Upload every file of ``root`` to ``{scheme}://bucket/prefix/``.

        Returns:
            The keys written, sorted.
        """
        self.create_bucket(bucket)
        keys = []
        for path in sorted(Path(root).iterdir()):
            if path.is_file():
                key = f"{prefix.strip('/')}/{path.name}" if prefix.strip("/") else path.name
                self.put(bucket, key, path.read_bytes())
                keys.append(key)
        return keys


class S3Store(MotoS3Server, StoreServer):
    """moto's S3 server (see :mod:`servers.moto_s3`)."""

    scheme = "s3"
    prefixes = ("AWS_",)
    secrets = (SECRET_KEY, SESSION_TOKEN)

    @property
    def secret_options(self) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "token": SESSION_TOKEN}

    def environment(self, credentials: bool = True) -> dict[str, str]:
        return s3_environment(self.endpoint_url, credentials=credentials)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def delete(self, bucket: str, key: str) -> None:
        self.client().delete_object(Bucket=bucket, Key=key)


class GCSEmulator(StoreServer):
    """``gcp-storage-emulator`` on ``127.0.0.1`` in a subprocess, in memory."""

    scheme = "gs"
    prefixes = ("GOOGLE_", "GCE_", "CLOUDSDK_", "STORAGE_EMULATOR_HOST", "GCSFS_")
    secrets = (GCS_TOKEN,)

    def __init__(self) -> None:
        self.port = _free_port()
        self.process: subprocess.Popen | None = None

    @property
    def secret_options(self) -> dict:
        return {"token": GCS_TOKEN}

    def environment(self, credentials: bool = True) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,
            # never ask the GCE metadata server (169.254.169.254) or Google's token
            # endpoint: credential lookups stay on loopback, or are not made at all
            "NO_GCE_CHECK": "true",
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
            "FETCH_RAW_TOKEN_EXPIRY": "false",
            "CLOUDSDK_CONFIG": os.devnull,
            "GOOGLE_CLOUD_PROJECT": "pyg-atompack-test",
        }

    def start(self, timeout: float = 60.0) -> GCSEmulator:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
             "--port", str(self.port), "--in-memory", "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/storage/v1/b?project=p",
                                            timeout=2):
                    return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("gcp-storage-emulator did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        _stop(self.process)
        self.process = None

    def client(self):
        """A google-cloud-storage client for this server (anonymous)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="pyg-atompack-test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.endpoint_url})

    def create_bucket(self, bucket: str) -> None:
        client = self.client()
        if client.lookup_bucket(bucket) is None:
            client.create_bucket(bucket)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().bucket(bucket).blob(key).upload_from_string(data)

    def delete(self, bucket: str, key: str) -> None:
        self.client().bucket(bucket).blob(key).delete()


class Azurite(StoreServer):
    """Azurite's blob service on ``127.0.0.1`` and an ephemeral port, in memory."""

    scheme = "az"
    prefixes = ("AZURE_",)
    secrets = (AZURE_KEY,)

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def connection_string(self, key: str = AZURE_KEY) -> str:
        """The development account's connection string for this server."""
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={key};"
                f"BlobEndpoint={self.endpoint_url}/{AZURE_ACCOUNT};")

    @property
    def secret_options(self) -> dict:
        return {"connection_string": self.connection_string()}

    def options_via(self, endpoint_url: str) -> dict:
        return {"connection_string": self.connection_string().replace(self.endpoint_url,
                                                                      endpoint_url)}

    def environment(self, credentials: bool = True) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()} \
            if credentials else {}

    def start(self, timeout: float = 120.0) -> Azurite:
        if not AZURITE.exists():
            raise RuntimeError(f"{AZURITE} is missing: run `make venv` (it installs Azurite "
                               f"from the npm registry into build/azurite)")
        self.process = subprocess.Popen(
            [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", "0",
             "--inMemoryPersistence", "--extentMemoryLimit", "512", "--skipApiVersionCheck",
             "--disableProductStyleUrl"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        seen = []
        for line in self.process.stdout:  # Azurite prints the port it was given
            seen.append(line)
            match = re.search(r"listens on http://127\.0\.0\.1:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                break
            if time.monotonic() > deadline:
                break
        if not self.port:
            self.stop()
            raise RuntimeError("Azurite did not start: " + "".join(seen)[-2000:])
        # keep draining its output so that it never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True,
                         name="azurite-output").start()
        return self

    def stop(self) -> None:
        if self.process is not None:  # in memory: nothing to flush, and SIGTERM takes 10 s
            self.process.kill()
            self.process.wait()
        self.process = None

    def client(self):
        """An azure-storage-blob service client for the development account."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def create_bucket(self, bucket: str) -> None:
        from azure.core.exceptions import ResourceExistsError

        with contextlib.suppress(ResourceExistsError):
            self.client().create_container(bucket)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().get_blob_client(bucket, key).upload_blob(data, overwrite=True)

    def delete(self, bucket: str, key: str) -> None:
        self.client().get_blob_client(bucket, key).delete_blob()


_KINDS: dict[str, Callable[[], StoreServer]] = {"s3": S3Store, "gs": GCSEmulator,
                                                "az": Azurite}


@pytest.fixture(scope="session")
def store_servers() -> Iterator[Callable[[str], StoreServer]]:
    """``get(scheme)``: that scheme's server, started on first use, once per process."""
    started: dict[str, StoreServer] = {}

    def get(scheme: str) -> StoreServer:
        if scheme not in started:
            started[scheme] = _KINDS[scheme]().start()
        return started[scheme]

    yield get
    for server in started.values():
        server.stop()


def use_store(monkeypatch: pytest.MonkeyPatch, server: StoreServer,
              credentials: bool = True) -> None:
    """Point every store client of this process at ``server`` only."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "AZURE_", "GOOGLE_", "GCE_", "CLOUDSDK_", "GCSFS_",
                            "STORAGE_EMULATOR_HOST")):
            monkeypatch.delenv(name)
    for name, value in server.environment(credentials).items():
        monkeypatch.setenv(name, value)
