"""Byte transfers of listed remote files: HTTP range reads and verified downloads.

Both go through the project's one transport (:mod:`pyg_atompack.transport.http`):
timeouts, retries with backoff on connection errors, 408, 429 and 5xx, ``Range``
resume, proxies and the trust store apply, and the Hub token is sent to the Hub's
origin only, never to the CDN a large file is redirected to.

What is fetched:

* :func:`fetch_range`: one ``GET`` of the file URL with ``Range: bytes=a-b``;
  only those bytes cross the network when the server honours ranges (every
  Hub endpoint and CDN does). A server that ignores the range answers 200: the
  body is then read only up to the end of the wanted range and the connection
  closed.
* :func:`download`: one streamed ``GET`` of the whole file, resumed with a
  ``Range`` request if the connection drops, into a temporary name next to its
  destination; then size and checksum are checked and the file is renamed into
  place. Nothing is fetched when a verified copy is already cached.

Cache layout under ``cache_dir`` (content-addressed, so a shard unchanged
between two revisions is downloaded once)::

    {cache_dir}/{repo_type}s--{owner}--{name}/blobs/{sha256}          verified LFS files
    {cache_dir}/{repo_type}s--{owner}--{name}/blobs/git-{blob_id}     verified plain git files
    {cache_dir}/{repo_type}s--{owner}--{name}/unverified/{revision}/{path}

A file is renamed into ``blobs/`` only after its size and hash matched the
listing, so the presence of a blob *is* the proof of verification (no
re-hashing of multi-GB shards on every open). Files without any known hash,
or downloaded with ``verify=False``, go to ``unverified/``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from pyg_atompack.hub.errors import HubIntegrityError
from pyg_atompack.hub.remote import HUB_POLICY, RemoteFile, hub_headers, translate_errors
from pyg_atompack.transport import http as transport
from pyg_atompack.transport.credentials import RequestHeaders
from pyg_atompack.transport.errors import RemoteRangeError
from pyg_atompack.transport.integrity import bytes_problem, file_problem
from pyg_atompack.transport.retry import RetryPolicy

if TYPE_CHECKING:
    from pyg_atompack.transport.objectstore import ObjectStore

_CACHE_ENV = "PYG_ATOMPACK_HUB_CACHE"


def default_cache_dir() -> Path:
    """The download cache used when none is given.

    Returns:
        ``$PYG_ATOMPACK_HUB_CACHE`` if set, else ``~/.cache/pyg_atompack/hub``.
    """
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pyg_atompack" / "hub"


def object_info(remote_file: RemoteFile):
    """The object-store backend's description of a file it listed."""
    from pyg_atompack.transport.objectstore import ObjectInfo

    return ObjectInfo(name=remote_file.path, url=remote_file.url, size=remote_file.size,
                      etag=remote_file.blob_id, sha256=remote_file.sha256)


def _translate(remote_file: RemoteFile):
    if remote_file.repo_type == "url":
        return translate_errors(None, None, remote_file.describe())
    return translate_errors(remote_file.repo_id, remote_file.revision, remote_file.path,
                            repo_type=remote_file.repo_type)


def _headers(remote_file: RemoteFile, token: str | bool | None) -> RequestHeaders:
    # files listed from a plain URL (no repository) get no Hub token; a repository file's
    # URL is built from the endpoint, so its origin is the Hub's
    return hub_headers(False if remote_file.repo_type == "url" else token, remote_file.url)


def fetch_range(
    remote_file: RemoteFile, start: int, length: int, *, token: str | bool | None = None,
    policy: RetryPolicy | None = None, store: ObjectStore | None = None,
) -> bytes:
    """Read ``length`` bytes of a remote file starting at byte ``start``.

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files`.
        start (int): First byte offset (``>= 0``).
        length (int): Number of bytes (``>= 0``); ``start + length`` must not exceed
            ``remote_file.size``.
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts.
            (default: :data:`~pyg_atompack.hub.remote.HUB_POLICY`)
        store (ObjectStore, optional): For a file listed from an object store
            (``repo_type="object"``): the backend's handle that listed it, which reads
            the range. (default: :obj:`None`)

    Returns:
        Exactly ``length`` bytes.

    Raises:
        RemoteRangeError: The range is negative or extends past the end of the file
            (also a :class:`ValueError`).
        HubTransferError: The request failed (after retries for transient causes).
    """
    start, length = int(start), int(length)
    if start < 0 or length < 0:
        raise RemoteRangeError(
            f"{remote_file.describe()}: negative range start={start} length={length}")
    if start + length > remote_file.size:
        raise RemoteRangeError(
            f"{remote_file.describe()}: range [{start}, {start + length}) exceeds the file "
            f"size {remote_file.size}"
        )
    if length == 0:
        return b""
    if remote_file.repo_type == "object":
        return store.read_range(object_info(remote_file), start, length)
    with _translate(remote_file):
        return transport.fetch_range(remote_file.url, start, length,
                                     headers=_headers(remote_file, token),
                                     policy=policy or HUB_POLICY)


def fetch_bytes(
    remote_file: RemoteFile, *, token: str | bool | None = None, verify: bool = True,
    policy: RetryPolicy | None = None,
) -> bytes:
    """Fetch a whole remote file into memory, checked against the listing.

    Meant for streaming consumers that decode a shard from memory and drop it
    (nothing is written to disk). One ``GET`` of the file URL (resumed after a drop).

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files`.
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        verify (bool, optional): Check the sha256 (LFS files) or git blob id (plain files); the
            size is always checked. (default: :obj:`True`)
        policy (RetryPolicy, optional): Retries and timeouts.
            (default: :data:`~pyg_atompack.hub.remote.HUB_POLICY`)

    Returns:
        The file's bytes.

    Raises:
        HubIntegrityError: Size or checksum differs from the listing.
        HubTransferError: The transfer failed.
    """
    with _translate(remote_file):
        data = transport.fetch(remote_file.url, headers=_headers(remote_file, token),
                               policy=policy or HUB_POLICY, size=remote_file.size)
    check_bytes(remote_file, data, verify=verify)
    return bytes(data)


