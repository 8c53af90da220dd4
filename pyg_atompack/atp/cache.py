"""What decoding learns about one open `.atp` file: layouts, per-record memos, plans.

A :class:`DecodeCache` belongs to one :class:`~pyg_atompack.atp.filestate.FileState`
(one mapping, image or descriptor) and lives exactly as long as it: a reader that
is closed, unpickled or forked gets a fresh one with its new state. It holds
everything ``reader[i]`` and ``read_batch`` remember between calls:

* ``layouts``: the checked :class:`~pyg_atompack.atp.records.Layout` of each
  ``(raw size, n_atoms)`` seen;
* ``memo``: per record, the id of the layout it was checked against (0: not yet),
  with ``memo_layouts`` / ``plans`` indexed by that id. The committed bytes of a
  file never change under an open reader, so a record is checked once;
* ``views`` (whole-file views, :mod:`.mapped`) and ``structures`` (the mixed-size
  memo, :mod:`.structure`) of a mapped uncompressed file;
* ``index_checked``, ``columns`` and ``resolved``: the batch path's once-per-file
  index check, int64 index columns and resolved ``fields=`` selections;
* ``cold``: whether the last first touch of a record waited for the disk, which
  decides whether the next one asks for its pages first (``"auto"``).

The functions that fill it take the file state as their first argument; nothing
here refers back to the state, so dropping the state frees the mapping at once.
"""

from __future__ import annotations

import array
import os
from time import perf_counter
from typing import Any

import numpy as np

from .codecs import CODEC_NONE, decompress
from .errors import CORRUPT_DATA_ERRORS, AtpError, RecordDecodeError, TruncatedFileError
from .header import HEADER_SIZE
from .index import ENTRY_STRUCT
from .mapped import MappedPlan, WholeFileViews
from .molecule import Molecule
from .preads import CACHED_READ_SECONDS
from .records import Layout, build_layout, decode_molecule
from .structure import StructureMemo

# bound on cached layouts; a crafted file with endless distinct layouts only costs re-parsing
MAX_LAYOUTS = 4096
# larger records are checked through a memoryview instead of a copy
_COPY_CHECK_LIMIT = 1 << 16
# memo ids are uint16; 0 means "not checked yet"
_MAX_MEMO_IDS = 65535


# Layouts parsed by any reader in this process, by (positions dtype, record format, raw
# size, atom count): a fresh reader of a file of many sizes (or of another shard of
# the same data set) reuses the parse after checking the record's structural bytes
# against it, as it does with its own layouts; never trusted without that check.
_PARSED: dict[tuple, Layout] = {}


class _Unchecked:
    """Stand-in for the per-record memo before any record was checked: all unknown."""

    __slots__ = ()

    def __getitem__(self, i: int) -> int:
        return 0


UNCHECKED = _Unchecked()


