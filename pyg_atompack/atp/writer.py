"""Create or append to `.atp` files with atompack-db's commit protocol (spec §2.3, §3, §7)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import struct
import weakref
from typing import Any, BinaryIO

import numpy as np

from . import locking
from .codecs import CODEC_NONE, CODEC_ZSTD, codec_id, make_compressor
from .encode import Section, batch_columns, check_positions, encode_section, molecule_sections
from .errors import AtpValueError, SchemaConflictError, TruncatedFileError
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

    Example:
        >>> with Writer("out.atp", compression="zstd") as w:      # doctest: +SKIP
        ...     w.add(positions, numbers, energy=-1.5, forces=forces)
    """

    def __init__(self, path: str | os.PathLike, compression: str = "none", level: int = 3,
                 overwrite: bool = False) -> None:
        codec = codec_id(compression)
        self._path = os.fspath(path)
        self._closed = True  # until the file is ours (close() and __del__ then do nothing)
        header = Header(codec=codec, level=level if codec == CODEC_ZSTD else 0)
        self._fh = _create(self._path, encode_slot(header) + encode_slot(header), overwrite)
        self._init_state(header, schema=None, index=np.zeros(0, INDEX_DTYPE), tail=False)

    @classmethod
    def append_to(cls, path: str | os.PathLike) -> Writer:
        """Reopen an existing file for appending.

        The codec, level, record format, schema and generation are kept; an
        uncommitted tail (records written but never flushed) is truncated at the
        first append or flush.

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
            header = select_header(self._read(0, min(size, HEADER_SIZE)), size, self._path)
            schema = None
            if header.schema_len:
                schema = decode_schema(self._read(header.schema_offset, header.schema_len),
                                       self._path)
            index = np.zeros(0, INDEX_DTYPE)
            if header.index_len:
                block = self._read(header.index_offset, header.index_len)
                index = decode_index(block, header.num_molecules, self._path).copy()
            self._init_state(header, schema, index, tail=size > header.committed_end)
        except BaseException:
            _release(self._fh)
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
        self._write_records(_assemble_batch(count, n, pos, z, sections), [n] * count)

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
        entries["offset"] = self._end + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        entries["stored"] = sizes
        entries["raw"] = [len(r) for r in records] if self._codec != CODEC_NONE else sizes
        entries["n_atoms"] = n_atoms
        self._fh.seek(self._end)
        self._fh.write(b"".join(stored))
        self._end += int(sizes.sum())
        self._pending.append(entries)
        self._pending_count += len(records)

    # ------------------------------------------------------------------ commit
    def flush(self) -> None:
        """Commit: write schema and index, sync, then the alternate header slot, sync."""
        self._check_open()
        self._truncate_tail()
        index = np.concatenate([self._committed, *self._pending])
        self._fh.seek(self._end)
        schema_offset = schema_len = 0
        if self._schema is not None:
            block = encode_schema(self._schema)
            schema_offset, schema_len = self._end, len(block)
            self._fh.write(block)
        index_block = encode_index(index)
        index_offset = self._end + schema_len
        self._fh.write(index_block)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        generation = self._header.generation + 1
        header = Header(generation, DATA_START, index_offset, len(index_block), len(index),
                        self._codec, self._header.level, self._record_format, schema_offset,
                        schema_len, "A" if generation % 2 == 0 else "B")
        self._fh.seek(slot_offset_for_generation(generation))
        self._fh.write(encode_slot(header))
        self._fh.flush()
        os.fsync(self._fh.fileno())
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
            _release(self._fh)

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


def _create(path: str, head: bytes, overwrite: bool) -> BinaryIO:
    """A new file at ``path`` that starts with ``head``, write-locked.

    The file is made under a hidden temporary name next to ``path`` and locked
    before it appears under ``path``: by a hard link when ``path`` is free (so a
    concurrent creator gets :class:`FileExistsError`, and nobody sees the file
    before its header is written), by a rename over the old file when overwriting,
    done while holding the old file's lock. Never truncating in place is what lets
    readers of the old file keep reading it: its inode lives on, unchanged, until
    they close it (a truncation would pull the pages from under their mappings).

    Args:
        path (str): The file to create (a symbolic link: the file it names).
        head (bytes): The two empty header slots.
        overwrite (bool): Replace an existing file (unless a writer holds it).

    Returns:
        The new file, open ``r+b`` and locked.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        FileLockedError: Another writer holds the file being overwritten.
    """
    target = os.path.realpath(path)
    while True:
        old = locking.lock_path(target, os.O_RDONLY) if overwrite else None
        if old is None:
            fh = None if os.path.lexists(target) else _link_new(target, path, head)
            if fh is not None:
                return fh
            if not overwrite:
                raise FileExistsError(f"{path}: already exists (pass overwrite=True)")
            continue  # created meanwhile: overwrite that one, under its lock
        try:
            fh, temp = _sibling(target, os.fstat(old).st_mode)
            try:
                _start(fh, path, head)
                os.replace(temp, target)
            except BaseException:
                _release(fh)
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
            return fh
        finally:
            locking.unlock(old)
            os.close(old)


def _link_new(target: str, path: str, head: bytes) -> BinaryIO | None:
    """A new locked file at ``target``, or :obj:`None` if one appeared there first."""
    fh, temp = _sibling(target, None)
    try:
        _start(fh, path, head)
        try:
            os.link(temp, target)
        except FileExistsError:
            _release(fh)
            return None
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            _release(fh)
            return _create_in_place(target, path, head)
    except BaseException:
        _release(fh)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)
    return fh


def _start(fh: BinaryIO, path: str, head: bytes) -> None:
    """Lock a new file and write its empty header slots."""
    locking.lock(fh.fileno(), path)
    fh.write(head)
    fh.flush()


# what link() says on a file system without hard links (vfat, many FUSE mounts)
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK)


def _create_in_place(target: str, path: str, head: bytes) -> BinaryIO | None:
    """:func:`_link_new` without hard links: an exclusive create, then the lock.

    Another writer could lock the empty file between the two steps; it then finds
    no header and fails, and if it still holds the lock this one says so.
    """
    try:
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL
                     | getattr(os, "O_CLOEXEC", 0), 0o666)
    except FileExistsError:
        return None
    fh = open(fd, "r+b")  # noqa: SIM115 - held until close()
    try:
        _start(fh, path, head)
    except BaseException:
        _release(fh)
        raise
    return fh


def _sibling(path: str, mode: int | None) -> tuple[BinaryIO, str]:
    """A new hidden file next to ``path`` (``.NAME.writing-PID-RANDOM``), open ``w+b``.

    Args:
        path (str): The file it will become.
        mode (int | None): Permission bits to copy (those of a file it replaces);
            :obj:`None` leaves the process's umask to decide, like ``open()``.
    """
    directory, name = os.path.split(path)
    while True:
        temp = os.path.join(directory, f".{name}.writing-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL
                         | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        if mode is not None:
            with contextlib.suppress(OSError):
                os.fchmod(fd, stat.S_IMODE(mode))
        return open(fd, "w+b"), temp  # noqa: SIM115 - held until close()


def _release(fh: BinaryIO) -> None:
    """Forget the file's lock in this process's table, then close it (releasing the lock)."""
    try:
        locking.unlock(fh.fileno())
    except (OSError, ValueError):
        pass
    finally:
        fh.close()


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


def _assemble_batch(count: int, n: int, pos: np.ndarray, z: np.ndarray,
                    sections: list[Section]) -> list[bytes]:
    """Build B records from per-column byte matrices with numpy (no per-molecule loop
    unless a column holds strings, whose lengths vary)."""
    u8 = np.uint8
    blocks: list[Any] = [
        np.broadcast_to(np.frombuffer(struct.pack("<I", n), u8), (count, 4)),
        pos.reshape(count, -1).view(u8),
        z,
        np.broadcast_to(np.frombuffer(struct.pack("<H", len(sections)), u8), (count, 2)),
    ]
    for s in sections:
        key = s.key_bytes()
        if isinstance(s.payload, list):  # strings: the header's length varies per record
            blocks.append([bytes((s.kind, len(key))) + key + bytes((s.tag,))
                           + struct.pack("<I", len(p)) + p for p in s.payload])
            continue
        head = bytes((s.kind, len(key))) + key + bytes((s.tag,)) + \
            struct.pack("<I", s.payload.shape[1])
        blocks.append(np.broadcast_to(np.frombuffer(head, u8), (count, len(head))))
        blocks.append(s.payload)
    # merge runs of fixed-width blocks into one matrix each
    merged: list[Any] = []
    run: list[np.ndarray] = []
    for block in blocks:
        if isinstance(block, list):
            if run:
                merged.append(np.concatenate(run, axis=1))
                run = []
            merged.append(block)
        else:
            run.append(block)
    if run:
        merged.append(np.concatenate(run, axis=1))
    if len(merged) == 1:
        matrix = merged[0]
        data = matrix.tobytes()
        width = matrix.shape[1]
        return [data[j * width:(j + 1) * width] for j in range(count)]
    pieces = [[m[j].tobytes() for j in range(count)] if isinstance(m, np.ndarray) else m
              for m in merged]
    return [b"".join(parts) for parts in zip(*pieces)]
