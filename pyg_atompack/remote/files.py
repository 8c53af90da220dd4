"""``RemoteFile``, the one description of a listed file, and ``Backend``, what every
backend shares.

Every backend (:mod:`pyg_atompack.remote.backends`: local files, ``http(s)://``, the Hub,
object stores) lists files as :class:`RemoteFile`; the cache
(:func:`pyg_atompack.remote.cache.cached_path`), the range readers, the Hub reader and
the stream's :class:`~pyg_atompack.stream.ShardInfo` (which adds the record count)
take it. Small, immutable and picklable: it carries everything needed to read the file
again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SHARD_SUFFIXES", "Backend", "RemoteFile"]

#: What a listing keeps unless told otherwise.
SHARD_SUFFIXES = (".pt", ".atp")


@dataclass(frozen=True)
class RemoteFile:
    """One listed file.

    Attributes:
        name: The name the listing gave it: the path relative to the listed directory,
            prefix or manifest (for a Hub file, its path in the repository). Checked by
            :func:`~pyg_atompack.remote.cache.local_name` before it names a local path.
        size: Size in bytes, or ``None`` when the listing does not say.
        sha256: Hex sha256 of the content when the listing names it, else ``None``.
        version: What pins the content: the commit sha of a Hub file, the ETag (else
            ``"modified <Last-Modified>"``) of an http(s) file, the ETag or the GCS
            generation of an object; ``None`` when the listing names none.
        url: Where the bytes are read (a Hub file's pinned ``resolve`` URL, an object's
            ``s3://`` URL, a local path).
        blob_id: The git blob id of a plain (non-LFS) Hub file, which verifies it.
        repo: A Hub file's repository, ``"{repo_type}s/{owner}/{name}"``; ``""`` for the
            files of every other backend.
    """

    name: str
    size: int | None = None
    sha256: str | None = None
    version: str | None = None
    url: str = ""
    blob_id: str | None = None
    repo: str = ""

    def describe(self) -> str:
        """How messages name the file: ``hf://`` URI for a Hub file, else the redacted URL."""
        if self.repo:
            from urllib.parse import quote

            at = f"@{quote(self.version, safe='')}" if self.version else ""
            return f"hf://{self.repo}{at}/{self.name}"
        from pyg_atompack.transport.redact import redact_url

        return redact_url(self.url or self.name)


def _redacted(url: str) -> str:
    from pyg_atompack.transport.redact import redact_url

    return redact_url(url)


def _has_size(path: Path, size: int | None) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


class Backend:
    """What every backend shares; subclasses implement ``list``, ``read_into`` and
    ``range_reader`` (and ``download`` where files are not local).

    Args:
        url (str): The URL (or local path) the backend is opened for.
        retry (RetryPolicy, optional): Retries, timeouts and deadlines of every request.
            (default: :class:`~pyg_atompack.transport.RetryPolicy` ``()``)
    """

    def __init__(self, url: str, *, retry: Any = None) -> None:
        from pyg_atompack.transport.retry import RetryPolicy

        self.url = url
        self.retry = retry or RetryPolicy()
        #: The entries of the ``manifest.json`` the last :meth:`list` read.
        self.manifest: dict[str, dict] = {}

    def list(self, suffixes: Sequence[str] | None = SHARD_SUFFIXES) -> list[RemoteFile]:
        """The files the URL names (see the module docstring)."""
        raise NotImplementedError

    def with_retry(self, retry: Any) -> Any:
        """A copy of this backend with another retry policy."""
        import copy

        clone = copy.copy(self)
        clone.retry = retry
        return clone

    def read_into(self, file: RemoteFile, out: memoryview, start: int, cancel: Any = None,
                  progress: Callable[[int], None] | None = None, pin: Any = None) -> None:
        """Bytes ``[start, start + len(out))`` of ``file`` into ``out`` (module docstring)."""
        raise NotImplementedError

    def version_of(self, file: RemoteFile) -> RemoteFile:
        """``file`` with the version its server names now, where the listing named none
        (only http(s) asks: other listings always name one)."""
        return file

    def integrity_error(self, file: RemoteFile, problem: str) -> Exception:
        """The error for a copy of ``file`` that does not match its listing."""
        from pyg_atompack.transport.errors import RemoteIntegrityError

        return RemoteIntegrityError(f"{file.describe()}: {problem}", url=_redacted(file.url))

    def read_all(self, file: RemoteFile, cancel: Any = None) -> Any:
        """The whole file in a new buffer (an anonymous memory map of its listed size).

        Args:
            file (RemoteFile): A listed file.
            cancel (Cancel, optional): Stops the transfer. (default: :obj:`None`)

        Returns:
            The bytes, decoded in place by the stream.

        Raises:
            RemoteTooLargeError: The listed size cannot be held in memory.
            TransportError: The size is unknown, or the transfer failed.
        """
        from pyg_atompack.transport.buffers import allocate
        from pyg_atompack.transport.errors import RemoteTooLargeError, TransportError

        where = file.describe()
        if file.size is None:
            raise TransportError(f"{where}: the listing tells no size", url=where)
        try:
            buffer = allocate(file.size)
        except (OverflowError, MemoryError, ValueError, OSError) as error:
            raise RemoteTooLargeError(f"{where}: {file.size} bytes cannot be held in memory "
                                      f"({error})", url=where) from error
        if file.size:
            view = memoryview(buffer).cast("B")
            try:
                self.read_into(file, view, 0, cancel)
            finally:
                view.release()
        return buffer

    def write_file(self, file: RemoteFile, path: Path) -> None:
        """Write the whole of ``file`` into ``path`` (a temporary file of the cache)."""
        import mmap

        with open(path, "wb") as handle:
            handle.truncate(file.size)
        if file.size:
            with open(path, "r+b") as handle, mmap.mmap(handle.fileno(), file.size) as mapped:
                view = memoryview(mapped)
                try:
                    self.read_into(file, view, 0)
                finally:
                    view.release()

    def download(self, file: RemoteFile, cache_dir: str | os.PathLike | None = None, *,
                 verify: bool = True) -> Path:
        """A verified copy of ``file`` in the one cache, downloaded if needed.

        A cached copy is reused only at the listed version: by content with a sha256 (or
        a Hub git blob id), else by the version the listing (or, for http(s), the server
        now) names, and the download is pinned to it; a file whose server names no version
        is downloaded again every time. The bytes go to a temporary file beside the
        destination (bounded by the listed size), are checked against the listing and
        only then renamed into place; a hit writes nothing (a read-only cache serves it).
        A lock file makes concurrent processes download once.

        Args:
            file (RemoteFile): A listed file (with its size).
            cache_dir (str | os.PathLike, optional): The cache root.
                (default: :func:`~pyg_atompack.remote.cache.cache_root`)
            verify (bool, optional): Check the listed hash; the size is always checked.
                (default: :obj:`True`)

        Returns:
            The local path (read-only by convention: it may be shared).

        Raises:
            RemoteIntegrityError: The bytes differ from the listing (nothing is cached).
            RemoteNameError: A listed value cannot safely name a file.
            CacheReadOnlyError: Not cached, and the cache cannot be written.
            TransportError: The transfer failed.
        """
        from pyg_atompack.remote import cache
        from pyg_atompack.transport.integrity import file_problem

        root = cache.cache_root(cache_dir)
        hashed = bool(file.sha256 or file.blob_id)
        if not verify and hashed:  # a verified copy is as good as an unverified one
            copy = cache.check_inside(cache.cached_path(file, root), root, url=file.url)
            if _has_size(copy, file.size):
                return copy
        if not (verify and hashed):
            file = self.version_of(file)
        final = cache.cached_path(file, root, verified=verify and hashed)
        reusable = (verify and hashed) or file.version is not None

        def write(temp: Path) -> None:
            self.write_file(file, temp)
            problem = file_problem(temp, size=file.size, sha256=file.sha256,
                                   blob_id=file.blob_id, verify=verify)
            if problem is not None:
                raise self.integrity_error(file, problem)

        return cache.cached_file(final, root, write=write, url=file.url,
                                 complete=lambda path: reusable and _has_size(path, file.size))

    def range_reader(self, file: RemoteFile) -> Any:
        """The range reader of ``file``: reads through :meth:`read_into`."""
        from pyg_atompack.remote.ranges import BackendRangeReader

        return BackendRangeReader(self, file)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_redacted(self.url)!r})"
