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
* ``columns`` and ``resolved``: the batch path's views of the index columns and
  resolved ``fields=`` selections;
* ``helper``: the pool task faulting in part of the last first-touch batch
  (:mod:`.prefault`);
* ``touch``: the decoder of a record's first touch (:func:`first_touch_decoder`),
  which also keeps whether first touches wait for the disk; ``batch_cold``:
  whether the last batch gathered from the mapping did, which decides whether the
  next one asks the page cache first (``"auto"``).

Index entries are checked against the file where they are used (a record's first
touch, the entries of a batch), not all at once: a fresh reader of a large file
pays for the records it reads, not for a pass over the whole index.

The functions that fill it take the file state as their first argument; nothing
here refers back to the state, so dropping the state frees the mapping at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np

from .codecs import CODEC_NONE, RecordBound, decompress
from .errors import CORRUPT_DATA_ERRORS, AtpError, RecordDecodeError, TruncatedFileError
from .header import HEADER_SIZE
from .index import ENTRY_STRUCT
from .mapped import MappedPlan, WholeFileViews
from .molecule import Molecule
from .preads import CACHED_READ_SECONDS
from .records import Layout, build_layout, decode_molecule
from .structure import StructureMemo

if TYPE_CHECKING:
    from .filestate import FileState

# bound on cached layouts; a crafted file with endless distinct layouts only costs re-parsing
MAX_LAYOUTS = 4096
# larger records are checked through a memoryview instead of a copy
_COPY_CHECK_LIMIT = 1 << 16
# memo ids are uint16; 0 means "not checked yet"
_MAX_MEMO_IDS = 65535
#: Fast first touches in a row after which ``reader[i]`` stops asking for a record's
#: pages before touching them (``"auto"``). On a file not in memory a touch now and
#: then finds its page there; one such hit turning the requests off made the next
#: records fault page by page (0.1-0.4 disk reads per record more, bench_atp cold).
FAST_TOUCHES_TO_WARM = 4
#: Once first touches find their pages in memory, one in this many is timed (to notice
#: the file leaving memory); timing every one cost ~0.2 µs a touch, ~3% of a first
#: ``reader[i]`` from the page cache.
TIMED_TOUCH_EVERY = 8


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
        count (int): The file's record count.
        file_u8 (np.ndarray | None): The mapping or image as uint8 when records can be decoded in
            place (uncompressed, mapped or in memory), else None.
    """

    __slots__ = ("count", "layouts", "memo", "memo_ids", "memo_layouts", "plans", "views",
                 "structures", "columns", "resolved", "touch", "batch_cold", "helper",
                 "helper_reads", "helper_skip", "lock", "bound")

    def __init__(self, count: int, file_u8: np.ndarray | None) -> None:
        self.count = count
        self.layouts: dict[tuple[int, int], Layout] = {}
        self.memo: memoryview | _Unchecked = UNCHECKED
        self.memo_ids: np.ndarray | None = None  # the memo as a uint16 array
        self.memo_layouts: list[Layout | None] = [None]
        # memo id -> decode plan of a mapped uncompressed file (None elsewhere: records
        # are then decoded from their own bytes, checked each time)
        self.plans: list[MappedPlan | None] = [None]
        self.views = WholeFileViews(file_u8) if file_u8 is not None else None
        self.structures: StructureMemo | None = None
        self.columns: tuple[np.ndarray, np.ndarray] | None = None
        self.resolved: dict[Any, dict] = {}
        # the decoder of records not checked before (first_touch_decoder), made with
        # the memo by reader[i]; whether the last batch gathered from the mapping
        # waited for the disk ("auto" only)
        self.touch: Callable[[FileState, int], Molecule | None] | None = None
        self.batch_cold = True
        # the pool task faulting in part of the last first-touch batch (prefault.py)
        self.helper: Future | None = None
        self.helper_reads: Any = None  # its request (start time: was a core free?)
        self.helper_skip = 0  # batches to fault in the calling thread alone
        # threads reading one reader: the memos are made, and memo ids handed out,
        # under it (an id seen before its plan exists, or two layouts given one id,
        # would decode a record with another layout's plan)
        self.lock = threading.Lock()
        # the most bytes a compressed record may declare (record_bound)
        self.bound: RecordBound | None = None

    def memo_array(self) -> np.ndarray:
        """The per-record memo of checked layout ids (uint16), created on first use.

        ``memo`` is the same memory as a memoryview (what ``reader[i]`` indexes: a
        Python int per item, as fast as an ``array.array``). Zero pages come from
        ``calloc``: a fresh reader of a large file pays only for the pages of the
        records it touches.
        """
        if self.memo_ids is None:
            with self.lock:
                if self.memo_ids is None:
                    memo_ids = np.zeros(self.count, np.uint16)
                    self.memo = memoryview(memo_ids)
                    self.memo_ids = memo_ids
        return self.memo_ids

    def untouched(self, idx: np.ndarray) -> np.ndarray | None:
        """Positions in ``idx`` of records neither memo knows (not read through this mapping).

        Args:
            idx (np.ndarray): Record indices.

        Returns:
            np.ndarray | None: The positions, or :obj:`None` when no record was
            checked yet (all of them).
        """
        if self.memo_ids is None and self.structures is None:
            return None
        new = np.ones(len(idx), bool)
        if self.memo_ids is not None:
            new &= self.memo_ids[idx] == 0
        if self.structures is not None:
            new &= self.structures.ids[idx] == 0
        return np.flatnonzero(new)

    def structure_memo(self) -> StructureMemo:
        """The mixed-size structure memo (:mod:`.structure`), created on first use."""
        if self.structures is None:
            with self.lock:
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
        self.memo_array()
        lid = layout.memo_id
        if lid is None:
            with self.lock:
                lid = layout.memo_id
                if lid is None and len(self.memo_layouts) <= _MAX_MEMO_IDS:
                    plan = self.plan(layout) if self.views is not None else None
                    self.memo_layouts.append(layout)
                    self.plans.append(plan)
                    # published last: a thread that sees the id finds its plan
                    lid = layout.memo_id = len(self.memo_layouts) - 1
        if lid is not None:
            self.memo[i] = lid

    def layout(self, st: FileState, rec: memoryview, raw: int, n: int, i: int) -> Layout:
        """The checked layout of record ``i`` (its bytes ``rec``), parsing it when new.

        Args:
            st (FileState): The file state.
            rec (memoryview): The record's uncompressed bytes.
            raw (int): Its raw size (from the index).
            n (int): Its atom count (from the index).
            i (int): Its index (for error messages).

        Returns:
            The layout, shared by every record of the same size and structure.

        Raises:
            RecordDecodeError: The record is malformed.
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

    def adopt(self, st, raw: int, n: int, off: int) -> Layout | None:
        """This reader's layout for ``(raw, n)`` from a parse made by any reader.

        The record at file offset ``off`` (inside the file) is compared in place
        with the known parse's structural bytes (no copy of the record); only when
        they match is the parse taken (and remembered under ``(raw, n)``).

        Args:
            st (FileState): The open file.
            raw (int): The record's raw size.
            n (int): Its atom count.
            off (int): Its file offset.

        Returns:
            Layout | None: The layout, or :obj:`None` when no parse of that size is
            known or the record's structural bytes differ from it.
        """
        known = _PARSED.get((st.pos_dtype, st.header.record_format, raw, n))
        if known is None or known.check_at(st.buf, off) != known.expected:
            return None
        layout = known.unbound()
        if len(self.layouts) >= MAX_LAYOUTS:
            self.layouts.clear()
        self.layouts[(raw, n)] = layout
        return layout

    def index_columns(self, st) -> tuple[np.ndarray, np.ndarray]:
        """Every record's offset and atom count: views of the index (no copy)."""
        if self.columns is None:
            self.columns = (st.index["offset"], st.index["n_atoms"])
        return self.columns


