"""Per-record compression: none, raw LZ4 blocks, zstd frames (spec §9)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import lz4.block
import zstandard

from .errors import CORRUPT_DATA_ERRORS, AtpValueError, RecordDecodeError

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


def decompress(codec: int, data, raw: int, where: str) -> bytes:
    """Decompress one stored record to exactly ``raw`` bytes.

    Args:
        codec (int): Codec byte of the file.
        data (bytes-like): The stored bytes.
        raw (int): The uncompressed size from the index.
        where (str): ``"file: record i"`` for error messages.

    Returns:
        The record bytes.

    Raises:
        RecordDecodeError: Corrupt data or a size mismatch.
    """
    if codec == CODEC_NONE:
        return data
    if not plausible_raw_size(codec, len(data), raw):
        raise RecordDecodeError(
            f"{where}: uncompressed size {raw} is impossible for {len(data)} stored bytes")
    try:
        if codec == CODEC_LZ4:
            out = lz4.block.decompress(data, uncompressed_size=raw)
        else:
            # the frame header may claim any size; never let it drive the allocation
            content_size = zstandard.frame_content_size(data)
            if content_size not in (-1, raw):
                raise RecordDecodeError(
                    f"{where}: zstd frame declares {content_size} bytes, index says {raw}")
            out = _zstd_decompressor().decompress(data, max_output_size=raw)
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
