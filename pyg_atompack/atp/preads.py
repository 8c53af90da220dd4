"""Record bytes from the descriptor: a residency probe and concurrent positional reads.

Two jobs of the ``pread`` side of the read path (the mapped side lives in
``mapped.py`` / ``gather.py``):

* :func:`resident` tells whether a byte range of a mapping is in the page cache,
  with ``mincore(2)`` (not in Python's ``mmap`` module, hence ctypes; Linux and
  macOS have it). ``access="auto"`` asks it once per ``read_batch`` to choose
  between gathering from the mapping (resident: no system call per record) and
  reading with :func:`read_ranges` (not resident: a page fault per page would wait
  for the disk one after the other).
* :func:`read_ranges` reads many ranges with ``os.pread`` on a small thread pool
  (``os.pread`` releases the GIL, so the reads are in flight together: on storage
  that serves parallel requests -- NVMe, network filesystems -- a batch costs about
  one round trip instead of one per record). Adjacent ranges are merged into one
  read first, so a sequential scan issues few large reads. Where residency cannot
  be asked (``access="pread"``: no mapping), the first read is timed: a page-cache
  hit (microseconds) keeps the rest in the calling thread, where a hand-off to the
  pool would cost more than the reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import TruncatedFileError

# reads in flight at once; more threads than this buy little even on NVMe queues
MAX_WORKERS = 32
# fewer ranges than this are read in the calling thread (a hand-off costs ~20 us)
MIN_CONCURRENT = 4
# a read faster than this came from the page cache (hits take 1-5 us, disk reads >= 50 us)
CACHED_READ_SECONDS = 30e-6
_PAGE = mmap.PAGESIZE

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reset_after_fork() -> None:
    # a child inherits the pool object but not its threads
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def executor() -> ThreadPoolExecutor:
    """The process's pool of reader threads (made on first use, fresh after fork)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="atp-pread")
        return _pool


def _load_mincore() -> Callable | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    mincore.restype = ctypes.c_int
    return mincore


_mincore = _load_mincore()


def mapping_address(file_u8: np.ndarray) -> int | None:
    """Start address of a mapping seen as a uint8 array (None where mincore is missing)."""
    return file_u8.ctypes.data if _mincore is not None and len(file_u8) else None


def resident(address: int | None, offset: int, length: int) -> bool:
    """Whether every page of ``[offset, offset + length)`` of a mapping is in memory.

    Args:
        address (int | None): The mapping's start (:func:`mapping_address`); None means unknown.
        offset (int): First byte.
        length (int): Number of bytes (at least 1).

    Returns:
        True when resident or when residency cannot be asked.
    """
    if address is None:
        return True
    first = offset - offset % _PAGE
    pages = (offset + length - first + _PAGE - 1) // _PAGE
    vec = ctypes.create_string_buffer(pages)
    if _mincore(address + first, pages * _PAGE, vec) != 0:
        return True
    return all(b & 1 for b in vec.raw)


def _concurrently(read_run: Callable, runs: list) -> list:
    """``[read_run(r) for r in runs]`` on the pool, ``MAX_WORKERS`` reads in flight."""
    if len(runs) < 2:
        return [read_run(run) for run in runs]
    workers = min(MAX_WORKERS, len(runs))
    chunks = [runs[w::workers] for w in range(workers)]
    try:
        results = list(executor().map(lambda chunk: [read_run(r) for r in chunk], chunks))
    except RuntimeError as exc:  # the interpreter is shutting down: no new threads
        if "shutdown" not in str(exc):
            raise
        return [read_run(run) for run in runs]
    datas: list = [None] * len(runs)
    for w, chunk_data in enumerate(results):
        datas[w::workers] = chunk_data
    return datas


def read_ranges(fd: int, offsets: list[int], lengths: list[int], name: str,
                records: list[int], pread: Callable[[int, int, int], bytes] = os.pread,
                probe: bool = False) -> list[bytes]:
    """The bytes of every ``(offset, length)`` range, read concurrently.

    Args:
        fd (int): The open file.
        offsets (list[int]): First byte of each range.
        lengths (list[int]): Length of each range.
        name (str): File name for error messages.
        records (list[int]): Record index of each range (for error messages).
        pread (Callable[[int, int, int], bytes], optional): The read function (``os.pread``; tests
            substitute a slow one). (default: :obj:`os.pread`)
        probe (bool, optional): Residency is unknown: read the first range alone and go concurrent
            only if it was slower than a page-cache hit (:data:`CACHED_READ_SECONDS`).
            (default: :obj:`False`)

    Returns:
        One ``bytes`` per range, in order.

    Raises:
        TruncatedFileError: The file is shorter than its index says (file changed?).
    """
    count = len(offsets)
    if not count:
        return []
    # merge runs of adjacent ranges (sequential scans) into one read each
    runs: list[tuple[int, int, int, int]] = []  # (offset, length, first range, last + 1)
    start = 0
    for k in range(1, count + 1):
        if k == count or offsets[k] != offsets[k - 1] + lengths[k - 1]:
            end_byte = offsets[k - 1] + lengths[k - 1]
            runs.append((offsets[start], end_byte - offsets[start], start, k))
            start = k

    def read_run(run: tuple[int, int, int, int]) -> bytes:
        off, length, first, _ = run
        data = pread(fd, length, off)
        if len(data) != length:
            raise TruncatedFileError(f"{name}: record {records[first]}: short read at offset "
                                     f"{off} ({len(data)} of {length} bytes); file changed?")
        return data

    datas: list = []
    if probe and len(runs) >= MIN_CONCURRENT:
        # residency unknown (no mapping to ask): time the first read; a page-cache hit
        # takes microseconds, a disk or network read tens to thousands of them
        start = time.perf_counter()
        datas.append(read_run(runs[0]))
        if time.perf_counter() - start < CACHED_READ_SECONDS:
            datas += [read_run(run) for run in runs[1:]]
        else:
            datas += _concurrently(read_run, runs[1:])
    elif len(runs) < MIN_CONCURRENT:
        datas = [read_run(run) for run in runs]
    else:
        datas = _concurrently(read_run, runs)
    out: list[bytes] = []

    for (off, _, first, last), data in zip(runs, datas):
        if last - first == 1:
            out.append(data)
            continue
        for k in range(first, last):
            out.append(data[offsets[k] - off:offsets[k] - off + lengths[k]])
    return out
