"""``read_batch`` of records with different atom counts but the same section structure.

Records of a mixed-size file rarely share a layout (the section offsets move with
the atom count), but they usually share a *structure*: the same ordered list of
sections (kind, key, type tag), per-atom payloads of the same row width and
per-molecule payloads of the same length. For such records every byte position
is affine in the atom count ``n``: a section starts at ``a + b * n`` from its
record's start, where ``b`` is the per-atom bytes (positions, atomic numbers,
forces, ...) stored before it.

A :class:`Structure` holds those ``(a, b)`` pairs, derived once from one checked
layout. A batch is validated against it in a few vectorised compares (record
size, every structural byte, the atom count and the per-atom payload lengths),
then every field of the whole batch is gathered at once: a per-atom field is
one join of each record's contiguous run of rows, a per-molecule field one numpy
gather of fixed-size blocks at ``start(record)``. Any record that does not fit
makes the caller fall back to the per-layout paths, so a file with unusual
records stays correct.

A record's bytes never change while a reader has the file open, so a record
that fitted a structure once is remembered in a :class:`StructureMemo` (one byte
per record, per mapping): a batch of remembered records costs one vectorised id
compare instead of the byte checks.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .assemble import all_present, assemble, store
from .fields import FieldInfo
from .records import OP_ARRAY, Layout

_U8 = np.dtype("u1")
_U32 = np.dtype("<u4")


class _Gather:
    """How one field sits in a record: start ``a + b * n``, per-atom or per-molecule."""

    __slots__ = ("a", "b", "per_atom", "nbytes", "dtype", "shape", "to_bool")

    def __init__(self, a: int, b: int, per_atom: bool, nbytes: int, dtype: np.dtype,
                 shape: tuple[int, ...], to_bool: bool = False) -> None:
        self.a, self.b, self.per_atom = a, b, per_atom
        self.nbytes = nbytes  # bytes per atom row (per-atom) or per value (per-molecule)
        self.dtype, self.shape, self.to_bool = dtype, shape, to_bool

    @property
    def signature(self) -> tuple:
        """Everything that places and types the field."""
        return (self.a, self.b, self.per_atom, self.nbytes, self.dtype, self.shape,
                self.to_bool)


class Structure:
    """Affine section positions shared by records of one structure, over one mapping.

    Args:
        file_u8 (np.ndarray): The mapped file as uint8.
        const (list[tuple[int, int, int]]): ``(a, b, expected byte)`` of every structural byte that
            does not depend on the atom count.
        counts (list[tuple[int, int, int]]): ``(a, b, multiplier)`` of every little-endian u32 equal
            to ``multiplier * n`` (the record's atom count, per-atom payload lengths).
        size (tuple[int, int]): ``(a, b)`` of the record size.
        fields (dict[str, _Gather]): Field name -> its :class:`_Gather` (positions and atomic
            numbers under their own names).
        stored (frozenset[str]): Every field the structure's records carry (gatherable or not).
    """

    __slots__ = ("file_u8", "const_a", "const_b", "const_expected", "count_a", "count_b",
                 "count_mult", "size_a", "size_b", "fields", "stored", "key", "memo_id",
                 "_row", "_a", "_b", "_n_atom_rows", "_windows", "_u32", "_mv", "_const_bytes")

    def __init__(self, file_u8: np.ndarray, const: list[tuple[int, int, int]],
                 counts: list[tuple[int, int, int]], size: tuple[int, int],
                 fields: dict[str, _Gather], stored: frozenset[str]) -> None:
        self.file_u8 = file_u8
        self.const_a, self.const_b, self.const_expected = (
            np.array(column, dtype=np.int64) for column in zip(*const))
        self.const_expected = self.const_expected.astype(_U8)
        self._const_bytes = self.const_expected.tobytes()
        self.count_a, self.count_b, self.count_mult = (
            np.array(column, dtype=np.int64) for column in zip(*counts))
        self.size_a, self.size_b = size
        self.fields = fields
        self.stored = stored
        # everything that makes two structures interchangeable (see StructureMemo)
        self.key = (tuple(const), tuple(counts), size, stored,
                    tuple(sorted((name, g.signature) for name, g in fields.items())))
        self.memo_id: int | None = None
        # one (rows, records) matrix ``offset + _a + _b * n`` per batch holds every
        # offset a gather needs: the start and end of each per-atom field's run,
        # then the start of each per-molecule field (``_row[name]``)
        atom = [name for name in fields if fields[name].per_atom]
        molecule = [name for name in fields if not fields[name].per_atom]
        self._n_atom_rows = len(atom)
        self._row = {name: row for row, name in enumerate(atom)}
        self._row.update((name, 2 * len(atom) + row) for row, name in enumerate(molecule))
        placed = [(fields[k].a, fields[k].b) for k in atom]
        placed += [(fields[k].a, fields[k].b + fields[k].nbytes) for k in atom]
        placed += [(fields[k].a, fields[k].b) for k in molecule]
        self._a = np.array([[a] for a, _ in placed], np.int64)
        self._b = np.array([[b] for _, b in placed], np.int64)
        self._windows: dict[int, np.ndarray] = {}
        self._mv = memoryview(file_u8)
        # the u32 starting at every byte of the file (unaligned reads are fine)
        rows = max(len(file_u8) - 3, 0)
        self._u32 = np.ndarray((rows,), _U32, file_u8, 0, (1,)) if rows else None

    def _window(self, nbytes: int) -> np.ndarray:
        """The file as overlapping ``nbytes`` blocks, one starting at every byte."""
        window = self._windows.get(nbytes)
        if window is None:
            rows = max(len(self.file_u8) - nbytes + 1, 0)
            window = np.ndarray((rows,), np.dtype((np.void, nbytes)), self.file_u8, 0, (1,))
            self._windows[nbytes] = window
        return window

    def fits(self, offsets: np.ndarray, raw: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Which records (file offset, raw size, atom count) have this structure.

        The caller has checked that ``[offset, offset + raw)`` lies inside the file.
        Bytes are compared only for records whose size agrees, so every byte read
        here is inside its own record.

        Args:
            offsets (np.ndarray): File offsets of the records (int64).
            raw (np.ndarray): Their raw sizes (int64).
            n (np.ndarray): Their atom counts (int64).

        Returns:
            A bool array, True where the record has this structure.
        """
        ok = raw == self.size_a + self.size_b * n
        if self._u32 is None:
            return np.zeros(len(ok), bool)
        everyone = bool(ok.all())
        if not everyone:
            rows = np.flatnonzero(ok)
            offsets, n = offsets[rows], n[rows]
        n_col = n[:, None]
        cols = offsets[:, None] + self.const_a + self.const_b * n_col
        const = self.file_u8[cols]
        at = offsets[:, None] + self.count_a + self.count_b * n_col
        counts = self._u32[at] == self.count_mult * n_col
        # the common case, every record fits: one bytes compare (a numpy reduction of
        # a batch-sized array costs ~1.5 µs, the compare a fraction of that)
        if everyone and const.tobytes() == self._const_bytes * len(offsets) and counts.all():
            return ok
        good = (const == self.const_expected).all(axis=1) & counts.all(axis=1)
        if everyone:
            return good
        ok[rows] = good
        return ok

    def take(self, names: list[str], offsets: np.ndarray, n: np.ndarray) -> list[np.ndarray]:
        """Fields ``names`` of every record: ``(sum(n), ...)`` per-atom, ``(B, ...)`` otherwise.

        Args:
            names (list[str]): Fields of this structure.
            offsets (np.ndarray): File offsets of records that fit this structure (int64).
            n (np.ndarray): Their atom counts (int64).

        Returns:
            One new array per name.
        """
        # every offset in three vector operations, whatever the number of fields
        starts = offsets + self._a + self._b * n
        atom_rows = self._n_atom_rows
        runs = starts[:2 * atom_rows].tolist()
        mv, fields, out = self._mv, self.fields, []
        for name in names:
            gather, row = fields[name], self._row[name]
            if row < atom_rows:
                # each record's rows are one contiguous run: joining slices of the
                # mapping beats a row-by-row fancy index (~4x) and np.concatenate
                # of views (~2x)
                lo, hi = runs[row], runs[atom_rows + row]
                joined = bytearray().join([mv[a:b] for a, b in zip(lo, hi)])
                values = np.frombuffer(joined, gather.dtype).reshape(-1, *gather.shape)
            elif gather.nbytes == 1:
                values = self.file_u8[starts[row]].reshape(len(offsets), *gather.shape)
            else:
                values = self._window(gather.nbytes)[starts[row]].view(gather.dtype)
                values = values.reshape(len(offsets), *gather.shape)
            out.append(values.astype(bool) if gather.to_bool else values)
        return out


class StructureMemo:
    """Which records of one mapping were verified against which structure.

    A record's structural bytes never change while a reader has the file open
    (it only sees committed records), so a record that fitted a structure once
    fits it for the life of the mapping: later batches check a one-byte id per
    record instead of every structural byte. Structures equal in every respect
    (e.g. built from layouts of different atom counts) share one id.

    Args:
        count (int): The number of records of the file.
    """

    __slots__ = ("count", "_ids", "structures", "_by_key", "_lock")

    MAX_IDS = 255  # ids are stored as uint8 (1 byte per record); 0 means "not verified"

    def __init__(self, count: int) -> None:
        self.count = count
        self._ids: np.ndarray | None = None
        self.structures: list[Structure | None] = [None]
        self._by_key: dict[tuple, Structure] = {}
        # threads reading one reader: ids are made and handed out under it (two
        # structures given one id would gather records of one with the other's offsets)
        self._lock = threading.Lock()

    @property
    def ids(self) -> np.ndarray:
        """The verified structure id of every record (0: none yet), made on first use."""
        if self._ids is None:
            with self._lock:
                if self._ids is None:  # calloc: untouched pages cost nothing
                    self._ids = np.zeros(self.count, _U8)
        return self._ids

    def canonical(self, structure: Structure) -> Structure:
        """The registered structure equal to ``structure`` (registering it when new).

        Args:
            structure (Structure): A structure over this memo's mapping.

        Returns:
            The shared equal structure; its ``memo_id`` is None once the ids ran out.
        """
        known = self._by_key.get(structure.key)
        if known is not None:
            return known
        with self._lock:
            known = self._by_key.get(structure.key)
            if known is not None:
                return known
            if len(self.structures) <= self.MAX_IDS:
                self.structures.append(structure)
                structure.memo_id = len(self.structures) - 1
            self._by_key[structure.key] = structure
        return structure

    def verify(self, structure: Structure, idx: np.ndarray, offsets: np.ndarray,
               raw: np.ndarray, n: np.ndarray) -> bool:
        """Whether records ``idx`` all have ``structure``, checking only unverified ones.

        Args:
            structure (Structure): A structure returned by :meth:`canonical`.
            idx (np.ndarray): Record indices.
            offsets (np.ndarray): Their file offsets (int64, inside the file with ``raw``).
            raw (np.ndarray): Their raw sizes (int64).
            n (np.ndarray): Their atom counts (int64).

        Returns:
            True when every record fits; the ones that do are remembered either way.
        """
        sid = structure.memo_id
        if sid is None:
            return bool(structure.fits(offsets, raw, n).all())
        ids = self.ids
        new = np.flatnonzero(ids[idx] != sid)
        if not len(new):
            return True
        ok = structure.fits(offsets[new], raw[new], n[new])
        ids[idx[new[ok]]] = sid
        return bool(ok.all())


def _slot_gather(slot, a: int, b: int, n0: int) -> tuple[_Gather | None, int]:
    """The gather of one section's payload and its per-atom row width (0: fixed size)."""
    shape = slot.value_shape
    if slot.per_atom:
        # per-atom rows (not a tensor, whose payload grows with n but is not rows)
        if slot.op != OP_ARRAY or slot.single:
            return None, 0
        width = slot.dtype.itemsize
        if slot.count != n0 or width * n0 != slot.length:
            return None, 0
        return _Gather(a, b, True, width, slot.elem, shape[1:]), width
    if shape is None or slot.length != slot.elem.itemsize * int(np.prod(shape, dtype=np.int64)):
        return None, 0  # strings, None values, tensors: fixed here, decoded per record
    return _Gather(a, b, False, slot.length, slot.elem, shape, slot.to_bool), 0


def build_structure(layout: Layout, file_u8: np.ndarray) -> Structure | None:
    """The affine structure of a checked layout, or None when it has none.

    Args:
        layout (Layout): A layout parsed from a real record (its structural bytes are known).
        file_u8 (np.ndarray): The mapped file the structure will gather from.

    Returns:
        The structure, or None when the layout has trailing bytes, a per-atom
        payload that is not plain rows, or header bytes that do not parse.
    """
    n0 = layout.n_atoms
    if layout.trailing or n0 == 0:
        return None
    row = 3 * layout.pos_dtype.itemsize
    fields = {"positions": _Gather(4, 0, True, row, layout.pos_dtype, (3,)),
              "atomic_numbers": _Gather(4, row, True, 1, _U8, ())}
    counts = [(0, 0, 1)]
    # the structural bytes of the reference record, by record position
    known: dict[int, int] = {}
    for (start, _), header in zip(layout.spans, layout.expected):
        known.update(zip(range(start, start + len(header)), header))
    a, b = 4, row + 1  # the section count follows the atomic numbers
    pos = a + b * n0
    try:
        n_sections = known[pos] | known[pos + 1] << 8
        const = [(a, b, known[pos]), (a + 1, b, known[pos + 1])]
        a, pos = a + 2, pos + 2
        slot_at = {slot.offset: slot for slot in layout.slots}
        for _ in range(n_sections):
            payload = pos + 2 + known[pos + 1] + 5
            length = int.from_bytes(bytes(known[p] for p in range(payload - 4, payload)),
                                    "little")
            width = 0
            slot = slot_at.get(payload)
            if slot is not None:
                gather, width = _slot_gather(slot, a + payload - pos, b, n0)
                if gather is not None:
                    fields[slot.field] = gather
            fixed = payload - pos - (4 if width else 0)
            const += [(a + k, b, known[pos + k]) for k in range(fixed)]
            if width:
                counts.append((a + payload - pos - 4, b, width))
                b += width
                a += payload - pos
            else:
                a += payload - pos + length
            pos = payload + length
    except KeyError:  # a header byte the layout does not record: no structure
        return None
    if pos != a + b * n0:
        return None
    # the last payload ends the record (no trailing bytes): its size is affine too
    return Structure(file_u8, const, counts, (a, b), fields,
                     frozenset(slot.field for slot in layout.slots))


def read_structured(structure: Structure, offsets: np.ndarray, n_atoms: np.ndarray,
                    infos: dict[str, FieldInfo]) -> dict[str, Any] | None:
    """The ``read_batch`` dict (less ``n_atoms``) of records that fit ``structure``.

    Args:
        structure (Structure): The structure every record was checked against
            (:meth:`Structure.fits`).
        offsets (np.ndarray): File offsets of the records (int64).
        n_atoms (np.ndarray): Their atom counts (int64).
        infos (dict[str, FieldInfo]): The fields to decode.

    Returns:
        The dict, or None when a requested field cannot be gathered this way
        (strings, tensors, None values): the caller decodes per layout then.
    """
    fields = structure.fields
    for name in infos:
        if name not in fields and name in structure.stored:
            return None
    count = len(offsets)
    everyone = all_present(count)
    carried = [name for name in infos if name in fields]
    positions, numbers, *values = structure.take(["positions", "atomic_numbers", *carried],
                                                 offsets, n_atoms)
    out: dict[str, Any] = {"positions": positions, "atomic_numbers": numbers,
                           "properties": {}, "atom_properties": {}, "mask": {}}
    taken = dict(zip(carried, values))
    for name, info in infos.items():
        value = taken.get(name)
        if value is None:  # no record of the batch carries it
            assemble(out, info, [None] * count, [False] * count, n_atoms)
        else:
            store(out, info, value, everyone)
    return out
