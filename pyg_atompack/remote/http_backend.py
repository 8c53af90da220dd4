"""The local files' and the ``http(s)`` backends (:mod:`pyg_atompack.remote.backends`).

:class:`HTTPBackend` is the one lister of http(s) URLs: a ``.pt`` / ``.atp`` file (its size
and version from a one-byte range request), a ``manifest.json`` written by the converter
(names relative to it, or absolute URLs; sizes, sha256 and record counts), a directory
ending in ``/`` (its ``manifest.json``) or a list of file URLs. Credentials given in
``headers`` are bound to the origins of the URLs given here, never to what a manifest
names. :class:`FileBackend` lists a local directory or glob the same way.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from pyg_atompack.remote.files import SHARD_SUFFIXES, Backend, RemoteFile
from pyg_atompack.remote.manifest import MANIFEST_NAME, read_manifest_records
from pyg_atompack.transport.errors import (
    RemoteNotFoundError,
    TransportError,
    UnsupportedURLError,
)
from pyg_atompack.transport.redact import redact_url

__all__ = ["FileBackend", "HTTPBackend"]


def _kept(name: str, suffixes: Sequence[str] | None) -> bool:
    # a manifest name may be an absolute URL: its path decides
    return suffixes is None or unquote(urlsplit(name).path).endswith(tuple(suffixes))


def _atp_record_count(path: Path) -> int | None:
    # the header and index only; a file the format layer cannot open fails loudly later,
    # when it is read, so here its count just stays unknown
    try:
        from pyg_atompack import atp

        with atp.open(str(path)) as reader:
            return len(reader)
    except Exception:  # noqa: BLE001 - counting is an optimisation, never an error
        return None


class FileBackend(Backend):
    """Local files: a directory (its ``.pt`` / ``.atp`` files, sorted), a glob or one file.

    Record counts come from a ``manifest.json`` next to the files, else from the index of
    ``.atp`` files.

    Args:
        url (str): A local path.
        checksums (bool, optional): Compute each file's sha256 while listing (reads every
            file once). (default: :obj:`False`; sizes are always verified)
        retry (Any, optional): Unused; accepted like every backend's. (default: :obj:`None`)
    """

    def __init__(self, url: str, *, checksums: bool = False, retry: Any = None) -> None:
        super().__init__(url, retry=retry)
        self.checksums = checksums

    def list(self, suffixes: Sequence[str] | None = SHARD_SUFFIXES) -> list[RemoteFile]:
        """The local files ``url`` names, sorted by path (see the class docstring).

        Raises:
            RemoteNotFoundError: Nothing matches.
        """
        pattern = self.url
        root = Path(pattern)
        if root.is_dir():
            paths = sorted(p for p in root.iterdir() if p.is_file() and _kept(p.name, suffixes))
            folder = root
        else:
            paths = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
            folder = paths[0].parent if paths else root.parent
        if not paths:
            raise RemoteNotFoundError(f"no .pt or .atp shards found at {pattern!r}", url=pattern)
        manifest = folder / MANIFEST_NAME
        self.manifest = {}
        if manifest.is_file():
            with open(manifest, encoding="utf-8") as handle:
                self.manifest = read_manifest_records(json.load(handle), str(manifest))
        files = []
        for path in paths:
            entry = self.manifest.setdefault(path.name, {})
            if entry.get("records") is None and path.suffix == ".atp":
                entry["records"] = _atp_record_count(path)
            digest = entry.get("sha256")
            if self.checksums:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            files.append(RemoteFile(path.name, size=path.stat().st_size, sha256=digest,
                                    url=str(path)))
        return files

    def read_into(self, file: RemoteFile, out: memoryview, start: int, cancel: Any = None,
                  progress: Callable[[int], None] | None = None, pin: Any = None) -> None:
        """Bytes ``[start, start + len(out))`` of a local file, in 1 MiB reads.

        Raises:
            OSError: The file cannot be read or is shorter (names it).
            StreamCancelled: ``cancel`` was cancelled meanwhile.
        """
        fd = os.open(file.url, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            while done < len(out):
                if cancel is not None:
                    cancel.raise_if_cancelled()
                got = os.preadv(fd, [out[done:done + (1 << 20)]], start + done)
                if got <= 0:
                    raise OSError(f"{file.url}: short read at byte {start + done}")
                done += got
                if progress is not None:
                    progress(start + done)
        finally:
            os.close(fd)

    def download(self, file: RemoteFile, cache_dir: str | os.PathLike | None = None, *,
                 verify: bool = True) -> Path:
        """The local file itself: nothing is copied."""
        return Path(file.url)

    def range_reader(self, file: RemoteFile) -> Any:
        """A :class:`~pyg_atompack.remote.ranges.FileRangeReader` of the file."""
        from pyg_atompack.remote.ranges import FileRangeReader

        return FileRangeReader(file.url)


def _name_from_url(url: str) -> str:
    return unquote(posixpath.basename(urlsplit(url).path)) or url


class HTTPBackend(Backend):
    """Files served over HTTP(S) (see the module docstring).

    Args:
        url (str | Sequence[str]): A file, a ``manifest.json``, a directory ending in
            ``/`` or a list of file URLs.
        headers (Mapping[str, str], optional): Request headers, e.g. ``{"Authorization":
            ...}``: bound to the origins of ``url``. (default: :obj:`None`)
        retry (RetryPolicy, optional): Retries, timeouts and deadlines.
            (default: :class:`~pyg_atompack.transport.RetryPolicy` ``()``)
    """

    def __init__(self, url: str | Sequence[str], *, headers: Mapping[str, str] | None = None,
                 retry: Any = None) -> None:
        from pyg_atompack.transport.credentials import bind_headers

        super().__init__(url if isinstance(url, str) else "", retry=retry)
        self.urls = None if isinstance(url, str) else list(url)
        self.headers = bind_headers(headers, url)  # the user's URLs, not a manifest's

    def list(self, suffixes: Sequence[str] | None = SHARD_SUFFIXES) -> list[RemoteFile]:
        """The files the URL names; files listed without a size are asked for it (and
        their version) with a one-byte range request each, in parallel.

        Raises:
            UnsupportedURLError: The URL names no file, manifest or directory.
            ManifestError: The manifest is not valid JSON or has another shape.
            RemoteNameError: A manifest name or sha256 cannot safely name a file.
            RemoteNotFoundError: The manifest lists no file with the suffixes.
            TransportError: The server could not be read (after retries).
        """
        from pyg_atompack.remote.manifest import ManifestError
        from pyg_atompack.transport import transfers

        if self.urls is not None:
            if not self.urls:
                raise UnsupportedURLError("no URL given", url="")
            return self._sized([RemoteFile(_name_from_url(u), url=u) for u in self.urls])
        url, where = self.url, redact_url(self.url)
        path = unquote(urlsplit(url).path)
        name = posixpath.basename(path)
        if name.endswith(SHARD_SUFFIXES):
            return self._sized([RemoteFile(name, url=url)])
        if path.endswith("/"):
            url = urljoin(url, MANIFEST_NAME)
        elif not name.endswith(".json"):
            raise UnsupportedURLError(
                f"{where!r}: an http(s) URL must name a manifest.json, a directory ending in "
                f"'/' that holds one, or a .pt / .atp file", url=where)
        where = redact_url(url)
        body = transfers.fetch(url, policy=self.retry, headers=self.headers,
                               limit=transfers.DOCUMENT_LIMIT)
        try:
            document = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            raise ManifestError(f"{where}: manifest is not valid JSON: {error}",
                                url=where) from error
        self.manifest = read_manifest_records(document, url)  # names and sha256 checked
        files = [RemoteFile(name, size=entry.get("bytes"), sha256=entry.get("sha256"),
                            url=urljoin(url, name))
                 for name, entry in self.manifest.items() if _kept(name, suffixes)]
        if not files:
            raise RemoteNotFoundError(
                f"{where}: the manifest lists no {' or '.join(suffixes or ('',))} file "
                f"(expected a 'shards' list)", url=where)
        return self._sized(files)

    def _sized(self, files: list[RemoteFile]) -> list[RemoteFile]:
        """``files``, each listed without a size asked for it and its version."""
        from pyg_atompack.transport import transfers

        def ask(file: RemoteFile) -> RemoteFile:
            if file.size is not None:
                return file
            try:
                found = transfers.probe(file.url, policy=self.retry, headers=self.headers)
            except TransportError:
                # its read fails the same way later, where the caller decides what happens
                return file
            return replace(file, size=found.size, version=found.validator)

        if all(file.size is not None for file in files):
            return files
        with ThreadPoolExecutor(min(8, len(files))) as pool:
            return list(pool.map(ask, files))

    # what the Hub's backend (a subclass) changes: headers, errors, the version pinned
    def headers_for(self, file: RemoteFile) -> Any:
        """The request headers of ``file`` (credentials bound to their origins)."""
        return self.headers

    def errors(self, file: RemoteFile) -> Any:
        """Turns the transport's errors into this backend's (none here)."""
        return contextlib.nullcontext()

    def _pinned(self, file: RemoteFile) -> str | None:
        """The server's version the bytes must come from: the listed one."""
        return file.version

    def read_into(self, file: RemoteFile, out: memoryview, start: int = 0, cancel: Any = None,
                  progress: Callable[[int], None] | None = None, pin: Any = None) -> None:
        """One retried, resumed range request into ``out``, bounded by it and pinned to
        ``pin`` (a :class:`~pyg_atompack.transport.transfers.VersionPin`; default: the
        listed version when the listing named one).

        Raises:
            TransportError: The transfer failed (names the redacted URL).
            RangeIgnoredError: The server answered with the whole body.
        """
        from pyg_atompack.transport import transfers
        from pyg_atompack.transport.buffers import ShardPart
        from pyg_atompack.transport.http import NEVER

        if pin is None:
            pin = transfers.VersionPin(self._pinned(file))
        part = ShardPart(out, start, start + len(out), base=start, on_data=progress,
                         file_size=file.size)
        with self.errors(file):
            transfers.fill(file.url, part, policy=self.retry, cancel=cancel or NEVER,
                           headers=self.headers_for(file), pin=pin)

    def read_all(self, file: RemoteFile, cancel: Any = None) -> Any:
        """One plain ``GET`` of the whole file (resumed by range, bounded by the listed
        size, or by :data:`~pyg_atompack.transport.transfers.UNLISTED_LIMIT` when unknown)."""
        from pyg_atompack.transport import transfers
        from pyg_atompack.transport.http import NEVER

        with self.errors(file):
            return transfers.fetch(file.url, policy=self.retry,
                                   cancel=cancel or NEVER,
                                   headers=self.headers_for(file), size=file.size,
                                   limit=transfers.UNLISTED_LIMIT)

    def write_file(self, file: RemoteFile, path: Path) -> None:
        """One plain ``GET`` streamed into ``path``, pinned to the listed version and
        stopped at the first byte beyond the listed size."""
        from pyg_atompack.transport import transfers
        from pyg_atompack.transport.buffers import FileSink

        with self.errors(file), open(path, "wb") as handle:
            sink = FileSink(handle, limit=file.size)
            transfers.fill(file.url, sink, policy=self.retry, headers=self.headers_for(file),
                           validator=self._pinned(file))
            sink.flush()

    def version_of(self, file: RemoteFile) -> RemoteFile:
        """``file`` with the version its server names now (a one-byte range request)."""
        from pyg_atompack.transport import transfers

        if file.version is not None:
            return file
        with self.errors(file):
            found = transfers.probe(file.url, policy=self.retry, headers=self.headers_for(file))
        return replace(file, version=found.validator)

    def range_reader(self, file: RemoteFile) -> Any:
        """A :class:`~pyg_atompack.remote.ranges.URLRangeReader` pinned to the version."""
        from pyg_atompack.remote.ranges import URLRangeReader
        from pyg_atompack.transport.transfers import Probe

        known = Probe(file.size, file.version) if file.version else None
        return URLRangeReader(file.url, size=file.size, sha256=file.sha256,
                              headers=self.headers, retry=self.retry, name=file.describe(),
                              probe=known)

    def __repr__(self) -> str:
        where = redact_url(self.url) if self.urls is None else f"{len(self.urls)} URLs"
        return f"{type(self).__name__}({where!r})"
