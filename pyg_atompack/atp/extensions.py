"""The extensions directory: the metadata frames of a file (framed revision, spec §15.4).

The header's extensions span points at a directory ``[version u32 = 1][count u32]``
then 20-byte entries ``[kind u32][offset u64][len u64]``, one per metadata frame
(groups, and kinds this version does not know), each naming a frame payload. Readers
list every entry and decode only the kinds they know; writers carry every entry forward
unchanged, so sections added by a newer version survive an append (the reference's
kind-99 test).

The API other modules build on (``atp/groups.py`` reads and writes the groups
payload through it):

* :attr:`Reader.metadata_frames <pyg_atompack.atp.Reader.metadata_frames>` lists the
  entries (:class:`~pyg_atompack.atp.frames.MetaFrame`: ``kind``, ``offset``,
  ``length``) and :meth:`Reader.read_metadata <pyg_atompack.atp.Reader.read_metadata>`
  returns one payload, its CRC checked; :func:`latest_payload` the newest of a kind;
* :meth:`Writer.add_metadata <pyg_atompack.atp.Writer.add_metadata>` appends a
  metadata frame (``replace=True`` drops the older entries of its kind) and
  :attr:`Writer.metadata_frames <pyg_atompack.atp.Writer.metadata_frames>` lists what
  the next commit's directory holds; :func:`copy_metadata` carries every metadata
  frame of a file into a rewrite of it.
"""

from __future__ import annotations

import struct
from typing import Any

from .errors import FrameError, IndexBlockError
from .frames import FRAME_HEADER_SIZE, FRAME_RECORD, FRAME_SCHEMA, MetaFrame, frame_crc
from .header import Header

ENTRY = struct.Struct("<IQQ")
DIRECTORY_HEAD = struct.Struct("<II")  # [version u32][count u32]
DIRECTORY_VERSION = 1
#: Most entries a directory may hold (a damaged length cannot make a reader allocate more).
MAX_ENTRIES = 1 << 20

__all__ = ["ENTRY", "copy_metadata", "decode_directory", "encode_directory",
           "latest_payload", "read_directory", "read_payload"]


def encode_directory(frames: list[MetaFrame]) -> bytes:
    """The directory block listing ``frames`` (in order): ``[version u32 = 1][count u32]``
    then the entries, as upstream's ``Extensions::encode_directory`` (90da9bd) writes it;
    no frames, no directory (``b""``: the header's span stays ``(0, 0)``)."""
    if not frames:
        return b""
    return DIRECTORY_HEAD.pack(DIRECTORY_VERSION, len(frames)) + b"".join(
        ENTRY.pack(f.kind, f.offset, f.length) for f in frames)


def decode_directory(buf: bytes, name: str) -> list[MetaFrame]:
    """Decode a directory block (no bounds checks; :func:`read_directory` adds them).

    Args:
        buf (bytes): The block.
        name (str): How messages name the file.

    Returns:
        The entries, in order.

    Raises:
        IndexBlockError: An unknown version, a length that disagrees with the count,
            or more than :data:`MAX_ENTRIES` entries.
    """
    if len(buf) < DIRECTORY_HEAD.size:
        raise IndexBlockError(f"{name}: the extensions directory is {len(buf)} bytes, shorter "
                              f"than its {DIRECTORY_HEAD.size}-byte head")
    version, count = DIRECTORY_HEAD.unpack_from(buf, 0)
    if version != DIRECTORY_VERSION:
        raise IndexBlockError(f"{name}: unsupported extensions directory version {version}")
    if count > MAX_ENTRIES or len(buf) != DIRECTORY_HEAD.size + count * ENTRY.size:
        raise IndexBlockError(f"{name}: the extensions directory is {len(buf)} bytes for "
                              f"{count} entries of {ENTRY.size} bytes (at most {MAX_ENTRIES})")
    return [MetaFrame(*ENTRY.unpack_from(buf, at))
            for at in range(DIRECTORY_HEAD.size, len(buf), ENTRY.size)]


def read_directory(buf: bytes, header: Header, name: str) -> list[MetaFrame]:
    """Decode the directory a header points at and check each entry lies among the frames.

    Args:
        buf (bytes): The directory block.
        header (Header): The header that points at it.
        name (str): How messages name the file.

    Returns:
        The entries (every kind, known or not), in order.

    Raises:
        IndexBlockError: The block is malformed, or an entry names a record or schema
            frame or a payload outside the frames (``data_start + 20`` up to
            ``data_end``, or up to the directory in an unframed file).
    """
    frames = decode_directory(buf, name)
    end = header.data_end or header.ext_offset
    for j, f in enumerate(frames):
        if f.kind in (FRAME_RECORD, FRAME_SCHEMA) or \
                f.offset < header.data_start + FRAME_HEADER_SIZE or f.offset + f.length > end:
            raise IndexBlockError(
                f"{name}: extensions directory entry {j} (kind {f.kind}, payload "
                f"[{f.offset}, +{f.length})) is not a metadata frame inside the data region "
                f"[{header.data_start}, {end})")
    return frames


def read_payload(read: Any, frame: MetaFrame, name: str) -> bytes:
    """The payload of a metadata frame, its frame header and CRC-32 checked.

    Args:
        read (Callable[[int, int], bytes]): ``read(offset, length)`` of the file.
        frame (MetaFrame): A directory entry (bounds checked by :func:`read_directory`).
        name (str): How messages name the file.

    Returns:
        The payload bytes.

    Raises:
        FrameError: The frame header disagrees with the entry or the CRC fails.
    """
    data = bytes(read(frame.offset - FRAME_HEADER_SIZE, FRAME_HEADER_SIZE + frame.length))
    kind, length, _, _, crc = struct.unpack_from("<IIIII", data, 0)
    where = f"{name}: metadata frame of kind {frame.kind} at byte {frame.offset}"
    if (kind, length) != (frame.kind, frame.length):
        raise FrameError(f"{where}: its frame header (kind {kind}, {length} bytes) disagrees "
                         f"with the extensions directory ({frame.length} bytes)")
    actual = frame_crc(data[:16], data[FRAME_HEADER_SIZE:])
    if actual != crc:
        raise FrameError(f"{where}: CRC-32 mismatch (frame says {crc:#010x}, the bytes give "
                         f"{actual:#010x}): the payload is damaged")
    return data[FRAME_HEADER_SIZE:]


def latest_payload(reader: Any, kind: int) -> bytes | None:
    """The payload of the newest metadata frame of ``kind`` in a reader's directory.

    Args:
        reader (Reader): An open :class:`~pyg_atompack.atp.Reader`.
        kind (int): The frame kind (e.g. :data:`~pyg_atompack.atp.frames.FRAME_GROUPS`).

    Returns:
        The payload (CRC checked), or :obj:`None` when the directory lists none.
    """
    found = [f for f in reader.metadata_frames if f.kind == kind]
    return reader.read_metadata(found[-1]) if found else None


def copy_metadata(reader: Any, writer: Any, kinds: Any = None) -> list[MetaFrame]:
    """Append a file's metadata frames, unchanged and in order, to a writer.

    For rewrites that keep the records in their order and number (re-encoding,
    changing the codec or the layout): payloads that name records by index, such
    as groups, stay true only then.

    Args:
        reader (Reader): The file read.
        writer (Writer): The file written.
        kinds (Collection[int], optional): Copy only these kinds. (default: every kind)

    Returns:
        list[MetaFrame]: The writer's new directory entries.
    """
    return [writer.add_metadata(frame.kind, reader.read_metadata(frame))
            for frame in reader.metadata_frames if kinds is None or frame.kind in kinds]
