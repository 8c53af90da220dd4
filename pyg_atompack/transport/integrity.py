"""The one integrity check of downloaded bytes: size, then sha256 (or the git blob id).

Listings announce what a file must be: its size always, its sha256 when they know it
(Hub LFS files, converter manifests, object-store metadata), or only the git blob id
(plain files in a Hub repository). Memory buffers and files on disk are checked by the
same rules, with the same wording.
"""

from __future__ import annotations

import hashlib
import os

_CHUNK = 8 << 20


def _digests(chunks, size: int, *, want_sha256: bool, want_blob: bool) -> tuple[str, str]:
    sha256 = hashlib.sha256() if want_sha256 else None
    blob = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False) if want_blob else None
    for chunk in chunks:
        if sha256 is not None:
            sha256.update(chunk)
        if blob is not None:
            blob.update(chunk)
    return (sha256.hexdigest() if sha256 else "", blob.hexdigest() if blob else "")


def _problem(size: int, chunks, *, expected_size: int | None, sha256: str | None,
             blob_id: str | None, verify: bool) -> str | None:
    if expected_size is not None and size != expected_size:
        return f"size {size} bytes, expected {expected_size}"
    if not verify or not (sha256 or blob_id):
        return None
    got_sha, got_blob = _digests(chunks(), size, want_sha256=bool(sha256),
                                 want_blob=not sha256 and bool(blob_id))
    if sha256:
        return None if got_sha == sha256.lower() else f"sha256 {got_sha}, expected {sha256}"
    return None if got_blob == blob_id.lower() else f"git blob id {got_blob}, expected {blob_id}"


def bytes_problem(data: bytes | memoryview, *, size: int | None, sha256: str | None = None,
                  blob_id: str | None = None, verify: bool = True) -> str | None:
    """What is wrong with ``data`` given what its listing announced, or ``None``.

    Args:
        data (bytes | memoryview): The received bytes (any buffer).
        size (int | None): The announced size, or ``None`` when unknown.
        sha256 (str, optional): The announced hex sha256, or ``None``. (default: :obj:`None`)
        blob_id (str, optional): The announced git blob id, used when no sha256 is known.
            (default: :obj:`None`)
        verify (bool, optional): Also compare the hash, not only the size. (default: :obj:`True`)

    Returns:
        A short description of the first mismatch (``"size 11 bytes, expected 12"``,
        ``"sha256 ..., expected ..."``), or :obj:`None`.
    """
    view = memoryview(data)
    return _problem(len(view), lambda: (view,), expected_size=size, sha256=sha256,
                    blob_id=blob_id, verify=verify)


def file_problem(path: str | os.PathLike, *, size: int | None, sha256: str | None = None,
                 blob_id: str | None = None, verify: bool = True) -> str | None:
    """:func:`bytes_problem` for a file on disk, read in 8 MiB chunks.

    Args:
        path (str | os.PathLike): The file.
        size (int | None): The announced size, or ``None``.
        sha256 (str, optional): The announced hex sha256, or ``None``. (default: :obj:`None`)
        blob_id (str, optional): The announced git blob id, used when no sha256 is known.
            (default: :obj:`None`)
        verify (bool, optional): Also compare the hash. (default: :obj:`True`)

    Returns:
        A short description of the first mismatch, or :obj:`None`.
    """
    def chunks():
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                yield chunk

    return _problem(os.stat(path).st_size, chunks, expected_size=size, sha256=sha256,
                    blob_id=blob_id, verify=verify)
