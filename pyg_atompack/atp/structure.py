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
then each field of the whole batch is one numpy gather of fixed-size blocks:
per-atom rows at ``start(record) + row * width``, per-molecule values at
``start(record)``. Any record that does not fit makes the caller fall back to
the per-layout paths, so a file with unusual records stays correct.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .assemble import assemble, store
from .fields import FieldInfo
from .records import OP_ARRAY, OP_F32, OP_F64, OP_I64, OP_PBC, Layout
from .types import KIND_ATOM, KIND_BUILTIN, PER_ATOM_BUILTINS

_U8 = np.dtype("u1")
_U32 = np.dtype("<u4")
_SCALAR_DTYPES = {OP_F64: np.dtype("<f8"), OP_I64: np.dtype("<i8"), OP_F32: np.dtype("<f4")}


class _Gather:
    """How one field sits in a record: start ``a + b * n``, per-atom or per-molecule."""

    __slots__ = ("a", "b", "per_atom", "nbytes", "dtype", "shape", "to_bool")

    def __init__(self, a: int, b: int, per_atom: bool, nbytes: int, dtype: np.dtype,
                 shape: tuple[int, ...], to_bool: bool = False) -> None:
        self.a, self.b, self.per_atom = a, b, per_atom
        self.nbytes = nbytes  # bytes per atom row (per-atom) or per value (per-molecule)
        self.dtype, self.shape, self.to_bool = dtype, shape, to_bool


class Structure:
    """Affine section positions shared by records of one structure, over one mapping.

    Args:
        file_u8: the mapped file as uint8.
        pos_dtype: positions element dtype.
        const: ``(a, b, expected byte)`` of every structural byte that does not
            depend on the atom count.
        counts: ``(a, b, multiplier)`` of every little-endian u32 equal to
            ``multiplier * n`` (the record's atom count, per-atom payload lengths).
        size: ``(a, b)`` of the record size.
        fields: field name -> its :class:`_Gather` (positions and atomic numbers
            under their own names).
        stored: every field the structure's records carry (gatherable or not).
    """

    __slots__ = ("file_u8", "const_a", "const_b", "const_expected", "count_a", "count_b",
                 "count_mult", "size_a", "size_b", "fields", "stored", "_windows", "_u32", "_mv")

    def __init__(self, file_u8: np.ndarray, const: list[tuple[int, int, int]],
                 counts: list[tuple[int, int, int]], size: tuple[int, int],
                 fields: dict[str, _Gather], stored: frozenset[str]) -> None:
        self.file_u8 = file_u8
        self.const_a, self.const_b, self.const_expected = (
            np.array(column, dtype=np.int64) for column in zip(*const))
        self.const_expected = self.const_expected.astype(_U8)
        self.count_a, self.count_b, self.count_mult = (
            np.array(column, dtype=np.int64) for column in zip(*counts))
        self.size_a, self.size_b = size
        self.fields = fields
        self.stored = stored
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

    def fits(self, offsets: np.ndarray, raw: np.ndarray, n: np.ndarray) -> bool:
        """Whether every record (file offset, raw size, atom count) has this structure.

        The caller has checked that ``[offset, offset + raw)`` lies inside the file,
        so once the sizes agree every byte compared here is inside its record.
        """
        if not (raw == self.size_a + self.size_b * n).all() or self._u32 is None:
            return False
        cols = offsets[:, None] + self.const_a + self.const_b * n[:, None]
        if not (self.file_u8[cols] == self.const_expected).all():
            return False
        at = offsets[:, None] + self.count_a + self.count_b * n[:, None]
        return bool((self._u32[at] == self.count_mult * n[:, None]).all())

    def take(self, gather: _Gather, offsets: np.ndarray, n: np.ndarray) -> np.ndarray:
        """One field of every record: ``(sum(n), ...)`` per-atom, ``(B, ...)`` otherwise."""
        starts = offsets + gather.a + gather.b * n
        if gather.per_atom:
            # each record's rows are one contiguous run: slicing the mapping and
            # joining the runs copies ~4x faster than a row-by-row fancy index
            stops = starts + n * gather.nbytes
            runs = operator.itemgetter(*map(slice, starts.tolist(), stops.tolist()))(self._mv)
            joined = bytearray().join(runs if len(starts) > 1 else (runs,))
            values = np.frombuffer(joined, gather.dtype).reshape(-1, *gather.shape)
        elif gather.nbytes == 1:
            values = self.file_u8[starts].reshape(len(starts), *gather.shape)
        else:
            values = self._window(gather.nbytes)[starts].view(gather.dtype)
            values = values.reshape(len(starts), *gather.shape)
        return values.astype(bool) if gather.to_bool else values


def _slot_gather(slot, a: int, b: int, n0: int) -> tuple[_Gather | None, int]:
    """The gather of one section's payload and its per-atom row width (0: fixed size)."""
    per_atom = slot.kind == KIND_ATOM or (slot.kind == KIND_BUILTIN and
                                         slot.key in PER_ATOM_BUILTINS)
    op = slot.op
    if op == OP_ARRAY:
        if per_atom and not slot.single:
            width = slot.dtype.itemsize
            if slot.count != n0 or width * n0 != slot.length:
                return None, 0
            return _Gather(a, b, True, width, slot.dtype.base, slot.dtype.shape), width
        shape = slot.dtype.shape if slot.single else (slot.count, *slot.dtype.shape)
        return _Gather(a, b, False, slot.length, slot.dtype.base, shape), 0
    if per_atom:
        return None, 0  # a per-atom tensor: its payload grows with n but is not rows
    if op in _SCALAR_DTYPES:
        return _Gather(a, b, False, slot.length, _SCALAR_DTYPES[op], ()), 0
    if op == OP_PBC and slot.length == 3:
        return _Gather(a, b, False, 3, _U8, (3,), to_bool=True), 0
    return None, 0  # strings, None values, tensors: fixed here, decoded per record


def build_structure(layout: Layout, file_u8: np.ndarray) -> Structure | None:
    """The affine structure of a checked layout, or None when it has none.

    Args:
        layout: a layout parsed from a real record (its structural bytes are known).
        file_u8: the mapped file the structure will gather from.

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
        structure: the structure every record was checked against (:meth:`Structure.fits`).
        offsets: file offsets of the records (int64).
        n_atoms: their atom counts (int64).
        infos: the fields to decode.

    Returns:
        The dict, or None when a requested field cannot be gathered this way
        (strings, tensors, None values): the caller decodes per layout then.
    """
    fields = structure.fields
    for name in infos:
        if name not in fields and name in structure.stored:
            return None
    count = len(offsets)
    everyone = np.ones(count, bool)
    everyone.flags.writeable = False  # one shared all-true mask
    out: dict[str, Any] = {"properties": {}, "atom_properties": {}, "mask": {}}
    for name in ("positions", "atomic_numbers"):
        out[name] = structure.take(fields[name], offsets, n_atoms)
    for name, info in infos.items():
        gather = fields.get(name)
        if gather is None:  # no record of the batch carries it
            assemble(out, info, [None] * count, [False] * count, n_atoms)
        else:
            store(out, info, structure.take(gather, offsets, n_atoms),
                  everyone)
    return out
