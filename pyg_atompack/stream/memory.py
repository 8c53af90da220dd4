"""Handing the memory of consumed shards back to the operating system.

A decoded shard is thousands of small tensors allocated on a prefetch thread. When
the shard is dropped, glibc keeps the freed chunks in that thread's malloc arena for
reuse instead of returning them, so the resident set keeps the high-water mark of
every arena: measured here, streaming 12 MiB shards with ``prefetch=2`` left the
process ~150 MiB above its baseline although at most three shards were alive, and
``malloc_trim(0)`` brought it back to the baseline. ``ShardStreamDataset`` trims once
``stream.iteration.TRIM_AFTER_BYTES`` of shards were consumed since the last trim, which keeps the
resident set near what is really alive at a cost of a few milliseconds per trim.

Shard buffers themselves no longer go through malloc when their size is known (they are
anonymous memory maps, see :mod:`pyg_atompack.transport.buffers`), and lazily decoded
shards allocate little else, so what trimming still returns is mostly the heap of
unpickled shards (layouts decoded by ``torch.load``) and of the samples built from them.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["release_free_memory"]


def _load_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim  # the C library this process runs on
    except (OSError, AttributeError):  # e.g. musl has no malloc_trim
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_MALLOC_TRIM = _load_malloc_trim()


def release_free_memory() -> bool:
    """Returns freed heap memory of every malloc arena to the operating system.

    Returns:
        bool: :obj:`True` when the C library offers ``malloc_trim`` (glibc) and it
        was called, :obj:`False` where there is nothing to call (other platforms).
    """
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
