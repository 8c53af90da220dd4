"""Opening one `.atp` file: descriptor or mapping, committed header, schema and index.

A :class:`FileState` is everything an open :class:`~pyg_atompack.atp.Reader` holds.
It is built in one go (and released completely if any step fails), and rebuilt
lazily by the reader after unpickling or fork. What decoding learns while the file
is open (layouts, the memo of checked records, plans, views) lives in the state's
:class:`~pyg_atompack.atp.cache.DecodeCache`, made empty here.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os

import numpy as np

from .cache import DecodeCache
from .codecs import CODEC_NONE
from .errors import AtpValueError, HeaderError, TruncatedFileError
from .extensions import read_directory
from .frames import FrameCheck, recover
from .header import HEADER_SIZE, select_header
from .index import INDEX_DTYPE, decode_index
from .preads import mapping_address, resident
from .schema import decode_schema
from .types import POSITIONS_DTYPE_BY_TAG

F32 = np.dtype("<f4")
# "auto" and "pread" advise random access from this file size on; below it the
# kernel's read-ahead wins (bench_atp.py: on the 35 MB file cold, the plain map reads
# 1.3-1.7x atompack-db's rate, the random-advised paths 0.2-1.1x)
RANDOM_ADVICE_BYTES = 128 << 20


class FileState:
    """The open file behind a reader.

    Args:
        name (str): Name used in error messages.
        path (str | None): The file, or None for an in-memory image.
        image (bytes | None): The complete file contents (``path`` None), else None.
        access (str): ``"mmap"``, ``"auto"``, ``"pread"`` or ``"memory"``.

    Raises:
        AtpError: The file is not a readable `.atp` file (a subclass says why).
    """

    __slots__ = ("name", "buf", "mv", "fd", "mm", "size", "header", "schema", "pos_dtype",
                 "index", "index_buf", "count", "codec", "fields", "n_atoms", "u8", "access",
                 "resident", "pread", "cache", "extent", "frames", "directory", "recovered")

    def __init__(self, name: str, path: str | None, image: bytes | None, access: str) -> None:
        self.name = name
        self.access = access
        # ``resident(offset, length)``: whether a range is in the page cache ("auto"
        # only; None: read from the mapping regardless). Tests force the other path.
        self.resident = None
        # the positional read of record bytes (a seam: tests emulate slow storage with it)
        self.pread = os.pread
        self.fd = -1
        self.mm = self.mv = self.u8 = self.buf = None
        self.index = self.index_buf = self.cache = None
        self.extent = None  # bytes the committed data needs (check_size), found on first use
        # framed files: the per-record CRC check (None: not framed), the metadata frames
        # of the extensions directory, and what a recovery scan found (None: committed)
        self.frames = None
        self.directory = []
        self.recovered = None
        try:
            self._map(path, image, access)
            self._parse()
        except BaseException:
            self.release()
            raise

    def _map(self, path: str | None, image: bytes | None, access: str) -> None:
        if image is not None:
            self.buf = image
            self.size = len(image)
            return
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except IsADirectoryError:
            raise AtpValueError(f"{self.name}: is a directory; use atp.open() for shards") \
                from None
        self.size = os.fstat(self.fd).st_size
        # small files keep the kernel's read-ahead: its windows soon hold the whole file
        random = access != "mmap" and self.size >= RANDOM_ADVICE_BYTES
        if access == "auto" and not random:
            access = self.access = "mmap"
        if random and hasattr(os, "posix_fadvise"):
            # a random record read fetches its pages only, not a read-ahead window of
            # 128 KiB or more that a shuffled reader would throw away; a read of a run
            # of adjacent records is one large read of exactly that run
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        if access in ("mmap", "auto") and self.size:
            self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
            self.buf = self.mm
            if access == "auto" and hasattr(mmap, "MADV_RANDOM"):
                # shuffled reads: a page fault reads only its page, not the kernel's
                # read-ahead window (which a random reader would mostly throw away)
                self.mm.madvise(mmap.MADV_RANDOM)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` (the caller checked they lie in the file).

        Args:
            offset (int): First byte.
            length (int): Number of bytes.

        Returns:
            The bytes (a slice of the mapping or image, or what ``os.pread`` returned).

        Raises:
            TruncatedFileError: The file is shorter than when it was opened (read
                with ``pread``; a mapped file is checked by the callers, once per
                call of the reader, with :meth:`check_size`).
        """
        if self.buf is not None:
            return self.buf[offset:offset + length]
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise TruncatedFileError(f"{self.name}: short read at offset {offset} "
                                     f"({len(data)} of {length} bytes); file changed?")
        return data

    def _parse(self) -> None:
        header = select_header(self.read(0, min(HEADER_SIZE, self.size)), self.size, self.name,
                               allow_writing=True)
        if self.mm is not None:
            self.mv = memoryview(self.mm)
        index_block = None
        if header.writing:  # no committed index: rebuilt from the frames (warns)
            self.recovered = recover(self.read, header, self.size, self.name)
            header, index_block = self.recovered.header, self.recovered.index_block
        self.header = header
        self.codec = header.codec
        self.schema = None
        if header.ext_len:
            self.directory = read_directory(self.read(header.ext_offset, header.ext_len),
                                            header, self.name)
        elif self.recovered is not None:
            self.directory = self.recovered.metadata
        if header.schema_len:
            self.schema = decode_schema(self.read(header.schema_offset, header.schema_len),
                                        self.name)
        if header.record_format == 2:
            self.pos_dtype = F32
        else:
            tag = self.schema.positions_tag if self.schema else None
            if tag not in POSITIONS_DTYPE_BY_TAG:
                raise HeaderError(f"{self.name}: record format 3 without a schema positions "
                                  f"type (tag {tag})")
            self.pos_dtype = POSITIONS_DTYPE_BY_TAG[tag]
        self.count = header.num_molecules
        if index_block is not None:
            self.index_buf = index_block
            self.index = decode_index(index_block, self.count, self.name)
        elif header.index_len:
            if self.mm is not None:
                end = header.index_offset + header.index_len
                if self.access == "auto":
                    self.load_range(header.index_offset, header.index_len)
                self.index_buf = self.mv[header.index_offset:end]
            else:
                self.index_buf = self.read(header.index_offset, header.index_len)
            self.index = decode_index(self.index_buf, self.count, self.name)
        else:
            self.index_buf = b""
            self.index = np.zeros(0, dtype=INDEX_DTYPE)
        # mapped (or in-memory) uncompressed files decode records in place
        if self.buf is not None and self.codec == CODEC_NONE:
            self.u8 = np.frombuffer(self.buf, np.uint8)
            address = mapping_address(self.u8) if self.access == "auto" else None
            if address is not None:
                self.resident = functools.partial(resident, address)
        self.cache = DecodeCache(self.count, self.u8)
        if header.framed:
            self.frames = FrameCheck(self.count)
        self.fields = None
        self.n_atoms = None

    def check_size(self) -> None:
        """Raise if the mapped file became shorter than its committed data.

        Touching a page of a mapping beyond the end of its file raises ``SIGBUS``,
        which kills the process (a Python handler cannot resume the faulting copy).
        The library's own writers never shrink a file in place (an overwrite
        replaces it by rename, appends only grow it past every commit), so only
        another program can (``truncate``, ``cp`` or a shell redirection onto the
        file). Mapped readers call this before every batch read and every read
        that copies out of the mapping: one ``lseek`` (about a microsecond), no
        more. A no-op for ``pread`` (a short read says so) and in-memory images.

        Raises:
            TruncatedFileError: The file is now shorter than the bytes the
                reader's commit refers to.
        """
        if self.mm is None:
            return
        size = os.lseek(self.fd, 0, os.SEEK_END)
        if size >= self.size:
            return
        # shorter than at open: harmful only below what the commit refers to (an
        # appending writer drops a crashed writer's uncommitted tail, past all of it)
        header = self.header
        needed = min(max(header.committed_end, header.schema_offset + header.schema_len,
                         HEADER_SIZE), self.size)
        if size >= needed:
            # the index lies below ``size``: reading it cannot fault. Records past the
            # index (only in a damaged file) are then checked too, once.
            if self.extent is None:
                ends = self.index["offset"] + self.index["stored"] if self.count else [0]
                self.extent = min(max(needed, int(np.max(ends))), self.size)
            needed = self.extent
        if size < needed:
            raise TruncatedFileError(
                f"{self.name}: the file shrank to {size} bytes under the reader; its commit "
                f"needs {needed} (another program truncated or rewrote it in place); "
                f"reopen it")

    def prefetch(self, offset: int, length: int) -> None:
        """Start reading ``[offset, offset + length)`` of the mapping in the background.

        ``MADV_WILLNEED``: one read of the whole range instead of a page fault per
        page under ``MADV_RANDOM``. Used for the index at open (the first
        ``read_batch`` checks every entry, random ``f[i]`` touch all its pages) and
        by sequential iteration.
        """
        if self.mm is None or not hasattr(mmap, "MADV_WILLNEED") or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            self.mm.madvise(mmap.MADV_WILLNEED, start, min(offset + length, self.size) - start)

    def load_range(self, offset: int, length: int) -> None:
        """Bring ``[offset, offset + length)`` into the page cache now, in large reads.

        Used for the index at open under ``"auto"``: random ``f[i]`` and every
        ``read_batch`` touch index pages all over it, and under ``MADV_RANDOM`` each
        would otherwise be a separate disk read in the middle of the reads of the
        records (or, with ``MADV_WILLNEED``, a background read competing with them).
        Read through the descriptor in 1 MiB pieces (the bytes are dropped: the
        mapping then finds them in the page cache); skipped when already resident.
        """
        if length <= 0:
            return
        address = mapping_address(np.frombuffer(self.mm, np.uint8))
        if address is None:  # residency cannot be asked: read in the background instead
            self.prefetch(offset, length)
            return
        if resident(address, offset, length):
            return
        chunk = bytearray(min(length, 1 << 20))
        end = offset + length
        while offset < end:
            view = memoryview(chunk)[:min(len(chunk), end - offset)]
            got = os.preadv(self.fd, [view], offset)
            if got <= 0:
                break
            offset += got

    def prefetch_record(self, offset: int, length: int) -> None:
        """Ask for a record's pages in one read before its first touch ("auto").

        Under ``MADV_RANDOM`` a fault reads only its own page, so touching a record
        that spans two pages not in memory waits for two reads one after the other;
        ``MADV_WILLNEED`` over the record first issues one read for both. On pages
        already in memory it only looks them up.
        """
        start = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            self.mm.madvise(mmap.MADV_WILLNEED, start, offset + length - start)

    def release(self) -> None:
        """Drop the caches, the mapping and the descriptor (idempotent)."""
        self.index = self.index_buf = self.u8 = self.cache = self.frames = None
        if self.mv is not None:
            self.mv.release()
            self.mv = None
        if self.mm is not None:
            # arrays handed out may still view the mapping (they hold a buffer export
            # of it): close() then refuses, and it closes when the last of them dies
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None
        self.buf = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
