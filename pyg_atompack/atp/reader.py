"""Read-only access to one `.atp` file through mmap, pread or an in-memory image."""

from __future__ import annotations

import array
import contextlib
import mmap
import operator
import os
import struct
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import batch as _batch
from .codecs import CODEC_NAMES, CODEC_NONE, decompress
from .errors import (
    AtpError,
    AtpIndexError,
    AtpValueError,
    HeaderError,
    ReadOnlyError,
    RecordDecodeError,
    TruncatedFileError,
)
from .fields import FieldInfo, fields_from_schema, merge_layout
from .header import HEADER_SIZE, Header, select_header
from .index import ENTRY_STRUCT, INDEX_DTYPE, decode_index
from .mapped import MappedPlan, WholeFileViews
from .molecule import Molecule
from .records import Layout, build_layout, decode_molecule
from .schema import Schema, decode_schema
from .types import POSITIONS_DTYPE_BY_TAG

ACCESS_MODES = ("mmap", "pread")
# bound on cached layouts; a crafted file with endless distinct layouts only costs re-parsing
_MAX_LAYOUTS = 4096
# larger records are checked through a memoryview instead of a copy
_COPY_CHECK_LIMIT = 1 << 16
_F32 = np.dtype("<f4")
_OPEN_READERS: weakref.WeakSet = weakref.WeakSet()
_OFFSET_UNPACK = struct.Struct("<Q").unpack_from  # the offset of an index entry


