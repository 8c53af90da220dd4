"""Shared memory that a producer process fills and its parent reads in place.

A DataLoader worker (or the retrieval process of
:class:`~pyg_atompack.stream.ShardStreamDataset`) packs every batch into one buffer
(:mod:`pyg_atompack.pyg.handoff`). Sent through a pipe, the buffer is copied twice and
crosses in 64 KiB pieces, each read waking the producer's writer thread; sent as a
torch shared-memory tensor, it costs a new segment, a descriptor passed over a socket
and a round trip to the producer's GIL per batch. An :class:`Arena` is one anonymous
``MAP_SHARED`` mapping made in the parent *before* it forks the producer, so both
processes see the same pages with no name to leak and nothing to pass: the producer
copies a batch into free chunks, sends only their position, and the parent's tensors
are views of those chunks.

The chunks go back to the producer when the parent lets go of the batch: the views
share one storage over a numpy array of the chunks, and a :func:`weakref.finalize` on
that array clears the chunks' state bytes (kept in the arena's first pages, which both
processes see) when the last view dies. Nothing waits for space: a producer that finds
no free run of chunks (the consumer keeps old batches alive, or the batch is larger
than the arena) sends that batch the old way. Only pages that were used become
resident, since the first free run is always taken from the front.

Chunk state bytes are written by one side at a time (the producer marks free chunks
busy, the parent marks its own busy chunks free), so no lock is needed on x86's
ordered stores; a weaker memory model could see a chunk freed before the parent's
last reads of it completed.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import uuid
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["CHUNK_BYTES", "DEFAULT_ARENA_BYTES", "Arena", "arenas_for_children", "find_arena"]

#: Allocation unit of an arena.
CHUNK_BYTES = 64 << 10
#: Address space of one arena; only the chunks in use at the peak become resident.
DEFAULT_ARENA_BYTES = 128 << 20

_FREE, _BUSY = 0, 1
# arenas by token: made in the parent, inherited by its forked producers, so a token
# in a message names the same memory on both sides
_ARENAS: weakref.WeakValueDictionary[str, Arena] = weakref.WeakValueDictionary()


def _release(states: np.ndarray, start: int, count: int) -> None:
    states[start:start + count] = _FREE


class Arena:
    """An anonymous shared mapping split into chunks, shared with forked children.

    Made in the parent before the fork; the child inherits it (the fork start method
    only: a spawned process cannot map it and must send its buffers another way).

    Args:
        size (int, optional): Bytes of chunk space (rounded up to whole chunks).
            (default: :data:`DEFAULT_ARENA_BYTES`)
    """

    def __init__(self, size: int = DEFAULT_ARENA_BYTES) -> None:
        self.chunks = max(1, -(-int(size) // CHUNK_BYTES))
        self._base = -(-self.chunks // CHUNK_BYTES) * CHUNK_BYTES  # the state bytes' pages
        self._map = mmap.mmap(-1, self._base + self.chunks * CHUNK_BYTES)
        self._states = np.frombuffer(self._map, dtype=np.uint8, count=self.chunks)
        self.token = uuid.uuid4().hex
        self.parent_pid = os.getpid()
        _ARENAS[self.token] = self

    @property
    def size(self) -> int:
        """Bytes of chunk space."""
        return self.chunks * CHUNK_BYTES

    def busy_chunks(self) -> int:
        """Chunks currently lent out (held by a batch or being filled)."""
        return int(np.count_nonzero(self._states))

    # ----------------------------------------------------------- producer side
    def allocate(self, nbytes: int) -> int | None:
        """Take the first run of free chunks that holds ``nbytes`` (producer side).

        Args:
            nbytes (int): Bytes needed (at least one).

        Returns:
            The first chunk of the run, now busy, or :obj:`None` if no run is free.
        """
        count = max(1, -(-nbytes // CHUNK_BYTES))
        if count > self.chunks:
            return None
        free = self._states == _FREE
        start = int(free.argmax())  # the first free chunk; its run is usually long enough
        if not free[start]:
            return None
        if start + count > self.chunks or (count > 1 and not free[start:start + count].all()):
            edges = np.diff(np.concatenate(([False], free, [False])).view(np.int8))
            starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            fits = np.flatnonzero(ends - starts >= count)
            if fits.size == 0:
                return None
            start = int(starts[fits[0]])
        self._states[start:start + count] = _BUSY
        return start

    def writable(self, start: int, nbytes: int) -> torch.Tensor:
        """The bytes of an allocated run as a ``uint8`` tensor to fill (producer side)."""
        array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes,
                              offset=self._base + start * CHUNK_BYTES)
        return torch.from_numpy(array)

    def give_back(self, start: int, nbytes: int) -> None:
        """Free a run the producer allocated but did not send."""
        _release(self._states, start, max(1, -(-nbytes // CHUNK_BYTES)))

    # ----------------------------------------------------------- parent side
    def claim(self, start: int, nbytes: int) -> torch.Tensor:
        """The bytes of a received run as a ``uint8`` tensor (parent side).

        The run is freed for the producer when the tensor and every view of its
        storage are gone.

        Args:
            start (int): First chunk, as :meth:`allocate` returned it.
            nbytes (int): Bytes the producer wrote.

        Returns:
            A writable tensor over the shared chunks.
        """
        array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes,
                              offset=self._base + start * CHUNK_BYTES)
        weakref.finalize(array, _release, self._states, start,
                         max(1, -(-nbytes // CHUNK_BYTES)))
        return torch.from_numpy(array)


def find_arena(token: str) -> Arena | None:
    """The arena ``token`` names in this process, if it is still alive.

    Args:
        token (str): :attr:`Arena.token`.

    Returns:
        The arena, or :obj:`None`.
    """
    return _ARENAS.get(token)


def arenas_for_children(count: int, context: Any = None,
                        size: int = DEFAULT_ARENA_BYTES) -> list[Arena] | None:
    """One arena per child process about to be started, if they will be forked.

    Args:
        count (int): Child processes.
        context (Any, optional): Their ``multiprocessing`` context or its name (a
            DataLoader's ``multiprocessing_context``). (default: :obj:`None`, the
            default context)
        size (int, optional): Bytes of each arena. (default: :data:`DEFAULT_ARENA_BYTES`)

    Returns:
        The arenas, or :obj:`None` when the children are not forked (``spawn``,
        ``forkserver``: they could not map this process's memory) or the platform has
        no fork.
    """
    if context is None:
        context = multiprocessing.get_context()
    elif isinstance(context, str):
        context = multiprocessing.get_context(context)
    if context.get_start_method() != "fork" or not hasattr(os, "fork"):
        return None
    return [Arena(size) for _ in range(count)]
