"""Per-record compression: none, raw LZ4 blocks, zstd frames (spec §9).

A compressed record's index entry declares its uncompressed size, and the decompressors
allocate that size before they look at the data: a few stored bytes could make a reader
allocate gigabytes. So before decompressing, the declared size must be

* possible for the codec (:func:`plausible_raw_size`: LZ4 expands at most 255x, zstd
  32768x), and
* no more than a record of its atom count can hold under the file's schema
  (:class:`RecordBound`): the record's head (atom count, positions, atomic numbers,
  section count), every schema section's header, the fixed payloads (``slot_bytes``
  once per molecule, or per atom for per-atom sections) and, only when the schema has
  sections of no fixed size (strings, tensors), :data:`VARIABLE_FLOOR` +
  :data:`VARIABLE_RATIO` x the stored size for those.

Decompression then stops at the declared size: an LZ4 block is decoded into exactly
that many bytes; a zstd frame in one call up to it when it is at most
:data:`STREAM_ABOVE`, and above that in chunks, so that memory follows the bytes the
frame really produces and never the declared size alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import lz4.block
import zstandard

from .errors import CORRUPT_DATA_ERRORS, AtpValueError, RecordDecodeError
from .types import TAG_NONE, TAG_STR, TENSOR_TAGS

CODEC_NONE = 0
CODEC_LZ4 = 1
CODEC_ZSTD = 2
CODEC_NAMES = {CODEC_NONE: "none", CODEC_LZ4: "lz4", CODEC_ZSTD: "zstd"}
CODEC_IDS = {v: k for k, v in CODEC_NAMES.items()}
# an LZ4 block expands at most ~255x; a zstd RLE block turns 4 bytes into up to 128 KiB
_MAX_RATIO = {CODEC_LZ4: 256, CODEC_ZSTD: 32768}
_local = threading.local()
# what the decompressors raise on corrupt input (and what numpy/struct may raise around them)
_DECOMPRESS_ERRORS = (lz4.block.LZ4BlockError, zstandard.ZstdError, *CORRUPT_DATA_ERRORS)
#: Bytes the strings and tensors of one record (sections with no fixed size in the
#: schema) may hold whatever their stored size ...
VARIABLE_FLOOR = 1 << 20
#: ... plus this many times the record's stored size.
VARIABLE_RATIO = 64
#: Largest declared size a zstd frame is decompressed to in one call (one allocation of
#: the declared size); larger frames are decompressed in chunks of this size.
STREAM_ABOVE = 1 << 20
#: Section header bytes besides the key: kind, key length, tag, payload length.
_SECTION_HEAD = 7
#: Record head bytes besides positions and atomic numbers: atom count, section count.
_RECORD_HEAD = 6
_VARIABLE_TAGS = frozenset({TAG_STR, *TENSOR_TAGS})


class RecordBound:
    """The most bytes a record can hold under one file's schema (see the module doc).

    ``bound(n_atoms, stored)`` is ``fixed + per_atom * n_atoms`` plus, when the schema
    has sections of no fixed size, ``VARIABLE_FLOOR + VARIABLE_RATIO * stored``. A file
    without a schema (atompack < 0.3) has no per-record bound beyond the codec's.

    Args:
        schema (Schema, optional): The file's schema.
        positions_itemsize (int): Bytes of one position coordinate (4 or 8).
    """

    __slots__ = ("fixed", "per_atom", "variable", "schemaless")

    def __init__(self, schema: Any, positions_itemsize: int) -> None:
        self.schemaless = schema is None
        self.fixed = _RECORD_HEAD
        self.per_atom = 3 * positions_itemsize + 1  # positions and the atomic number
        self.variable = schema is None
        for entry in (schema.entries.values() if schema is not None else ()):
            self.fixed += _SECTION_HEAD + len(entry.key.encode("utf-8"))
            if entry.tag in _VARIABLE_TAGS:
                self.variable = True
            elif entry.tag == TAG_NONE:
                continue
            elif entry.per_atom:
                self.per_atom += entry.slot_bytes
            else:
                self.fixed += entry.slot_bytes

    def __call__(self, n_atoms: int, stored: int) -> int | None:
        """The most bytes record of ``n_atoms`` atoms stored in ``stored`` bytes can hold
        (:obj:`None`: no bound, a file without a schema)."""
        if self.schemaless:
            return None
        bound = self.fixed + self.per_atom * n_atoms
        if self.variable:
            bound += VARIABLE_FLOOR + VARIABLE_RATIO * stored
        return bound


def codec_id(name: str) -> int:
    """The codec byte for ``"none"``, ``"lz4"`` or ``"zstd"``."""
    try:
        return CODEC_IDS[name]
    except KeyError:
        raise AtpValueError(
            f"unknown compression {name!r}; expected one of {sorted(CODEC_IDS)}") from None


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    # a ZstdDecompressor must not be shared between threads, so keep one per thread
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def plausible_raw_size(codec: int, stored: int, raw: int) -> bool:
    """Whether ``raw`` bytes can come out of ``stored`` compressed bytes with this codec.

    Checked before decompressing so that a crafted index cannot make the reader
    allocate far more memory than the file could ever expand to.
    """
    if codec == CODEC_NONE:
        return raw == stored
    return raw <= stored * _MAX_RATIO[codec] + 131072


def _zstd_stream(data, raw: int) -> bytes:
    """A zstd frame decompressed in chunks, refused past ``raw`` bytes of output."""
    reader = _zstd_decompressor().stream_reader(data, read_size=STREAM_ABOVE,
                                                read_across_frames=False)
    out = bytearray()
    with reader:
        while len(out) <= raw:
            chunk = reader.read(min(STREAM_ABOVE, raw + 1 - len(out)))
            if not chunk:
                break
            out += chunk
    return bytes(out)


def decompress(codec: int, data, raw: int, where: str, n_atoms: int | None = None,
               bound: RecordBound | None = None) -> bytes:
    """Decompress one stored record to exactly ``raw`` bytes.

    Args:
        codec (int): Codec byte of the file.
        data (bytes-like): The stored bytes.
        raw (int): The uncompressed size from the index.
        where (str): ``"file: record i"`` for error messages.
        n_atoms (int, optional): The atom count from the index, checked with ``bound``.
            (default: :obj:`None`)
        bound (RecordBound, optional): The file's record bound. (default: :obj:`None`)

    Returns:
        The record bytes.

    Raises:
        RecordDecodeError: Corrupt data, a size mismatch, or a declared size more than
            the codec or a record of ``n_atoms`` atoms under the schema allows.
    """
    if codec == CODEC_NONE:
        return data
    if not plausible_raw_size(codec, len(data), raw):
        raise RecordDecodeError(
            f"{where}: uncompressed size {raw} is impossible for {len(data)} stored bytes")
    if bound is not None and n_atoms is not None:
        most = bound(n_atoms, len(data))
        if most is not None and raw > most:
            raise RecordDecodeError(
                f"{where}: declares {raw} uncompressed bytes, more than a record of "
                f"{n_atoms} atoms can hold under the file's schema ({most} bytes)")
    try:
        if codec == CODEC_LZ4:
            out = lz4.block.decompress(data, uncompressed_size=raw)
        else:
            # the frame header may claim any size; never let it drive the allocation
            content_size = zstandard.frame_content_size(data)
            if content_size not in (-1, raw):
                raise RecordDecodeError(
                    f"{where}: zstd frame declares {content_size} bytes, index says {raw}")
            if raw <= STREAM_ABOVE:
                out = _zstd_decompressor().decompress(data, max_output_size=raw)
            else:
                out = _zstd_stream(data, raw)
    except RecordDecodeError:
        raise
    except _DECOMPRESS_ERRORS as exc:
        raise RecordDecodeError(f"{where}: {CODEC_NAMES[codec]} decompression failed: {exc}") \
            from exc
    if len(out) != raw:
        raise RecordDecodeError(
            f"{where}: decompressed to {len(out)} bytes, index says {raw}")
    return out


def make_compressor(codec: int, level: int) -> Callable[[bytes], bytes]:
    """A function compressing one record the way atompack-db does.

    Args:
        codec (int): Codec byte.
        level (int): zstd level (ignored by the other codecs).

    Returns:
        ``compress(record_bytes) -> stored_bytes``.
    """
    if codec == CODEC_NONE:
        return bytes
    if codec == CODEC_LZ4:
        def compress_lz4(data: bytes) -> bytes:
            return lz4.block.compress(data, mode="high_compression", compression=12,
                                      store_size=False)
        return compress_lz4
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return cctx.compress