def check_entries(st, idx: np.ndarray, entries: np.ndarray) -> None:
    """Check the index entries of records ``idx`` against the file size.

    Args:
        st (FileState): The open file.
        idx (np.ndarray): Record indices (for the message).
        entries (np.ndarray): Their index entries.

    Raises:
        RecordDecodeError: If an entry's stored bytes lie outside the file (or,
            without compression, disagree with its raw size); the message names the
            first such record.
    """
    offsets, stored = entries["offset"], entries["stored"]
    if not len(offsets):
        return
    ends = offsets + stored
    # the common case in few numpy calls (each costs ~1.5 µs at batch sizes); an offset
    # inside the file cannot wrap ``ends`` around (sizes are 32-bit)
    if int(offsets.min()) >= HEADER_SIZE and int(offsets.max()) <= st.size and \
            int(ends.max()) <= st.size and \
            (st.codec != CODEC_NONE or stored.tobytes() == entries["raw"].tobytes()):
        return
    bad = (offsets < HEADER_SIZE) | (ends > st.size) | (ends < offsets)
    if st.codec == CODEC_NONE:
        bad |= stored != entries["raw"]
    if bad.any():
        j = int(np.argmax(bad))
        raise RecordDecodeError(
            f"{st.name}: record {int(idx[j])}: stored bytes [{int(offsets[j])}, "
            f"+{int(stored[j])}) lie outside the {st.size}-byte file or disagree with its "
            f"size")


