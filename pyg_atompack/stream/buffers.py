"""Shard download buffers whose memory goes back to the operating system at once.

A shard is downloaded into one buffer, decoded (lazily decoded shards keep the buffer as
their samples' storage) and dropped once consumed. Growing a :class:`bytearray` chunk by
chunk is the wrong tool for that: it overallocates and copies as it grows, and after the
first multi-megabyte buffer is freed, glibc raises its mmap threshold to that size, so
later buffers come from the heap and stay in the resident set after they are freed
(measured: ~12 MiB of a 12.5 MiB shard per shard in flight, until ``malloc_trim``).

When the size is known up front (a ``Content-Length``, a file's size), the bytes go into
an anonymous memory map of exactly that size instead; unmapping it when the last
reference goes returns every page immediately, whatever the allocator's state.
"""

from __future__ import annotations

import mmap

__all__ = ["ShardBuffer", "WritableBuffer", "allocate", "is_writable_buffer"]

WritableBuffer = bytearray | mmap.mmap


def allocate(size: int) -> WritableBuffer:
    """A zero-filled writable buffer of exactly ``size`` bytes, outside the C heap.

    Args:
        size: Its length.

    Returns:
        An anonymous :class:`mmap.mmap` (a :class:`bytearray` when ``size`` is 0, which
        cannot be mapped).
    """
    return mmap.mmap(-1, size) if size > 0 else bytearray()


def is_writable_buffer(buffer: object) -> bool:
    """Whether ``buffer`` is a shard buffer decoders may keep as their samples' storage."""
    return isinstance(buffer, (bytearray, mmap.mmap))


class ShardBuffer:
    """Collects one shard's bytes as they arrive; resumable after a broken transfer.

    Args:
        name: Shard name for messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._data: WritableBuffer = bytearray()
        self._filled = 0

    def __len__(self) -> int:
        return self._filled

    def restart(self, size: int | None) -> None:
        """Drop what was received and expect a body of ``size`` bytes (if known)."""
        self._data = allocate(size) if size else bytearray()
        self._filled = 0

    def append(self, chunk: bytes) -> None:
        """Add the next bytes of the body."""
        end = self._filled + len(chunk)
        if isinstance(self._data, mmap.mmap):
            if end <= len(self._data):
                self._data[self._filled:end] = chunk
                self._filled = end
                return
            # more than announced: carry on in a growable buffer
            self._data = bytearray(self._data[:self._filled])
        self._data += chunk
        self._filled = end

    def take(self) -> WritableBuffer:
        """The received bytes, handed over (the buffer starts empty again).

        Returns:
            The body: the memory map itself when it was filled exactly.
        """
        data, filled = self._data, self._filled
        self._data, self._filled = bytearray(), 0
        if isinstance(data, mmap.mmap) and filled != len(data):
            data = bytearray(data[:filled])
        return data