class DecodeCache:
    """Decoding state of one open file (see the module docstring).

    Args:
        count: the file's record count.
        file_u8: the mapping or image as uint8 when records can be decoded in place
            (uncompressed, mapped or in memory), else None.
    """

    __slots__ = ("count", "layouts", "memo", "memo_layouts", "plans", "views", "structures",
                 "index_checked", "columns", "resolved", "cold")

    def __init__(self, count: int, file_u8: np.ndarray | None) -> None:
        self.count = count
        self.layouts: dict[tuple[int, int], Layout] = {}
        self.memo: array.array | _Unchecked = UNCHECKED
        self.memo_layouts: list[Layout | None] = [None]
        # memo id -> decode plan of a mapped uncompressed file (None elsewhere: records
        # are then decoded from their own bytes, checked each time)
        self.plans: list[MappedPlan | None] = [None]
        self.views = WholeFileViews(file_u8) if file_u8 is not None else None
        self.structures: StructureMemo | None = None
        self.index_checked = False
        self.columns: tuple[np.ndarray, np.ndarray] | None = None
        self.resolved: dict[Any, dict] = {}
        # whether the last first touch of a record waited for the disk ("auto" only)
        self.cold = True

    def memo_array(self) -> array.array:
        """The per-record memo of checked layout ids, created on first use."""
        if self.memo is UNCHECKED:
            self.memo = array.array("H", bytes(2 * self.count))
        return self.memo

    def structure_memo(self) -> StructureMemo:
        """The mixed-size structure memo (:mod:`.structure`), created on first use."""
        if self.structures is None:
            self.structures = StructureMemo(self.count)
        return self.structures

    def plan(self, layout: Layout) -> MappedPlan:
        """The mapped decode plan of ``layout`` (mapped uncompressed files only)."""
        if layout.plan is None:
            layout.plan = MappedPlan(layout, self.views)
        return layout.plan

    def remember(self, i: int, layout: Layout) -> None:
        """Record that record ``i`` was checked against ``layout``."""
        memo = self.memo_array()
        lid = layout.memo_id
        if lid is None and len(self.memo_layouts) <= _MAX_MEMO_IDS:
            lid = layout.memo_id = len(self.memo_layouts)
            self.memo_layouts.append(layout)
            self.plans.append(self.plan(layout) if self.views is not None else None)
        if lid is not None:
            memo[i] = lid

    def layout(self, st, rec, raw: int, n: int, i: int) -> Layout:
        """The checked layout of record ``i`` (its bytes ``rec``), parsing it when new.

        Args:
            st: the file state.
            rec: the record's uncompressed bytes.
            raw: its raw size (from the index).
            n: its atom count (from the index).
            i: its index (for error messages).

        Returns:
            The layout, shared by every record of the same size and structure.

        Raises:
            RecordDecodeError: the record is malformed.
        """
        layout = self.layouts.get((raw, n))
        if layout is None or not layout.matches(rec):
            key = (st.pos_dtype, st.header.record_format, raw, n)
            known = _PARSED.get(key)
            if known is not None and known.matches(rec):
                layout = known.unbound()
            else:
                layout = build_layout(rec, n, st.pos_dtype, st.header.record_format,
                                      (st.name, i))
                if len(_PARSED) >= MAX_LAYOUTS:
                    _PARSED.clear()
                _PARSED[key] = layout.unbound()
            if len(self.layouts) >= MAX_LAYOUTS:
                self.layouts.clear()
            self.layouts[(raw, n)] = layout
        return layout

    def check_index(self, st) -> None:
        """Check every index entry against the file once; raises naming the first bad one."""
        if self.index_checked:
            return
        index = st.index
        offsets, stored = index["offset"], index["stored"].astype(np.uint64)
        bad = (offsets < HEADER_SIZE) | (offsets > st.size) | (offsets + stored > st.size)
        if st.codec == CODEC_NONE:
            bad |= index["stored"] != index["raw"]
        if bad.any():
            j = int(np.argmax(bad))
            raise RecordDecodeError(
                f"{st.name}: record {j}: stored bytes [{int(offsets[j])}, +{int(stored[j])}) "
                f"lie outside the {st.size}-byte file or disagree with its size")
        self.index_checked = True

    def index_columns(self, st) -> tuple[np.ndarray, np.ndarray]:
        """Every record's offset and atom count as int64 (made once per file)."""
        if self.columns is None:
            self.columns = (st.index["offset"].astype(np.int64),
                            st.index["n_atoms"].astype(np.int64))
        return self.columns


def entry(st, i: int) -> tuple[int, int, int, int]:
    """Index entry ``i`` (offset, stored, raw, n_atoms), checked against the file size."""
    off, stored, raw, n = ENTRY_STRUCT.unpack_from(st.index_buf, 8 + 20 * i)
    if off < HEADER_SIZE or off + stored > st.size:
        raise RecordDecodeError(
            f"{st.name}: record {i}: stored bytes [{off}, +{stored}) lie outside the "
            f"data region of the {st.size}-byte file")
    return off, stored, raw, n


