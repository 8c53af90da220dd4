"""What differs between the object stores: client, conditional range read, error codes.

:class:`~pyg_atompack.remote.objectstore.ObjectStore` does everything that is the
same for every store (listing, manifests, retries, resume, downloads, pickling); each
:class:`Backend` here supplies the rest for its scheme:

* ``s3://``: s3fs (aiobotocore); ``GetObject`` with ``Range`` and ``If-Match`` on the
  listed ETag.
* ``gs://``: gcsfs's core ``GCSFileSystem`` (the JSON API over aiohttp, not its
  experimental gRPC subclass: gRPC channels do not survive ``fork``); a media download
  with ``Range`` and ``ifGenerationMatch`` on the listed generation. With an emulator
  (``STORAGE_EMULATOR_HOST`` or ``endpoint_url``) and no token it is anonymous, as
  google-cloud-storage is.
* ``az://``: adlfs (azure-storage-blob's async client); ``download_blob`` with an
  offset, a length and ``If-Match`` on the listed ETag.

Every client makes a single attempt per request (botocore's and azure-core's retry
policies set to none, gcsfs's retrying request wrapper bypassed), so the transport's one
:class:`~pyg_atompack.transport.RetryPolicy` is the only retry loop. This module is
torch-free and imports each client library only when its scheme is used.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["BACKENDS", "Backend", "StoreHTTPError"]

_CHUNK = 1 << 20
_AZURE_GET = 4 << 20


def _path(obj: Any) -> str:
    """``bucket/key`` of a listed object, as fsspec names it."""
    return obj.url.split("://", 1)[1]


class StoreHTTPError(Exception):
    """A non-success answer to one of this module's own requests.

    Args:
        status (int): The HTTP status.
        code (str, optional): The store's error code, if it sent one. (default: :obj:`None`)
        retry_after (str, optional): The ``Retry-After`` header. (default: :obj:`None`)
    """

    def __init__(self, status: int, code: str | None = None,
                 retry_after: str | None = None) -> None:
        super().__init__(f"HTTP {status}" + (f" {code}" if code else ""))
        self.status = status
        self.code = code
        self.retry_after = retry_after


class Backend:
    """One store's client and wire details (the base serves as documentation).

    Attributes:
        package: The fsspec implementation it needs.
        extra: The ``pyg_atompack`` extra that installs it.
        credentials_hint: Where credentials come from, for messages.
    """

    package = ""
    extra = ""
    credentials_hint = ""

    def make_filesystem(self, store: Any, options: dict) -> Any:
        """A new single-attempt filesystem for ``store`` (called once per process).

        Args:
            store (ObjectStore): The handle (scheme, ``anon``, ``profile``,
                ``endpoint_url``, ``retry``).
            options (dict): The storage options, secrets merged in.

        Returns:
            The fsspec filesystem.
        """
        raise NotImplementedError

    def chunks(self, store: Any, obj: Any, start: int, end: int) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` of ``obj``, pinned to the listed version, as they arrive.

        Args:
            store (ObjectStore): The handle; its ``fs`` is this process's client.
            obj (RemoteFile): The listed object.
            start (int): First byte.
            end (int): One past the last byte.

        Returns:
            An async iterator of chunks, run on the filesystem's event loop.
        """
        raise NotImplementedError

    def endpoint(self, store: Any) -> str | None:
        """The endpoint requests go to (for messages; no secret), if known."""
        return None


class S3Backend(Backend):
    """``s3://`` through s3fs."""

    package = "s3fs"
    extra = "s3"
    credentials_hint = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass "
                        "anon=True for a public bucket")

    def make_filesystem(self, store: Any, options: dict) -> Any:
        from s3fs import S3FileSystem

        # botocore's "max_attempts" counts retries, "total_max_attempts" attempts
        config = dict(options.pop("config_kwargs", {}))
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", store.retry.connect_timeout)
        config.setdefault("read_timeout", store.retry.timeout)
        options.update(config_kwargs=config, anon=store.anon)
        endpoint = self.endpoint(store)
        if endpoint:
            options["endpoint_url"] = endpoint
        if "session" not in options:
            options["session"] = _new_session(store.profile)
        fs = S3FileSystem(**options)
        fs.retries = 1  # s3fs's own retry loop: one attempt
        return fs

    async def chunks(self, store: Any, obj: Any, start: int, end: int):
        extra = {"IfMatch": f'"{obj.version}"'} if obj.version else {}
        response = await store.fs._call_s3("get_object", Bucket=store.bucket,
                                           Key=_path(obj).split("/", 1)[1],
                                           Range=f"bytes={start}-{end - 1}", **extra)
        body = response["Body"]
        try:
            while chunk := await body.read(_CHUNK):
                yield chunk
        finally:
            body.close()

    def endpoint(self, store: Any) -> str | None:
        return (store.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))


_LOADER: list[Any] = []


def _new_session(profile: str | None) -> Any:
    """A fresh aiobotocore session (own credentials) sharing the parsed service models.

    Parsing botocore's JSON models is most of the cost of a new client (0.3 s of 0.6 s
    measured); the loader is a plain cache, safe to share between sessions and across
    ``fork``, while credentials stay per session.
    """
    import botocore.loaders
    from aiobotocore.session import AioSession

    if not _LOADER:
        _LOADER.append(botocore.loaders.create_loader())
    session = AioSession(profile=profile) if profile else AioSession()
    session.register_component("data_loader", _LOADER[0])
    return session


_GCS_CLASS: list[type] = []


