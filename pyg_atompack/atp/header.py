"""The two 4096-byte header slots: decode, validate, choose, encode (spec §2).

A remote reader only needs the first 8192 bytes of a file plus its size to learn
where the index lives, so :func:`select_header` works on a plain ``bytes``.

The framed revision of the format (``docs/atp-format.md`` §15) adds four fields
after the schema span, zero in every 0.4.1 file: the extensions directory's span,
flags (:data:`FLAG_FRAMED`, :data:`FLAG_WRITING`) and ``data_end``, the end of the
last frame. A slot in the writing state holds ``index_offset = 0`` and
``num_molecules = 2**64 - 1``, which 0.4.1 readers refuse; :func:`select_header`
returns it only to callers that can scan the frames (``allow_writing=True``).
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
#: Header flag: everything after the header region is a frame (``frames.py``).
FLAG_FRAMED = 1
#: Header flag: a write is under way (or was interrupted); the index is not valid.
FLAG_WRITING = 2
KNOWN_FLAGS = FLAG_FRAMED | FLAG_WRITING
#: ``num_molecules`` of a slot in the writing state ("invalid for older versions").
WRITING_COUNT = (1 << 64) - 1

_FIELDS = struct.Struct("<4sIQQQQQB3xiIQQQQIQ")
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
        ext_offset (int, optional): Absolute offset of the extensions directory (0 = none).
            (default: :obj:`0`)
        ext_len (int, optional): Its length in bytes (0 = none). (default: :obj:`0`)
        flags (int, optional): :data:`FLAG_FRAMED` / :data:`FLAG_WRITING` bits.
            (default: :obj:`0`)
        data_end (int, optional): End of the last frame of a framed file (0 in unframed
            files). (default: :obj:`0`)
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
    ext_offset: int = 0
    ext_len: int = 0
    flags: int = 0
    data_end: int = 0

    @property
    def framed(self) -> bool:
        """Whether the file's data region is a sequence of frames."""
        return bool(self.flags & FLAG_FRAMED)

    @property
    def writing(self) -> bool:
        """Whether the slot is in the writing state (its index is not valid)."""
        return bool(self.flags & FLAG_WRITING)

    @property
    def committed_end(self) -> int:
        """End of the committed bytes: end of the index block (or of the extensions
        directory after it), or data_start."""
        end = self.index_offset + self.index_len if self.index_offset and self.index_len \
            else self.data_start
        return max(end, self.ext_offset + self.ext_len, self.data_end)

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
     schema_offset, schema_len, ext_offset, ext_len, flags, data_end) = \
        _FIELDS.unpack_from(raw, 0)
    if magic != MAGIC:
        return SlotReport(slot, None, False, f"slot {slot} has no ATPK magic")
    header = Header(gen, data_start, index_offset, index_len, count, codec, level, rec_fmt,
                    schema_offset, schema_len, slot, ext_offset, ext_len, flags, data_end)
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
    problem = _framed_problem(h, file_size)
    if problem is not None or h.writing:
        return problem
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


def _framed_problem(h: Header, file_size: int) -> str | None:
    """What is wrong with the framed revision's fields (flags, extensions, data_end)."""
    if h.flags & ~KNOWN_FLAGS:
        return f"unknown header flags {h.flags:#x} (written by a newer version?)"
    if (h.ext_offset == 0) != (h.ext_len == 0):
        return f"extensions offset {h.ext_offset} / length {h.ext_len}: only one is zero"
    if h.ext_len and (h.ext_offset < h.data_start or h.ext_offset + h.ext_len > file_size):
        return (f"extensions directory [{h.ext_offset}, +{h.ext_len}) outside the data "
                f"region (file size {file_size})")
    if h.data_end and not h.data_start <= h.data_end <= file_size:
        return f"data_end {h.data_end} outside [data_start, file size {file_size}]"
    if h.writing:
        if not h.framed:
            return "writing state in a file that is not framed"
        if h.index_offset or h.index_len or h.num_molecules != WRITING_COUNT:
            return (f"writing state with index_offset {h.index_offset}, index_len "
                    f"{h.index_len}, num_molecules {h.num_molecules}")
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


def select_header(buf: bytes, file_size: int, name: str, allow_writing: bool = False) -> Header:
    """Choose the committed header: the valid slot with the larger generation (tie: A).

    Args:
        buf (bytes): The first 8192 bytes of the file (an HTTP range read is enough).
        file_size (int): The full length of the file.
        name (str): File name used in error messages.
        allow_writing (bool, optional): Return a slot in the writing state (the caller
            recovers the records by scanning the frames, :mod:`.frames`); otherwise
            such a file raises :class:`HeaderError`. (default: :obj:`False`)

    Returns:
        The chosen :class:`Header`.

    Raises:
        NotAtpFileError: No slot carries the ``ATPK`` magic.
        TruncatedFileError: The file is shorter than the 8192-byte header.
        HeaderError: No slot is valid, or the chosen slot has an unknown record format
            (or is in the writing state and ``allow_writing`` is False).

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
    # max() keeps the first maximum, so slot A wins a tie; a committed slot wins a tie
    # with one in the writing state (the commit's index is exact, a scan may stop early)
    chosen = max(valid, key=lambda h: (h.generation, not h.writing))
    if chosen.record_format not in RECORD_FORMATS:
        raise HeaderError(
            f"{name}: header slot {chosen.slot} has unsupported record format "
            f"{chosen.record_format}")
    if chosen.writing and not allow_writing:
        raise HeaderError(
            f"{name}: the file is in the writing state (a write is under way or was "
            f"interrupted: no header slot holds a committed index); its records are found "
            f"by scanning every frame, which needs the whole file: download it and open "
            f"it locally")
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
        if newer.valid and not newer.header.writing and \
                newer.header.generation > chosen.generation:
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
        header.level, header.record_format, header.schema_offset, header.schema_len,
        header.ext_offset, header.ext_len, header.flags, header.data_end)
    struct.pack_into("<I", body, _CHECKSUM_AT, zlib.adler32(bytes(body[:_CHECKSUM_AT])))
    return bytes(body)


def slot_offset_for_generation(generation: int) -> int:
    """File offset of the slot a commit of ``generation`` goes to (even: A, odd: B)."""
    return 0 if generation % 2 == 0 else SLOT_SIZE


def with_slot(header: Header, slot: str) -> Header:
    """A copy of ``header`` labelled with ``slot``."""
    return replace(header, slot=slot)
