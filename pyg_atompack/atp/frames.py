"""Framed entries of the data region (the framed revision, ``docs/atp-format.md`` §15).

In a framed file everything after the header region is a frame::

    [kind u32][len u32][uncompressed_len u32][n_atoms u32][crc32 u32][payload: len bytes]

The CRC-32 (zlib's) covers the first 16 header bytes and the payload. Index entries
point at record payloads, so a reader that ignores frames (0.4.1) reads records as
before; this module adds what frames make possible:

* :class:`FrameCheck`: each record's CRC checked on its first read through a
  reader (one bit per record), so a flipped byte raises :class:`FrameError` naming
  the file and record instead of decoding to wrong values;
* :func:`scan_frames`: the recovery of a file in the writing state, frames read
  from ``data_start`` up to the first incomplete or damaged one (the index, the
  latest schema frame and the metadata frames), as the reference's ``open`` does.

It follows ``atompack/src/storage/frames.rs`` of LeMaterial/atompack at commit
90da9bd35904a3625ab143eeb5cdd8d532a22c78.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import FrameError, HeaderError, RecoveredWriteWarning
from .header import Header
from .index import INDEX_DTYPE, encode_index
from .types import RECORD_FORMATS

FRAME_HEADER_SIZE = 20
#: Frame kinds written by the reference; any other kind is a metadata frame a
#: reader skips and a writer keeps.
FRAME_RECORD = 1
FRAME_SCHEMA = 2  # payload: [record_format u32][schema block]
FRAME_GROUPS = 3
FRAME_HEAD = struct.Struct("<IIIII")
_SCAN_WINDOW = 4 << 20  # bytes read at once by a scan


def frame_crc(head: bytes | memoryview, payload: bytes | memoryview) -> int:
    """The CRC-32 of a frame: its first 16 header bytes, then its payload."""
    return zlib.crc32(payload, zlib.crc32(head[:16]))


def encode_frame(kind: int, payload: bytes, uncompressed_len: int = 0,
                 n_atoms: int = 0) -> bytes:
    """One frame: the 20-byte header (CRC filled in) followed by ``payload``.

    Args:
        kind (int): :data:`FRAME_RECORD`, :data:`FRAME_SCHEMA`, :data:`FRAME_GROUPS` or
            another kind.
        payload (bytes): The payload (a record's stored bytes for a record frame).
        uncompressed_len (int, optional): A record's uncompressed size. (default: ``0``,
            what upstream's ``write_metadata_frame`` writes for every other kind)
        n_atoms (int, optional): A record's atom count. (default: :obj:`0`)

    Returns:
        The frame's bytes.
    """
    head = struct.pack("<IIII", kind, len(payload), uncompressed_len, n_atoms)
    return head + struct.pack("<I", frame_crc(head, payload)) + payload


@dataclass(frozen=True)
class MetaFrame:
    """A frame other than a record: its kind and its payload's span in the file.

    Attributes:
        kind: The frame kind (:data:`FRAME_SCHEMA`, :data:`FRAME_GROUPS`, or one this
            version does not know).
        offset: Absolute offset of the payload (the frame header is the 20 bytes before).
        length: Payload length in bytes.
    """

    kind: int
    offset: int
    length: int


@dataclass
class Scan:
    """What a scan of the frames found.

    Attributes:
        index: Index entries of the record frames, in file order.
        schema: The latest schema frame (None if there is none).
        metadata: The other non-record frames, in file order (of the groups kind
            only the latest: a newer groups frame replaces the older).
        end: End of the last valid frame.
        stop: Why the scan stopped before the end of the file (None when it reached it).
    """

    index: np.ndarray
    schema: MetaFrame | None = None
    metadata: list[MetaFrame] = field(default_factory=list)
    end: int = 0
    stop: str | None = None


def scan_frames(read: Callable[[int, int], bytes], start: int, size: int) -> Scan:
    """Read frames from ``start`` until the first incomplete or damaged one.

    Everything after that frame is an interrupted write (the reference's
    ``scan_frames``). Each frame's CRC is checked as it is read.

    Args:
        read (Callable[[int, int], bytes]): ``read(offset, length)``: bytes of the file,
            inside ``[0, size)``.
        start (int): The first frame (``data_start``).
        size (int): The file's length.

    Returns:
        The :class:`Scan`.
    """
    # compact columns (20 bytes a record): a file of tiny frames costs no more than itself
    offsets, sizes = array("Q"), array("I")
    scan = Scan(np.zeros(0, INDEX_DTYPE), end=start)
    window, base = b"", start
    at = start
    while True:
        if at + FRAME_HEADER_SIZE > size:
            if at < size:
                scan.stop = f"an incomplete frame header at byte {at} (file ends at {size})"
            break
        if at + FRAME_HEADER_SIZE > base + len(window):
            base, window = at, memoryview(read(at, min(max(_SCAN_WINDOW, FRAME_HEADER_SIZE),
                                                       size - at)))
        kind, length, raw, n_atoms, crc = FRAME_HEAD.unpack_from(window, at - base)
        offset = at + FRAME_HEADER_SIZE
        if offset + length > size:
            scan.stop = (f"an incomplete frame at byte {at} ({length} payload bytes, the "
                         f"file ends at {size})")
            break
        if offset + length > base + len(window):
            base, window = at, memoryview(read(at, max(min(_SCAN_WINDOW, size - at),
                                                       FRAME_HEADER_SIZE + length)))
        head = window[at - base:offset - base]
        payload = window[offset - base:offset - base + length]
        if frame_crc(head, payload) != crc:
            scan.stop = f"a frame at byte {at} that fails its CRC-32"
            break
        if kind == FRAME_RECORD:
            offsets.append(offset)
            sizes.extend((length, raw, n_atoms))
        elif kind == FRAME_SCHEMA:
            scan.schema = MetaFrame(kind, offset, length)
        else:  # every metadata frame, in file order: each groups frame is one chunk
            scan.metadata.append(MetaFrame(kind, offset, length))
        at = scan.end = offset + length
    if offsets:
        scan.index = np.zeros(len(offsets), INDEX_DTYPE)
        scan.index["offset"] = np.frombuffer(offsets, np.uint64)
        columns = np.frombuffer(sizes, np.uint32).reshape(-1, 3)
        scan.index["stored"], scan.index["raw"], scan.index["n_atoms"] = columns.T
    return scan


class FrameCheck:
    """Which records of an open framed file passed their CRC check (one byte each).

    The committed bytes of a file never change under an open reader, so a record
    is checked once, on its first read through any path (``reader[i]``,
    ``read_batch``, ``raw_record``); decoders only remember a record (and skip
    their own checks) after this one passed.

    Args:
        count (int): The file's record count.
    """

    __slots__ = ("ok", "flags")

    def __init__(self, count: int) -> None:
        self.ok = bytearray(count)  # zero pages: a fresh reader pays for what it reads
        self.flags = np.frombuffer(self.ok, np.uint8) if count else np.zeros(0, np.uint8)

    def check(self, st, i: int, off: int, stored: int, raw: int, n: int) -> None:
        """Check record ``i`` (index entry ``off, stored, raw, n``) against its frame.

        Args:
            st (FileState): The open file.
            i (int): The record.
            off (int): Its payload's offset (inside the file).
            stored (int): Its stored size.
            raw (int): Its uncompressed size.
            n (int): Its atom count.

        Raises:
            FrameError: The frame header disagrees with the index entry, or the CRC
                does not match: the record's bytes are damaged.
        """
        start = off - FRAME_HEADER_SIZE
        if start < st.header.data_start:
            raise FrameError(f"{st.name}: record {i}: payload at byte {off} leaves no room "
                             f"for its frame header")
        data = st.mv[start:off + stored] if st.mv is not None else \
            st.read(start, FRAME_HEADER_SIZE + stored)
        kind, length, frame_raw, frame_n, crc = FRAME_HEAD.unpack_from(data, 0)
        if kind != FRAME_RECORD or length != stored or frame_raw != raw or frame_n != n:
            raise FrameError(
                f"{st.name}: record {i}: the frame header at byte {start} (kind {kind}, "
                f"{length} stored / {frame_raw} raw bytes, {frame_n} atoms) disagrees with "
                f"the index ({stored} stored / {raw} raw bytes, {n} atoms)")
        actual = zlib.crc32(data[FRAME_HEADER_SIZE:], zlib.crc32(data[:16]))
        if actual != crc:
            raise FrameError(
                f"{st.name}: record {i}: CRC-32 mismatch (frame says {crc:#010x}, the "
                f"bytes give {actual:#010x}): the record's {stored} stored bytes are "
                f"damaged")
        self.ok[i] = 1

    def check_batch(self, st, idx: np.ndarray) -> None:
        """Check every record of ``idx`` not checked before (see :meth:`check`)."""
        if not len(idx):
            return
        new = idx[self.flags[idx] == 0]
        if not len(new):
            return
        from .cache import check_entries

        entries = st.index[new]
        check_entries(st, new, entries)  # every entry inside the file, at once
        # :meth:`check` inlined (a first batch pays it per record); on any mismatch
        # :meth:`check` itself runs again and raises its message
        ok, mv, low = self.ok, st.mv, st.header.data_start + FRAME_HEADER_SIZE
        unpack, crc32 = FRAME_HEAD.unpack_from, zlib.crc32
        for i, off, stored, raw, n in zip(new.tolist(), entries["offset"].tolist(),
                                          entries["stored"].tolist(), entries["raw"].tolist(),
                                          entries["n_atoms"].tolist()):
            if ok[i]:  # a repeated index is checked once
                continue
            if off < low:
                self.check(st, i, off, stored, raw, n)
            data = mv[off - 20:off + stored] if mv is not None else \
                st.read(off - 20, 20 + stored)
            kind, length, frame_raw, frame_n, crc = unpack(data, 0)
            if kind != FRAME_RECORD or length != stored or frame_raw != raw or \
                    frame_n != n or crc32(data[20:], crc32(data[:16])) != crc:
                self.check(st, i, off, stored, raw, n)
            ok[i] = 1


@dataclass
class Recovery:
    """A file in the writing state, as its frames describe it (:func:`recover`).

    Attributes:
        header: The writing slot with what the scan found filled in: the record count,
            the latest schema frame's block (``schema_offset``/``schema_len`` inside its
            payload) and record format, and ``data_end`` (end of the last valid frame).
            ``index_offset`` stays 0 (no index on disk) and the writing flag stays set.
        index_block: The rebuilt index block (count + entries), in memory.
        metadata: The metadata frames found (what the extensions directory would list).
        stop: Why the scan stopped before the end of the file (None: it reached it).
    """

    header: Header
    index_block: bytes
    metadata: list[MetaFrame]
    stop: str | None


def recover(read: Callable[[int, int], bytes], header: Header, size: int,
            name: str) -> Recovery:
    """Rebuild a writing-state file's index by scanning its frames; warn how many were found.

    Args:
        read (Callable[[int, int], bytes]): ``read(offset, length)`` of the file.
        header (Header): The chosen slot (in the writing state).
        size (int): The file's length.
        name (str): How messages name the file.

    Returns:
        The :class:`Recovery`.

    Warns:
        RecoveredWriteWarning: always: the file holds no commit, its records were
            recovered by the scan (the message names the file, the count and where
            and why the scan stopped).
    """
    scan = scan_frames(read, header.data_start, size)
    record_format, schema_offset, schema_len = header.record_format, 0, 0
    if scan.schema is not None and scan.schema.length >= 4:
        payload_at = scan.schema.offset
        (record_format,) = struct.unpack("<I", read(payload_at, 4))
        schema_offset, schema_len = payload_at + 4, scan.schema.length - 4
        if not schema_len:
            schema_offset = 0
    if record_format not in RECORD_FORMATS:
        raise HeaderError(f"{name}: the latest schema frame (byte {scan.schema.offset}) "
                          f"names unsupported record format {record_format}")
    count = len(scan.index)
    recovered = replace(header, num_molecules=count, record_format=record_format,
                        schema_offset=schema_offset, schema_len=schema_len, ext_offset=0,
                        ext_len=0, data_end=scan.end)
    where = "to the end of the file" if scan.stop is None else \
        f"up to byte {scan.end}, where it found {scan.stop}; the bytes after it are ignored"
    warnings.warn(
        f"{name}: the file is in the writing state (a write was interrupted or is under "
        f"way, nothing is committed): recovered {count} records from its frames, read "
        f"{where}", RecoveredWriteWarning, stacklevel=4)
    return Recovery(recovered, encode_index(scan.index), scan.metadata, scan.stop)
