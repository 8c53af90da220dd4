"""The write protocol of framed files (``docs/atp-format.md`` §15.5), used by ``Writer``.

What the reference's writer does (``frames.rs``, LeMaterial/atompack commit
90da9bd35904a3625ab143eeb5cdd8d532a22c78):

1. before the first frame of a session, both header slots are set to the writing
   state (``index_offset = 0``, ``num_molecules = 2**64 - 1``, flags framed |
   writing), so a crash from then on leaves a file every framed reader recovers by
   scanning, and that older readers refuse rather than misread;
2. frames are written from ``data_end`` (the end of the last frame) on: the index
   and directory of the previous commit after it are a cache, overwritten in place,
   so frequent commits leave no dead bytes;
3. a commit writes the extensions directory and the index after the last frame,
   syncs, then one header slot (the next generation, flags framed), and syncs.

Unlike an append to a 0.4.1 file, this rewrites bytes a reader opened on the
previous commit may be reading (its index): such readers must reopen the file.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

import numpy as np

from .extensions import encode_directory
from .frames import FRAME_HEADER_SIZE, FRAME_SCHEMA, MetaFrame, encode_frame
from .header import (
    FLAG_FRAMED,
    FLAG_WRITING,
    SLOT_SIZE,
    WRITING_COUNT,
    Header,
    encode_slot,
    slot_offset_for_generation,
)
from .index import encode_index


class FramedLog:
    """The frames of one framed file being written, and its commits.

    Args:
        fh (BinaryIO): The file, open ``r+b`` and locked.
        header (Header): The slot the file was opened with (committed or writing).
        data_end (int): End of the last valid frame.
        schema_payload (bytes | None): Payload of the newest schema frame in the file
            (``[record_format u32][schema block]``), None if there is none.
        schema_offset (int): Offset of that payload (0 if none).
    """

    def __init__(self, fh: BinaryIO, header: Header, data_end: int,
                 schema_payload: bytes | None, schema_offset: int) -> None:
        self.fh = fh
        self.header = header
        self.data_end = data_end
        self.writing = header.writing
        self.generation = header.generation
        self.schema_payload = schema_payload
        self.schema_offset = schema_offset

    def begin(self) -> None:
        """Put both header slots into the writing state (once per session), then sync.

        As upstream's ``begin_write`` (``mod.rs`` at 90da9bd): two generations, each into
        its own slot, each the current state (record format and schema span of the last
        commit, ``data_end``) with ``index = (0, 0)``, no directory and
        ``num_molecules = 2**64 - 1``; the commit then takes the generation after both.
        """
        if self.writing:
            return
        schema = ((self.schema_offset + 4, len(self.schema_payload) - 4)
                  if self.schema_payload else (0, 0))
        for _ in range(2):
            self.generation += 1
            self.fh.seek(slot_offset_for_generation(self.generation))
            self.fh.write(encode_slot(Header(
                self.generation, self.header.data_start, 0, 0, WRITING_COUNT,
                self.header.codec, self.header.level, self.header.record_format, *schema,
                flags=FLAG_FRAMED | FLAG_WRITING, data_end=self.data_end)))
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.writing = True

    def append(self, frames: list[bytes]) -> int:
        """Write frames at ``data_end``; returns where the first one starts."""
        start = self.data_end
        self.fh.seek(start)
        data = b"".join(frames)
        self.fh.write(data)
        self.data_end += len(data)
        return start

    def schema(self, record_format: int, block: bytes) -> None:
        """Write a schema frame when the schema or record format changed since the last."""
        payload = struct.pack("<I", record_format) + block
        if payload == self.schema_payload:
            return
        self.begin()
        start = self.append([encode_frame(FRAME_SCHEMA, payload)])
        self.schema_payload = payload
        self.schema_offset = start + FRAME_HEADER_SIZE

    def records(self, stored: list[bytes], raw: list[int], n_atoms: list[int]) -> np.ndarray:
        """Write record frames; returns their payload offsets (int64)."""
        self.begin()
        frames = [encode_frame(1, s, r, n) for s, r, n in zip(stored, raw, n_atoms)]
        start = self.append(frames)
        sizes = np.fromiter((len(f) for f in frames), np.int64, len(frames))
        return start + np.concatenate([[0], np.cumsum(sizes)[:-1]]) + FRAME_HEADER_SIZE

    def metadata(self, kind: int, payload: bytes) -> MetaFrame:
        """Write one metadata frame; returns its directory entry."""
        self.begin()
        start = self.append([encode_frame(kind, payload)])
        return MetaFrame(kind, start + FRAME_HEADER_SIZE, len(payload))

    def commit(self, index: np.ndarray, directory: list[MetaFrame],
               record_format: int) -> Header | None:
        """Write index, directory and the committed slot; None when nothing was written.

        Returns:
            Header | None: The committed header, or :obj:`None` when the session
            wrote nothing (a commit then writes nothing at all, as the reference's).
        """
        if not self.writing:
            return None
        block = encode_index(index)
        ext = encode_directory(directory)
        # the directory at data_end, the index after it, as upstream's flush
        self.fh.seek(self.data_end)
        self.fh.write(ext + block)
        end = self.data_end + len(ext) + len(block)
        # bytes past the new end were never committed (a recovered tail, an older
        # cache): no reader of a commit maps them
        if os.fstat(self.fh.fileno()).st_size > end:
            self.fh.truncate(end)
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.generation += 1
        schema_len = len(self.schema_payload) - 4 if self.schema_payload else 0
        header = Header(
            self.generation, self.header.data_start, self.data_end + len(ext), len(block),
            len(index),
            self.header.codec, self.header.level, record_format,
            self.schema_offset + 4 if schema_len else 0, schema_len,
            "A" if self.generation % 2 == 0 else "B",
            self.data_end if ext else 0, len(ext), FLAG_FRAMED, self.data_end)
        self.fh.seek(slot_offset_for_generation(self.generation))
        self.fh.write(encode_slot(header))
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.header = header
        self.writing = False
        return header


def empty_framed_header(codec: int, level: int) -> Header:
    """The two slots of a new, empty framed file (generation 0, nothing committed)."""
    return Header(codec=codec, level=level, flags=FLAG_FRAMED, data_end=2 * SLOT_SIZE)
