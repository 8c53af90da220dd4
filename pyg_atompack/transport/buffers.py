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
import os
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["BodyOverrunError", "FileSink", "RangeIgnoredError", "ShardBuffer", "ShardPart",
           "WritableBuffer", "allocate", "is_writable_buffer"]

WritableBuffer = bytearray | mmap.mmap


def allocate(size: int) -> WritableBuffer:
    """A zero-filled writable buffer of exactly ``size`` bytes, outside the C heap.

    Args:
        size (int): Its length.

    Returns:
        An anonymous :class:`mmap.mmap` (a :class:`bytearray` when ``size`` is 0, which
        cannot be mapped).
    """
    return mmap.mmap(-1, size) if size > 0 else bytearray()


def is_writable_buffer(buffer: object) -> bool:
    """Whether ``buffer`` is a shard buffer decoders may keep as their samples' storage."""
    return isinstance(buffer, (bytearray, mmap.mmap))


class BodyOverrunError(ValueError):
    """A server sent more bytes than the sink was listed to hold."""


class _ResumableBody:
    """A whole body received from its first byte: resumes with ``Range: bytes=N-``.

    Subclasses count the bytes they hold in ``_filled``; ``limit`` is the most the whole
    body may hold (its listed size), :obj:`None` for no bound.
    """

    _filled: int
    limit: int | None

    def __len__(self) -> int:
        return self._filled

    def room(self, whole: bool) -> int | None:
        """How many more bytes may arrive.

        Args:
            whole (bool): The answer restarts the body from its first byte.

        Returns:
            The bytes left under :attr:`limit`, or :obj:`None` without a limit.
        """
        if self.limit is None:
            return None
        return self.limit - (0 if whole else self._filled)

    def _check_room(self, chunk: bytes) -> None:
        if self.limit is not None and self._filled + len(chunk) > self.limit:
            raise BodyOverrunError(f"more than the {self.limit} bytes listed arrived")

    @property
    def position(self) -> int:
        """Offset in the body of the next byte expected."""
        return self._filled

    def range_header(self) -> str | None:
        """The ``Range`` to request: the rest of the body once some of it arrived."""
        return f"bytes={self._filled}-" if self._filled else None


class ShardBuffer(_ResumableBody):
    """Collects one shard's bytes as they arrive, for a :class:`Source` to return.

    ``len(buffer)`` is the number of bytes received so far, which is where a resumed
    transfer continues (``Range: bytes=len(buffer)-``).

    Example::

        buffer = ShardBuffer(shard.name)
        buffer.restart(shard.size)        # None when the size is not known
        for chunk in response:
            buffer.append(chunk)
        return buffer.take()

    Args:
        name (str): Shard name for messages.
        limit (int, optional): The most bytes the body may hold (its listed size); more
            raise :class:`BodyOverrunError`. (default: :obj:`None`, no bound)
    """

    def __init__(self, name: str, limit: int | None = None) -> None:
        self.name = name
        self.limit = limit
        self._data: WritableBuffer = bytearray()
        self._filled = 0

    def whole_body(self, size: int | None) -> None:
        """The server sends the whole body (again): start over.

        Args:
            size (int | None): Its announced length, if any (see :meth:`restart`).
        """
        self.restart(size)

    def restart(self, size: int | None) -> None:
        """Drop what was received and expect a body of ``size`` bytes.

        Args:
            size (int | None): The announced length: the bytes go to an anonymous memory map of
                exactly this size. :obj:`None` (or 0) collects them in a bytearray.
        """
        self._data = allocate(size) if size else bytearray()
        self._filled = 0

    def append(self, chunk: bytes) -> None:
        """Add the next bytes of the body.

        Args:
            chunk (bytes): The bytes; more than announced switch to a growable buffer.

        Raises:
            BodyOverrunError: The body would exceed :attr:`limit`.
        """
        self._check_room(chunk)
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


class RangeIgnoredError(Exception):
    """The server answered a byte-range request with the whole body."""


