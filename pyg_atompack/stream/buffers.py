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

from collections.abc import Sequence

import torch
from torch_geometric.data.data import BaseData

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

class BufferViewSamples(Sequence):
    """The samples of a shard decoded in place, each built from its buffer when taken.

    Subclasses implement :meth:`_build`. A built sample's tensors view the shard buffer,
    so keeping one alive keeps the whole buffer alive; :meth:`detached` gives a sample
    with its own copies, for samples that may outlive their shard.

    Args:
        length: Number of samples.
    """

    #: Samples are views of the shard buffer: one kept alive keeps the whole buffer.
    views_into_buffer = True

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int | slice) -> BaseData | list[BaseData]:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[position] for position in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        return self._build(index)

    def _build(self, index: int) -> BaseData:
        raise NotImplementedError

    def detached(self, index: int) -> BaseData:
        """Sample ``index`` with tensors of its own, not views of the shard buffer.

        Args:
            index: Position of the sample in the shard.

        Returns:
            The sample, holding no reference to the buffer.
        """
        return self[index].apply(torch.clone)
