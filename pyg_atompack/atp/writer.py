"""Create or append to `.atp` files with atompack-db's commit protocol (spec §2.3, §3, §7)."""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import locking
from .add_groups import GroupsState
from .codecs import CODEC_NONE, CODEC_ZSTD, codec_id, make_compressor
from .encode import (
    Section,
    assemble_batch,
    batch_columns,
    check_positions,
    encode_section,
    molecule_sections,
)
from .errors import AtpValueError, SchemaConflictError, TruncatedFileError
from .extensions import encode_directory, read_directory, read_payload
from .framedwrite import FramedLog, empty_framed_header
from .frames import FRAME_RECORD, FRAME_SCHEMA, MetaFrame, encode_frame, recover
from .groups import FRAME_GROUPS, merge_chunks
from .header import (
    DATA_START,
    HEADER_SIZE,
    Header,
    encode_slot,
    select_header,
    slot_offset_for_generation,
)
from .index import INDEX_DTYPE, decode_index, encode_index
from .schema import Schema, SchemaEntry, decode_schema, encode_schema
from .types import (
    BUILTIN_CANONICAL_TAG,
    ELEM_BYTES,
    KIND_BUILTIN,
    POSITIONS_TAG_BY_DTYPE,
    per_atom_flag,
)


class Writer:
    """Append molecules to an `.atp` file; nothing is visible to readers before :meth:`flush`.

    Args:
        path (str or os.PathLike): File to create.
        compression (str, optional): ``"none"``, ``"lz4"`` or ``"zstd"``. (default: :obj:`"none"`)
        level (int, optional): Zstd level (ignored otherwise). (default: :obj:`3`)
        overwrite (bool, optional): Replace an existing file instead of raising
            ``FileExistsError``. (default: :obj:`False`)
        framed (bool, optional): Write the framed layout of the revision after 0.4.1
            (``docs/atp-format.md`` §15: every record and metadata frame with a CRC-32,
            recoverable after a crash, readable by atompack-db 0.4.1 once committed).
            The default writes the 0.4.1 layout, byte-identical to atompack-db 0.4.1.
            (default: :obj:`False`)

    Example:
        >>> with Writer("out.atp", compression="zstd") as w:      # doctest: +SKIP
        ...     w.add(positions, numbers, energy=-1.5, forces=forces)
    """

    def __init__(self, path: str | os.PathLike, compression: str = "none", level: int = 3,
                 overwrite: bool = False, framed: bool = False) -> None:
        codec = codec_id(compression)
        self._path = os.fspath(path)
        self._closed = True  # until the file is ours (close() and __del__ then do nothing)
        level = level if codec == CODEC_ZSTD else 0
        header = empty_framed_header(codec, level) if framed else \
            Header(codec=codec, level=level)
        self._fh = locking.create_locked(self._path, encode_slot(header) * 2, overwrite)
        self._init_state(header, schema=None, index=np.zeros(0, INDEX_DTYPE), tail=False)
        if framed:
            self._log = FramedLog(self._fh, header, DATA_START, None, 0)

    @classmethod
    def append_to(cls, path: str | os.PathLike) -> Writer:
        """Reopen an existing file for appending.

        The codec, level, record format, schema, generation, layout (0.4.1 or
        framed) and every metadata frame of the extensions directory (kinds this
        version does not know included) are kept. In a 0.4.1 file an uncommitted
        tail (records written but never flushed) is truncated at the first append
        or flush; a framed file in the writing state is recovered (its valid frames
        kept, with a :class:`~pyg_atompack.atp.RecoveredWriteWarning`) and writing
        continues after its last valid frame.

        Args:
            path (str or os.PathLike): An existing `.atp` file with a valid header.

        Returns:
            A writer positioned after the committed data.

        Raises:
            FileLockedError: Another writer has the file open.
            AtpError: The header, schema or index is invalid.
        """
        self = cls.__new__(cls)
        self._path = os.fspath(path)
        self._closed = True
        fd = locking.lock_path(self._path, os.O_RDWR)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self._path)
        self._fh = open(fd, "r+b")  # noqa: SIM115 - held until close()
        try:
            size = os.fstat(self._fh.fileno()).st_size
            opened = select_header(self._read(0, min(size, HEADER_SIZE)), size, self._path,
                                   allow_writing=True)
            header, index_block, directory = opened, None, []
            if opened.writing:
                found = recover(self._read, opened, size, self._path)
                header, index_block, directory = found.header, found.index_block, \
                    found.metadata
            elif header.ext_len:
                directory = read_directory(self._read(header.ext_offset, header.ext_len),
                                           header, self._path)
            schema = None
            if header.schema_len:
                schema = decode_schema(self._read(header.schema_offset, header.schema_len),
                                       self._path)
            index = np.zeros(0, INDEX_DTYPE)
            if index_block is not None:
                index = decode_index(index_block, header.num_molecules, self._path).copy()
            elif header.index_len:
                block = self._read(header.index_offset, header.index_len)
                index = decode_index(block, header.num_molecules, self._path).copy()
            self._init_state(header, schema, index, tail=size > header.committed_end)
            self._directory = list(directory)
            if header.framed:
                payload = self._read(header.schema_offset - 4, header.schema_len + 4) \
                    if header.schema_len else None
                self._log = FramedLog(self._fh, opened, header.data_end, payload,
                                      header.schema_offset - 4 if payload else 0)
        except BaseException:
            locking.release(self._fh)
            raise
        return self

    def _read(self, offset: int, length: int) -> bytes:
        self._fh.seek(offset)
        data = self._fh.read(length)
        if len(data) != length:
            raise TruncatedFileError(f"{self._path}: short read at offset {offset}")
        return data

    def _init_state(self, header: Header, schema: Schema | None, index: np.ndarray,
                    tail: bool) -> None:
        self._header = header
        self._codec = header.codec
        self._compress = make_compressor(header.codec, header.level)
        self._record_format = header.record_format
        self._schema = schema
        self._committed = index
        self._pending: list[np.ndarray] = []
        self._pending_count = 0
        self._end = header.committed_end
        self._tail = tail
        self._log: FramedLog | None = None  # the framed layout's frames and commits
        self._directory: list[MetaFrame] = []  # metadata frames the next commit lists
        self._closed = False
        _OPEN_WRITERS.add(self)

    # ------------------------------------------------------------------ properties
    @property
    def path(self) -> str:
        """The file being written."""
        return self._path

    def __len__(self) -> int:
        """Molecules in the file, including ones not yet flushed."""
        return len(self._committed) + self._pending_count

    @property
    def record_format(self) -> int:
        """2 or 3 (fixed by the first write into an empty file)."""
        return self._record_format

    @property
    def framed(self) -> bool:
        """Whether the file has the framed layout (``docs/atp-format.md`` §15)."""
        return self._log is not None

    @property
    def metadata_frames(self) -> list[MetaFrame]:
        """The metadata frames the next commit's extensions directory lists, in order.

        Every entry of the file's directory when it was opened (kinds this version
        does not know included), then those added by :meth:`add_metadata`.
        """
        return list(self._directory)

    def add_metadata(self, kind: int, payload: bytes, replace: bool = False) -> MetaFrame:
        """Append a metadata frame (e.g. groups) and list it in the extensions directory.

        Visible to readers after the next :meth:`flush`. In a 0.4.1 file the frame is
        written after the records (0.4.1 readers ignore it and the directory); the file
        stays a 0.4.1 file.

        Args:
            kind (int): The frame kind (``frames.FRAME_GROUPS`` = 3, or any kind other
                than 1 (record) and 2 (schema)).
            payload (bytes): The payload.
            replace (bool, optional): Drop the directory's earlier entries of ``kind``
                (their bytes stay in the file, unreferenced). (default: :obj:`False`)

        Returns:
            MetaFrame: The new directory entry.

        Raises:
            AtpValueError: ``kind`` is a record or schema kind, or does not fit 32 bits.
        """
        self._check_open()
        if kind in (FRAME_RECORD, FRAME_SCHEMA) or not 0 <= kind < 1 << 32:
            raise AtpValueError(f"{self._path}: metadata frame kind {kind} is not allowed "
                                f"(1 and 2 are records and schemas; a u32 otherwise)")
        payload = bytes(payload)
        if self._log is not None:
            entry = self._log.metadata(kind, payload)
        else:
            self._truncate_tail()
            self._fh.seek(self._end)
            self._fh.write(encode_frame(kind, payload))
            entry = MetaFrame(kind, self._end + 20, len(payload))
            self._end += 20 + len(payload)
        if replace:
            self._directory = [f for f in self._directory if f.kind != kind]
        self._directory.append(entry)
        return entry

    def add_groups(self, name: str, members: Any, properties: Mapping[str, Any] | None = None,
                   roles: Sequence[str] | None = None) -> None:
        """Append groups to the grouping ``name`` (created if new), as upstream's
        ``Database.add_groups``: one groups frame, visible after the next :meth:`flush`.

        Args:
            name (str): The grouping.
            members (Any): Dicts ``{role: record}`` (named roles), sequences of records
                (ordered groups), or with ``roles`` a ``(n_groups, len(roles))`` integer
                array whose ``-1`` entries mark absent members. Records must exist
                (pending ones count).
            properties (Mapping[str, Any], optional): One value per group for each key:
                ints, floats or str (int64, float64, str columns). (default: :obj:`None`)
            roles (Sequence[str], optional): The role of each column of ``members``.
                (default: :obj:`None`)

        Raises:
            GroupsError: Groups that break a rule (a missing record, an empty group, a
                repeated role, a column of the wrong length, columns that differ from
                the grouping's); the message names the file, grouping and field.
            TypeError: Named and ordered groups mixed, or values of an unsupported type.
        """
        self._check_open()
        state = getattr(self, "_groups", None)
        if state is None:
            state = self._groups = GroupsState(self._stored_groups)
        grouping, payload = state.prepare(name, members, properties, roles, len(self),
                                          self._path)
        self.add_metadata(FRAME_GROUPS, payload)
        state.push(name, grouping)

    def _stored_groups(self) -> dict:
        """The groupings of the groups frames this writer's directory lists."""
        payloads = [(f"{self._path}: groups frame at byte {f.offset}",
                     read_payload(self._read, f, self._path))
                    for f in self._directory if f.kind == FRAME_GROUPS]
        return merge_chunks(payloads, len(self))

    # ------------------------------------------------------------------ appending
    def add(self, positions: Any, atomic_numbers: Any, *, energy: Any = None, forces: Any = None,
            charges: Any = None, velocities: Any = None, cell: Any = None, stress: Any = None,
            pbc: Any = None, name: str | None = None, properties: dict[str, Any] | None = None,
            atom_properties: dict[str, Any] | None = None) -> None:
        """Append one molecule, encoded exactly like ``atompack.Database.add_molecule``.

        Args:
            positions (np.ndarray): ``(n, 3)`` float32 or float64.
            atomic_numbers (np.ndarray): ``(n,)`` integers in 0..255.
            energy (float, optional): Float (stored as float64). (default: :obj:`None`)
            forces (np.ndarray, optional): ``(n, 3)`` float32/float64. (default: :obj:`None`)
            charges (np.ndarray, optional): ``(n,)`` float64/float32. (default: :obj:`None`)
            velocities (np.ndarray, optional): ``(n, 3)`` float32/float64. (default: :obj:`None`)
            cell (np.ndarray, optional): ``(3, 3)`` float64/float32, rows are lattice vectors.
                (default: :obj:`None`)
            stress (np.ndarray, optional): ``(3, 3)`` float64/float32. (default: :obj:`None`)
            pbc (tuple[bool, bool, bool], optional): Three booleans. (default: :obj:`None`)
            name (str, optional): A string. (default: :obj:`None`)
            properties (dict[str, Any], optional): Per-molecule custom values (None, bool, int,
                float, str, arrays). (default: :obj:`None`)
            atom_properties (dict[str, Any], optional): Per-atom custom arrays with first dimension
                n. (default: :obj:`None`)

        Raises:
            AtpValueError: A value the format cannot hold (the message names the file,
                the molecule number(s) and the field).
            SchemaConflictError: A value that conflicts with what the file already holds.
        """
        builtins = dict(energy=energy, forces=forces, charges=charges, velocities=velocities,
                        cell=cell, stress=stress, pbc=pbc, name=name)
        pos, z, sections = self._encode(positions, atomic_numbers, builtins, properties,
                                        atom_properties, batch=False)
        n = len(z)
        parts = [struct.pack("<I", n), pos.tobytes(), z.tobytes(),
                 struct.pack("<H", len(sections)), *map(encode_section, sections)]
        self._write_records([b"".join(parts)], [n])

    def add_batch(self, positions: Any, atomic_numbers: Any, *, energy: Any = None,
                  forces: Any = None, charges: Any = None, velocities: Any = None,
                  cell: Any = None, stress: Any = None, pbc: Any = None,
                  name: list[str] | None = None, properties: dict[str, Any] | None = None,
                  atom_properties: dict[str, Any] | None = None) -> None:
        """Append B molecules of equal size, like ``atompack.Database.add_arrays_batch``.

        Args:
            positions (np.ndarray): ``(B, n, 3)`` float32 or float64.
            atomic_numbers (np.ndarray): ``(B, n)`` integers in 0..255.
            energy (np.ndarray, optional): ``(B,)`` float64 or float32. (default: :obj:`None`)
            forces (np.ndarray, optional): ``(B, n, 3)``. (default: :obj:`None`)
            charges (np.ndarray, optional): ``(B, n)``. (default: :obj:`None`)
            velocities (np.ndarray, optional): ``(B, n, 3)``. (default: :obj:`None`)
            cell (np.ndarray, optional): ``(B, 3, 3)``. (default: :obj:`None`)
            stress (np.ndarray, optional): ``(B, 3, 3)``. (default: :obj:`None`)
            pbc (np.ndarray, optional): ``(B, 3)`` booleans. (default: :obj:`None`)
            name (list[str], optional): List of B strings. (default: :obj:`None`)
            properties (dict[str, Any], optional): Per-molecule columns with leading axis B (a list
                of str for strings). (default: :obj:`None`)
            atom_properties (dict[str, Any], optional): Per-atom columns of shape ``(B, n, ...)``.
                (default: :obj:`None`)

        Raises:
            AtpValueError: A value the format cannot hold (the message names the file,
                the molecule number(s) and the field).
            SchemaConflictError: A value that conflicts with what the file already holds.
        """
        builtins = dict(energy=energy, forces=forces, charges=charges, velocities=velocities,
                        cell=cell, stress=stress, pbc=pbc, name=name)
        pos, z, sections = self._encode(positions, atomic_numbers, builtins, properties,
                                        atom_properties, batch=True)
        count, n = z.shape
        if count == 0:
            return
        self._write_records(assemble_batch(count, n, pos, z, sections), [n] * count)

    def _encode(self, positions: Any, atomic_numbers: Any, builtins: dict[str, Any],
                properties: dict[str, Any] | None, atom_properties: dict[str, Any] | None,
                batch: bool) -> tuple[np.ndarray, np.ndarray, list[Section]]:
        """Check and encode what :meth:`add` or :meth:`add_batch` was given.

        Both raise the same errors, naming the file and the molecule(s); the
        sections are admitted against the file's schema. An empty batch gives no
        sections and is not admitted.

        Returns:
            The checked positions and atomic numbers and the sections.
        """
        self._check_open()
        try:
            pos, z = check_positions(positions, atomic_numbers, batch=batch)
            if batch and len(z) == 0:
                return pos, z, []
            sections = (batch_columns(*z.shape, builtins, properties, atom_properties) if batch
                        else molecule_sections(len(z), builtins, properties, atom_properties))
        except AtpValueError as exc:
            where = self._batch_span(positions) if batch else f"molecule {len(self)}"
            raise AtpValueError(f"{self._path}: {where}: {exc}") from None
        self._admit(pos.dtype, sections, z.shape[-1])
        return pos, z, sections

    def _batch_span(self, positions: Any) -> str:
        """``molecules a..b`` a rejected batch would have taken (its size when known)."""
        first = len(self)
        size = getattr(positions, "shape", (None,))[:1]
        if size and isinstance(size[0], int) and size[0] > 0:
            return f"molecules {first}..{first + size[0] - 1} (batch of {size[0]})"
        return f"batch starting at molecule {first}"

    def _admit(self, pos_dtype: np.dtype, sections: list[Section], n: int) -> None:
        """Check record format and schema lock; commit the merge only if all fits."""
        needs_v3 = pos_dtype == np.dtype("<f8") or any(
            s.kind == KIND_BUILTIN and s.tag != BUILTIN_CANONICAL_TAG[s.key] for s in sections)
        schema = self._schema_for_append()
        empty = len(self) == 0 and not schema.entries and schema.positions_tag is None
        record_format = self._record_format
        if needs_v3 and record_format == 2:
            if not (empty and not self._header.has_schema):
                raise SchemaConflictError(
                    f"{self._path}: record format 2 file cannot hold float64 positions or "
                    f"non-canonical builtin dtypes (the format is fixed by the first write)")
            record_format = 3
        merged = schema.copy()
        pos_tag = POSITIONS_TAG_BY_DTYPE[pos_dtype]
        if merged.positions_tag is None:
            merged.positions_tag = pos_tag
        elif merged.positions_tag != pos_tag:
            raise SchemaConflictError(
                f"{self._path}: positions are {pos_dtype} but the file stores "
                f"{'float64' if merged.positions_tag == 7 else 'float32'} positions")
        where = f"{self._path}: molecule {len(self)}"
        for s in sections:
            merged.merge(SchemaEntry(s.kind, s.key, s.tag, per_atom_flag(s.kind, s.key),
                                     ELEM_BYTES[s.tag], s.slot_bytes), where)
        self._schema = merged
        self._record_format = record_format

    def _schema_for_append(self) -> Schema:
        if self._schema is None:
            self._schema = self._rebuild_schema() if len(self._committed) else Schema()
        return self._schema

    def _rebuild_schema(self) -> Schema:
        # a schema-less (0.2.x) file: derive the lock from its committed records
        from .reader import Reader

        with Reader(self._path, access="pread") as reader:
            return reader.rebuild_schema()

    def _truncate_tail(self) -> None:
        if self._tail:
            self._fh.truncate(self._end)
            self._tail = False

    def _write_records(self, records: list[bytes], n_atoms: list[int]) -> None:
        self._truncate_tail()
        stored = records if self._codec == CODEC_NONE else [self._compress(r) for r in records]
        entries = np.zeros(len(records), INDEX_DTYPE)
        sizes = np.fromiter((len(s) for s in stored), np.int64, len(stored))
        entries["stored"] = sizes
        entries["raw"] = [len(r) for r in records] if self._codec != CODEC_NONE else sizes
        entries["n_atoms"] = n_atoms
        if self._log is not None:
            # the schema frame first: a recovery then knows every key of these records
            self._log.schema(self._record_format, encode_schema(self._schema))
            entries["offset"] = self._log.records(stored, entries["raw"].tolist(), n_atoms)
        else:
            entries["offset"] = self._end + np.concatenate([[0], np.cumsum(sizes)[:-1]])
            self._fh.seek(self._end)
            self._fh.write(b"".join(stored))
            self._end += int(sizes.sum())
        self._pending.append(entries)
        self._pending_count += len(records)

    # ------------------------------------------------------------------ commit
    def flush(self) -> None:
        """Commit: write schema and index, sync, then the alternate header slot, sync.

        A framed file writes its extensions directory and index after the last frame
        (the schema lives in its schema frame), and nothing at all when nothing was
        written since the last commit.
        """
        self._check_open()
        self._truncate_tail()
        index = np.concatenate([self._committed, *self._pending])
        if self._log is not None:
            header = self._log.commit(index, self._directory, self._record_format)
            if header is not None:
                self._committed_as(header, index)
            return
        self._fh.seek(self._end)
        schema_offset = schema_len = 0
        if self._schema is not None:
            block = encode_schema(self._schema)
            schema_offset, schema_len = self._end, len(block)
            self._fh.write(block)
        index_block = encode_index(index)
        index_offset = self._end + schema_len
        self._fh.write(index_block)
        # metadata frames of a 0.4.1 file: their directory after the index (0.4.1
        # readers ignore it), so the header keeps pointing at every one of them
        directory = encode_directory(self._directory)
        self._fh.write(directory)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        generation = self._header.generation + 1
        ext_offset = index_offset + len(index_block) if directory else 0
        header = Header(generation, DATA_START, index_offset, len(index_block), len(index),
                        self._codec, self._header.level, self._record_format, schema_offset,
                        schema_len, "A" if generation % 2 == 0 else "B", ext_offset,
                        len(directory))
        self._fh.seek(slot_offset_for_generation(generation))
        self._fh.write(encode_slot(header))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._committed_as(header, index)

    def _committed_as(self, header: Header, index: np.ndarray) -> None:
        self._header = header
        self._committed = index
        self._pending = []
        self._pending_count = 0
        self._end = header.committed_end

    def close(self) -> None:
        """Close the file without committing (call :meth:`flush` first to keep appends).

        Releases the file's write lock: another writer may open it from then on.
        """
        if not self._closed:
            self._closed = True
            _OPEN_WRITERS.discard(self)
            locking.release(self._fh)

    def __del__(self) -> None:
        # a writer dropped without close(): the descriptor would close with its file
        # object anyway, but the lock would stay in this process's table
        with contextlib.suppress(Exception):
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise AtpValueError(f"{self._path}: writer is closed")

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if exc_type is None and not self._closed:
                self.flush()
        finally:
            self.close()

    def __repr__(self) -> str:
        return (f"Writer({self._path!r}, molecules={len(self)}, "
                f"pending={self._pending_count}, record_format={self._record_format})")


_OPEN_WRITERS: weakref.WeakSet = weakref.WeakSet()


def _forget_after_fork() -> None:
    # a forked child (a DataLoader worker) shares the parent's open file descriptions:
    # writing through them would interleave with the parent, and keeping them open
    # would keep the parent's lock alive after the parent closes. The child closes its
    # copies (the lock stays with the parent) and holds no writer of its own.
    for writer in list(_OPEN_WRITERS):
        writer._closed = True
        with contextlib.suppress(Exception):
            writer._fh.close()
    _OPEN_WRITERS.clear()
    locking.forget_all()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
