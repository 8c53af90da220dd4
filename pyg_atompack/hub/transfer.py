"""Byte transfers of listed remote files: HTTP range reads and verified downloads.

Both go through the project's one transport (:mod:`pyg_atompack.transport.transfers`):
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

Downloads land in the one cache at :func:`pyg_atompack.remote.cache.cached_path`
(content-addressed: a shard unchanged between two revisions is downloaded once; a
file is renamed into ``blobs/`` only after its size and hash matched the listing, so
the presence of a blob *is* the proof of verification). Files without a hash, or
downloaded with ``verify=False``, go to ``versions/``, keyed by the Hub commit or the
version an http(s) server names (ETag, else Last-Modified: from the listing, else asked
with a one-byte range request) and downloaded pinned to it, so a file rewritten at the
same size is fetched again.
"""

from __future__ import annotations

import os
from pathlib import Path

from pyg_atompack.hub.errors import HubIntegrityError
from pyg_atompack.hub.remote import HUB_POLICY, describe_file
from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.remote.files import RemoteFile
from pyg_atompack.transport import transfers
from pyg_atompack.transport.errors import RemoteRangeError
from pyg_atompack.transport.integrity import bytes_problem
from pyg_atompack.transport.redact import redact_url
from pyg_atompack.transport.retry import RetryPolicy


def fetch_range(
    remote_file: RemoteFile, start: int, length: int, *, token: str | bool | None = None,
    policy: RetryPolicy | None = None,
) -> bytes:
    """Read ``length`` bytes of a remote file starting at byte ``start``.

    Object-store files are read by their store
    (:class:`~pyg_atompack.remote.ranges.BackendRangeReader`), not here.

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
            f"{describe_file(remote_file)}: negative range start={start} length={length}")
    if start + length > remote_file.size:
        raise RemoteRangeError(
            f"{describe_file(remote_file)}: range [{start}, {start + length}) exceeds the file "
            f"size {remote_file.size}"
        )
    if length == 0:
        return b""
    backend = backend_of(remote_file, token=token, policy=policy)
    with backend.errors(remote_file):
        return transfers.fetch_range(remote_file.url, start, length, policy=backend.retry,
                                     headers=backend.headers_for(remote_file))


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
    data = backend_of(remote_file, token=token, policy=policy).read_all(remote_file)
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
        raise HubIntegrityError(f"{describe_file(remote_file)}: received {problem}",
                                url=redact_url(remote_file.url))


def repo_cache_folder(cache_dir: str | os.PathLike | None, repo_id: str, repo_type: str) -> Path:
    """The cache folder of one repository (its files, ``listings/`` and ``refs/``).

    Args:
        cache_dir (str | os.PathLike | None): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        repo_id (str): ``owner/name``.
        repo_type (str): ``"dataset"``, ``"model"`` or ``"space"``.

    Returns:
        ``{root}/hub/{repo_type}s--{owner}--{name}``
        (:func:`~pyg_atompack.remote.cache.folder_of`).

    Raises:
        RemoteNameError: A part of the id cannot safely name a folder (``..``, ``/`` ...).
    """
    return remote_cache.folder_of(RemoteFile("", repo=f"{repo_type}s/{repo_id or 'unknown'}"),
                                  cache_dir)


def backend_of(remote_file: RemoteFile, *, token: str | bool | None = None,
               policy: RetryPolicy | None = None):
    """The backend reading ``remote_file``: the Hub's for a repository file (with
    ``token``), else the one its URL's scheme names.

    Args:
        remote_file (RemoteFile): A listed file.
        token (str | bool, optional): Hub token (repository files only). (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts.
            (default: :data:`~pyg_atompack.hub.remote.HUB_POLICY`)

    Returns:
        The backend.
    """
    if remote_file.repo:
        from pyg_atompack.hub.backend import HubBackend

        return HubBackend(f"hf://{remote_file.repo}", token=token, retry=policy or HUB_POLICY)
    from pyg_atompack.remote.backends import open_backend

    return open_backend(remote_file.url, retry=policy or HUB_POLICY)


def download(
    remote_file: RemoteFile,
    cache_dir: str | os.PathLike | None = None,
    *,
    token: str | bool | None = None,
    verify: bool = True,
    policy: RetryPolicy | None = None,
) -> Path:
    """Download a listed file into the cache, verified, and return its local path.

    The one download of every backend (:meth:`pyg_atompack.remote.backends.Backend.download`):
    a cached copy is reused only at the listed version, a hit writes nothing (a read-only
    cache serves it), a lock file makes concurrent processes (DataLoader workers)
    download once, and nothing unverified is renamed into ``blobs/``.

    Args:
        remote_file (RemoteFile): A file from :func:`list_remote_files` or a URL listing.
        cache_dir (str | os.PathLike, optional): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        verify (bool, optional): Check the sha256 (LFS files) or git blob id (plain files)
            against the listing. The size is always checked. (default: :obj:`True`)
        policy (RetryPolicy, optional): Retries and timeouts.
            (default: :data:`~pyg_atompack.hub.remote.HUB_POLICY`)

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
    return backend_of(remote_file, token=token, policy=policy).download(
        remote_file, cache_dir, verify=verify)