def _forget_after_fork() -> None:
    # a child process must never use the parent's descriptors or mappings
    for reader in list(_OPEN_READERS):
        reader._drop_state(close=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


class _Unchecked:
    """Stand-in for the per-record memo before any record was checked: all unknown."""

    __slots__ = ()

    def __getitem__(self, i: int) -> int:
        return 0


_UNCHECKED = _Unchecked()


class _State:
    """Everything an open reader holds; rebuilt lazily after unpickling or fork."""

    __slots__ = ("buf", "mv", "fd", "mm", "size", "header", "schema", "pos_dtype", "index",
                 "index_buf", "count", "layouts", "codec", "fields", "n_atoms", "u8", "memo",
                 "memo_layouts", "memo_plans", "views", "index_checked")


class Reader:
    """Read-only view of one `.atp` file.

    Args:
        path: the file.
        access: ``"mmap"`` (default; zero-copy read-only arrays for uncompressed
            records) or ``"pread"`` (``os.pread``; writable arrays owned by the caller).

    Raises:
        AtpError: the file is not a readable `.atp` file (a subclass says why).
    """

    def __init__(self, path: str | os.PathLike, access: str = "mmap") -> None:
        if access not in ACCESS_MODES:
            raise AtpValueError(f"access must be one of {ACCESS_MODES}, got {access!r}")
        self._path = os.fspath(path)
        self._name = self._path
        self._access = access
        self._image: bytes | None = None
        self._st: _State | None = None
        self._load()

    @classmethod
    def from_bytes(cls, buffer: bytes | bytearray | memoryview, name: str = "<memory>") -> Reader:
        """Open an in-memory `.atp` image (e.g. a shard fetched over HTTP).

        Args:
            buffer: the complete file contents.
            name: name used in error messages.

        Returns:
            A reader over the buffer; arrays are zero-copy read-only views of it.
        """
        self = cls.__new__(cls)
        self._path = None
        self._name = name
        self._access = "memory"
        self._image = bytes(buffer)
        self._st = None
        self._load()
        return self

    # ------------------------------------------------------------------ opening
    def _load(self) -> _State:
        st = _State()
        st.fd = -1
        st.mm = st.mv = st.u8 = None
        try:
            self._map(st)
            self._parse(st)
        except BaseException:
            self._release(st)
            raise
        self._st = st
        _OPEN_READERS.add(self)
        return st

    def _map(self, st: _State) -> None:
        if self._image is not None:
            st.buf = self._image
            st.size = len(self._image)
            return
        try:
            st.fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except IsADirectoryError:
            raise AtpValueError(f"{self._name}: is a directory; use atp.open() for shards") \
                from None
        st.size = os.fstat(st.fd).st_size
        if self._access == "mmap" and st.size:
            st.mm = mmap.mmap(st.fd, 0, access=mmap.ACCESS_READ)
            st.buf = st.mm
        else:
            st.buf = None

    def _read(self, st: _State, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` (the caller checked they lie in the file)."""
        if st.buf is not None:
            return st.buf[offset:offset + length]
        data = os.pread(st.fd, length, offset)
        if len(data) != length:
            raise TruncatedFileError(f"{self._name}: short read at offset {offset} "
                                     f"({len(data)} of {length} bytes); file changed?")
        return data

    def _parse(self, st: _State) -> None:
        head = self._read(st, 0, min(HEADER_SIZE, st.size))
        header = select_header(head, st.size, self._name)
        st.header = header
        st.codec = header.codec
        st.schema = None
        if header.schema_len:
            st.schema = decode_schema(
                self._read(st, header.schema_offset, header.schema_len), self._name)
        if header.record_format == 2:
            st.pos_dtype = _F32
        else:
            tag = st.schema.positions_tag if st.schema else None
            if tag not in POSITIONS_DTYPE_BY_TAG:
                raise HeaderError(f"{self._name}: record format 3 without a schema positions "
                                  f"type (tag {tag})")
            st.pos_dtype = POSITIONS_DTYPE_BY_TAG[tag]
        st.count = header.num_molecules
        if header.index_len:
            if st.mm is not None:
                st.mv = memoryview(st.mm)
                st.index_buf = st.mv[header.index_offset:header.index_offset + header.index_len]
            else:
                st.index_buf = self._read(st, header.index_offset, header.index_len)
            st.index = decode_index(st.index_buf, st.count, self._name)
        else:
            st.index_buf = b""
            st.index = np.zeros(0, dtype=INDEX_DTYPE)
        st.layouts = {}
        # per-record memo of checked layouts (ids into memo_layouts; 0 = not checked yet),
        # an array('H') once the first record is checked
        st.memo = _UNCHECKED
        st.memo_layouts = [None]
        st.index_checked = False
        # mapped uncompressed files decode through per-layout plans (memo id -> plan)
        st.memo_plans = st.views = None
        if st.buf is not None and st.codec == CODEC_NONE:
            st.u8 = np.frombuffer(st.buf, np.uint8)
            st.views = WholeFileViews(st.u8)
            st.memo_plans = [None]
        st.fields = None
        st.n_atoms = None

    def _release(self, st: _State) -> None:
        st.index = st.index_buf = st.u8 = st.layouts = st.memo = st.memo_layouts = None
        st.memo_plans = st.views = None
        if st.mv is not None:
            st.mv.release()
            st.mv = None
        if st.mm is not None:
            # arrays handed out may still view the mapping; it then closes when they die
            with contextlib.suppress(BufferError):
                st.mm.close()
            st.mm = None
        st.buf = None
        if st.fd >= 0:
            os.close(st.fd)
            st.fd = -1

    def _drop_state(self, close: bool) -> None:
        st, self._st = self._st, None
        if st is not None and close:
            self._release(st)

    def _state(self) -> _State:
        return self._st or self._load()

    def close(self) -> None:
        """Release the file; a later access reopens it."""
        self._drop_state(close=True)
        _OPEN_READERS.discard(self)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
    def access(self) -> str:
        """``"mmap"``, ``"pread"`` or ``"memory"``."""
        return self._access

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
    def n_atoms(self) -> np.ndarray:
        """Atom count of every molecule (int64), from the index alone."""
        st = self._state()
        if st.n_atoms is None:
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
        schema = Schema(4 if st.pos_dtype == _F32 else 7)
        for i in range(st.count):
            merge_layout(schema, self._record(st, i)[2])
        return schema

    # ------------------------------------------------------------------ records
    def _entry(self, st: _State, i: int) -> tuple[int, int, int, int]:
        off, stored, raw, n = ENTRY_STRUCT.unpack_from(st.index_buf, 8 + 20 * i)
        if off < HEADER_SIZE or off + stored > st.size:
            raise RecordDecodeError(
                f"{self._name}: record {i}: stored bytes [{off}, +{stored}) lie outside the "
                f"data region of the {st.size}-byte file")
        return off, stored, raw, n

    def _record(self, st: _State, i: int) -> tuple[Any, int, Layout]:
        """The buffer holding record ``i``, its offset there, and its checked layout."""
        off, stored, raw, n = self._entry(st, i)
        if st.codec == CODEC_NONE:
            if stored != raw:
                raise RecordDecodeError(f"{self._name}: record {i}: stored size {stored} != "
                                        f"raw size {raw} without compression")
            if st.buf is not None:
                buf, base = st.buf, off
                rec = buf[off:off + raw] if raw <= _COPY_CHECK_LIMIT or st.mv is None \
                    else st.mv[off:off + raw]
            else:
                buf = rec = bytearray(raw)
                if os.preadv(st.fd, [buf], off) != raw:
                    raise TruncatedFileError(f"{self._name}: record {i}: short read")
                base = 0
        else:
            data = self._read(st, off, stored)
            out = decompress(st.codec, data, raw, f"{self._name}: record {i}")
            buf = rec = bytearray(out) if st.buf is None else out
            base = 0
        layout = st.layouts.get((raw, n))
        if layout is None or not layout.matches(rec):
            layout = self._layout(st, rec, raw, n, i)
        return buf, base, layout

    def _memo(self, st: _State) -> array.array:
        """The per-record memo of checked layout ids, created on first use."""
        if st.memo is _UNCHECKED:
            st.memo = array.array("H", bytes(2 * st.count))
        return st.memo

    def _remember(self, st: _State, i: int, layout: Layout) -> None:
        memo = self._memo(st)
        lid = layout.memo_id
        if lid is None and len(st.memo_layouts) < 65535:
            lid = layout.memo_id = len(st.memo_layouts)
            st.memo_layouts.append(layout)
            if st.memo_plans is not None:
                st.memo_plans.append(self._plan(st, layout))
        if lid is not None:
            memo[i] = lid

    def _plan(self, st: _State, layout: Layout) -> MappedPlan:
        if layout.plan is None:
            layout.plan = MappedPlan(layout, st.views)
        return layout.plan

    def _layout(self, st: _State, rec, raw: int, n: int, i: int) -> Layout:
        """The checked layout of record ``i`` (bytes ``rec``), parsing it when new."""
        layout = st.layouts.get((raw, n))
        if layout is None or not layout.matches(rec):
            layout = build_layout(rec, n, st.pos_dtype, st.header.record_format,
                                  (self._name, i))
            if len(st.layouts) >= _MAX_LAYOUTS:
                st.layouts.clear()
            st.layouts[(raw, n)] = layout
        return layout

    def _check_index(self, i: Any, count: int) -> int:
        try:
            i = operator.index(i)
        except TypeError:
            raise AtpValueError(f"{self._name}: molecule index must be an integer, "
                                f"got {type(i).__name__}") from None
        if i < 0:
            i += count
        if not 0 <= i < count:
            raise AtpIndexError(f"{self._name}: molecule index out of range for {count} "
                                f"molecules")
        return i

    def __getitem__(self, i: int) -> Molecule:
        st = self._st or self._load()
        if type(i) is not int or not 0 <= i < st.count:
            if isinstance(i, slice):
                return [self[j] for j in range(*i.indices(st.count))]
            i = self._check_index(i, st.count)
        try:
            plans = st.memo_plans
            if plans is not None:
                # hot path (uncompressed, mapped): a record's layout is checked on its
                # first access and remembered; the file's committed bytes never change
                plan = plans[st.memo[i]]
                if plan is not None:
                    return plan.decode(st.buf, _OFFSET_UNPACK(st.index_buf, 8 + 20 * i)[0],
                                       self._name, i)
                buf, base, layout = self._record(st, i)
                self._remember(st, i, layout)
                return self._plan(st, layout).decode(buf, base, self._name, i)
            buf, base, layout = self._record(st, i)
            return decode_molecule(buf, base, layout, (self._name, i))
        except AtpError:
            raise
        except Exception as exc:  # numpy/struct errors on a corrupt record
            raise RecordDecodeError(f"{self._name}: record {i}: {exc}") from exc

    def get(self, i: int) -> Molecule:
        """Same as ``reader[i]``."""
        return self[i]

    def __iter__(self) -> Iterator[Molecule]:
        for i in range(len(self)):
            yield self[i]

    def raw_record(self, i: int) -> bytes:
        """The uncompressed bytes of record ``i`` (as written, byte for byte)."""
        st = self._state()
        i = self._check_index(i, st.count)
        off, stored, raw, _ = self._entry(st, i)
        data = bytes(self._read(st, off, stored))
        return bytes(decompress(st.codec, data, raw, f"{self._name}: record {i}"))

    def read_batch(self, indices: Sequence[int] | np.ndarray,
                   fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Decode several molecules into concatenated arrays.

        Args:
            indices: molecule indices (negative allowed), any order, repeats allowed.
            fields: names to decode besides positions / atomic numbers: builtin
                names, ``properties/<key>``, ``atom_properties/<key>`` or an
                unambiguous bare custom key (default: every field of the file).

        Returns:
            A dict as described in ``docs/architecture.md``: ``n_atoms``,
            ``positions``, ``atomic_numbers``, the requested fields, ``properties``,
            ``atom_properties`` and ``mask``.
        """
        infos = _batch.resolve_fields(self.fields, fields, self._name)
        return _batch.read_batch(self, indices, infos)

    # ------------------------------------------------------------------ writes refused
    def add(self, *args: Any, **kwargs: Any) -> None:
        """Readers are read-only; use :class:`pyg_atompack.atp.Writer`."""
        raise ReadOnlyError(f"{self._name}: opened read-only; use atp.Writer.append_to()")

    add_batch = add
    flush = add

    def __repr__(self) -> str:
        if self._st is None:
            return f"Reader({self._name!r}, access={self._access!r}, closed)"
        return (f"Reader({self._name!r}, molecules={len(self)}, codec={self.codec!r}, "
                f"access={self._access!r})")
