"""Fast ``reader[i]`` for uncompressed records of a memory-mapped file.

Creating an array with ``np.frombuffer`` on an mmap costs about a microsecond,
slicing an existing array a fifth of that. So every array a layout decodes is
cut from a *whole-file view*: the file seen as one long array of the field's
row dtype, starting at byte shift ``s < itemsize`` (one view per dtype and
shift, shared by all layouts of the reader).

Which view and which row a field lands on depends only on the record's file
offset modulo ``period`` (the lcm of the layout's item sizes): for
``base = period * q + s`` the field at record offset ``o`` starts at row
``q * (period // itemsize) + (s + o) // itemsize`` of the view with shift
``(s + o) % itemsize``. A :class:`MappedPlan` keeps, per ``s``, the ready list of
``(key, view, step, first, count, single)`` tuples, so decoding a record is one
``divmod`` plus one slice per array. Fixed-size scalars (energy, pbc, ...) are
read by one precompiled :class:`struct.Struct` whose pad bytes skip the gaps.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from .molecule import Molecule
from .records import OP_ARRAY, OP_F32, OP_F64, OP_I64, OP_PBC, Layout, decode_slot
from .types import KIND_ATOM

_U8 = np.dtype("u1")
# struct codes of the scalars read in one unpack; pbc is three '?' (any non-zero is True)
_SCALAR_CODES = {OP_F64: ("d", 8), OP_I64: ("q", 8), OP_F32: ("f", 4), OP_PBC: ("???", 3)}
_new_molecule = Molecule.__new__


class WholeFileViews:
    """Whole-file typed views of one mapping, created on first use.

    It also carries the mapping's ``structures`` memo (``structure.StructureMemo``,
    set by ``read_batch`` on first use), which lives exactly as long as the mapping.

    Args:
        file_u8: the mapped file as a uint8 array.
    """

    __slots__ = ("file_u8", "_views", "structures")

    def __init__(self, file_u8: np.ndarray) -> None:
        self.file_u8 = file_u8
        self._views: dict[tuple[np.dtype, int], np.ndarray] = {}
        self.structures = None

    def get(self, dtype: np.dtype, shift: int) -> np.ndarray:
        """The file as rows of ``dtype`` starting at byte ``shift``.

        Args:
            dtype: row dtype (may be a subarray dtype such as ``('<f4', (3,))``).
            shift: byte offset of row 0, ``0 <= shift < dtype.itemsize``.

        Returns:
            A read-only view over the mapping.
        """
        view = self._views.get((dtype, shift))
        if view is None:
            size = len(self.file_u8)
            rows = max(size - shift, 0) // dtype.itemsize
            view = np.frombuffer(self.file_u8, dtype, rows, shift if rows else 0)
            self._views[(dtype, shift)] = view
        return view


class MappedPlan:
    """Per-layout recipe turning a record's file offset into a :class:`Molecule`.

    Args:
        layout: the checked layout the plan decodes.
        views: the reader's shared whole-file views.
    """

    # n_atoms rather than the layout itself: the layout caches its plan, and a cycle
    # through the plan would keep the file's buffer alive until a full garbage collection
    __slots__ = ("n_atoms", "views", "period", "arrays", "by_shift", "scalars", "scalar_offset",
                 "scalar_keys", "others", "customs")

    def __init__(self, layout: Layout, views: WholeFileViews) -> None:
        self.n_atoms = n = layout.n_atoms
        self.views = views
        arrays = [("positions", layout.pos_rows, 4, n, False),
                  ("atomic_numbers", _U8, layout.z_offset, n, False)]
        scalar_slots = []
        others = []
        for slot in layout.builtins:
            if slot.op == OP_ARRAY:
                arrays.append((slot.key, slot.dtype, slot.offset, slot.count, slot.single))
            elif slot.op in _SCALAR_CODES:
                scalar_slots.append(slot)
            else:
                others.append(slot)
        self.arrays = tuple(arrays)
        self.period = math.lcm(*(dtype.itemsize for _, dtype, _, _, _ in arrays))
        self.by_shift: list[tuple | None] = [None] * self.period
        self.scalars, self.scalar_offset, self.scalar_keys = _scalar_reader(scalar_slots)
        self.others = tuple(others)
        self.customs = layout.customs

    def _arrays_at(self, shift: int) -> tuple:
        """The slicing recipe for records whose offset is ``shift`` modulo the period."""
        period = self.period
        recipe = []
        for key, dtype, offset, count, single in self.arrays:
            itemsize = dtype.itemsize
            start = shift + offset
            view = self.views.get(dtype, start % itemsize)
            recipe.append((key, view, period // itemsize, start // itemsize, count, single))
        recipe = tuple(recipe)
        self.by_shift[shift] = recipe
        return recipe

    def decode(self, buf, base: int, name: str, index: int) -> Molecule:
        """Decode the record at file offset ``base``.

        Args:
            buf: the mapping (scalars and strings are read from it).
            base: the record's file offset (already checked against the file size).
            name: file name for error messages.
            index: record index for error messages.

        Returns:
            The molecule; arrays are read-only zero-copy views of the mapping.
        """
        q, shift = divmod(base, self.period)
        recipe = self.by_shift[shift] or self._arrays_at(shift)
        mol = _new_molecule(Molecule)
        d = mol.__dict__
        for key, view, step, first, count, single in recipe:
            row = q * step + first
            d[key] = view[row] if single else view[row:row + count]
        if self.scalars is not None:
            values = self.scalars.unpack_from(buf, base + self.scalar_offset)
            for key, pos, width in self.scalar_keys:
                d[key] = values[pos] if width == 1 else values[pos:pos + width]
        if self.others or self.customs:
            self._decode_sections(d, buf, base, (name, index))
        return mol

    def _decode_sections(self, d: dict, buf, base: int, where: tuple) -> None:
        """Strings, tensors and custom sections: decoded one by one, checked as they go."""
        n = self.n_atoms
        if self.others:
            for slot in self.others:
                d[slot.key] = decode_slot(buf, base, slot, n, where)
        if self.customs:
            props: dict[str, Any] = {}
            atom_props: dict[str, Any] = {}
            for slot in self.customs:
                target = atom_props if slot.kind == KIND_ATOM else props
                target[slot.key] = decode_slot(buf, base, slot, n, where)
            d["properties"] = props
            d["atom_properties"] = atom_props


def _scalar_reader(slots: list) -> tuple[struct.Struct | None, int, tuple]:
    """One struct reading every fixed-size scalar of a record, pad bytes over the gaps.

    Returns:
        ``(struct or None, record offset of the first scalar, ((key, position, width), ...))``
        where ``width`` is 1 for a number and 3 for a pbc triple.
    """
    if not slots:
        return None, 0, ()
    slots = sorted(slots, key=lambda s: s.offset)
    fmt = ["<"]
    keys = []
    first = slots[0].offset
    pos = first
    n_values = 0
    for slot in slots:
        code, size = _SCALAR_CODES[slot.op]
        if slot.offset > pos:
            fmt.append(f"{slot.offset - pos}x")
        fmt.append(code)
        width = 3 if slot.op == OP_PBC else 1
        keys.append((slot.key, n_values, width))
        n_values += width
        pos = slot.offset + size
    return struct.Struct("".join(fmt)), first, tuple(keys)
