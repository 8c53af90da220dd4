"""Byte transfers of listed remote files: HTTP range reads and verified downloads.

Both go through huggingface_hub's shared HTTP client
(``huggingface_hub.utils.get_session``, via ``http_backoff`` and
``file_download.http_get``), so the client's headers (user agent, token),
proxy settings, retries on 429/5xx and redirect handling (the Hub redirects
LFS files to a CDN) apply unchanged.

What is fetched:

* :func:`fetch_range`: one ``GET`` of the file URL with ``Range: bytes=a-b``;
  only those bytes cross the network when the server honours ranges (every
  Hub endpoint and CDN does). A server that ignores the range answers 200: the
  body is then read only up to the end of the wanted range and the connection
  closed.
* :func:`download`: one streamed ``GET`` of the whole file, resumed with a
  ``Range`` request if the connection drops (``http_get`` does this), into a
  temporary name next to its destination; then size and checksum are checked
  and the file is renamed into place. Nothing is fetched when a verified copy
  is already cached.

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

import hashlib
import os
import uuid
from pathlib import Path

from pyg_atompack.hub.errors import HubError, HubIntegrityError, HubTransferError
from pyg_atompack.hub.remote import RemoteFile, translate_errors

_HASH_CHUNK = 8 * 1024 * 1024
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


def _request_headers(token: str | bool | None, extra: dict[str, str] | None = None) -> dict:
    from huggingface_hub.utils import build_hf_headers

    from pyg_atompack import __version__

    headers = build_hf_headers(
        token=token, library_name="pyg_atompack", library_version=__version__, headers=extra
    )
    # Compressed transfer encodings would make byte offsets and sizes meaningless.
    headers["Accept-Encoding"] = "identity"
    return headers


def _parse_content_range(value: str | None) -> tuple[int, int] | None:
    """``"bytes 10-19/100"`` -> ``(10, 19)``; ``None`` when absent or malformed."""
    if not value or not value.startswith("bytes "):
        return None
    span = value[len("bytes ") :].split("/", 1)[0]
    first, sep, last = span.partition("-")
    if not sep or not first.isdigit() or not last.isdigit():
        return None
    return int(first), int(last)


def fetch_range(
    remote_file: RemoteFile, start: int, length: int, *, token: str | bool | None = None
) -> bytes:
    """Read ``length`` bytes of a remote file starting at byte ``start``.

    Args:
        remote_file: A file from :func:`list_remote_files`.
        start: First byte offset (``>= 0``).
        length: Number of bytes (``>= 0``); ``start + length`` must not exceed
            ``remote_file.size``.
        token: Hub token; ``None`` uses the locally saved token, ``False`` none.

    Returns:
        Exactly ``length`` bytes.

    Raises:
        ValueError: The range is negative or extends past the end of the file.
        HubTransferError: The request failed or the server answered with a
            different range.
    """
    from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff

    start, length = int(start), int(length)
    if start < 0 or length < 0:
        raise ValueError(f"{remote_file.describe()}: negative range start={start} length={length}")
    if start + length > remote_file.size:
        raise ValueError(
            f"{remote_file.describe()}: range [{start}, {start + length}) exceeds the file "
            f"size {remote_file.size}"
        )
    if length == 0:
        return b""
    last = start + length - 1
    headers = _request_headers(token, {"Range": f"bytes={start}-{last}"})
    where = remote_file.describe()
    with (
        translate_errors(remote_file.repo_id, remote_file.revision, remote_file.path),
        http_stream_backoff("GET", remote_file.url, headers=headers) as response,
    ):
            hf_raise_for_status(response)
            if response.status_code == 206:
                span = _parse_content_range(response.headers.get("Content-Range"))
                if span is not None and span[0] != start:
                    raise HubTransferError(
                        f"{where}: asked for bytes {start}-{last}, server sent "
                        f"{response.headers.get('Content-Range')!r}"
                    )
                data = response.read()
            elif response.status_code == 200:
                data = _prefix_of_stream(response, start + length)[start:]
            else:
                raise HubTransferError(
                    f"{where}: unexpected HTTP {response.status_code} for a range request"
                )
    if len(data) != length:
        raise HubTransferError(
            f"{where}: range [{start}, {start + length}) returned {len(data)} bytes"
        )
    return data


def fetch_bytes(
    remote_file: RemoteFile, *, token: str | bool | None = None, verify: bool = True
) -> bytes:
    """Fetch a whole remote file into memory, checked against the listing.

    Meant for streaming consumers that decode a shard from memory and drop it
    (nothing is written to disk). One ``GET`` of the file URL.

    Args:
        remote_file: A file from :func:`list_remote_files`.
        token: Hub token; ``None`` uses the locally saved token, ``False`` none.
        verify: Check the sha256 (LFS files) or git blob id (plain files); the
            size is always checked. (default: ``True``)

    Returns:
        The file's bytes.

    Raises:
        HubIntegrityError: Size or checksum differs from the listing.
        HubTransferError: The transfer failed.
    """
    from huggingface_hub.utils import hf_raise_for_status, http_backoff

    with translate_errors(remote_file.repo_id, remote_file.revision, remote_file.path):
        response = http_backoff("GET", remote_file.url, headers=_request_headers(token))
        hf_raise_for_status(response)
        data = response.content
    check_bytes(remote_file, data, verify=verify)
    return data


def check_bytes(remote_file: RemoteFile, data: bytes, *, verify: bool = True) -> None:
    """Raise :class:`HubIntegrityError` unless ``data`` matches the listing of ``remote_file``.

    Args:
        remote_file: The listed file.
        data: Its supposed content.
        verify: Also compare hashes, not only the size. (default: ``True``)
    """
    if len(data) != remote_file.size:
        raise HubIntegrityError(
            f"{remote_file.describe()}: received {len(data)} bytes, the listing says "
            f"{remote_file.size}"
        )
    if not verify:
        return
    if remote_file.sha256:
        got = hashlib.sha256(data).hexdigest()
        if got != remote_file.sha256.lower():
            raise HubIntegrityError(
                f"{remote_file.describe()}: sha256 mismatch: expected {remote_file.sha256}, "
                f"received bytes hash to {got}"
            )
    elif remote_file.blob_id:
        got = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
        if got != remote_file.blob_id.lower():
            raise HubIntegrityError(
                f"{remote_file.describe()}: git blob id mismatch: expected "
                f"{remote_file.blob_id}, received bytes hash to {got}"
            )


def _prefix_of_stream(response, n_bytes: int) -> bytes:
    """The first ``n_bytes`` of a streamed body, without reading the rest."""
    chunks, total = [], 0
    for chunk in response.iter_bytes(chunk_size=1 << 16):
        chunks.append(chunk)
        total += len(chunk)
        if total >= n_bytes:
            break
    return b"".join(chunks)[:n_bytes]


def repo_cache_folder(cache_dir: str | os.PathLike | None, repo_id: str, repo_type: str) -> Path:
    """The cache folder of one repository: ``{cache_dir}/{repo_type}s--{owner}--{name}``.

    Args:
        cache_dir: Cache root (default: :func:`default_cache_dir`).
        repo_id: ``owner/name`` (``""`` for files not listed from a repository).
        repo_type: ``"dataset"``, ``"model"`` or ``"space"``.

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
        remote_file: A file from :func:`list_remote_files`.
        cache_dir: Cache root (default: :func:`default_cache_dir`).
        verified: The location of a checksum-verified copy (content-addressed)
            rather than of an unverified one.

    Returns:
        The path.
    """
    folder = repo_cache_folder(cache_dir, remote_file.repo_id, remote_file.repo_type)
    if verified and remote_file.sha256:
        return folder / "blobs" / remote_file.sha256
    if verified and remote_file.blob_id:
        return folder / "blobs" / f"git-{remote_file.blob_id}"
    return folder / "unverified" / remote_file.revision / remote_file.path


def _file_digests(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a local file, in one read."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def _check_integrity(remote_file: RemoteFile, path: Path, *, verify: bool) -> None:
    size = path.stat().st_size
    if size != remote_file.size:
        raise HubIntegrityError(
            f"{remote_file.describe()}: downloaded {size} bytes, the listing says "
            f"{remote_file.size}"
        )
    if not verify or not (remote_file.sha256 or remote_file.blob_id):
        return
    sha256, git_sha1 = _file_digests(path)
    if remote_file.sha256 and sha256 != remote_file.sha256.lower():
        raise HubIntegrityError(
            f"{remote_file.describe()}: sha256 mismatch: expected {remote_file.sha256}, "
            f"downloaded bytes hash to {sha256}"
        )
    if not remote_file.sha256 and git_sha1 != remote_file.blob_id.lower():
        raise HubIntegrityError(
            f"{remote_file.describe()}: git blob id mismatch: expected {remote_file.blob_id}, "
            f"downloaded bytes hash to {git_sha1}"
        )


def download(
    remote_file: RemoteFile,
    cache_dir: str | os.PathLike | None = None,
    *,
    token: str | bool | None = None,
    verify: bool = True,
) -> Path:
    """Download a remote file into the cache, verified, and return its local path.

    Safe to call from several processes at once (DataLoader workers): a file
    lock next to the destination makes one process download while the others
    wait and then reuse the result.

    Args:
        remote_file: A file from :func:`list_remote_files`.
        cache_dir: Cache root (default: :func:`default_cache_dir`).
        token: Hub token; ``None`` uses the locally saved token, ``False`` none.
        verify: Check the sha256 (LFS files) or git blob id (plain files)
            against the listing. The size is always checked. (default: ``True``)

    Returns:
        Path of the local copy (treat it as read-only; it may be shared).

    Raises:
        HubIntegrityError: Size or checksum differs from the listing; nothing
            is left in the cache.
        HubTransferError: The transfer failed.
    """
    from filelock import FileLock

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
            _stream_to(remote_file, temp, token=token)
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


def _stream_to(remote_file: RemoteFile, temp: Path, *, token: str | bool | None) -> None:
    from huggingface_hub.file_download import http_get

    headers = _request_headers(token)
    with (
        translate_errors(remote_file.repo_id, remote_file.revision, remote_file.path),
        open(temp, "wb") as handle,
    ):
            try:
                http_get(
                    remote_file.url,
                    handle,
                    headers=headers,
                    expected_size=remote_file.size,
                    displayed_filename=remote_file.path.rpartition("/")[2] or None,
                )
            except HubError:
                raise
            except OSError as exc:
                if "Consistency check failed" in str(exc):
                    raise HubIntegrityError(
                        f"{remote_file.describe()}: transfer ended with a size different from "
                        f"the listing's {remote_file.size} bytes"
                    ) from exc
                raise