def record(st, i: int) -> tuple[Any, int, Layout]:
    """The buffer holding record ``i``, its offset there, and its checked layout.

    Args:
        st: the file state.
        i: the record index (in range).

    Returns:
        ``(buffer, offset, layout)``: the mapping / image and the record's file
        offset, or a private buffer holding just the record and 0.

    Raises:
        AtpError: the record is damaged or the file shrank.
    """
    off, stored, raw, n = entry(st, i)
    if st.codec == CODEC_NONE:
        if stored != raw:
            raise RecordDecodeError(f"{st.name}: record {i}: stored size {stored} != "
                                    f"raw size {raw} without compression")
        if st.buf is not None:
            buf, base = st.buf, off
            rec = buf[off:off + raw] if raw <= _COPY_CHECK_LIMIT or st.mv is None \
                else st.mv[off:off + raw]
        else:
            buf = rec = bytearray(raw)
            if os.preadv(st.fd, [buf], off) != raw:
                raise TruncatedFileError(f"{st.name}: record {i}: short read")
            base = 0
    else:
        data = st.read(off, stored)
        out = decompress(st.codec, data, raw, f"{st.name}: record {i}")
        buf = rec = bytearray(out) if st.buf is None else out
        base = 0
    return buf, base, st.cache.layout(st, rec, raw, n, i)


def _check_timed(st, cache: DecodeCache, layout: Layout, off: int, raw: int) -> bool:
    """``layout.check_at`` of a first touch under ``"auto"``, learning whether to prefetch.

    The check is the record's first touch: when the previous first touch had to wait
    for the disk (slower than a page-cache hit), this one asks for the record's
    pages with one ``MADV_WILLNEED`` first (:meth:`FileState.prefetch_record`); when
    it is fast again (the pages are in memory), the system call is skipped. Timing
    costs two clock reads; the system call on every first touch cost more than that
    on data already in memory.
    """
    if cache.cold:
        st.prefetch_record(off, raw)
    start = perf_counter()
    matches = layout.check_at(st.buf, off) == layout.expected
    cache.cold = perf_counter() - start > CACHED_READ_SECONDS
    return matches


def molecule(st, i: int) -> Molecule:
    """Decode record ``i`` (in range), checking it when it was not checked before.

    ``reader[i]`` takes a shortcut for records already remembered; this is the
    rest: a record's first touch on a mapped uncompressed file (checked in place
    against a known layout of its size, or parsed, then remembered), and every
    read of a compressed or ``pread`` file.

    Args:
        st: the file state.
        i: the record index (in range).

    Returns:
        The molecule.

    Raises:
        AtpError: the record is damaged (the message names the file and record).
    """
    cache = st.cache
    try:
        if cache.views is not None:
            plan = cache.plans[cache.memo[i]]
            if plan is not None:
                return plan.decode(st.buf, entry(st, i)[0], st.name, i)
            # first touch: check the record's structural bytes in place against a known
            # layout of its size (no copy of the record, no re-parse)
            off, stored, raw, n = ENTRY_STRUCT.unpack_from(st.index_buf, 8 + 20 * i)
            inside = stored == raw and off >= HEADER_SIZE and off + raw <= st.size
            layout = cache.layouts.get((raw, n))
            if inside and layout is not None and layout.memo_id is not None:
                if st.resident is None:
                    matches = layout.check_at(st.buf, off) == layout.expected
                else:
                    matches = _check_timed(st, cache, layout, off, raw)
                if matches:
                    memo = cache.memo
                    (cache.memo_array() if memo is UNCHECKED else memo)[i] = layout.memo_id
                    return cache.plans[layout.memo_id].decode(st.buf, off, st.name, i)
            elif inside and st.resident is not None:
                st.prefetch_record(off, raw)
            buf, base, layout = record(st, i)
            cache.remember(i, layout)
            return cache.plan(layout).decode(buf, base, st.name, i)
        buf, base, layout = record(st, i)
        return decode_molecule(buf, base, layout, (st.name, i))
    except AtpError:
        raise
    except CORRUPT_DATA_ERRORS as exc:  # numpy/struct errors on a corrupt record
        raise RecordDecodeError(f"{st.name}: record {i}: {exc}") from exc
