"""Read-only access to one `.atp` file through mmap, pread or an in-memory image."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import batch as _batch
from . import cache as _cache
from .codecs import CODEC_NAMES, decompress
from .errors import CORRUPT_DATA_ERRORS, AtpError, AtpValueError, RecordDecodeError
from .extensions import read_payload
from .fields import FieldInfo, fields_from_schema, merge_layout
from .filestate import F32, FileState
from .frames import MetaFrame
from .groups import Groups, read_groups
from .header import Header
from .index import molecule_index
from .molecule import Molecule
from .readonly import ReadOnlyReader
from .schema import Schema

ACCESS_MODES = ("auto", "mmap", "pread")
_OPEN_READERS: weakref.WeakSet = weakref.WeakSet()
_OFFSET_UNPACK = struct.Struct("<Q").unpack_from  # the offset of an index entry
_SCAN_CHUNK = 1024  # records read ahead at once by iteration (access="auto")


def _forget_after_fork() -> None:
    # a child process must never use the parent's descriptors or mappings; nor a lock
    # another thread of the parent held when it forked
    for reader in list(_OPEN_READERS):
        reader._opening = threading.Lock()
        reader._drop_state(close=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


class Reader(ReadOnlyReader):
    """Read-only view of one `.atp` file.

    Args:
        path (str | os.PathLike): The file.
        access (str, optional): ``"auto"`` (default), ``"mmap"`` or ``"pread"``, see
            :data:`ACCESS_MODES` and ``docs/architecture.md``. ``"mmap"`` and ``"auto"``
            return zero-copy read-only arrays for uncompressed records; ``"pread"``
            returns writable arrays owned by the caller. (default: :obj:`"auto"`)
        name (str, optional): How messages name the file, e.g. the URL a cached download came from.
            (default: the path)

    Raises:
        AtpError: The file is not a readable `.atp` file (a subclass says why).
    """

    def __init__(self, path: str | os.PathLike, access: str = "auto", *,
                 name: str | None = None) -> None:
        if access not in ACCESS_MODES:
            raise AtpValueError(f"access must be one of {ACCESS_MODES}, got {access!r}")
        self._path = os.fspath(path)
        self._name = name or self._path
        self._access = access
        self._image: bytes | None = None
        self._st: FileState | None = None
        self._opening = threading.Lock()
        self._load()

    @classmethod
    def from_bytes(cls, buffer: bytes | bytearray | memoryview, name: str = "<memory>", *,
                   copy: bool = True) -> Reader:
        """Open an in-memory `.atp` image (e.g. a shard fetched over HTTP).

        Args:
            buffer (bytes | bytearray | memoryview): The complete file contents.
            name (str, optional): Name used in error messages. (default: :obj:`"<memory>"`)
            copy (bool, optional): Take a private ``bytes`` copy of a ``bytearray``, ``mmap`` or
                ``memoryview``. ``False`` keeps a ``bytearray`` or ``mmap`` as it is, so
                a downloaded shard is held once rather than twice; the caller hands it
                over and must not change it afterwards. ``bytes`` are never copied.
                (default: :obj:`True`)

        Returns:
            A reader over the buffer; arrays are zero-copy views of it (read-only over
            ``bytes``, writable over a kept ``bytearray``).
        """
        self = cls.__new__(cls)
        self._path = None
        self._name = name
        self._access = "memory"
        keep = not copy and isinstance(buffer, (bytearray, mmap.mmap))
        self._image = buffer if keep else bytes(buffer)
        self._st = None
        self._opening = threading.Lock()
        self._load()
        return self

    # ------------------------------------------------------------------ opening
    def _load(self) -> FileState:
        # threads sharing a reader that is not open (unpickled, closed) open it once: a
        # second state would leak its descriptor. Known to the fork hook before the lock
        # is taken, so a child never inherits it held.
        _OPEN_READERS.add(self)
        with self._opening:
            st = self._st
            if st is None:
                st = self._st = FileState(self._name, self._path, self._image,
                                          self._access)
        return st

    def _drop_state(self, close: bool) -> None:
        st, self._st = self._st, None
        if st is not None and close:
            st.release()

    def _state(self) -> FileState:
        return self._st or self._load()

    def close(self) -> None:
        """Release the file; a later access reopens it."""
        self._drop_state(close=True)
        _OPEN_READERS.discard(self)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._drop_state(close=True)

    def __getstate__(self) -> dict[str, Any]:
        # only what is needed to reopen: no descriptor or mapping crosses processes
        return {"path": self._path, "name": self._name, "access": self._access,
                "image": self._image}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._path = state["path"]
        self._name = state["name"]
        self._access = state["access"]
        self._image = state["image"]
        self._st = None
        self._opening = threading.Lock()

    # ------------------------------------------------------------------ metadata
    @property
    def path(self) -> str | None:
        """The file path (None for an in-memory image)."""
        return self._path

    @property
    def name(self) -> str:
        """The name used in messages."""
        return self._name

    @property
    def header(self) -> Header:
        """The committed header slot."""
        return self._state().header

    @property
    def codec(self) -> str:
        """``"none"``, ``"lz4"`` or ``"zstd"``."""
        return CODEC_NAMES[self._state().codec]

    @property
    def record_format(self) -> int:
        """2 or 3."""
        return self._state().header.record_format

    @property
    def positions_dtype(self) -> np.dtype:
        """Element dtype of every record's positions."""
        return self._state().pos_dtype

    @property
    def schema(self) -> Schema | None:
        """The stored schema block (None for schema-less files)."""
        return self._state().schema

    @property
    def index(self) -> np.ndarray:
        """The index entries (``offset``, ``stored``, ``raw``, ``n_atoms``), read-only."""
        return self._state().index

    def __len__(self) -> int:
        return self._state().count

    @property
    def metadata_frames(self) -> list[MetaFrame]:
        """The metadata frames the extensions directory lists (every kind, in order).

        A file in the writing state lists the metadata frames its recovery scan found.
        See :mod:`pyg_atompack.atp.extensions`.
        """
        return list(self._state().directory)

    def read_metadata(self, frame: MetaFrame) -> bytes:
        """The payload of one of :attr:`metadata_frames`, its CRC-32 checked.

        Args:
            frame (MetaFrame): An entry of :attr:`metadata_frames`.

        Returns:
            The payload bytes.

        Raises:
            FrameError: The frame is damaged (names the file, kind and offset).
            AtpValueError: ``frame`` is not listed by this file.
        """
        st = self._state()
        if frame not in st.directory:
            raise AtpValueError(f"{self._name}: {frame} is not in the extensions directory")
        st.check_size()
        return read_payload(st.read, frame, self._name)

    @property
    def groups(self) -> Groups:
        """The file's groupings: ``groups[name][i]`` is one group (see :mod:`.groups`).

        Decoded from the groups frames the extensions directory lists on first access
        (each frame's CRC-32 checked); files without groups give an empty mapping.

        Raises:
            GroupsError: A groups frame is damaged or breaks a rule (names the file,
                frame, grouping and field).
        """
        st = self._state()
        cached = getattr(self, "_groups", None)
        if cached is None or cached[0] is not st:
            cached = self._groups = (st, read_groups(self))
        return cached[1]

    @property
    def n_atoms(self) -> np.ndarray:
        """Atom count of every molecule (int64), from the index alone."""
        st = self._state()
        if st.n_atoms is None:
            st.check_size()  # reads the whole index out of the mapping
            st.n_atoms = st.index["n_atoms"].astype(np.int64)
        return st.n_atoms

    @property
    def fields(self) -> dict[str, FieldInfo]:
        """Every field of the file (from the schema; schema-less files are scanned once)."""
        st = self._state()
        if st.fields is None:
            schema = st.schema if st.schema is not None else self.rebuild_schema()
            st.fields = fields_from_schema(schema, st.pos_dtype)
        return st.fields

    def rebuild_schema(self) -> Schema:
        """Build a schema by decoding every record (what a schema-less file implies)."""
        st = self._state()
        st.check_size()
        schema = Schema(4 if st.pos_dtype == F32 else 7)
        for i in range(st.count):
            merge_layout(schema, _cache.record(st, i)[2])
        return schema

    # ------------------------------------------------------------------ records
    def __getitem__(self, i: int) -> Molecule:
        st = self._st or self._load()
        if type(i) is not int or not 0 <= i < st.count:
            if isinstance(i, slice):
                return [self[j] for j in range(*i.indices(st.count))]
            i = molecule_index(i, st.count, self._name)
        cache = st.cache
        plan = cache.plans[cache.memo[i]]
        touched = False
        try:
            if plan is not None:
                # hot path: a record checked before (its committed bytes never change)
                return plan.decode(st.buf, _OFFSET_UNPACK(st.index_buf, 8 + 20 * i)[0],
                                   self._name, i)
            touch = cache.touch
            if touch is not None:
                # first touch of a record of a mapped uncompressed file: checked in place
                mol = touch(st, i)
                if mol is not None:
                    return mol
                touched = True
        except AtpError:
            raise
        except CORRUPT_DATA_ERRORS as exc:  # a string or tensor section that fails
            raise RecordDecodeError(f"{self._name}: record {i}: {exc}") from exc
        # the rest: parsing, compressed and pread files
        return _cache.molecule(st, i, touched)

    def get(self, i: int) -> Molecule:
        """Decode one molecule like ``reader[i]``, checking first that the file did not shrink.

        ``reader[i]`` of a mapped file does not look at the file's size (the check,
        one ``lseek``, costs 0.6 µs, a third of an uncompressed ``reader[i]`` and a
        tenth of a zstd one): if another program shrank the file, reading the record
        raises ``SIGBUS``. This checks first, for per-sample pipelines that copy
        what they read at once (``AtompackDataset``). The arrays returned stay views
        of the mapping either way (``docs/architecture.md``, "Files that change
        under a reader").

        Args:
            i (int): Molecule index; negative values count from the end.

        Returns:
            The decoded :class:`Molecule`.

        Raises:
            AtpIndexError: ``i`` is out of range.
            AtpValueError: ``i`` is not an integer.
            TruncatedFileError: The file is shorter than the reader's commit needs.
            AtpError: The record is damaged (the message names the file and record).
        """
        (self._st or self._load()).check_size()
        return self[i]

    def __iter__(self) -> Iterator[Molecule]:
        count = len(self)
        for start in range(0, count, _SCAN_CHUNK):
            stop = min(start + _SCAN_CHUNK, count)
            st = self._st
            if st is not None:
                st.check_size()  # once per chunk: reader[i] itself does not check
            if st is not None and st.resident is not None:
                # a scan under MADV_RANDOM would fault page by page: ask for the next
                # records' bytes in one background read instead
                entries = st.index[start:stop]
                low = int(entries["offset"].min())
                st.prefetch(low, int((entries["offset"] + entries["stored"]).max()) - low)
            for i in range(start, stop):
                yield self[i]

    def raw_record(self, i: int) -> bytes:
        """The uncompressed bytes of record ``i`` (as written, byte for byte).

        Args:
            i (int): Molecule index; negative values count from the end.

        Returns:
            The record's bytes after decompression, without decoding its sections.

        Raises:
            AtpIndexError: ``i`` is out of range.
            AtpValueError: ``i`` is not an integer.
            RecordDecodeError: The stored bytes do not decompress to the indexed size.
        """
        st = self._state()
        i = molecule_index(i, st.count, self._name)
        st.check_size()
        off, stored, raw, _ = _cache.entry(st, i)
        data = bytes(st.read(off, stored))
        return bytes(decompress(st.codec, data, raw, f"{self._name}: record {i}"))

    def read_batch(self, indices: Sequence[int] | np.ndarray,
                   fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Decode several molecules into concatenated arrays.

        Args:
            indices (Sequence[int] | np.ndarray): Molecule indices (negative allowed), any order,
                repeats allowed.
            fields (Sequence[str], optional): Names to decode besides positions / atomic numbers:
                builtin names, ``properties/<key>``, ``atom_properties/<key>`` or an
                unambiguous bare custom key (default: every field of the file).

        Returns:
            A dict as described in ``docs/architecture.md``: ``n_atoms``,
            ``positions``, ``atomic_numbers``, the requested fields, ``properties``,
            ``atom_properties`` and ``mask``.
        """
        st = self._st or self._load()
        st.check_size()  # one lseek per batch: a file shrunk under the mapping raises here
        key = fields if fields is None or isinstance(fields, str) else tuple(fields)
        resolved = st.cache.resolved
        infos = resolved.get(key)
        if infos is None:
            infos = _batch.resolve_fields(self.fields, fields, self._name)
            if len(resolved) < 64:
                resolved[key] = infos
        return _batch.read_batch(st, indices, infos)

    def read_resolved(self, indices: Sequence[int] | np.ndarray,
                      infos: dict[str, FieldInfo]) -> dict[str, Any]:
        """:meth:`read_batch` with the fields already resolved (the multi-file readers' call).

        Args:
            indices (Sequence[int] | np.ndarray): Molecule indices (negative allowed), any order,
                repeats allowed.
            infos (dict[str, FieldInfo]): ``name -> FieldInfo`` to decode, e.g. resolved against the
                union of several files' fields.

        Returns:
            The dict of :meth:`read_batch`.
        """
        st = self._st or self._load()
        st.check_size()
        return _batch.read_batch(st, indices, infos)

    def _read_only_message(self) -> str:
        return f"{self._name}: opened read-only; use atp.Writer.append_to()"

    def __repr__(self) -> str:
        if self._st is None:
            return f"Reader({self._name!r}, access={self._access!r}, closed)"
        return (f"Reader({self._name!r}, molecules={len(self)}, codec={self.codec!r}, "
                f"access={self._access!r})")
