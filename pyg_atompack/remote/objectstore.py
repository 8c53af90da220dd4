"""Object stores (``s3://``, and ``gs://`` / ``az://`` where gcsfs / adlfs are installed).

Built on `fsspec <https://filesystem-spec.readthedocs.io>`_ with s3fs, gcsfs and adlfs:
obstore was 2-3x faster against moto (``benchmarks/objectstore_clients.py``) but a child
process hangs on its first request once the parent has used it, which every DataLoader
worker started by ``fork`` would do; the fsspec clients work in a forked child given a
client of their own (see ``docs/architecture.md``, "Object stores"). What differs
between the stores (client options, the conditional range read, error codes) lives in
:mod:`pyg_atompack.remote.objectstore_backends`; how the stores' failures become the
transport's errors in :mod:`pyg_atompack.remote.objectstore_errors`; everything else is
here, once.

:class:`ObjectStore` is one bucket prefix (or one object, or a ``manifest.json``):

* :meth:`ObjectStore.list` lists the objects below the prefix with sizes and ETags, and
  takes sha256 digests and record counts from a ``manifest.json`` found there;
* :meth:`ObjectStore.read_range` reads a byte range; :meth:`ObjectStore.read_into`
  streams a range into a writable buffer, resuming from the last byte received after
  a transient failure (``Range`` pinned to the listed version: ``If-Match`` on the ETag
  for S3 and Azure, ``ifGenerationMatch`` for GCS; an object that changed meanwhile is
  an error, never a splice of two versions);
* :meth:`ObjectStore.download` (the one download of every backend) puts a verified copy into
  a cache directory and returns its path; nothing unverified ever lands there.

Clients are made lazily, in the process that uses them: a handle created before a
``fork`` makes a new client in the child instead of touching the parent's event loop
(s3fs's ``RuntimeError: This class is not fork-safe``). Pickling keeps the URL and the
non-secret options only; credentials passed explicitly stay in the process that got
them, and an unpickled handle uses the standard credential chain (environment
variables, ``AWS_PROFILE`` / ``profile=``, config files, instance roles).

Every failure raises one :class:`~pyg_atompack.transport.TransportError` subclass whose
message names the object URL and the cause (never a credential). Retries are the
project's one policy (:class:`~pyg_atompack.transport.RetryPolicy`, run by
:func:`~pyg_atompack.transport.retry.with_retries`, as for HTTP(S)): connection
failures, timeouts, 408, 429, 5xx and the stores' throttling codes are retried with
exponential backoff and jitter, honouring a ``Retry-After`` header; nothing else is.
The clients make a single attempt each, so retries never multiply.

:class:`ObjectStore` is the object stores' backend (:mod:`pyg_atompack.remote.backends`):
its ``range_reader`` gives a listed object the
:class:`~pyg_atompack.remote.ranges.RangeReader` interface
(:class:`~pyg_atompack.remote.ranges.BackendRangeReader`), for record-level reads (record
blocks, the page cache) exactly as for HTTP(S) files.

This module is torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.remote.files import Backend, RemoteFile
from pyg_atompack.remote.manifest import read_manifest_records
from pyg_atompack.remote.objectstore_backends import BACKENDS
from pyg_atompack.remote.objectstore_errors import (
    Truncated,
    describe_transient,
    is_transient,
    requested_wait,
    translate,
)
from pyg_atompack.transport.errors import (
    RemoteIntegrityError,
    RemoteNotFoundError,
    TransportError,
    UnsupportedURLError,
)
from pyg_atompack.transport.retry import (
    RetryPolicy,
    TransientError,
    with_retries,
)

if TYPE_CHECKING:
    from pyg_atompack.transport.http import Cancel

__all__ = [
    "OBJECT_STORE_SCHEMES",
    "ObjectStore",
    "is_object_store_url",
]

logger = logging.getLogger(__name__)

#: URL schemes this module serves, and the package each needs.
OBJECT_STORE_SCHEMES = {scheme: backend.package for scheme, backend in BACKENDS.items()}
SHARD_SUFFIXES = (".pt", ".atp")
MANIFEST_NAME = "manifest.json"
# storage options that hold a credential: kept in memory, never pickled, never printed
_SECRET_OPTIONS = frozenset({"key", "secret", "token", "session_token", "password",
                             "account_key", "sas_token", "connection_string",
                             "client_secret", "credential", "credentials", "aws_access_key_id",
                             "aws_secret_access_key", "aws_session_token"})

def is_object_store_url(url: object) -> bool:
    """Whether ``url`` is a string with one of :data:`OBJECT_STORE_SCHEMES`."""
    return isinstance(url, str) and urlsplit(url).scheme in OBJECT_STORE_SCHEMES


def _split_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> ``("s3", "bucket", "a/b")``; refuses anything else."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in OBJECT_STORE_SCHEMES:
        supported = ", ".join(f"{s}://" for s in OBJECT_STORE_SCHEMES)
        raise UnsupportedURLError(f"{url}: not an object-store URL (supported: {supported})",
                                  url=url)
    if parts.username or parts.password or parts.query:
        raise UnsupportedURLError(
            f"{scheme}://{parts.hostname or ''}{parts.path}: object-store URLs carry no user "
            f"info or query; pass credentials as options or through the environment",
            url=f"{scheme}://{parts.hostname or ''}{parts.path}")
    bucket = parts.netloc
    if not bucket:
        raise UnsupportedURLError(f"{url}: no bucket in the URL", url=url)
    return scheme, bucket, parts.path.strip("/")




class ObjectStore(Backend):
    """A fork-safe, picklable handle on one object-store prefix, object or manifest.

    Args:
        url (str): ``s3://bucket/prefix/`` (every object below it), ``s3://bucket/key``
            (one object) or ``s3://bucket/prefix/manifest.json`` (the shards it names);
            ``gs://`` and ``az://`` likewise when gcsfs / adlfs are installed.
        anon (bool, optional): Unsigned requests, for public buckets. (default: :obj:`False`)
        profile (str, optional): A named profile of the AWS config files (``s3://`` only).
            (default: :obj:`AWS_PROFILE`)
        endpoint_url (str, optional): An S3-compatible endpoint (MinIO, Ceph, R2, ...), or for
            ``gs://`` a GCS endpoint such as an emulator's. ``az://`` takes its endpoint from the
            connection string (``BlobEndpoint=``).
            (default: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else AWS;
            ``STORAGE_EMULATOR_HOST``, else Google's for ``gs://``)
        retry (RetryPolicy, optional): Retries, backoff and timeouts of every request (``timeout``
            is the read timeout, ``connect_timeout`` the connect timeout): transient failures
            (connection, timeout, 408, 429, 5xx, throttling) are retried, and a
            retried transfer resumes where it stopped.
            (default: :class:`~pyg_atompack.transport.RetryPolicy` ``()``)
        **storage_options (optional): Further options of the fsspec filesystem (e.g. ``key``,
            ``secret``, ``client_kwargs`` for s3fs; ``token``, ``project`` for gcsfs;
            ``connection_string``, ``account_name``, ``account_key``, ``sas_token``,
            ``credential`` for adlfs); credentials among them are never pickled.
    """

    def __init__(self, url: str, *, anon: bool = False, profile: str | None = None,
                 endpoint_url: str | None = None, retry: RetryPolicy | None = None,
                 **storage_options: Any) -> None:
        self.scheme, self.bucket, self.key = _split_url(url)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        self.url = f"{self.scheme}://{self.bucket}/{self.key}"
        self.anon = anon
        self.profile = profile
        self.endpoint_url = endpoint_url
        self.retry = retry or RetryPolicy()
        self.storage_options, self._secrets = _split_secrets(storage_options)
        self._secrets_dropped = False
        #: The entries of the ``manifest.json`` the last :meth:`list` read (records).
        self.manifest: dict[str, dict] = {}
        self._fs: Any = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ client
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_secrets_dropped"] = bool(self._secrets) or self._secrets_dropped
        state["_secrets"] = {}
        state["_fs"] = None
        state["_pid"] = None
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _make_filesystem(self) -> Any:
        backend = BACKENDS[self.scheme]
        try:
            import fsspec

            fsspec.get_filesystem_class(self.scheme)
        except (ImportError, ValueError) as error:
            raise UnsupportedURLError(
                f"{self.url}: {self.scheme}:// needs the optional package "
                f"{backend.package!r} (pip install {backend.package}, or "
                f"pip install 'pyg_atompack[{backend.extra}]')", url=self.url,
            ) from error
        options = _merge(self.storage_options, self._secrets)
        options["skip_instance_cache"] = True
        return backend.make_filesystem(self, options)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of this process (made on first use, again after fork)."""
        pid = os.getpid()
        if self._fs is None or self._pid != pid:
            if self._pid is not None and self._pid != pid:
                # a lock some parent thread held at fork time stays held in the child
                self._lock = threading.Lock()
            with self._lock:
                if self._fs is None or self._pid != pid:
                    self._fs = self._make_filesystem()
                    self._pid = pid
        return self._fs

    def object_url(self, key: str) -> str:
        """The URL of ``key`` in this bucket."""
        return f"{self.scheme}://{self.bucket}/{key}"

    def with_retry(self, retry: RetryPolicy) -> ObjectStore:
        """A copy of this handle with another retry policy (and a client of its own).

        Args:
            retry (RetryPolicy): The policy.

        Returns:
            The new handle (secrets given to this one are kept, in memory only).
        """
        clone = copy.copy(self)
        clone.retry = retry
        clone._fs, clone._pid, clone._lock = None, None, threading.Lock()
        return clone

    def _retrying(self, url: str, operation: Callable[[], Any],
                  cancel: Cancel | None = None) -> Any:
        """Run ``operation`` under :attr:`retry` (the transport's one retry loop).

        Transient causes become :class:`TransientError` for
        :func:`~pyg_atompack.transport.retry.with_retries`; anything else is translated
        into the error family at once, without a retry.
        """

        def attempt() -> Any:
            try:
                return operation()
            except asyncio.CancelledError:
                if cancel is not None:
                    cancel.raise_if_cancelled()
                raise
            except TransportError:
                raise
            except Exception as error:  # noqa: BLE001 - classified and translated here
                if cancel is not None:
                    cancel.raise_if_cancelled()
                if is_transient(error):
                    raise TransientError(
                        describe_transient(error, BACKENDS[self.scheme].endpoint(self)),
                        retry_after=requested_wait(error)) from error
                raise translate(error, url, scheme=self.scheme, bucket=self.bucket,
                                secrets_dropped=self._secrets_dropped) from error

        return with_retries(attempt, url=url, policy=self.retry, cancel=cancel)

    # ------------------------------------------------------------------ listing
    def _info(self, key: str) -> RemoteFile:
        url = self.object_url(key)
        entry = self._retrying(url, lambda: self.fs.info(f"{self.bucket}/{key}"))
        if entry.get("type") == "directory":
            raise RemoteNotFoundError(f"{url}: no such object", url=url)
        return _object_info(self, entry, posixpath.basename(key))

    def _read_manifest(self, key: str) -> dict[str, dict]:
        url = self.object_url(key)
        raw = self.read_range(self._info(key), 0, None)
        try:
            document = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TransportError(f"{url}: manifest is not valid JSON: {error}",
                                 url=url) from error
        return read_manifest_records(document, url)  # names and sha256 checked there

    def list(self, suffixes: Sequence[str] | None = SHARD_SUFFIXES) -> list[RemoteFile]:
        """List the objects this handle names, sorted by POSIX path.

        A prefix is listed recursively; names are relative to it. A ``manifest.json``
        directly below the prefix (or the manifest the URL names) contributes each
        shard's sha256 and record count (:attr:`manifest`), and its ``bytes`` must agree
        with the listed size. With a manifest URL, exactly the shards it names are returned.

        Args:
            suffixes (Sequence[str] | None, optional): Keep names ending with one of these;
                :obj:`None` keeps every object. (default: :obj:`(".pt", ".atp")`)

        Returns:
            The objects.

        Raises:
            RemoteNotFoundError: The bucket, the object, or a shard the manifest names
                does not exist; or nothing matches below the prefix.
            RemoteIntegrityError: A listed size disagrees with the manifest.
            RemoteAuthError: Missing or refused credentials.
            RemoteUnavailableError: The endpoint stayed unreachable through every retry.
            RemoteNameError: A listed key cannot safely name a file (``..``, an absolute or
                empty component, a control character, a backslash, too long: see
                :func:`pyg_atompack.remote.cache.local_name`).
        """
        if self.key.endswith(".json"):
            directory = posixpath.dirname(self.key)
            manifest = self.manifest = self._read_manifest(self.key)
            if not manifest:
                raise TransportError(f"{self.url}: manifest lists no shards "
                                     f"(expected a 'shards' list)", url=self.url)
            listed = {o.name: o for o in self._list_prefix(directory)}
            objects = []
            for name, entry in manifest.items():
                if name not in listed:
                    url = self.object_url(f"{directory}/{name}" if directory else name)
                    raise RemoteNotFoundError(
                        f"{url}: named by the manifest {self.url} but not in the bucket",
                        url=url)
                objects.append(_with_manifest(listed[name], entry, self.url))
            return _checked(self.url, sorted(objects, key=lambda o: o.name))
        single = bool(self.key) and posixpath.splitext(self.key)[1] in SHARD_SUFFIXES
        if single:
            with contextlib.suppress(RemoteNotFoundError):
                return _checked(self.url, [self._info(self.key)])
        everything = self._list_prefix(self.key)
        if single and not everything:
            raise RemoteNotFoundError(f"{self.url}: no such object", url=self.url)
        if not everything:
            raise RemoteNotFoundError(f"{self.url}: no objects below this prefix",
                                      url=self.url)
        manifest: dict[str, dict] = {}
        manifest_url = self.object_url(f"{self.key}/{MANIFEST_NAME}" if self.key
                                       else MANIFEST_NAME)
        if any(o.name == MANIFEST_NAME for o in everything):
            manifest = self._read_manifest(manifest_url.split("/", 3)[3])
        self.manifest = manifest
        objects = [_with_manifest(o, manifest.get(o.name), manifest_url) for o in everything
                   if suffixes is None or o.name.endswith(tuple(suffixes))]
        if not objects:
            raise RemoteNotFoundError(
                f"{self.url}: no {' or '.join(suffixes or ())} objects below this prefix",
                url=self.url)
        missing = sorted(set(manifest) - {o.name for o in objects})
        if missing:
            url = self.object_url(f"{self.key}/{missing[0]}" if self.key else missing[0])
            raise RemoteNotFoundError(
                f"{url}: named by the manifest {manifest_url} but not in the bucket", url=url)
        return _checked(self.url, objects)

    def _list_prefix(self, prefix: str) -> list[RemoteFile]:
        root = f"{self.bucket}/{prefix}".rstrip("/")
        url = self.object_url(prefix)

        def find() -> tuple[dict, bool]:
            try:
                found = self.fs.find(root + "/", detail=True)
            except FileNotFoundError:  # gcsfs, for a missing bucket
                found = {}
            # an empty answer may mean a missing bucket in some backends: ask once
            return found, bool(found) or self.fs.exists(self.bucket)

        found, bucket_exists = self._retrying(url, find)
        if not bucket_exists:
            raise RemoteNotFoundError(f"{url}: bucket {self.bucket!r} does not exist", url=url)
        objects = []
        for path, entry in found.items():
            if entry.get("type") == "directory":
                continue
            name = path[len(root) + 1:] if path.startswith(root + "/") else path
            objects.append(_object_info(self, entry, name))
        objects.sort(key=lambda o: o.name)
        return objects

    # ------------------------------------------------------------------ bytes
    def read_range(self, obj: RemoteFile, start: int, length: int | None) -> bytes:
        """Read ``length`` bytes of ``obj`` from byte ``start`` (:obj:`None`: to the end).

        Args:
            obj (RemoteFile): A listed object.
            start (int): First byte.
            length (int | None): Number of bytes, or :obj:`None` for the rest of the object.

        Returns:
            Exactly the bytes asked for.

        Raises:
            ValueError: The range lies outside the object.
            TransportError: The read failed (see :meth:`read_into`).
        """
        end = obj.size if length is None else start + length
        if start < 0 or end < start or end > obj.size:
            raise ValueError(f"{obj.url}: range [{start}, {end}) outside its {obj.size} bytes")
        buffer = bytearray(end - start)
        self.read_into(obj, memoryview(buffer), start)
        return bytes(buffer)

    def read_into(self, obj: RemoteFile, out: Any, start: int = 0, cancel: Cancel | None = None,
                  progress: Callable[[int], None] | None = None, pin: Any = None) -> None:
        """Stream bytes ``[start, start + len(out))`` of ``obj`` into ``out``.

        One ranged ``GET`` conditioned on the listed version (ETag, GCS generation); after a
        transient failure the next attempt asks for the rest only. Cancelling ``cancel``
        aborts the transfer in flight at once (the request task is cancelled, not waited
        for).

        Args:
            obj (RemoteFile): A listed object.
            out (Any): A writable buffer (``bytearray``, ``mmap``, ``memoryview``).
            start (int, optional): First byte of the object. (default: 0)
            cancel (Cancel, optional): Stops the transfer and any backoff wait.
                (default: :obj:`None`)
            progress (Callable[[int], None], optional): Called as bytes land with the offset
                one past the last byte in. (default: :obj:`None`)
            pin (Any, optional): Not needed: every request is conditioned on the listed
                version, so the ranges of one download cannot come from two versions.
                (default: :obj:`None`)

        Raises:
            RemoteIntegrityError: The object changed since it was listed.
            RemoteNotFoundError, RemoteAuthError: Permanent failures.
            RemoteUnavailableError: Transient failures outlasted every retry.
        """
        view = memoryview(out).cast("B")
        end = start + len(view)
        position = [start]

        def sink(chunk: bytes) -> None:
            at = position[0] - start
            view[at:at + len(chunk)] = chunk
            position[0] += len(chunk)
            if progress is not None:
                progress(position[0])

        def attempt() -> None:
            if position[0] < end:
                self._stream(obj, position[0], end, sink, cancel)

        try:
            self._retrying(obj.url, attempt, cancel)
        finally:
            view.release()

    def _stream(self, obj: RemoteFile, start: int, end: int, sink: Callable[[bytes], None],
                cancel: Cancel | None) -> None:
        fs = self.fs
        if cancel is not None:
            cancel.raise_if_cancelled()
        received = [0]

        async def run() -> None:
            # aclosing: leaving early still closes the response (the backend's finally)
            chunks = BACKENDS[self.scheme].chunks(self, obj, start, end)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    chunk = chunk[:end - start - received[0]]
                    if chunk:
                        sink(chunk)
                        received[0] += len(chunk)
                    if received[0] >= end - start:
                        break

        future = asyncio.run_coroutine_threadsafe(run(), fs.loop)
        unregister = cancel.on_cancel(future.cancel) if cancel is not None else None
        try:
            future.result()
        finally:
            if unregister is not None:
                unregister()
        if received[0] != end - start:
            raise Truncated(f"connection closed after {start + received[0]} of {end} bytes")



def _split_secrets(options: dict) -> tuple[dict, dict]:
    """(public, secret) halves of ``options``; nested dicts such as ``client_kwargs`` too."""
    public, secret = {}, {}
    for name, value in options.items():
        if name.lower() in _SECRET_OPTIONS:
            secret[name] = value
        elif isinstance(value, dict):
            public[name], inner = _split_secrets(value)
            if inner:
                secret[name] = inner
        else:
            public[name] = value
    return public, secret


def _merge(public: dict, secret: dict) -> dict:
    merged = dict(public)
    for name, value in secret.items():
        merged[name] = _merge(merged.get(name, {}), value) if isinstance(value, dict) else value
    return merged



def _checked(url: str, objects: list[RemoteFile]) -> list[RemoteFile]:
    """``objects`` listed at ``url``, after checking each name can safely become a path."""
    for obj in objects:
        remote_cache.local_name(obj.name, url=url)
    return objects


def _object_info(store: ObjectStore, entry: dict, name: str) -> RemoteFile:
    # what reads and cached copies are pinned to: GCS's generation, else the ETag
    version = entry.get("generation") or entry.get("ETag") or entry.get("etag") or \
        entry.get("md5Hash")
    return RemoteFile(name=name, url=f"{store.scheme}://{entry['name']}",
                      size=int(entry["size"]),
                      version=str(version).strip('"') if version else None)


def _with_manifest(obj: RemoteFile, entry: dict | None, manifest_url: str) -> RemoteFile:
    if not entry:
        return obj
    announced = entry.get("bytes")
    if announced is not None and announced != obj.size:
        raise RemoteIntegrityError(
            f"{obj.url}: the bucket lists {obj.size} bytes, the manifest {manifest_url} "
            f"says {announced}", url=obj.url)
    return replace(obj, sha256=entry.get("sha256"))
