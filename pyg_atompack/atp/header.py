"""The two 4096-byte header slots: decode, validate, choose, encode (spec §2).

A remote reader only needs the first 8192 bytes of a file plus its size to learn
where the index lives, so :func:`select_header` works on a plain ``bytes``.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from dataclasses import dataclass, replace

from .errors import HeaderError, NotAtpFileError, TruncatedCommitWarning, TruncatedFileError
from .types import RECORD_FORMATS

MAGIC = b"ATPK"
FORMAT_VERSION = 2
SLOT_SIZE = 4096
HEADER_SIZE = 2 * SLOT_SIZE
DATA_START = HEADER_SIZE
INDEX_ENTRY_SIZE = 20
SLOT_NAMES = ("A", "B")

_FIELDS = struct.Struct("<4sIQQQQQB3xiIQQ")
_CHECKSUM_AT = SLOT_SIZE - 4


@dataclass(frozen=True)
class Header:
    """The committed state described by one header slot.

    Args:
        generation (int, optional): Commit counter. (default: :obj:`0`)
        data_start (int, optional): First byte after the header region (8192).
            (default: :obj:`DATA_START`)
        index_offset (int, optional): Absolute offset of the index block (0 if never flushed).
            (default: :obj:`0`)
        index_len (int, optional): Index block length in bytes. (default: :obj:`0`)
        num_molecules (int, optional): Committed molecule count. (default: :obj:`0`)
        codec (int, optional): 0 none, 1 LZ4, 2 zstd. (default: :obj:`0`)
        level (int, optional): codec level field (zstd level, else 0). (default: :obj:`0`)
        record_format (int, optional): 2 or 3. (default: :obj:`2`)
        schema_offset (int, optional): Absolute offset of the schema block (0 = none).
            (default: :obj:`0`)
        schema_len (int, optional): Schema block length (0 = none). (default: :obj:`0`)
        slot (str, optional): ``"A"`` or ``"B"``, the slot this header was read from.
            (default: :obj:`"A"`)
    """

    generation: int = 0
    data_start: int = DATA_START
    index_offset: int = 0
    index_len: int = 0
    num_molecules: int = 0
    codec: int = 0
    level: int = 0
    record_format: int = 2
    schema_offset: int = 0
    schema_len: int = 0
    slot: str = "A"

    @property
    def committed_end(self) -> int:
        """End of the committed bytes: end of the index block, or data_start."""
        if self.index_offset and self.index_len:
            return self.index_offset + self.index_len
        return self.data_start

    @property
    def has_schema(self) -> bool:
        """Whether this header references a schema block."""
        return self.schema_len > 0


@dataclass(frozen=True)
class SlotReport:
    """What one slot holds and why it is (in)valid, for :func:`pyg_atompack.atp.describe`.

    Args:
        slot (str): ``"A"`` or ``"B"``.
        header (Header | None): Decoded fields, or None when the magic is missing.
        valid (bool): Whether the slot passes every check of spec §2.1.
        problem (str | None): Why it is invalid (None when valid).
    """

    slot: str
    header: Header | None
    valid: bool
    problem: str | None


def decode_slot(raw: bytes, file_size: int, slot: str = "A") -> SlotReport:
    """Decode one 4096-byte slot and check it against spec §2.1.

    Args:
        raw (bytes): The slot's bytes (at least 4096).
        file_size (int): Current length of the file (offsets must lie inside it).
        slot (str, optional): ``"A"`` or ``"B"`` (recorded in the result). (default: :obj:`"A"`)

    Returns:
        A :class:`SlotReport`; ``header`` is None only when the magic is wrong.
    """
    raw = bytes(raw[:SLOT_SIZE])
    if len(raw) < SLOT_SIZE:
        return SlotReport(slot, None, False, f"slot {slot} is truncated ({len(raw)} bytes)")
    (magic, version, gen, data_start, index_offset, index_len, count, codec, level, rec_fmt,
     schema_offset, schema_len) = _FIELDS.unpack_from(raw, 0)
    if magic != MAGIC:
        return SlotReport(slot, None, False, f"slot {slot} has no ATPK magic")
    header = Header(gen, data_start, index_offset, index_len, count, codec, level, rec_fmt,
                    schema_offset, schema_len, slot)
    problem = _slot_problem(raw, version, header, file_size)
    return SlotReport(slot, header, problem is None, problem and f"slot {slot}: {problem}")


def _slot_problem(raw: bytes, version: int, h: Header, file_size: int) -> str | None:
    if version != FORMAT_VERSION:
        return f"unsupported format version {version}"
    stored = struct.unpack_from("<I", raw, _CHECKSUM_AT)[0]
    actual = zlib.adler32(raw[:_CHECKSUM_AT])
    if stored != actual:
        return f"checksum mismatch (stored {stored:#010x}, computed {actual:#010x})"
    if h.codec not in (0, 1, 2):
        return f"unknown codec {h.codec}"
    if not HEADER_SIZE <= h.data_start <= file_size:
        return f"data_start {h.data_start} outside [8192, file size {file_size}]"
    if (h.schema_offset == 0) != (h.schema_len == 0):
        return f"schema offset {h.schema_offset} / length {h.schema_len}: only one is zero"
    if h.schema_len and (
        h.schema_offset < h.data_start or h.schema_offset + h.schema_len > file_size
    ):
        return (f"schema block [{h.schema_offset}, +{h.schema_len}) outside the data region "
                f"(file size {file_size})")
    if h.index_offset == 0 or h.index_len == 0:
        if h.index_offset or h.index_len or h.num_molecules:
            return (f"empty index with index_offset {h.index_offset}, index_len {h.index_len}, "
                    f"num_molecules {h.num_molecules}")
        return None
    if h.index_len != 8 + INDEX_ENTRY_SIZE * h.num_molecules:
        return f"index_len {h.index_len} does not match num_molecules {h.num_molecules}"
    if h.index_offset < h.data_start or h.index_offset + h.index_len > file_size:
        return (f"index block [{h.index_offset}, +{h.index_len}) outside the data region "
                f"(file size {file_size})")
    return None


def inspect_slots(buf: bytes, file_size: int) -> list[SlotReport]:
    """Decode both slots of a header region.

    Args:
        buf (bytes): The first 8192 bytes of the file (or fewer if the file is shorter).
        file_size (int): The file's length.

    Returns:
        Reports for slot A and slot B.
    """
    return [decode_slot(buf[i * SLOT_SIZE:(i + 1) * SLOT_SIZE], file_size, name)
            for i, name in enumerate(SLOT_NAMES)]


def select_header(buf: bytes, file_size: int, name: str) -> Header:
    """Choose the committed header: the valid slot with the larger generation (tie: A).

    Args:
        buf (bytes): The first 8192 bytes of the file (an HTTP range read is enough).
        file_size (int): The full length of the file.
        name (str): File name used in error messages.

    Returns:
        The chosen :class:`Header`.

    Raises:
        NotAtpFileError: No slot carries the ``ATPK`` magic.
        TruncatedFileError: The file is shorter than the 8192-byte header.
        HeaderError: No slot is valid, or the chosen slot has an unknown record format.

    Warns:
        TruncatedCommitWarning: a newer slot is valid but for pointing past the end
            of the file, so the file was probably cut short and an older commit is read.
    """
    if bytes(buf[:4]) != MAGIC and bytes(buf[SLOT_SIZE:SLOT_SIZE + 4]) != MAGIC:
        raise NotAtpFileError(f"{name}: not an .atp file (no ATPK magic in either header slot)")
    if file_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise TruncatedFileError(
            f"{name}: file is {min(file_size, len(buf))} bytes, shorter than the "
            f"{HEADER_SIZE}-byte header")
    reports = inspect_slots(buf, file_size)
    valid = [r.header for r in reports if r.valid]
    if not valid:
        problems = "; ".join(r.problem or "" for r in reports)
        raise HeaderError(f"{name}: no valid header slot ({problems})")
    # max() keeps the first maximum, so slot A wins a tie
    chosen = max(valid, key=lambda h: h.generation)
    if chosen.record_format not in RECORD_FORMATS:
        raise HeaderError(
            f"{name}: header slot {chosen.slot} has unsupported record format "
            f"{chosen.record_format}")
    _warn_if_cut_short(buf, file_size, chosen, name)
    return chosen


def _warn_if_cut_short(buf: bytes, file_size: int, chosen: Header, name: str) -> None:
    # A newer slot that only fails the "inside the file" checks names a commit the
    # file once held: the tail was lost after the commit, not torn during it.
    for i, slot in enumerate(SLOT_NAMES):
        if slot == chosen.slot:
            continue
        raw = buf[i * SLOT_SIZE:(i + 1) * SLOT_SIZE]
        newer = decode_slot(raw, 1 << 62, slot)
        if newer.valid and newer.header.generation > chosen.generation:
            h = newer.header
            end = max(h.committed_end, h.schema_offset + h.schema_len)
            warnings.warn(
                f"{name}: the newest commit (generation {h.generation}, "
                f"{h.num_molecules} records) ends at byte {end} but the file is "
                f"{file_size} bytes; the file "
                f"looks cut short, so the previous commit (generation {chosen.generation}, "
                f"{chosen.num_molecules} records) is read",
                TruncatedCommitWarning, stacklevel=3)


def encode_slot(header: Header) -> bytes:
    """Encode a header into one 4096-byte slot with its Adler-32 checksum."""
    body = bytearray(SLOT_SIZE)
    _FIELDS.pack_into(
        body, 0, MAGIC, FORMAT_VERSION, header.generation, header.data_start,
        header.index_offset, header.index_len, header.num_molecules, header.codec,
        header.level, header.record_format, header.schema_offset, header.schema_len)
    struct.pack_into("<I", body, _CHECKSUM_AT, zlib.adler32(bytes(body[:_CHECKSUM_AT])))
    return bytes(body)


def slot_offset_for_generation(generation: int) -> int:
    """File offset of the slot a commit of ``generation`` goes to (even: A, odd: B)."""
    return 0 if generation % 2 == 0 else SLOT_SIZE


def with_slot(header: Header, slot: str) -> Header:
    """A copy of ``header`` labelled with ``slot``."""
    return replace(header, slot=slot)
