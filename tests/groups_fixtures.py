"""Framed `.atp` files with groups, laid out the way upstream's writer lays them out.

An encoder independent of the package (``struct`` and ``zlib`` only), following
``atompack/src/storage/mod.rs``, ``frames.rs`` and ``extensions.rs`` of LeMaterial/atompack
at 90da9bd35904a3625ab143eeb5cdd8d532a22c78: ``create`` writes two generation-0 slots;
the first write marks both slots "writing" (generations 1 and 2, ``num_molecules =
2**64 - 1``, no index); records and schema go out as frames, each ``add_groups`` call as
one groups frame (a chunk); ``flush`` writes the metadata directory
(``[version u32 = 1][count u32]`` then ``[kind u32][offset u64][len u64]`` per frame) at
``data_end``, the index right after it, and commits generation 3 into slot B. The
records and schema block are taken from a 0.4.1 file written by ``atp.Writer``.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from pyg_atompack import atp

SLOT, HEADER = 4096, 8192
FRAMED, WRITING = 1, 2
RECORD, SCHEMA, GROUPS = 1, 2, 3


def frame(kind: int, payload: bytes, raw: int = 0, n_atoms: int = 0) -> bytes:
    head = struct.pack("<IIII", kind, len(payload), raw, n_atoms)
    return head + struct.pack("<I", zlib.crc32(head + payload)) + payload


def slot(generation: int, *, count: int, index: tuple[int, int] = (0, 0), codec: int = 0,
         level: int = 0, record_format: int = 2, schema: tuple[int, int] = (0, 0),
         ext: tuple[int, int] = (0, 0), flags: int = FRAMED, data_end: int = HEADER) -> bytes:
    body = bytearray(SLOT)
    struct.pack_into("<4sIQQQQQB3xiIQQQQIQ", body, 0, b"ATPK", 2, generation, HEADER, *index,
                     count, codec, level, record_format, *schema, *ext, flags, data_end)
    struct.pack_into("<I", body, SLOT - 4, zlib.adler32(bytes(body[:SLOT - 4])))
    return bytes(body)


def source_records(path: Path) -> tuple[dict, list[tuple[bytes, int, int]]]:
    """Codec fields, schema block and stored records of a committed 0.4.1 file."""
    data = path.read_bytes()
    with atp.open(path, access="pread") as reader:
        h = reader.header
        records = [(data[o:o + s], r, n) for o, s, r, n in reader.index.tolist()]
    return dict(codec=h.codec, level=h.level, record_format=h.record_format,
                schema=data[h.schema_offset:h.schema_offset + h.schema_len]), records


def write_framed(path: Path, source: Path, chunks: list[bytes],
                 extra: list[tuple[int, bytes]] = (), commit: bool = True) -> None:
    """``source``'s records as a framed file, then one groups frame per chunk.

    Args:
        path (Path): The file to write.
        source (Path): A 0.4.1 file whose records, codec and schema are used.
        chunks (list[bytes]): Groups payloads, one frame each, in order.
        extra (list[tuple[int, bytes]]): Further metadata frames ``(kind, payload)``
            written before the groups (e.g. kind 99, "from a newer version").
        commit (bool): Flush (directory, index, committed slot B); else leave the file
            as a crash before the flush does (both slots writing).
    """
    meta, records = source_records(source)
    codec = dict(codec=meta["codec"], level=meta["level"])
    out = bytearray()
    schema_payload = struct.pack("<I", meta["record_format"]) + meta["schema"]
    schema_span = (HEADER + 20 + 4, len(meta["schema"]))
    out += frame(SCHEMA, schema_payload)
    index = []
    for stored, raw, n in records:
        index.append((HEADER + len(out) + 20, len(stored), raw, n))
        out += frame(RECORD, stored, raw, n)
    directory = []
    for kind, payload in [*extra, *((GROUPS, c) for c in chunks)]:
        directory.append((kind, HEADER + len(out) + 20, len(payload)))
        out += frame(kind, payload)
    writing = [slot(g, count=2**64 - 1, flags=FRAMED | WRITING, data_end=HEADER,
                    record_format=2, **codec) for g in (2, 1)]  # slot A: gen 2, B: gen 1
    if not commit:
        path.write_bytes(b"".join(writing) + out)
        return
    data_end = HEADER + len(out)
    dir_block = struct.pack("<II", 1, len(directory)) + b"".join(
        struct.pack("<IQQ", *e) for e in directory) if directory else b""
    index_block = struct.pack("<Q", len(index)) + b"".join(struct.pack("<QIII", *e)
                                                           for e in index)
    committed = slot(3, count=len(index), index=(data_end + len(dir_block), len(index_block)),
                     record_format=meta["record_format"], schema=schema_span,
                     ext=(data_end, len(dir_block)) if dir_block else (0, 0),
                     data_end=data_end, **codec)
    path.write_bytes(writing[0] + committed + out + dir_block + index_block)


def plain_file(path: Path, n: int, compression: str = "zstd") -> Path:
    """``n`` small molecules with energy ``i`` (record ``i`` has ``i % 3 + 1`` atoms)."""
    rng = np.random.default_rng(0)
    with atp.Writer(path, compression=compression) as w:
        for i in range(n):
            k = i % 3 + 1
            w.add(rng.normal(size=(k, 3)).astype(np.float32), np.full(k, 6 + i % 3),
                  energy=float(i), forces=rng.normal(size=(k, 3)).astype(np.float32))
    return path
