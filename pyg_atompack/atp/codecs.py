"""Per-record compression: none, raw LZ4 blocks, zstd frames (spec §9).

A compressed record's index entry declares its uncompressed size, and the decompressors
allocate that size before they look at the data: a few stored bytes could make a reader
allocate gigabytes. So before decompressing, the declared size must be

* possible for the codec (:func:`plausible_raw_size`: LZ4 expands at most 255x, zstd
  32768x), and
* above :data:`CHECK_ABOVE` (64 KiB), no more than a record of its atom count can hold
  under the file's schema (:class:`RecordBound`): the record's head (atom count,
  positions, atomic numbers, section count), every schema section's header, the
  fixed payloads (``slot_bytes`` once per molecule, or per atom for per-atom sections)
  and, only when the schema has sections of no fixed size (strings, tensors),
  :data:`VARIABLE_FLOOR` + :data:`VARIABLE_RATIO` x the stored size for those.

Decompression then stops at the declared size: an LZ4 block is decoded into exactly
that many bytes; a zstd frame in one call up to it when it is at most
:data:`STREAM_ABOVE`, and above that in chunks (its atom count compared with the
index's after the first 4 KiB), so that memory follows the bytes the frame really
produces and never the declared size alone. An LZ4 block above that size has its
first sequences decoded first, for the same comparison, before the declared size is
allocated.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

import lz4.block
import numpy as np
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
#: Declared sizes up to this are decompressed without computing the record bound: an
#: allocation this small costs less than the check would on every record of the hot path
#: (records of small molecules are a few KiB).
CHECK_ABOVE = 64 << 10
#: Largest declared size a zstd frame is decompressed to in one call (one allocation of
#: the declared size); larger frames are decompressed in chunks of this size.
STREAM_ABOVE = 1 << 20
#: Section header bytes besides the key: kind, key length, tag, payload length.
_SECTION_HEAD = 7
#: Record head bytes besides positions and atomic numbers: atom count, section count.
_RECORD_HEAD = 6
_VARIABLE_TAGS = frozenset({TAG_STR, *TENSOR_TAGS})
#: A file without a schema: per atom, forces and velocities as float64 vectors and
#: charges as float64, each with its section header ...
_SCHEMALESS_PER_ATOM = 24 + 24 + 8
#: ... and per molecule, those three headers plus energy, cell, stress and pbc with theirs.
_SCHEMALESS_FIXED = 3 * 17 + (8 + 13) + (72 + 11) + (72 + 13) + (3 + 10)
#: Bytes of a streamed frame decompressed before its atom count is compared with the index.
_HEAD_CHECK = 4096
_U32 = struct.Struct("<I")


class RecordBound:
    """The most bytes a record can hold under one file's schema (see the module doc).

    ``bound(n_atoms, stored)`` is ``fixed + per_atom * n_atoms`` plus, when the schema
    has sections of no fixed size, ``VARIABLE_FLOOR + VARIABLE_RATIO * stored``. A file
    without a schema (atompack < 0.3) is bounded as if it had every builtin at its
    widest (:data:`_SCHEMALESS_PER_ATOM`, :data:`_SCHEMALESS_FIXED`) and sections of no
    fixed size.

    Args:
        schema (Schema | None): The file's schema, :obj:`None` for a file without one.
        positions_itemsize (int): Bytes of one position coordinate (4 or 8).
    """

    __slots__ = ("fixed", "per_atom", "variable")

    def __init__(self, schema: Any, positions_itemsize: int) -> None:
        self.fixed = _RECORD_HEAD
        self.per_atom = 3 * positions_itemsize + 1  # positions and the atomic number
        self.variable = schema is None
        if schema is None:
            self.fixed += _SCHEMALESS_FIXED
            self.per_atom += _SCHEMALESS_PER_ATOM
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

    def __call__(self, n_atoms: int, stored: int) -> int:
        """The most bytes a record of ``n_atoms`` atoms stored in ``stored`` bytes can
        hold."""
        bound = self.fixed + self.per_atom * n_atoms
        if self.variable:
            bound += VARIABLE_FLOOR + VARIABLE_RATIO * stored
        return bound

    def first_excess(self, n_atoms: np.ndarray, stored: np.ndarray,
                     raw: np.ndarray) -> int | None:
        """The position of the first record declaring more than its bound, or
        :obj:`None` (index entry columns of a batch, checked in a few numpy calls)."""
        bound = self.fixed + self.per_atom * n_atoms.astype(np.int64)
        if self.variable:
            bound += VARIABLE_FLOOR + VARIABLE_RATIO * stored.astype(np.int64)
        excess = raw > bound
        return int(np.argmax(excess)) if excess.any() else None

    def refusal(self, n_atoms: int, stored: int, raw: int, where: str) -> RecordDecodeError:
        """The error for a record declaring ``raw`` bytes beyond its bound."""
        return RecordDecodeError(
            f"{where}: declares {raw} uncompressed bytes, more than a record of "
            f"{n_atoms} atoms can hold under the file's schema "
            f"({self(n_atoms, stored)} bytes)")


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


def _zstd_stream(data, raw: int, n_atoms: int | None, where: str) -> bytes:
    """A zstd frame decompressed in chunks, refused past ``raw`` bytes of output, and as
    soon as its first bytes state another atom count than the index."""
    reader = _zstd_decompressor().stream_reader(data, read_size=1 << 16,
                                                read_across_frames=False)
    out = bytearray()
    with reader:
        out += reader.read(_HEAD_CHECK)
        _check_head(out, n_atoms, where)
        while len(out) <= raw:
            chunk = reader.read(min(STREAM_ABOVE, raw + 1 - len(out)))
            if not chunk:
                break
            out += chunk
    return bytes(out)


def _lz4_head(data, want: int) -> bytes:
    """The first ``want`` bytes an LZ4 block decodes to (its first sequences only).

    ``lz4.block`` decodes whole blocks into the declared size; a record's atom count is
    its first four bytes, so this reads just enough of the block's sequences (literal
    runs and back-references, LZ4 block format) to compare it before that allocation.
    """
    out = bytearray()
    at = 0
    while len(out) < want:
        token = data[at]
        at += 1
        literals = token >> 4
        if literals == 15:
            while True:
                extra = data[at]
                at += 1
                literals += extra
                if extra != 255:
                    break
        out += data[at:at + literals]
        at += literals
        if len(out) >= want:
            break
        offset = data[at] | data[at + 1] << 8
        at += 2
        if not 0 < offset <= len(out):
            raise lz4.block.LZ4BlockError("corrupt block: back-reference before the start")
        for _ in range(min((token & 15) + 4, want - len(out))):  # a longer match only
            out.append(out[-offset])  # repeats bytes past what is wanted
    return bytes(out[:want])


def _check_head(head: bytes, n_atoms: int | None, where: str) -> None:
    """Refuse a record whose first bytes state another atom count than the index."""
    if n_atoms is not None and len(head) >= 4 and _U32.unpack_from(head)[0] != n_atoms:
        raise RecordDecodeError(f"{where}: record holds {_U32.unpack_from(head)[0]} atoms "
                                f"but the index says {n_atoms}")


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
    if raw > CHECK_ABOVE and bound is not None and n_atoms is not None and \
            raw > bound(n_atoms, len(data)):
        raise bound.refusal(n_atoms, len(data), raw, where)
    try:
        if codec == CODEC_LZ4:
            if raw > STREAM_ABOVE:  # compare the atom count before allocating ``raw``
                _check_head(_lz4_head(data, 4), n_atoms, where)
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
                out = _zstd_stream(data, raw, n_atoms, where)
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