def record_bound(st) -> RecordBound:
    """The most bytes a record of the file may declare (made once per open file).

    Args:
        st (FileState): The open file.

    Returns:
        The file's :class:`~pyg_atompack.atp.codecs.RecordBound`.
    """
    bound = st.cache.bound
    if bound is None:
        bound = st.cache.bound = RecordBound(st.schema, st.pos_dtype.itemsize)
    return bound


def entry(st, i: int) -> tuple[int, int, int, int]:
    """Index entry ``i`` (offset, stored, raw, n_atoms), checked against the file size."""
    off, stored, raw, n = ENTRY_STRUCT.unpack_from(st.index_buf, 8 + 20 * i)
    if off < HEADER_SIZE or off + stored > st.size:
        raise RecordDecodeError(
            f"{st.name}: record {i}: stored bytes [{off}, +{stored}) lie outside the "
            f"data region of the {st.size}-byte file")
    frames = st.frames
    if frames is not None and not frames.ok[i]:
        # a framed file's record is CRC-checked on its first read (every single-record
        # path comes through here before it decodes or remembers the record)
        frames.check(st, i, off, stored, raw, n)
    return off, stored, raw, n


def record(st: FileState, i: int) -> tuple[Any, int, Layout]:
    """The buffer holding record ``i``, its offset there, and its checked layout.

    Args:
        st (FileState): The file state.
        i (int): The record index (in range).

    Returns:
        ``(buffer, offset, layout)``: the mapping / image and the record's file
        offset, or a private buffer holding just the record and 0.

    Raises:
        AtpError: The record is damaged or the file shrank.
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
        out = decompress(st.codec, data, raw, f"{st.name}: record {i}", n, record_bound(st))
        buf = rec = bytearray(out) if st.buf is None else out
        base = 0
    return buf, base, st.cache.layout(st, rec, raw, n, i)


def first_touch_decoder(st: FileState) -> Callable[[FileState, int], Molecule | None]:
    """The decoder of records not checked before, for a mapped uncompressed file.

    ``touch(st, i)`` (kept as ``cache.touch``) decodes record ``i`` after checking
    it in place against the reader's layout of its size (or a parse of that size
    made by any reader), structural bytes compared inside the plan's ``checked``
    decoder, and remembers it. It returns :obj:`None` when the entry, the layout or
    the structural bytes call for the full parse (:func:`molecule`). It is a
    closure over the cache's containers that tries the last size's layout before
    the lookup by size: a first ``reader[i]`` costs 0.50-0.64 µs more than a
    remembered one, where a function looking everything up on the state cost
    0.56-0.84 µs more (``timeit``, ``benchmarks/RESULTS.md``). It holds no reference to the
    state or the cache (the state comes in as an argument), so dropping the state
    frees the mapping at once.

    Under ``"auto"`` the check is the record's first touch. While first touches
    wait for the disk (slower than a page-cache hit), each one -- also the first
    record of a size new to the reader -- asks for the record's pages with one
    ``MADV_WILLNEED`` first (:meth:`FileState.prefetch_record`): one read for all
    of them, where touching them would wait for one read per page. Only after
    :data:`FAST_TOUCHES_TO_WARM` fast touches in a row (the pages are in memory) is
    the system call skipped; from then on one touch in :data:`TIMED_TOUCH_EVERY` is
    timed, and one slow timed touch brings the requests back. A skipped request on
    a record not in memory costs a disk read per page, an unneeded one ~3 us, and
    timing a touch two clock reads (~0.2 µs).

    Args:
        st (FileState): The open file (its decode cache has views and a memo).

    Returns:
        ``touch(st, i) -> Molecule | None`` for records ``i`` in range.
    """
    cache = st.cache
    layouts, plans, memo, size = cache.layouts, cache.plans, cache.memo, st.size
    timed = st.resident is not None
    cold = FAST_TOUCHES_TO_WARM  # see FAST_TOUCHES_TO_WARM (0: pages are not asked for)
    untimed = 0  # touches still to go before the next timed one, while warm
    # (raw size, atom count, memo id, checked decoder) of the last size touched: records
    # of a file of one size skip the lookup (a layout replaced since stays a valid
    # check). One tuple, read and replaced whole: threads sharing the reader never see
    # one size's decoder under another size.
    last = (None, None, 0, None)
    crc_ok = st.frames.ok if st.frames is not None else None

    def touch(st: FileState, i: int) -> Molecule | None:
        nonlocal cold, untimed, last
        off, stored, raw, n = ENTRY_STRUCT.unpack_from(st.index_buf, 8 + 20 * i)
        if stored != raw or off < HEADER_SIZE or off + raw > size:
            return None
        if crc_ok is not None and not crc_ok[i]:  # a framed file's record: CRC first
            st.frames.check(st, i, off, stored, raw, n)
        known = last
        if known[0] == raw and known[1] == n:
            lid, checked = known[2], known[3]
        else:
            layout = layouts.get((raw, n))
            if layout is None:  # the first record of its size in this reader
                if timed and cold:
                    st.prefetch_record(off, raw)
                layout = st.cache.adopt(st, raw, n, off)
                if layout is None:
                    return None  # parsed from its bytes
                st.cache.remember(i, layout)
                return st.cache.plan(layout).decode(st.buf, off, st.name, i)
            lid = layout.memo_id
            if lid is None:
                return None
            checked = plans[lid].checked
            last = (raw, n, lid, checked)
        if not timed:
            mol = checked(st.buf, off, st.name, i)
        elif untimed:  # nonzero only while warm: the timed touch that turns cold clears it
            untimed -= 1
            mol = checked(st.buf, off, st.name, i)
        else:
            # timed with the request: a read it started can end before the touch begins
            start = perf_counter()
            if cold:
                st.prefetch_record(off, raw)
            mol = checked(st.buf, off, st.name, i)
            if perf_counter() - start > CACHED_READ_SECONDS:
                cold = FAST_TOUCHES_TO_WARM
            elif cold:
                cold -= 1
            untimed = 0 if cold else TIMED_TOUCH_EVERY - 1
        if mol is not None:
            memo[i] = lid
        else:
            last = (None, None, 0, None)  # another structure of this size: look it up
        return mol

    return touch


def molecule(st: FileState, i: int, touched: bool = False) -> Molecule:
    """Decode record ``i`` (in range), checking it when it was not checked before.

    ``reader[i]`` takes a shortcut for records already remembered; this is the
    rest: a record's first touch on a mapped uncompressed file (checked in place
    against a known layout of its size, or parsed, then remembered), and every
    read of a compressed or ``pread`` file.

    Args:
        st (FileState): The file state.
        i (int): The record index (in range).
        touched (bool, optional): Whether ``cache.touch`` was tried on the record
            already and called for the full parse (a second try would repeat its
            page request and layout lookup). (default: :obj:`False`)

    Returns:
        The molecule.

    Raises:
        AtpError: The record is damaged (the message names the file and record).
    """
    cache = st.cache
    try:
        if cache.views is not None:
            plan = cache.plans[cache.memo[i]]
            if plan is not None:
                return plan.decode(st.buf, entry(st, i)[0], st.name, i)
            touch = cache.touch
            if touch is None:
                cache.memo_array()
                touch = cache.touch = first_touch_decoder(st)
            mol = None if touched else touch(st, i)
            if mol is not None:
                return mol
            buf, base, layout = record(st, i)
            cache.remember(i, layout)
            return cache.plan(layout).decode(buf, base, st.name, i)
        buf, base, layout = record(st, i)
        return decode_molecule(buf, base, layout, (st.name, i))
    except AtpError:
        raise
    except CORRUPT_DATA_ERRORS as exc:  # numpy/struct errors on a corrupt record
        raise RecordDecodeError(f"{st.name}: record {i}: {exc}") from exc