def check_bytes(remote_file: RemoteFile, data: bytes | memoryview, *,
                verify: bool = True) -> None:
    """Raise :class:`HubIntegrityError` unless ``data`` matches the listing of ``remote_file``.

    Args:
        remote_file (RemoteFile): The listed file.
        data (bytes | memoryview): Its supposed content.
        verify (bool, optional): Also compare hashes, not only the size. (default: :obj:`True`)
    """
    problem = bytes_problem(data, size=remote_file.size, sha256=remote_file.sha256,
                            blob_id=remote_file.blob_id, verify=verify)
    if problem is not None:
        raise HubIntegrityError(f"{remote_file.describe()}: received {problem}",
                                url=transport.redact_url(remote_file.url))


def repo_cache_folder(cache_dir: str | os.PathLike | None, repo_id: str, repo_type: str) -> Path:
    """The cache folder of one repository: ``{cache_dir}/{repo_type}s--{owner}--{name}``.

    Args:
        cache_dir (str | os.PathLike | None): Cache root (default: :func:`default_cache_dir`).
        repo_id (str): ``owner/name`` (``""`` for files not listed from a repository).
        repo_type (str): ``"dataset"``, ``"model"`` or ``"space"``.

    Returns:
        The folder path.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / (f"{repo_type}s--" + "--".join((repo_id or "unknown").split("/")))


def cached_path(
    remote_file: RemoteFile, cache_dir: str | os.PathLike | None = None, *, verified: bool = True
) -> Path:
    """Where :func:`download` stores ``remote_file`` (whether or not it is there yet).

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files`.
        cache_dir (str | os.PathLike, optional): Cache root (default: :func:`default_cache_dir`).
        verified (bool, optional): The location of a checksum-verified copy (content-addressed)
            rather than of an unverified one. (default: :obj:`True`)

    Returns:
        The path.
    """
    folder = repo_cache_folder(cache_dir, remote_file.repo_id, remote_file.repo_type)
    if verified and remote_file.sha256:
        return folder / "blobs" / remote_file.sha256
    if verified and remote_file.blob_id:
        return folder / "blobs" / f"git-{remote_file.blob_id}"
    return folder / "unverified" / remote_file.revision / remote_file.path


def _check_integrity(remote_file: RemoteFile, path: Path, *, verify: bool) -> None:
    problem = file_problem(path, size=remote_file.size, sha256=remote_file.sha256,
                           blob_id=remote_file.blob_id, verify=verify)
    if problem is not None:
        raise HubIntegrityError(f"{remote_file.describe()}: downloaded {problem}",
                                url=transport.redact_url(remote_file.url))


def download(
    remote_file: RemoteFile,
    cache_dir: str | os.PathLike | None = None,
    *,
    token: str | bool | None = None,
    verify: bool = True,
    policy: RetryPolicy | None = None,
    store: ObjectStore | None = None,
) -> Path:
    """Download a remote file into the cache, verified, and return its local path.

    Safe to call from several processes at once (DataLoader workers): a file
    lock next to the destination makes one process download while the others
    wait and then reuse the result.

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files`.
        cache_dir (str | os.PathLike, optional): Cache root (default: :func:`default_cache_dir`).
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        verify (bool, optional): Check the sha256 (LFS files) or git blob id (plain files)
            against the listing. The size is always checked. (default: :obj:`True`)
        policy (RetryPolicy, optional): Retries and timeouts.
            (default: :data:`~pyg_atompack.hub.remote.HUB_POLICY`)
        store (ObjectStore, optional): For a file listed from an object store: the
            backend's handle, which keeps its own verified cache (``verify`` is then
            always on). (default: :obj:`None`)

    Returns:
        Path of the local copy (treat it as read-only; it may be shared).

    Raises:
        HubIntegrityError: Size or checksum differs from the listing; nothing
            is left in the cache.
        HubTransferError: The transfer failed.
    """
    from filelock import FileLock

    if remote_file.repo_type == "object":
        return store.download(object_info(remote_file), cache_dir)
    hashed = bool(remote_file.sha256 or remote_file.blob_id)
    final = cached_path(remote_file, cache_dir, verified=verify and hashed)
    if _is_complete(final, remote_file):
        return final
    if not verify:  # a verified copy is as good as an unverified one
        verified_copy = cached_path(remote_file, cache_dir, verified=True)
        if hashed and _is_complete(verified_copy, remote_file):
            return verified_copy
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if _is_complete(final, remote_file):  # another process finished it meanwhile
            return final
        temp = final.with_name(f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.incomplete")
        try:
            _stream_to(remote_file, temp, token=token, policy=policy)
            _check_integrity(remote_file, temp, verify=verify)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
    return final


def _is_complete(path: Path, remote_file: RemoteFile) -> bool:
    try:
        return path.stat().st_size == remote_file.size
    except FileNotFoundError:
        return False


def _stream_to(remote_file: RemoteFile, temp: Path, *, token: str | bool | None,
               policy: RetryPolicy | None = None) -> None:
    with _translate(remote_file), open(temp, "wb") as handle:
        transport.fetch_to_file(remote_file.url, handle, headers=_headers(remote_file, token),
                                policy=policy or HUB_POLICY, size=remote_file.size)
