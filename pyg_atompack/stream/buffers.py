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

from pyg_atompack.pyg.samples import BufferViewSamples
from pyg_atompack.transport.buffers import (
    RangeIgnoredError,
    ShardBuffer,
    ShardPart,
    WritableBuffer,
    allocate,
    is_writable_buffer,
)

__all__ = ["BufferViewSamples", "RangeIgnoredError", "ShardBuffer", "ShardPart",
           "WritableBuffer", "allocate", "is_writable_buffer"]
