"""Byte-range reads of one remote (or local) file: the one seam every block read goes through.

Everything that reads *parts* of a file (the `.atp` metadata cache, record blocks in
:class:`~pyg_atompack.stream.ShardStreamDataset`, the disk block cache behind remote
:class:`~pyg_atompack.data.AtompackDataset`) needs only the small :class:`RangeReader`
protocol: a size, a content identity and ``read_into(start, out)``. The adapters here
wrap the transport's range reads:

* :class:`FileRangeReader`: a local file (``os.preadv``);
* :class:`URLRangeReader`: a plain HTTP(S) URL, through the resumable ranged transfer of
  :mod:`pyg_atompack.transport.transfers` (a connection dropped mid-range resumes at the first
  missing byte, under the source's retry policy), pinned to the server's ``ETag`` /
  ``Last-Modified``;
* :class:`BackendRangeReader`: any listed file through its backend's ``read_into``: an
  object-store object (a ranged ``GET`` pinned to the listed ETag / generation, resumed
  after a dropped connection under the store's retry policy; picklable without secrets
  and fork-safe, the store making its client in each process), a Hub file, the files of
  schemes other packages register.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pyg_atompack.transport.http import Cancel

__all__ = ["BackendRangeReader", "FileRangeReader", "RangeAdapter", "RangeReader",
           "URLRangeReader", "read_range"]


@runtime_checkable
class RangeReader(Protocol):
    """What a block read needs from a file.

    Attributes:
        name: How messages name the file (a path, or a URL without any secret).
        size: The file's length in bytes.
        identity: A string that changes whenever the content does (``sha256:<hex>``
            when the listing knows the hash, else location + size (+ mtime); remote
            files add the server's version: ETag, generation or Last-Modified); caches
            are keyed by it.
    """

    name: str
    size: int
    identity: str

    def read_into(self, start: int, out: memoryview, cancel: Cancel | None = None) -> None:
        """Fill ``out`` with the file's bytes ``[start, start + len(out))``.

        Args:
            start (int): First byte.
            out (memoryview): Writable buffer; its length is the number of bytes to read.
            cancel (Cancel, optional): Stops the read when cancelled (a
                :class:`~pyg_atompack.transport.http.Cancel`, e.g. a
                :class:`~pyg_atompack.stream.CancelToken`). (default: :obj:`None`)

        Raises:
            OSError: The bytes cannot be read (after the adapter's retries).
        """
        ...


def read_range(reader: RangeReader, start: int, stop: int,
               cancel: Cancel | None = None) -> bytearray:
    """The bytes ``[start, stop)`` of ``reader``'s file, in a new buffer.

    Args:
        reader (RangeReader): The file.
        start (int): First byte.
        stop (int): One past the last byte.
        cancel (Cancel, optional): Stops the read when cancelled. (default: :obj:`None`)

    Returns:
        The bytes.
    """
    out = bytearray(max(0, stop - start))
    if out:
        reader.read_into(start, memoryview(out), cancel)
    return out


class RangeAdapter:
    """What every adapter shares: the one ``read_into`` (bounds check, then the read).

    Subclasses set ``name``, ``size`` and ``identity`` and implement ``_read``.
    """

    name: str
    size: int
    identity: str

    def read_into(self, start: int, out: memoryview, cancel: Cancel | None = None) -> None:
        """Fill ``out`` with the file's bytes ``[start, start + len(out))``.

        Args:
            start (int): First byte of the file to read.
            out (memoryview): Writable buffer; its length is the number of bytes read.
            cancel (Cancel, optional): Stops a remote transfer in flight, and any
                backoff wait, when cancelled. (default: :obj:`None`)

        Raises:
            RemoteRangeError: The range lies outside the file (names it).
            OSError: The bytes cannot be read: a short local file, or for remote files a
                :class:`~pyg_atompack.transport.TransportError` after the retries
                (names the URL; an object changed since it was listed is a
                :class:`~pyg_atompack.transport.RemoteIntegrityError`).
        """
        from pyg_atompack.transport.errors import RemoteRangeError

        if not len(out):
            return
        if start < 0 or start + len(out) > self.size:
            raise RemoteRangeError(f"{self.name}: range [{start}, {start + len(out)}) outside "
                                   f"the {self.size}-byte file", url=self.name)
        self._read(start, out, cancel)

    def _read(self, start: int, out: memoryview, cancel: Cancel | None) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, size={self.size})"


class FileRangeReader(RangeAdapter):
    """Range reads of a local file.

    Args:
        path (str | os.PathLike): The file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.name = self.path
        stat = os.stat(self.path)
        self.size = stat.st_size
        self.identity = f"file:{os.path.realpath(self.path)}|{stat.st_size}|{stat.st_mtime_ns}"

    def _read(self, start: int, out: memoryview, cancel: Cancel | None) -> None:
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            while done < len(out):
                got = os.preadv(fd, [out[done:]], start + done)
                if got <= 0:
                    raise OSError(f"{self.name}: short read at byte {start + done} "
                                  f"(file shorter than {self.size} bytes?)")
                done += got
        finally:
            os.close(fd)


class URLRangeReader(RangeAdapter):
    """Range reads of a file served over HTTP(S), pinned to one version of it.

    The version is the server's validator (``ETag``, else ``Last-Modified``): ``probe``'s
    when given, else the answer to the first read's, else (the identity asked for before
    any read) a one-byte range request's. It is part of the identity, so cached metadata
    and pages follow a file rewritten under the same URL even when a manifest's sha256 is
    stale, and every read refuses an answer from another version (a
    :class:`~pyg_atompack.transport.RemoteIntegrityError`), as
    :class:`BackendRangeReader` does with an object's listed ETag.

    Args:
        url (str): The file's URL.
        size (int): Its length (from a listing or manifest).
        sha256 (str, optional): Its hex sha256 when known. (default: :obj:`None`)
        headers (RequestHeaders | dict, optional): Request headers; credentials must come
            bound to their origin (:func:`~pyg_atompack.transport.bind_headers`), never part
            of messages. (default: :obj:`None`)
        retry (RetryPolicy, optional): Retries and timeouts.
            (default: :class:`~pyg_atompack.transport.RetryPolicy` ``()``)
        name (str, optional): How messages name it. (default: the URL)
        probe (Probe, optional): What a :func:`~pyg_atompack.transport.transfers.probe` of
            the URL already told (size and validator). (default: :obj:`None`: probe
            when needed)
    """

    def __init__(self, url: str, *, size: int, sha256: str | None = None,
                 headers: Any = None, retry: Any = None,
                 name: str | None = None, probe: Any = None) -> None:
        from pyg_atompack.transport.credentials import request_headers

        self.url = url
        self.size = int(size)
        self.sha256 = sha256
        self.headers = request_headers(headers)
        self.retry = retry
        self.name = name or url
        self._probe = probe

    @property
    def validator(self) -> str | None:
        """The server's ``ETag`` / ``Last-Modified`` of the file (:obj:`None`: it sends
        neither); the first use asks the server."""
        if self._probe is None:
            from pyg_atompack.transport import transfers
            from pyg_atompack.transport.errors import RemoteIntegrityError
            from pyg_atompack.transport.retry import RetryPolicy

            found = transfers.probe(self.url, policy=self.retry or RetryPolicy(),
                                         headers=self.headers)
            if found.size is not None and found.size != self.size:
                raise RemoteIntegrityError(f"{self.name}: the server has {found.size} bytes, "
                                           f"the listing says {self.size}", url=self.name)
            self._probe = found
        return self._probe.validator

    @property
    def identity(self) -> str:
        """``sha256:<hex>`` (else URL and size), plus the server's validator."""
        base = f"sha256:{self.sha256.lower()}" if self.sha256 else f"url:{self.url}|{self.size}"
        validator = self.validator
        return f"{base}|{validator}" if validator else base

    def _read(self, start: int, out: memoryview, cancel: Cancel | None) -> None:
        from pyg_atompack.transport import transfers
        from pyg_atompack.transport.buffers import RangeIgnoredError, ShardPart
        from pyg_atompack.transport.http import NEVER
        from pyg_atompack.transport.retry import RetryPolicy

        known = self._probe
        pin = transfers.VersionPin(known.validator if known is not None else None)
        policy, cancel = self.retry or RetryPolicy(), cancel or NEVER
        # a part based at ``start`` lands byte ``start`` at out[0] and resumes a dropped
        # connection at the first byte not yet received
        part = ShardPart(out, start, start + len(out), base=start)
        try:
            transfers.fill(self.url, part, policy=policy, cancel=cancel,
                                headers=self.headers, pin=pin)
        except RangeIgnoredError:
            # a server that ignores ranges (its answer was checked against the pin): the
            # bytes wanted are read off the front of its whole body
            out[:] = transfers.fetch_range(self.url, start, len(out), policy=policy,
                                                cancel=cancel, headers=self.headers)
        if known is None:
            # the first read's answer names the version: later reads and the identity are
            # pinned to it without a probe of their own (opening a listing reads each
            # header this way, one request per shard; the caches ask the identity, so
            # probe, before their first read)
            self._probe = transfers.Probe(self.size, pin.version)


class BackendRangeReader(RangeAdapter):
    """Range reads of a listed file through its backend's ``read_into``.

    Picklable with its backend. The identity is the listed sha256, else the git blob id,
    else the URL and size, plus the listed version (ETag, generation) of a file outside
    the Hub: caches then follow an object rewritten under its name even when a
    manifest's sha256 is stale. (A Hub file's version is its commit, whose content its
    hashes name already.)

    Args:
        backend (Any): The :mod:`~pyg_atompack.remote.backends` backend that listed ``file``.
        file (RemoteFile): The listed :class:`~pyg_atompack.remote.RemoteFile`.
    """

    def __init__(self, backend: Any, file: Any) -> None:
        self.backend = backend
        self.file = file
        self.name = file.describe()
        self.size = int(file.size)
        if file.sha256:
            identity = f"sha256:{file.sha256.lower()}"
        elif file.blob_id:
            identity = f"git:{file.blob_id}"
        else:
            identity = f"url:{file.url}|{self.size}"
        pinned = file.version is not None and not file.repo
        self.identity = f"{identity}|version:{file.version}" if pinned else identity

    def _read(self, start: int, out: memoryview, cancel: Cancel | None) -> None:
        self.backend.read_into(self.file, out, start, cancel)