def _single_attempt_gcs() -> type:
    """gcsfs's core filesystem with its built-in retry loop (6 tries) bypassed."""
    if not _GCS_CLASS:
        from gcsfs.core import GCSFileSystem

        retrying = GCSFileSystem._request
        once = getattr(retrying, "__wrapped__", retrying)  # the undecorated request

        class SingleAttemptGCSFileSystem(GCSFileSystem):
            async def _request(self, *args: Any, **kwargs: Any) -> Any:
                return await once(self, *args, **kwargs)

        _GCS_CLASS.append(SingleAttemptGCSFileSystem)
    return _GCS_CLASS[0]


class GCSBackend(Backend):
    """``gs://`` through gcsfs."""

    package = "gcsfs"
    extra = "gcs"
    credentials_hint = ("set GOOGLE_APPLICATION_CREDENTIALS (a service-account key file) or "
                        "log in with `gcloud auth application-default login`, or pass "
                        "token=...; anon=True for a public bucket")

    def make_filesystem(self, store: Any, options: dict) -> Any:
        import aiohttp

        if store.profile is not None:
            raise ValueError(f"{store.url}: profile= is for s3:// only")
        if store.endpoint_url:
            options.setdefault("endpoint_url", store.endpoint_url)
        if store.anon or ("token" not in options and self.endpoint(store) != _GCS_DEFAULT):
            # an emulator takes no credentials: anonymous, as google-cloud-storage is
            options["token"] = "anon"
        options.setdefault("requests_timeout", aiohttp.ClientTimeout(
            sock_connect=store.retry.connect_timeout, sock_read=store.retry.timeout))
        return _single_attempt_gcs()(**options)

    async def chunks(self, store: Any, obj: Any, start: int, end: int):
        fs = store.fs
        # the listing's version is the generation (GCS lists one for every object)
        params = {"ifGenerationMatch": obj.version} if str(obj.version).isdigit() else {}
        session = await fs._set_session()
        headers = fs._get_headers({"Range": f"bytes={start}-{end - 1}"})
        async with session.get(fs.url(_path(obj)), params=fs._get_params(params),
                               headers=headers, timeout=fs.requests_timeout) as response:
            if response.status not in (200, 206):
                body = await response.read()
                raise StoreHTTPError(response.status, _gcs_reason(body),
                                     response.headers.get("Retry-After"))
            async for chunk in response.content.iter_chunked(_CHUNK):
                yield chunk

    def endpoint(self, store: Any) -> str | None:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator in ("", "default"):
            emulator = ""
        elif not emulator.startswith(("http://", "https://")):
            emulator = f"http://{emulator}"
        return store.endpoint_url or store.storage_options.get("endpoint_url") or \
            emulator or _GCS_DEFAULT


_GCS_DEFAULT = "https://storage.googleapis.com"


def _gcs_reason(body: bytes) -> str | None:
    """The ``reason`` of a GCS JSON error body, if it is one."""
    import json

    try:
        errors = json.loads(body)["error"].get("errors") or [{}]
        return errors[0].get("reason")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class AzureBackend(Backend):
    """``az://`` (and ``abfs://``) through adlfs."""

    package = "adlfs"
    extra = "azure"
    credentials_hint = ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
                        "with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN (or pass "
                        "them as options); anon=True with an account name for a public "
                        "container")

    def make_filesystem(self, store: Any, options: dict) -> Any:
        from adlfs import AzureBlobFileSystem

        from pyg_atompack.transport.errors import RemoteAuthError

        if store.profile is not None or store.endpoint_url is not None:
            raise ValueError(f"{store.url}: profile= and endpoint_url= are for s3:// (and "
                             f"gs://); give az:// a connection string with BlobEndpoint=")
        named = ("connection_string", "account_name")
        variables = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME")
        if not any(options.get(n) for n in named) and not any(map(os.environ.get, variables)):
            hint = (" (credentials given as options are not pickled: in spawned workers use "
                    "the environment)" if store._secrets_dropped else "")
            raise RemoteAuthError(f"{store.url}: no credentials found: "
                                  f"{self.credentials_hint}{hint}", url=store.url)
        if store.anon:
            options["anon"] = True
        options.setdefault("connection_timeout", store.retry.connect_timeout)
        options.setdefault("read_timeout", store.retry.timeout)
        fs = AzureBlobFileSystem(**options)
        # one attempt per request: the client's retry policy object is shared by every
        # container and blob client derived from it
        config = fs.service_client._config
        policy = config.retry_policy
        policy.total_retries = policy.connect_retries = 0
        policy.read_retries = policy.status_retries = 0
        # the SDK buffers each GET whole before handing it on: ranges go in 4 MiB GETs
        # (its default chunk), so a dropped transfer resumes after the last whole chunk
        config.max_single_get_size = config.max_chunk_get_size = _AZURE_GET
        return fs

    async def chunks(self, store: Any, obj: Any, start: int, end: int):
        from azure.core import MatchConditions

        fs = store.fs
        container, blob = _path(obj).split("/", 1)
        client = fs.service_client.get_blob_client(container, blob)
        pin = ({"etag": f'"{obj.version}"', "match_condition": MatchConditions.IfNotModified}
               if obj.version else {})
        downloader = await client.download_blob(
            offset=start, length=end - start, max_concurrency=1,
            connection_timeout=store.retry.connect_timeout,
            read_timeout=store.retry.timeout, **pin)
        async for chunk in downloader.chunks():
            yield chunk

    def endpoint(self, store: Any) -> str | None:
        fs = store._fs
        return getattr(getattr(fs, "service_client", None), "url", None)


#: Scheme -> backend.
BACKENDS: dict[str, Backend] = {"s3": S3Backend(), "gs": GCSBackend(), "gcs": GCSBackend(),
                                "az": AzureBackend(), "abfs": AzureBackend()}
