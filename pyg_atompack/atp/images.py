"""In-memory `.atp` images holding a subset of a file's records (record blocks, gathers).

A remote `.atp` file is read without downloading it: its metadata (the header slots,
the schema block and the index) is fetched once (:class:`FileMeta`), and records are
fetched by byte range, either as a *block* of consecutive records (one range request,
:func:`plan_blocks`) or as the few records a random batch needs. Either way the fetched
bytes are wrapped into a small, valid `.atp` image::

    [8192-byte header][the records][the schema block][an index of just these records]

so that :meth:`Reader.from_bytes <pyg_atompack.atp.Reader.from_bytes>` decodes them with
every fast path of the format layer (zero-copy views, vectorised gathers), and the
format rules live in one place. The records keep their stored bytes (compressed or
not); only the index offsets are rebased. Building an image costs the header, the
schema copy and 20 bytes a record, next to the records themselves.

Records must be stored in index order (offsets increasing, as every writer produces
them); :func:`plan_blocks` refuses other files with a clear error.

Framed files (``docs/atp-format.md`` §15): a record's bytes are fetched with the
20-byte frame header before them (:func:`record_ranges`, :func:`block_span`) and the
image is framed too, so the reader of the image checks each record's CRC-32 as a
reader of the whole file does. A file in the writing state has no index to fetch:
:func:`parse_meta` refuses it (its records are found by scanning the whole file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .codecs import CODEC_NONE
from .errors import IndexBlockError
from .frames import FRAME_HEADER_SIZE
from .header import FLAG_FRAMED, HEADER_SIZE, SLOT_SIZE, Header, encode_slot, select_header
from .index import INDEX_DTYPE, decode_index, encode_index
from .reader import Reader
from .schema import decode_schema

__all__ = ["FileMeta", "block_span", "complete_block", "gathered_image", "image_layout",
           "parse_meta", "plan_blocks", "record_ranges"]


@dataclass(frozen=True)
class FileMeta:
    """The metadata of one `.atp` file: enough to locate and decode any of its records.

    Attributes:
        name: How messages name the file (the user's path or URL, never a temp name).
        size: The file's length in bytes.
        header: The committed header slot.
        head: The first 8192 bytes (both header slots), as fetched.
        schema: The schema block's bytes (``b""`` for schema-less files).
        index: The index entries (``offset``, ``stored``, ``raw``, ``n_atoms``).
    """

    name: str
    size: int
    header: Header
    head: bytes
    schema: bytes
    index: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    @property
    def n_atoms(self) -> np.ndarray:
        """Atom count of every record (int64)."""
        return self.index["n_atoms"].astype(np.int64)

    @property
    def frame_bytes(self) -> int:
        """Bytes of frame header before each record's stored bytes (20 framed, else 0)."""
        return FRAME_HEADER_SIZE if self.header.framed else 0

    @property
    def record_ends(self) -> np.ndarray:
        """One past the last stored byte of every record (int64)."""
        return self.index["offset"].astype(np.int64) + self.index["stored"].astype(np.int64)


def parse_meta(name: str, size: int, head: bytes, schema: bytes, index: bytes) -> FileMeta:
    """Check and decode fetched metadata against the header that announced it.

    Args:
        name (str): How messages name the file.
        size (int): The file's length.
        head (bytes): Its first 8192 bytes.
        schema (bytes): The bytes of the schema block the header points at (``b""`` if none).
        index (bytes): The bytes of the index block the header points at (``b""`` if none).

    Returns:
        The :class:`FileMeta`.

    Raises:
        AtpError: The header is invalid, a block's length differs from the header's,
            the schema is malformed, or an index entry points outside the file.
    """
    header = select_header(head, size, name)
    if len(schema) != header.schema_len:
        raise IndexBlockError(f"{name}: schema block is {len(schema)} bytes, the header "
                              f"says {header.schema_len}")
    if header.schema_len:
        decode_schema(schema, name)  # raises SchemaError when malformed
    if header.index_len:
        if len(index) != header.index_len:
            raise IndexBlockError(f"{name}: index block is {len(index)} bytes, the header "
                                  f"says {header.index_len}")
        entries = decode_index(index, header.num_molecules, name)
    else:
        entries = np.zeros(0, INDEX_DTYPE)
    offsets = entries["offset"]
    ends = offsets + entries["stored"].astype(np.uint64)
    bad = (offsets < HEADER_SIZE + (FRAME_HEADER_SIZE if header.framed else 0)) | (ends > size)
    if header.codec == CODEC_NONE:
        bad |= entries["stored"] != entries["raw"]
    if bad.any():
        j = int(np.argmax(bad))
        raise IndexBlockError(f"{name}: record {j}: stored bytes [{int(offsets[j])}, "
                              f"+{int(entries['stored'][j])}) lie outside the {size}-byte "
                              f"file or disagree with its size")
    return FileMeta(name, size, header, bytes(head[:HEADER_SIZE]), bytes(schema), entries)


def plan_blocks(meta: FileMeta, block_bytes: int) -> np.ndarray:
    """Cut a file's records into blocks of consecutive records of at most ``block_bytes``.

    A block is the byte span from its first record's offset to its last record's end
    (one range request). A single record larger than ``block_bytes`` is a block alone.

    Args:
        meta (FileMeta): The file's metadata.
        block_bytes (int): The largest span of a block, in bytes.

    Returns:
        int64 boundaries ``b`` with ``b[0] == 0`` and ``b[-1] == len(meta)``: block ``j``
        holds records ``b[j]:b[j + 1]``.

    Raises:
        IndexBlockError: The records are not stored in index order.
    """
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    offsets = meta.index["offset"].astype(np.int64)
    ends = meta.record_ends
    if len(offsets) > 1 and not (offsets[1:] >= ends[:-1]).all():
        j = int(np.argmax(offsets[1:] < ends[:-1])) + 1
        raise IndexBlockError(f"{meta.name}: record {j} is not stored after record {j - 1}; "
                              f"record blocks need records in index order")
    bounds = [0]
    count = len(offsets)
    while bounds[-1] < count:
        first = bounds[-1]
        stop = int(np.searchsorted(ends, offsets[first] + block_bytes, side="right"))
        bounds.append(max(stop, first + 1))
    return np.asarray(bounds, dtype=np.int64)


def record_ranges(meta: FileMeta, records: np.ndarray) -> list[tuple[int, int]]:
    """The file byte ranges ``(start, end)`` to fetch for records ``records``.

    A record's stored bytes, and in a framed file the frame header before them
    (:func:`gathered_image` takes the ranges' bytes as they are).

    Args:
        meta (FileMeta): The file's metadata.
        records (np.ndarray): Record indices.

    Returns:
        One ``(start, end)`` per record, in the same order.
    """
    entries = meta.index[records]
    starts = entries["offset"].astype(np.int64)
    ends = (starts + entries["stored"]).tolist()
    return list(zip((starts - meta.frame_bytes).tolist(), ends))


def image_layout(meta: FileMeta, stored_bytes: int, count: int) -> tuple[int, int, int]:
    """Where the parts of an image of ``count`` records (``stored_bytes`` in all) go.

    Args:
        meta (FileMeta): The file's metadata.
        stored_bytes (int): Total stored bytes of the records.
        count (int): Number of records.

    Returns:
        ``(schema_offset, index_offset, total_size)`` of the image; the records start
        at byte 8192.
    """
    schema_offset = HEADER_SIZE + stored_bytes
    index_offset = schema_offset + len(meta.schema)
    return schema_offset, index_offset, index_offset + 8 + 20 * count


def _finish(buffer, meta: FileMeta, entries: np.ndarray, stored_bytes: int) -> None:
    """Write header slots, schema and index of an image whose records are in place."""
    schema_offset, index_offset, total = image_layout(meta, stored_bytes, len(entries))
    if len(buffer) != total:
        raise ValueError(f"image buffer holds {len(buffer)} bytes, the layout needs {total}")
    has_schema = bool(meta.schema)
    framed = meta.header.framed
    header = Header(generation=1, index_offset=index_offset, index_len=8 + 20 * len(entries),
                    num_molecules=len(entries), codec=meta.header.codec,
                    level=meta.header.level, record_format=meta.header.record_format,
                    schema_offset=schema_offset if has_schema else 0,
                    schema_len=len(meta.schema), flags=FLAG_FRAMED if framed else 0,
                    data_end=schema_offset if framed else 0)
    slot = encode_slot(header)
    buffer[0:SLOT_SIZE] = slot
    buffer[SLOT_SIZE:HEADER_SIZE] = slot
    buffer[schema_offset:index_offset] = meta.schema
    buffer[index_offset:total] = encode_index(entries)


def block_span(meta: FileMeta, first: int, stop: int) -> tuple[int, int, int]:
    """The file span of records ``first:stop`` and the size of their image.

    Read file bytes ``[span_start, span_start + span_len)`` into bytes
    ``[8192, 8192 + span_len)`` of a zeroed buffer of ``image_size`` bytes, then call
    :func:`complete_block`.

    Args:
        meta (FileMeta): The file's metadata.
        first (int): First record of the block.
        stop (int): One past its last record.

    Returns:
        ``(span_start, span_len, image_size)``.
    """
    span_start = int(meta.index["offset"][first]) - meta.frame_bytes
    span_len = int(meta.record_ends[stop - 1]) - span_start
    return span_start, span_len, image_layout(meta, span_len, stop - first)[2]


def complete_block(image, meta: FileMeta, first: int, stop: int) -> None:
    """Write header, schema and index around a block's records read in place.

    Afterwards ``Reader.from_bytes(image, copy=False)`` opens the block; its record
    ``j`` is record ``first + j`` of the file.

    Args:
        image (writable buffer): Of the size :func:`block_span` gave, holding the span
            at byte 8192.
        meta (FileMeta): The file's metadata.
        first (int): First record of the block.
        stop (int): One past its last record.
    """
    span_start, span_len, _ = block_span(meta, first, stop)
    entries = meta.index[first:stop].copy()
    entries["offset"] = entries["offset"] - span_start + HEADER_SIZE
    _finish(image, meta, entries, span_len)


def gathered_image(meta: FileMeta, records: np.ndarray,
                   payloads: Sequence[bytes | memoryview]) -> Reader:
    """An image of chosen records, from their stored bytes.

    Args:
        meta (FileMeta): The file's metadata.
        records (np.ndarray): Record indices (any order, no repeats needed).
        payloads (Sequence[bytes | memoryview]): The bytes of each record's range
            (:func:`record_ranges`: stored bytes, after the frame header in a framed
            file), in the same order.

    Returns:
        A reader whose record ``j`` is record ``records[j]`` of the file.
    """
    entries = meta.index[records].copy()
    stored = entries["stored"].astype(np.int64) + meta.frame_bytes
    starts = np.concatenate([[0], np.cumsum(stored)])
    total_stored = int(starts[-1])
    total = image_layout(meta, total_stored, len(entries))[2]
    image = bytearray(total)
    for start, payload, size in zip(starts[:-1].tolist(), payloads, stored.tolist()):
        if len(payload) != size:
            raise IndexBlockError(f"{meta.name}: got {len(payload)} bytes for a record of "
                                  f"{size} stored bytes")
        image[HEADER_SIZE + start:HEADER_SIZE + start + size] = payload
    entries["offset"] = starts[:-1] + HEADER_SIZE + meta.frame_bytes
    _finish(image, meta, entries, total_stored)
    return Reader.from_bytes(image, name=meta.name, copy=False)
