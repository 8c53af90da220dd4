"""First touch of a batch's records through a fresh mapping, on two cores.

The first read of a record through a mapping is a page fault even when the file
is in the page cache: the kernel looks the page up and fills in page-table
entries (about 7 µs of kernel time per 64-atom record on the development VM,
``benchmarks/offcpu.py``), and that is most of what a batch costs on its first
touch. atompack-db spreads a batch over its thread pool, so its faults run on
every core; a gather of ours runs in one thread under the GIL.

:func:`spread` hands the faults of the second half of a batch's untouched records
to a pool thread, which asks the kernel to read one byte of each of their pages
with one ``process_vm_readv(2)`` on this process's own memory (a ctypes call:
the GIL is released for the whole call, so the kernel work runs on a second core
while the calling thread does the first half). The helper walks its
records from the last one back while the caller's gathers go forward, so they
meet rather than fault the same pages. Nothing waits for the helper: a page it has not
reached yet is simply faulted by the gather that reads it. On a busy machine (no
free core) the helper starts late and only competes with the caller for a core:
a helper that waited longer than :data:`LATE_START_SECONDS` to start makes the
next :data:`BACK_OFF` eligible batches fault in the calling thread alone. The
system call reads memory, it never raises a signal: a page beyond the end of a
shrunken file is an error return, not a ``SIGBUS``. No library does this (numpy
keeps the GIL for gathers of a few hundred elements), hence ctypes here; Linux
only, elsewhere :func:`spread` is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter

import numpy as np

from .preads import executor

# a pool thread that took longer than this to start found no free core (waking one
# takes ~50 us here); then the next BACK_OFF batches fault in the calling thread only
# (offcpu.py at load ~1.5: the hand-off cost batches of 128 / 256 up to 1.15x)
LATE_START_SECONDS = 300e-6
BACK_OFF = 32
# records not read through the mapping before, below which handing half of them off
# costs more than it saves (benchmarks/offcpu.py, wall clock of a fresh reader's batches:
# 32 records 1.5x slower with the hand-off, 64 records 1.09x slower, 128 1.08x faster,
# 256 1.13-1.19x faster)
MIN_RECORDS = 100
_IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux UIO_MAXIOV)
_PAGE_SHIFT = mmap.PAGESIZE.bit_length() - 1


def _load() -> Callable | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]
    readv.restype = ctypes.c_ssize_t
    return readv


_readv = _load()


def pages_of(offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Page numbers of every page of every ``[offset, offset + size)`` range, in order.

    Args:
        offsets (np.ndarray): First byte of each range (int64).
        sizes (np.ndarray): Length of each range (int64, at least 1).

    Returns:
        np.ndarray: The page numbers (int64), range by range.
    """
    first = offsets >> _PAGE_SHIFT
    last = (offsets + sizes - 1) >> _PAGE_SHIFT
    counts = last - first + 1
    if (counts == 1).all():
        return first
    steps = np.ones(int(counts.sum()), np.int64)
    starts = np.cumsum(counts) - counts
    steps[starts] = first - np.concatenate(([0], last[:-1]))
    return np.cumsum(steps)


class _Reads:
    """One ``process_vm_readv`` request: a byte of each page, into a scratch buffer.

    Built by the calling thread, so that the thread that runs it holds the GIL only
    for the call itself (the GIL is released inside it).

    Args:
        file_u8 (np.ndarray): The mapping as uint8 (held: the mapping stays alive
            while the request runs).
        pages (np.ndarray): Page numbers inside the mapping.
    """

    __slots__ = ("file_u8", "requests", "submitted", "started")

    def __init__(self, file_u8: np.ndarray, pages: np.ndarray) -> None:
        self.file_u8 = file_u8
        self.submitted = self.started = 0.0
        base = file_u8.ctypes.data
        self.requests = []
        for start in range(0, len(pages), _IOV_MAX):
            chunk = pages[start:start + _IOV_MAX]
            remote = np.empty((len(chunk), 2), np.uint64)
            remote[:, 0] = (chunk << _PAGE_SHIFT) + base
            remote[:, 1] = 1
            scratch = np.empty(len(chunk), np.uint8)
            local = np.array([[scratch.ctypes.data, len(chunk)]], np.uint64)
            self.requests.append((local, remote, scratch))

    def __call__(self) -> int:
        """Fault the pages in; returns the bytes read (the page count unless refused)."""
        self.started = perf_counter()
        pid = os.getpid()
        done = 0
        for local, remote, _ in self.requests:
            got = _readv(pid, local.ctypes.data, 1, remote.ctypes.data, len(remote), 0)
            if got <= 0:  # not permitted here, or the file shrank: the gathers will say
                break
            done += got
        return done


def touch(file_u8: np.ndarray, pages: np.ndarray) -> int:
    """Fault in ``pages`` of the mapping ``file_u8`` (one byte read from each).

    Args:
        file_u8 (np.ndarray): The mapping as uint8.
        pages (np.ndarray): Page numbers inside the mapping.

    Returns:
        int: Bytes read (the page count, unless the kernel refused).
    """
    if _readv is None or not len(pages):
        return 0
    return _Reads(file_u8, pages)()


def spread(st, idx: np.ndarray, entries: np.ndarray) -> Future | None:
    """Start faulting in the second half of a batch's untouched records on a pool thread.

    The pool thread walks its half from the last record back; the calling thread
    returns at once and faults the rest itself as its gathers read them.

    Args:
        st (FileState): The open file (mapped, uncompressed).
        idx (np.ndarray): The batch's record indices.
        entries (np.ndarray): Their index entries.

    Returns:
        Future | None: The pool thread's task, or :obj:`None` when there was
        nothing worth handing off (few untouched records, the previous task still
        running, or no ``process_vm_readv``).
    """
    cache = st.cache
    if _readv is None or len(idx) < MIN_RECORDS:
        return None
    if cache.helper is not None:
        if not cache.helper.done():
            return None
        last, cache.helper = cache.helper_reads, None
        if last.started - last.submitted > LATE_START_SECONDS:
            cache.helper_skip = BACK_OFF  # no core was free: the hand-off only cost
    if cache.helper_skip:
        cache.helper_skip -= 1
        return None
    new = cache.untouched(idx)
    if new is not None and len(new) < MIN_RECORDS:
        return None
    count = len(idx) if new is None else len(new)
    # the second half, last record first (the calling thread's gathers go forward)
    mine = np.arange(count - 1, count // 2 - 1, -1) if new is None else new[count // 2:][::-1]
    offsets = entries["offset"][mine].astype(np.int64)
    ends = offsets + np.maximum(entries["stored"][mine].astype(np.int64), 1)
    if int(offsets.min()) < 0 or int(ends.max()) > st.size:
        return None  # a damaged entry: the batch's own checks name it
    if int((ends - offsets).max()) <= mmap.PAGESIZE:  # a record spans one or two pages
        pages = np.stack([offsets >> _PAGE_SHIFT, (ends - 1) >> _PAGE_SHIFT], 1).ravel()
    else:
        pages = pages_of(offsets, ends - offsets)
    reads = _Reads(st.u8, pages)
    try:
        reads.submitted = perf_counter()
        task = executor().submit(reads)
    except RuntimeError:  # the interpreter is shutting down: no new threads
        return None
    cache.helper, cache.helper_reads = task, reads
    return task