class ShardPart:
    """Receives bytes ``[start, end)`` of a shard straight into the shard's buffer.

    Several parts of one buffer are filled by concurrent range requests
    (:meth:`pyg_atompack.stream.RemoteSource.fetch_in_parts`); each keeps its own count, so
    a broken part resumes where it stopped.

    Args:
        buffer (WritableBuffer): The whole shard's buffer, shared by all its parts.
        start (int): First byte of the part.
        end (int): One past its last byte.
        base (int, optional): The file offset of ``buffer[0]`` (``start`` for a buffer holding only
            this range). (default: :obj:`0`)
        on_data (Callable[[int], None], optional): Called after every chunk written with the
            offset in the shard one past its last byte (bytes ``[start, offset)`` are
            in). (default: :obj:`None`)
        file_size (int, optional): The size the whole file must have (from its
            listing); a server that reports another is refused. (default: :obj:`None`)
    """

    def __init__(self, buffer: WritableBuffer, start: int, end: int, *, base: int = 0,
                 on_data: Callable[[int], None] | None = None,
                 file_size: int | None = None) -> None:
        self.buffer = buffer
        self.file_size = file_size
        self.start = start
        self.end = end
        self.base = base
        self.on_data = on_data
        self._filled = 0

    def __len__(self) -> int:
        return self._filled

    def room(self, whole: bool) -> int | None:
        """How many more bytes of the range may arrive (:obj:`None` for a whole body, refused
        by :meth:`whole_body` anyway)."""
        return None if whole else self.end - self.position

    @property
    def complete(self) -> bool:
        """Whether every byte of the part arrived."""
        return self.start + self._filled == self.end

    @property
    def position(self) -> int:
        """Offset in the shard of the next byte expected."""
        return self.start + self._filled

    def range_header(self) -> str:
        """The ``Range`` still to request."""
        return f"bytes={self.start + self._filled}-{self.end - 1}"

    def whole_body(self, size: int | None) -> None:
        """A range request answered with the whole body: the server ignores ranges.

        Args:
            size (int | None): The announced length (unused: the part gives up).

        Raises:
            RangeIgnoredError: Always; the caller downloads the shard in one piece.
        """
        raise RangeIgnoredError(f"bytes {self.start}-{self.end - 1} answered with the whole body")

    def restart(self, size: int | None) -> None:
        """Drop what this part received.

        Args:
            size (int | None): Ignored (a part's size is fixed).
        """
        self._filled = 0

    def append(self, chunk: bytes) -> None:
        """Write the next bytes of the part into the shard buffer.

        Raises:
            BodyOverrunError: The server sent more than the part holds.
        """
        at = self.start + self._filled
        if at + len(chunk) > self.end:
            raise BodyOverrunError(f"server sent past byte {self.end - 1} of a range request")
        self.buffer[at - self.base:at - self.base + len(chunk)] = chunk
        self._filled += len(chunk)
        if self.on_data is not None:
            self.on_data(at + len(chunk))


class FileSink(_ResumableBody):
    """Receives a body into an open binary file, with the interface of :class:`ShardBuffer`.

    Used for downloads into the cache: a dropped connection resumes at the file's current
    length, a server that sends the whole body again truncates the file first.

    Args:
        handle (BinaryIO): A file opened for writing in binary mode, positioned at its start.
        limit (int, optional): The most bytes the body may hold (its listed size); more
            raise :class:`BodyOverrunError` before they are written. (default: :obj:`None`)
    """

    def __init__(self, handle: BinaryIO, limit: int | None = None) -> None:
        self.handle = handle
        self.limit = limit
        self._filled = 0

    def whole_body(self, size: int | None) -> None:
        """The server sends the whole body (again): start over."""
        self.restart(size)

    def restart(self, size: int | None) -> None:
        """Drop what was written so far."""
        self.handle.seek(0)
        self.handle.truncate()
        self._filled = 0

    def append(self, chunk: bytes) -> None:
        """Write the next bytes of the body.

        Raises:
            BodyOverrunError: The body would exceed :attr:`limit`.
        """
        self._check_room(chunk)
        self.handle.write(chunk)
        self._filled += len(chunk)

    def flush(self) -> None:
        """Push the written bytes to the operating system."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
