"""A small, independent encoder of framed `.atp` files for the tests.

It follows ``atompack/src/storage/frames.rs`` (LeMaterial/atompack, commit
90da9bd35904a3625ab143eeb5cdd8d532a22c78) and ``docs/atp-format.md`` §15 with
``struct`` and ``zlib`` only: none of the package's framed code is used, so a test
comparing the package with it compares two implementations. Records and schema
blocks come from 0.4.1 files (written by ``atp.Writer``, byte-identical to
atompack-db 0.4.1, or the golden files): their stored bytes are taken as they are.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

HEADER = 8192
SLOT = 4096
FRAMED, WRITING = 1, 2
RECORD, SCHEMA, GROUPS = 1, 2, 3
WRITING_COUNT = (1 << 64) - 1


def frame(kind: int, payload: bytes, raw: int = 0, n_atoms: int = 0) -> bytes:
    """``[kind][len][uncompressed_len][n_atoms][crc32][payload]``, CRC over head[:16] + payload
    (``uncompressed_len`` and ``n_atoms`` are 0 in metadata frames: ``write_metadata_frame``)."""
    head = struct.pack("<IIII", kind, len(payload), raw, n_atoms)
    crc = zlib.crc32(head + payload)
    return head + struct.pack("<I", crc) + payload


def slot(generation: int, *, index_offset: int = 0, index_len: int = 0, count: int = 0,
         codec: int = 0, level: int = 0, record_format: int = 2, schema: tuple = (0, 0),
         ext: tuple = (0, 0), flags: int = FRAMED, data_end: int = 0) -> bytes:
    """One 4096-byte header slot with its Adler-32."""
    body = bytearray(SLOT)
    struct.pack_into("<4sIQQQQQB3xiIQQ", body, 0, b"ATPK", 2, generation, HEADER, index_offset,
                     index_len, count, codec, level, record_format, *schema)
    struct.pack_into("<QQIQ", body, 76, *ext, flags, data_end)
    struct.pack_into("<I", body, SLOT - 4, zlib.adler32(bytes(body[:SLOT - 4])))
    return bytes(body)


@dataclass
class Source:
    """What a framed file is made of: a 0.4.1 file's records, codec and schema."""

    codec: int
    level: int
    record_format: int
    schema: bytes
    records: list[tuple[bytes, int, int]]  # (stored bytes, raw size, n_atoms)


def source_of(path) -> Source:
    """Records, codec and schema block of a 0.4.1 file, parsed with ``struct`` alone."""
    data = Path(path).read_bytes()
    best = None
    for at in (0, SLOT):
        (gen, _, index_offset, index_len, count, codec, level, rf, so, sl) = struct.unpack_from(
            "<QQQQQB3xiIQQ", data, at + 8)
        if zlib.adler32(data[at:at + SLOT - 4]) != struct.unpack_from("<I", data, at + SLOT - 4)[0]:
            continue
        if best is None or gen > best[0]:
            best = (gen, index_offset, count, codec, level, rf, so, sl)
    _, index_offset, count, codec, level, rf, so, sl = best
    records = []
    for i in range(count):
        off, stored, raw, n = struct.unpack_from("<QIII", data, index_offset + 8 + 20 * i)
        records.append((data[off:off + stored], raw, n))
    return Source(codec, level, rf, data[so:so + sl], records)


