"""A real S3-compatible server on loopback: moto's server mode in a subprocess.

:class:`MotoS3Server` runs ``python -m moto.server`` (the same server s3fs's own test
suite uses) on ``127.0.0.1`` and a free port, and hands out boto3 clients for uploading
fixtures. It runs in its own process, so a client under test competes with the server
neither for the GIL nor across a ``fork`` of DataLoader workers.

:func:`s3_environment` gives the environment a client under test sees: fake static keys
(moto accepts any), the endpoint in ``AWS_ENDPOINT_URL``, and every lookup that could
leave loopback switched off (instance metadata, shared config files).

Use the ``moto_s3`` fixture (one server per test session) or the class directly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ACCESS_KEY = "AKIAPYGATOMPACKTEST1"
SECRET_KEY = "pyg-atompack-secret-key-do-not-leak-0123"
SESSION_TOKEN = "pyg-atompack-session-token-do-not-leak-4567"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3_environment(endpoint_url: str, *, credentials: bool = True) -> dict[str, str]:
    """Environment variables for S3 clients talking to ``endpoint_url`` only.

    Args:
        endpoint_url: The server's base URL.
        credentials: Include the fake static keys and session token. (default: :obj:`True`)

    Returns:
        Variables to set; every other ``AWS_*`` variable should be unset (container
        credential URIs above all, which would send the client elsewhere).
    """
    env = {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        # never ask the EC2/ECS metadata services (169.254.x.x) for credentials
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",
        # no shared config or credentials file of the machine's user
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_ALLOW_HTTP": "true",
    }
    if credentials:
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                   AWS_SESSION_TOKEN=SESSION_TOKEN)
    return env


class MotoS3Server:
    """``moto_server`` on ``127.0.0.1`` in a subprocess.

    Args:
        port: Port to listen on. (default: a free one)
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.process: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:{port}``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> MotoS3Server:
        """Start the server and wait until it answers.

        Args:
            timeout: Seconds to wait for it. (default: 60)
        """
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=2):
                    return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """Terminate the server process."""
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def client(self):
        """A boto3 S3 client for this server (fake keys, path-style addressing)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=REGION,
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}),
        )

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (no error when it exists)."""
        client = self.client()
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)

    def upload_directory(self, root: str | Path, bucket: str, prefix: str) -> list[str]:
        """Upload every file of ``root`` to ``s3://bucket/prefix/`` with boto3.

        Returns:
            The keys written, sorted.
        """
        self.create_bucket(bucket)
        client = self.client()
        keys = []
        for path in sorted(Path(root).iterdir()):
            if path.is_file():
                key = f"{prefix.strip('/')}/{path.name}" if prefix.strip("/") else path.name
                client.upload_file(str(path), bucket, key)
                keys.append(key)
        return keys

    def __enter__(self) -> MotoS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    """One moto S3 server for the whole session."""
    with MotoS3Server() as server:
        yield server
