"""A size-bounded disk cache of file pages, shared by the processes of one machine.

Random reads of a remote file (``AtompackDataset`` over a URL) go through
:class:`BlockCache`: the file is cut into aligned pages of ``page_bytes``; a read of any
byte ranges loads the pages covering them from ``{directory}/{file key}/`` and fetches
the missing ones, runs of adjacent missing pages as one range request each (at most
``max_request_bytes``), several requests at once. So nearby records cost one request,
and a warm cache costs none.

Why hand-written: the cache must be keyed by content identity and page, bounded in
bytes across processes, verify its entries, and evict least recently used pages while
other processes read; fsspec's block caches are per process and unbounded on disk,
and a general key-value store (diskcache, sqlite) would add a dependency and a
database file for what is a directory of immutable files.

Concurrency rules (DataLoader workers, ranks on one node):

* a page file is written under a temporary name and renamed into place, so readers see
  a whole page or none;
* every insertion takes one file lock (``{directory}/.lock``), measures the directory,
  evicts the pages with the oldest modification time until the new pages fit, then
  renames them in: the total never exceeds ``cache_bytes``;
* a hit refreshes the page's modification time (the LRU clock); a page evicted between
  listing and reading is simply a miss;
* each page file ends with the CRC-32 of its bytes: a damaged page is deleted and
  fetched again;
* every path written (the folder, the lock, temporary and page files) is checked to stay
  inside the cache root after resolving symlinks (:mod:`pyg_atompack.remote.cache`);
* a read-only cache (a shared, pre-filled one) serves its pages without writing: the LRU
  clock is not moved, and missing pages are fetched into memory and not stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.remote.ranges import RangeReader, read_range

if TYPE_CHECKING:
    from pyg_atompack.transport.http import Cancel

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_PAGE_BYTES", "BlockCache"]

#: Default bound on the cache directory.
DEFAULT_CACHE_BYTES = 8 << 30
#: Default page size (the unit fetched for a random record).
DEFAULT_PAGE_BYTES = 256 << 10
_CRC = struct.Struct("<I")
_SUFFIX = ".page"


class BlockCache:
    """Pages of remote files on local disk, bounded by ``cache_bytes``.

    Args:
        directory (str | os.PathLike): The cache directory (shared by every process using it).
        cache_bytes (int, optional): Largest total size of the page files. ``0`` stores nothing
            (every read is fetched). (default: 8 GiB)
        page_bytes (int, optional): Page size. (default: 256 KiB)
        max_request_bytes (int, optional): Largest range request for a run of missing pages.
            (default: 16 MiB)
        workers (int, optional): Range requests in flight. (default: :obj:`8`)
        root (str | os.PathLike, optional): The cache root every written path must stay inside
            once symlinks are resolved. (default: :obj:`directory`)
    """

    def __init__(self, directory: str | os.PathLike, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 *, page_bytes: int = DEFAULT_PAGE_BYTES, max_request_bytes: int = 16 << 20,
                 workers: int = 8, root: str | os.PathLike | None = None) -> None:
        if cache_bytes < 0 or page_bytes < 1 or max_request_bytes < page_bytes:
            raise ValueError("need cache_bytes >= 0 and max_request_bytes >= page_bytes >= 1")
        self.directory = Path(directory)
        self.root = Path(root) if root is not None else self.directory
        self.cache_bytes = int(cache_bytes)
        self.page_bytes = int(page_bytes)
        self.max_request_bytes = int(max_request_bytes)
        self.workers = workers
        self.stats = {"hits": 0, "misses": 0, "requests": 0, "fetched_bytes": 0,
                      "damaged": 0, "evicted": 0}

    # ----------------------------------------------------------------- layout
    def _folder(self, reader: RangeReader) -> Path:
        key = hashlib.sha256(f"{reader.identity}|{reader.size}".encode()).hexdigest()[:40]
        return self.directory / key

    @staticmethod
    def _page_path(folder: Path, page: int) -> Path:
        return folder / f"{page:012d}{_SUFFIX}"

    def disk_bytes(self) -> int:
        """Total size of the page files now in the directory."""
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[int, int, Path]]:
        found = []
        if not self.directory.is_dir():
            return found
        for folder in os.scandir(self.directory):
            # never into a symlinked folder: eviction deletes what it finds
            if not folder.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(folder.path):
                if entry.name.endswith(_SUFFIX):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:  # evicted by another process meanwhile
                        continue
                    found.append((stat.st_mtime_ns, stat.st_size, Path(entry.path)))
        return found

    # ----------------------------------------------------------------- pages
    def _load(self, path: Path, length: int) -> bytes | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        body, crc = data[:-_CRC.size], data[-_CRC.size:]
        if len(data) != length + _CRC.size or _CRC.unpack(crc)[0] != zlib.crc32(body):
            self.stats["damaged"] += 1
            self._without_writes(path.unlink, missing_ok=True)  # damaged: fetched again
            return None
        self._without_writes(os.utime, path)  # the LRU clock
        return body

    @staticmethod
    def _without_writes(operation: Any, *args: Any, **kwargs: Any) -> None:
        # an LRU touch or a cleanup: a page evicted meanwhile, or a read-only cache (which
        # evicts nothing, so needs no clock), leaves it undone
        try:
            operation(*args, **kwargs)
        except OSError as error:
            if not (isinstance(error, FileNotFoundError) or remote_cache.read_only(error)):
                raise

    def _page_length(self, reader: RangeReader, page: int) -> int:
        return min(self.page_bytes, reader.size - page * self.page_bytes)

    def _fetch_runs(self, reader: RangeReader, missing: list[int],
                    cancel: Cancel | None) -> dict[int, bytes]:
        per_request = self.max_request_bytes // self.page_bytes
        runs: list[list[int]] = []
        for page in missing:
            if runs and page == runs[-1][-1] + 1 and len(runs[-1]) < per_request:
                runs[-1].append(page)
            else:
                runs.append([page])

        def fetch(run: list[int]) -> dict[int, bytes]:
            start = run[0] * self.page_bytes
            stop = min((run[-1] + 1) * self.page_bytes, reader.size)
            data = bytes(read_range(reader, start, stop, cancel))
            return {page: data[(page - run[0]) * self.page_bytes:
                               (page - run[0] + 1) * self.page_bytes] for page in run}

        got: dict[int, bytes] = {}
        if len(runs) == 1:
            got.update(fetch(runs[0]))
        else:
            with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(runs)))) as pool:
                for pages in pool.map(fetch, runs):
                    got.update(pages)
        self.stats["requests"] += len(runs)
        self.stats["fetched_bytes"] += sum(len(v) for v in got.values())
        return got

    def _store(self, folder: Path, pages: dict[int, bytes]) -> None:
        if not self.cache_bytes or not pages:
            return
        # a read-only cache: the pages were fetched and are served from memory, unstored
        with contextlib.suppress(remote_cache.CacheReadOnlyError):
            self._store_locked(folder, pages)

    def _store_locked(self, folder: Path, pages: dict[int, bytes]) -> None:
        remote_cache.make_folder(folder, self.root)
        with remote_cache.writes_to(self.directory), \
                remote_cache.file_lock(self.directory / ".lock", self.root):
            entries = self._entries()
            present = {path for _, _, path in entries}
            new = [(page, data) for page, data in sorted(pages.items())
                   if self._page_path(folder, page) not in present]
            total = sum(size for _, size, _ in entries)
            budget = self.cache_bytes
            # keep only what can fit at all (the first pages of this read)
            kept, need = [], 0
            for page, data in new:
                if need + len(data) + _CRC.size > budget:
                    break
                kept.append((page, data))
                need += len(data) + _CRC.size
            if total + need > budget:
                for _, size, path in sorted(entries):  # oldest first
                    path.unlink(missing_ok=True)
                    self.stats["evicted"] += 1
                    total -= size
                    if total + need <= budget:
                        break
            for page, data in kept:
                body = data + _CRC.pack(zlib.crc32(data))
                remote_cache.write_atomically(self._page_path(folder, page), self.root,
                                              lambda temp, body=body: temp.write_bytes(body))

    # ----------------------------------------------------------------- reads
    def pages(self, reader: RangeReader, ranges: Sequence[tuple[int, int]],
              cancel: Cancel | None = None) -> dict[int, bytes]:
        """The pages covering ``ranges`` of ``reader``'s file, from disk or fetched.

        Args:
            reader (RangeReader): The file.
            ranges (Sequence[tuple[int, int]]): ``(start, stop)`` byte ranges.
            cancel (Cancel, optional): Stops the fetches when cancelled.
                (default: :obj:`None`)

        Returns:
            ``page number -> bytes``.
        """
        wanted: set[int] = set()
        for start, stop in ranges:
            if stop > start:
                wanted.update(range(start // self.page_bytes, (stop - 1) // self.page_bytes + 1))
        folder = self._folder(reader)
        got: dict[int, bytes] = {}
        missing = []
        for page in sorted(wanted):
            data = self._load(self._page_path(folder, page), self._page_length(reader, page)) \
                if self.cache_bytes else None
            if data is None:
                missing.append(page)
            else:
                got[page] = data
        self.stats["hits"] += len(got)
        self.stats["misses"] += len(missing)
        if missing:
            fetched = self._fetch_runs(reader, missing, cancel)
            self._store(folder, fetched)
            got.update(fetched)
        return got

    def read(self, reader: RangeReader, ranges: Sequence[tuple[int, int]],
             cancel: Cancel | None = None) -> list[bytes]:
        """The bytes of each range of ``reader``'s file (see :meth:`pages`).

        Args:
            reader (RangeReader): The file.
            ranges (Sequence[tuple[int, int]]): ``(start, stop)`` byte ranges.
            cancel (Cancel, optional): Stops the fetches when cancelled.
                (default: :obj:`None`)

        Returns:
            One ``bytes`` per range.
        """
        return slice_pages(self.pages(reader, ranges, cancel), self.page_bytes, ranges)


def slice_pages(pages: dict[int, bytes], page_bytes: int,
                ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Cut byte ranges out of a set of pages that covers them.

    Args:
        pages (dict[int, bytes]): ``page number -> bytes``.
        page_bytes (int): Page size.
        ranges (Sequence[tuple[int, int]]): ``(start, stop)`` byte ranges.

    Returns:
        One ``bytes`` per range.
    """
    out = []
    for start, stop in ranges:
        first, last = start // page_bytes, (stop - 1) // page_bytes
        if first == last:
            base = first * page_bytes
            out.append(pages[first][start - base:stop - base])
            continue
        parts = [pages[first][start - first * page_bytes:]]
        parts.extend(pages[p] for p in range(first + 1, last))
        parts.append(pages[last][:stop - last * page_bytes])
        out.append(b"".join(parts))
    return out