@dataclass
class Framed:
    """A framed file being built, the way the reference's writer lays it out.

    ``items`` are frames in file order: ``("record", i)`` for record ``i`` of the
    source, ``("schema",)`` for a schema frame, ``("meta", kind, payload)``.
    """

    source: Source
    items: list = field(default_factory=list)

    def data(self) -> tuple[bytes, list, list, tuple[int, int]]:
        """Frames, index entries, metadata (kind, offset, len) and the schema span."""
        out = bytearray()
        entries, metadata, schema = [], [], (0, 0)
        for item in self.items:
            at = HEADER + len(out)
            if item[0] == "record":
                stored, raw, n = self.source.records[item[1]]
                out += frame(RECORD, stored, raw, n)
                entries.append((at + 20, len(stored), raw, n))
            elif item[0] == "schema":
                payload = struct.pack("<I", self.source.record_format) + self.source.schema
                out += frame(SCHEMA, payload)
                schema = (at + 24, len(self.source.schema)) if self.source.schema else (0, 0)
            else:
                kind, payload = item[1], item[2]
                out += frame(kind, payload)
                metadata.append((kind, at + 20, len(payload)))
        return bytes(out), entries, metadata, schema

    def _slot_args(self) -> dict:
        s = self.source
        return dict(codec=s.codec, level=s.level, record_format=s.record_format)

    def _writing_slots(self) -> tuple[bytes, bytes]:
        """Slots A and B after ``begin_write`` on a new file (``mod.rs`` at 90da9bd):
        generations 1 (slot B) and 2 (slot A), the state of the empty file (record
        format 2, no schema, ``data_end`` 8192), no index, ``num_molecules = 2**64 - 1``."""
        args = dict(count=WRITING_COUNT, flags=FRAMED | WRITING, data_end=HEADER,
                    codec=self.source.codec, level=self.source.level, record_format=2)
        return slot(2, **args), slot(1, **args)

    def writing(self) -> bytes:
        """The file as a crash leaves it: both slots in the writing state, no index."""
        frames, _, _, _ = self.data()
        return b"".join(self._writing_slots()) + frames

    def committed(self) -> bytes:
        """The file after a flush: the directory, then the index after the last frame;
        slot B committed (generation 3), slot A still in the writing state."""
        frames, entries, metadata, schema = self.data()
        data_end = HEADER + len(frames)
        index = struct.pack("<Q", len(entries)) + b"".join(
            struct.pack("<QIII", *e) for e in entries)
        directory = struct.pack("<II", 1, len(metadata)) + b"".join(
            struct.pack("<IQQ", *m) for m in metadata) if metadata else b""
        ext = (data_end, len(directory)) if directory else (0, 0)
        done = slot(3, index_offset=data_end + len(directory), index_len=len(index),
                    count=len(entries), schema=schema, ext=ext, flags=FRAMED,
                    data_end=data_end, **self._slot_args())
        return self._writing_slots()[0] + done + frames + directory + index


def boundaries(framed: Framed) -> list[int]:
    """File offsets at which each frame ends (where a cut leaves whole frames)."""
    ends, at = [], HEADER
    frames = framed.data()[0]
    while at < HEADER + len(frames):
        (length,) = struct.unpack_from("<I", frames, at - HEADER + 4)
        at += 20 + length
        ends.append(at)
    return ends


#: The framed golden files (``tests/data/atp_framed/``): name -> (0.4.1 golden source,
#: state). Each holds the source's records, a schema frame first and a kind-99 frame
#: after the first half of the records.
GOLDEN_CASES = {
    "committed_none_rf3.atp": ("f64_positions.atp", "committed"),
    "committed_zstd.atp": ("builtins_zstd.atp", "committed"),
    "committed_lz4_custom.atp": ("batch_canonical_lz4.atp", "committed"),
    "writing_torn_lz4.atp": ("builtins_lz4.atp", "writing, last frame torn"),
}


def golden_bytes(golden_dir: Path, name: str) -> bytes:
    """What the framed golden file ``name`` holds, built from its 0.4.1 source."""
    source_name, state = GOLDEN_CASES[name]
    source = source_of(golden_dir / source_name)
    count = len(source.records)
    items = [("schema",)] + [("record", i) for i in range(count // 2)] + \
        [("meta", 99, b"a frame from a newer version")] + \
        [("record", i) for i in range(count // 2, count)]
    framed = Framed(source, items)
    return framed.committed() if state == "committed" else framed.writing()[:-5]
