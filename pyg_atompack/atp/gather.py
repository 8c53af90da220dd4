"""``read_batch`` straight from a memory-mapped uncompressed file.

A field of a layout lies at a fixed offset from its record's start, so the field
values of many records are one numpy gather through a *window*: a strided view
of the file whose row ``b`` is the field as it would sit in a record starting at
file byte ``b`` (row stride 1 byte; rows may overlap and be unaligned, numpy
copies them correctly). ``window[record_offsets]`` then yields a fresh,
contiguous ``(B, *value_shape)`` array with no intermediate byte matrix.

Windows are made once per layout (:class:`GatherPlan`); a batch whose records
share one layout costs one fancy index per field. Batches mixing layouts (other
atom counts, sparse fields) are gathered per group of equal layout and scattered
into the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .assemble import all_present, assemble, store
from .fields import FieldInfo
from .records import Layout, Slot, decode_slot
from .structure import Structure, build_structure

if TYPE_CHECKING:
    from .filestate import FileState

_U8 = np.dtype("u1")


# values of at least this many bytes are gathered as opaque blocks (one memcpy per record)
# and then viewed as numbers; smaller ones element by element
_BLOCK_BYTES = 32


class Window:
    """Field values of one layout, gathered by record offset.

    Args:
        file_u8 (np.ndarray): The mapped file as uint8.
        offset (int): Field offset inside the record.
        elem (np.dtype): Element dtype.
        value_shape (tuple[int, ...]): Shape of one record's value (e.g. ``(n, 3)``, ``(3, 3)``,
            ``()``).
        to_bool (bool, optional): Turn bytes into booleans (pbc). (default: :obj:`False`)
    """

    __slots__ = ("view", "elem", "value_shape", "to_bool", "value_dtype")

    def __init__(self, file_u8: np.ndarray, offset: int, elem: np.dtype,
                 value_shape: tuple[int, ...], to_bool: bool = False) -> None:
        nbytes = elem.itemsize * int(np.prod(value_shape, dtype=np.int64))
        rows = max(len(file_u8) - offset - nbytes + 1, 0)
        buffer = file_u8  # its memoryview base keeps the mapping's buffer export
        inner = []
        stride = elem.itemsize
        for dim in reversed(value_shape):
            inner.insert(0, stride)
            stride *= dim
        start = offset if rows else 0
        if nbytes >= _BLOCK_BYTES:
            # numpy copies an unaligned strided element at a time, a void block at once
            self.view = np.ndarray((rows,), np.dtype((np.void, nbytes)), buffer, start, (1,))
            self.value_dtype = np.dtype((elem, value_shape))
        else:
            self.view = np.ndarray((rows, *value_shape), elem, buffer, start, (1, *inner))
            self.value_dtype = None
        self.elem = elem
        self.value_shape = value_shape
        self.to_bool = to_bool

    def take(self, offsets: np.ndarray) -> np.ndarray:
        """Values of the records at file ``offsets`` as a new ``(B, *value_shape)`` array."""
        values = self.view[offsets]
        if self.value_dtype is not None:
            values = values.view(self.value_dtype)  # the subarray dtype adds the value axes
        return values.astype(bool) if self.to_bool else values

    @property
    def signature(self) -> tuple:
        """What must agree for windows of different layouts to share one output array."""
        return (self.elem, self.value_shape, self.to_bool)


def slot_window(file_u8: np.ndarray, slot: Slot) -> Window | None:
    """The window of a fixed-size section, or None when its values need per-record decoding."""
    if slot.value_shape is None:
        return None
    return Window(file_u8, slot.offset, slot.elem, slot.value_shape, slot.to_bool)


class GatherPlan:
    """Windows of every field of one layout over one mapping, made on first use.

    Args:
        layout (Layout): The checked layout.
        file_u8 (np.ndarray): The mapped file as uint8.
    """

    # no reference back to the layout: the layout caches its plan, and a cycle through
    # the plan would keep the file's buffer alive until a full garbage collection
    __slots__ = ("by_field", "file_u8", "positions", "numbers", "_fields", "_structure")

    def __init__(self, layout: Layout, file_u8: np.ndarray) -> None:
        n = layout.n_atoms
        self.by_field = layout.by_field
        self.file_u8 = file_u8
        self.positions = Window(file_u8, 4, layout.pos_dtype, (n, 3))
        self.numbers = Window(file_u8, layout.z_offset, _U8, (n,))
        self._fields: dict[str, Window | None] = {}
        self._structure: Structure | bool | None = None

    def structure(self, layout: Layout) -> Structure | None:
        """The affine structure (structure.py) of ``layout``, this plan's layout, or None."""
        if self._structure is None:
            self._structure = build_structure(layout, self.file_u8) or False
        return self._structure or None

    def window(self, field: str) -> Window | None:
        """The window of ``field`` (None if this layout lacks it or it is not fixed-size)."""
        try:
            return self._fields[field]
        except KeyError:
            slot = self.by_field.get(field)
            window = None if slot is None else slot_window(self.file_u8, slot)
            self._fields[field] = window
            return window


def flatten_atoms(values: np.ndarray, per_atom: bool) -> np.ndarray:
    """``(B, n, ...)`` per-atom values as ``(B * n, ...)``; per-molecule values unchanged."""
    if per_atom:
        return values.reshape(-1, *values.shape[2:])
    return values


