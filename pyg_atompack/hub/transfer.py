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

Cache layout below the cache root (:mod:`pyg_atompack.remote.cache`, ``$PYG_ATOMPACK_CACHE``;
content-addressed, so a shard unchanged between two revisions is downloaded once)::

    {root}/hub/{repo_type}s--{owner}--{name}/blobs/{sha256}          verified LFS files
    {root}/hub/{repo_type}s--{owner}--{name}/blobs/git-{blob_id}     verified plain git files
    {root}/hub/{repo_type}s--{owner}--{name}/unverified/{commit}/{path}
    {root}/http/{host}--{hash of the URL's directory}/blobs/{sha256}
    {root}/http/{host}--{hash of the URL's directory}/versions/{version key}/{file name}

A file is renamed into ``blobs/`` only after its size and hash matched the
listing, so the presence of a blob *is* the proof of verification (no
re-hashing of multi-GB shards on every open). Files without any known hash,
or downloaded with ``verify=False``, go to ``unverified/`` (a Hub commit never
changes) or, for http(s) URLs, to ``versions/``: keyed by the version the server
names (ETag, else Last-Modified: from the listing, else asked with a one-byte range
request), and downloaded pinned to it, so a file rewritten at the same size is fetched
again. Every listed name, digest and version goes through
:mod:`pyg_atompack.remote.cache` before it becomes a path, and every write stays inside
the cache root.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from pyg_atompack.hub.errors import HubIntegrityError
from pyg_atompack.hub.remote import HUB_POLICY, RemoteFile, hub_headers, translate_errors
from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.transport import http as transport
from pyg_atompack.transport.buffers import FileSink
from pyg_atompack.transport.credentials import RequestHeaders
from pyg_atompack.transport.errors import RemoteIntegrityError, RemoteRangeError
from pyg_atompack.transport.integrity import bytes_problem, file_problem
from pyg_atompack.transport.retry import RetryPolicy

if TYPE_CHECKING:
    from pyg_atompack.remote.objectstore import ObjectStore

def object_info(remote_file: RemoteFile):
    """The object-store backend's description of a file it listed."""
    from pyg_atompack.remote.objectstore import ObjectInfo

    return ObjectInfo(name=remote_file.path, url=remote_file.url, size=remote_file.size,
                      etag=remote_file.blob_id, sha256=remote_file.sha256,
                      generation=remote_file.version)


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
    policy: RetryPolicy | None = None,
) -> bytes:
    """Read ``length`` bytes of a remote file starting at byte ``start``.

    Object-store files are read by their store
    (:class:`~pyg_atompack.remote.ranges.ObjectRangeReader`), not here.

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files` or a URL listing.
        start (int): First byte offset (``>= 0``).
        length (int): Number of bytes (``>= 0``); ``start + length`` must not exceed
            ``remote_file.size``.
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts.
            (default: :data:`~pyg_atompack.hub.remote.HUB_POLICY`)

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
    """The cache folder of one repository, or of one URL directory (``repo_type="url"``).

    Args:
        cache_dir (str | os.PathLike | None): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        repo_id (str): ``owner/name`` (``""`` for files not listed from a repository); for
            ``"url"`` the folder key of :func:`~pyg_atompack.hub.url_files.list_url_files`.
        repo_type (str): ``"dataset"``, ``"model"``, ``"space"`` or ``"url"``.

    Returns:
        ``{root}/hub/{repo_type}s--{owner}--{name}``, or ``{root}/http/{key}`` for a URL.

    Raises:
        RemoteNameError: A part of the id cannot safely name a folder (``..``, ``/`` ...).
    """
    if repo_type == "url":
        key = remote_cache.local_component(repo_id or "unknown", url="http://",
                                           field="URL folder key")
        return remote_cache.kind_folder(remote_cache.HTTP, cache_dir) / key
    where = f"hf://{repo_type}s/{repo_id}"
    parts = [remote_cache.local_component(part, url=where, field="repository id part")
             for part in (repo_id or "unknown").split("/")]
    kind = remote_cache.local_component(repo_type, url=where, field="repository type")
    return remote_cache.kind_folder(remote_cache.HUB, cache_dir) / (f"{kind}s--" +
                                                                    "--".join(parts))


def _url_file_name(remote_file: RemoteFile) -> str:
    # a URL's local name is its last path component, decoded (for an absolute manifest
    # entry too: its folder is keyed by the URL's own origin and directory)
    return remote_cache.local_component(unquote(posixpath.basename(urlsplit(
        remote_file.url).path)), url=remote_file.url, field="file name")


def cached_path(
    remote_file: RemoteFile, cache_dir: str | os.PathLike | None = None, *, verified: bool = True
) -> Path:
    """Where :func:`download` stores ``remote_file`` (whether or not it is there yet).

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files`.
        cache_dir (str | os.PathLike, optional): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        verified (bool, optional): The location of a checksum-verified copy (content-addressed)
            rather than of an unverified one. (default: :obj:`True`)

    Returns:
        The path (see the module docstring); an http(s) file without a known version goes
        to ``unversioned/`` and is never reused.

    Raises:
        RemoteNameError: A listed name, digest or revision cannot safely name a file.
    """
    folder = repo_cache_folder(cache_dir, remote_file.repo_id, remote_file.repo_type)
    url = remote_file.url
    if verified and remote_file.sha256:
        return folder / "blobs" / remote_cache.check_sha256(remote_file.sha256, url=url)
    if verified and remote_file.blob_id:
        blob = remote_cache.check_digest(remote_file.blob_id, url=url, field="git blob id",
                                         lengths=(40, 64))
        return folder / "blobs" / f"git-{blob}"
    if remote_file.repo_type == "url":
        if remote_file.version is None:
            return folder / "unversioned" / _url_file_name(remote_file)
        return folder / "versions" / remote_cache.version_key(remote_file.version) / \
            _url_file_name(remote_file)
    revision = remote_cache.local_name(remote_file.revision or "unknown", url=url,
                                       field="revision")
    return folder / "unverified" / revision / remote_cache.local_name(remote_file.path, url=url)


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
    wait and then reuse the result. A cached copy is reused only at the listed
    version (see the module docstring); a hit writes nothing, so a read-only cache
    serves it.

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files`.
        cache_dir (str | os.PathLike, optional): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
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
        RemoteIntegrityError: An http(s) file changed while it was downloaded.
        RemoteNameError: A listed name, digest or version cannot safely name a file.
        CacheReadOnlyError: Not cached, and the cache cannot be written.
    """
    if remote_file.repo_type == "object":
        return store.download(object_info(remote_file), cache_dir)
    root = remote_cache.cache_root(cache_dir)
    hashed = bool(remote_file.sha256 or remote_file.blob_id)
    if not verify and hashed:  # a verified copy is as good as an unverified one
        verified_copy = remote_cache.check_inside(
            cached_path(remote_file, root, verified=True), root, url=remote_file.url)
        if _is_complete(verified_copy, remote_file):
            return verified_copy
    if remote_file.repo_type == "url" and not (verify and hashed) and \
            remote_file.version is None:
        # the listing named no version: ask the server which one it serves now
        with _translate(remote_file):
            version = transport.probe(remote_file.url, policy=policy or HUB_POLICY,
                                      headers=_headers(remote_file, token)).validator
        remote_file = replace(remote_file, version=version)
    final = cached_path(remote_file, root, verified=verify and hashed)
    # an http(s) file whose server names no version is never reused
    reusable = remote_file.repo_type != "url" or (verify and hashed) or \
        remote_file.version is not None

    def write(temp: Path) -> None:
        _stream_to(remote_file, temp, token=token, policy=policy)
        _check_integrity(remote_file, temp, verify=verify)

    return remote_cache.cached_file(
        final, root, complete=lambda path: reusable and _is_complete(path, remote_file),
        write=write, url=remote_file.url)


def _is_complete(path: Path, remote_file: RemoteFile) -> bool:
    try:
        return path.stat().st_size == remote_file.size
    except FileNotFoundError:
        return False


def _stream_to(remote_file: RemoteFile, temp: Path, *, token: str | bool | None,
               policy: RetryPolicy | None = None) -> None:
    # pinned to the listed version (http(s) files): a file rewritten meanwhile is an
    # error, never a copy stored under the old version's key
    version = remote_file.version if remote_file.repo_type == "url" else None
    with _translate(remote_file), open(temp, "wb") as handle:
        # bounded by the listed size: no byte beyond it is written
        sink = FileSink(handle, limit=remote_file.size)
        try:
            transport.fill(remote_file.url, sink, headers=_headers(remote_file, token),
                           policy=policy or HUB_POLICY, validator=version)
        except RemoteIntegrityError as error:  # another version: an integrity error
            raise HubIntegrityError(str(error), url=error.url, status=error.status) from error
        sink.flush()