def gather_groups(windows: list[Window | None], group_of: np.ndarray, offsets: np.ndarray,
                  n_atoms: np.ndarray, per_atom: bool):
    """Gather one field of a batch whose records use several layouts.

    Args:
        windows (list[Window | None]): The field's window in each group's layout (None: the layout
            lacks it).
        group_of (np.ndarray): Group number of each record of the batch.
        offsets (np.ndarray): File offset of each record (int64).
        n_atoms (np.ndarray): Atom count of each record (int64).
        per_atom (bool): Whether values have one row per atom.

    Returns:
        ``(values, present)`` with missing values zero-filled, or None when the
        groups' values do not share one dtype and shape (decode per record then).
    """
    known = [w for w in windows if w is not None]
    if not known:
        return None
    first = known[0]
    tail = first.value_shape[1:] if per_atom else first.value_shape
    for w in known:
        if (w.elem, w.to_bool) != (first.elem, first.to_bool) or \
                (w.value_shape[1:] if per_atom else w.value_shape) != tail:
            return None
    rows = int(n_atoms.sum()) if per_atom else len(offsets)
    dtype = np.dtype(bool) if first.to_bool else first.elem
    complete = len(known) == len(windows)
    out = (np.empty if complete else np.zeros)((rows, *tail), dtype)
    present = np.ones(len(offsets), bool)
    starts = np.cumsum(n_atoms) - n_atoms if per_atom else None
    for g, window in enumerate(windows):
        members = np.flatnonzero(group_of == g)
        if window is None:
            present[members] = False
            continue
        values = window.take(offsets[members])
        if not per_atom:
            out[members] = values
        elif len(members) == 1:
            start = int(starts[members[0]])
            out[start:start + len(values[0])] = values[0]
        else:
            n = window.value_shape[0]
            atom_rows = (starts[members][:, None] + np.arange(n)).ravel()
            out[atom_rows] = flatten_atoms(values, True)
    return out, present


def plan_of(layout: Layout, file_u8: np.ndarray) -> GatherPlan:
    if layout.gather is None:
        layout.gather = GatherPlan(layout, file_u8)
    return layout.gather


def read_mapped(st: FileState, idx: np.ndarray, offsets: np.ndarray, layout_ids: np.ndarray,
                n_atoms: np.ndarray, infos: dict[str, FieldInfo]) -> dict[str, Any]:
    """The ``read_batch`` dict of checked records of a mapped uncompressed file.

    Args:
        st (FileState): The open file state (mapping, name, decode cache).
        idx (np.ndarray): Record indices.
        offsets (np.ndarray): Their file offsets.
        layout_ids (np.ndarray): Their checked layout ids (``st.cache.memo_layouts``).
        n_atoms (np.ndarray): Their atom counts (int64).
        infos (dict[str, FieldInfo]): The fields to decode.

    Returns:
        Everything but ``n_atoms`` of the ``read_batch`` dict.
    """
    file_u8 = st.u8
    count = len(idx)
    offsets = offsets.astype(np.int64)
    out: dict[str, Any] = {"properties": {}, "atom_properties": {}, "mask": {}}
    # one read-only all-true mask serves every field all records carry
    everyone = all_present(count)
    first = int(layout_ids[0])
    if (layout_ids == first).all():
        return read_single(st, idx, offsets, first, infos)
    lids, group_of = np.unique(layout_ids, return_inverse=True)
    plans = [plan_of(st.cache.memo_layouts[lid], file_u8) for lid in lids.tolist()]
    out["positions"] = gather_groups([p.positions for p in plans], group_of, offsets,
                                     n_atoms, True)[0]
    out["atomic_numbers"] = gather_groups([p.numbers for p in plans], group_of, offsets,
                                          n_atoms, True)[0]
    for field, info in infos.items():
        got = gather_groups([p.window(field) for p in plans], group_of, offsets, n_atoms,
                            info.per_atom)
        if got is None:
            _per_record(st, out, info, idx, offsets, layout_ids, n_atoms)
        else:
            values, present = got
            store(out, info, values, everyone if present.all() else present)
    return out


def read_single(st: FileState, idx: np.ndarray, offsets: np.ndarray, layout_id: int,
                infos: dict[str, FieldInfo]) -> dict[str, Any]:
    """:func:`read_mapped` of records that all have the checked layout ``layout_id``.

    Args:
        st (FileState): The open file state (mapping, name, decode cache).
        idx (np.ndarray): Record indices.
        offsets (np.ndarray): Their file offsets (int64).
        layout_id (int): Their layout's id (``st.cache.memo_layouts``).
        infos (dict[str, FieldInfo]): The fields to decode.

    Returns:
        Everything but ``n_atoms`` of the ``read_batch`` dict.
    """
    layout = st.cache.memo_layouts[layout_id]
    plan = plan_of(layout, st.u8)
    out: dict[str, Any] = {"properties": {}, "atom_properties": {}, "mask": {}}
    everyone = all_present(len(idx))
    out["positions"] = plan.positions.take(offsets).reshape(-1, 3)
    out["atomic_numbers"] = plan.numbers.take(offsets).reshape(-1)
    for field, info in infos.items():
        window = plan.window(field)
        if window is not None:
            store(out, info, flatten_atoms(window.take(offsets), info.per_atom), everyone)
        else:
            lids = np.full(len(idx), layout_id, np.uint16)
            n_atoms = np.full(len(idx), layout.n_atoms, np.int64)
            _per_record(st, out, info, idx, offsets, lids, n_atoms)
    return out


def _per_record(st, out, info, idx, offsets, layout_ids, n_atoms) -> None:
    """Decode a field record by record (strings, tensors, ragged or absent values)."""
    layouts = st.cache.memo_layouts
    values, present = [], []
    for i, base, lid in zip(idx.tolist(), offsets.tolist(), layout_ids.tolist()):
        layout = layouts[lid]
        slot = layout.by_field.get(info.name)
        present.append(slot is not None)
        values.append(None if slot is None else
                      decode_slot(st.buf, base, slot, layout.n_atoms, (st.name, i)))
    assemble(out, info, values, present, n_atoms)
