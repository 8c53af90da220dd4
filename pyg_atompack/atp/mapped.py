"""Fast ``reader[i]`` for uncompressed records of a mapped file or an in-memory image.

Creating an array with ``np.frombuffer`` costs about a microsecond, indexing an
existing array with one integer a tenth of that. So every array a record decodes
to is one integer index into a *whole-file view*: the file seen as overlapping
values of one element dtype and shape, one value starting at every byte (row
stride 1 byte), so that row ``b`` is the value stored at file byte ``b``. A field
at record offset ``o`` of the record at file offset ``base`` is row ``base + o``,
whatever the record's offset or alignment; decoding a record is one index per
array plus one :class:`struct.Struct` unpack that reads every fixed-size scalar
(energy, pbc, ...), its pad bytes skipping the gaps. The views of one mapping are
shared by all its layouts (:class:`WholeFileViews`), so a file of many atom counts
costs one view per distinct value shape.

At that point the interpreter's own work (a loop over the fields, tuple unpacking,
attribute look-ups) is a third of a record's decode, so each plan's ``decode`` is a
straight-line function made for its layout (:func:`_decoder`): the source is
generated from the *number* of arrays and the scalar widths only (field names,
views and offsets are bound as closure values, never written into the source),
compiled once per such pattern and closed over each plan's values.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
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
    """Whole-file views of one mapping, one per value dtype and shape, made on first use.

    Args:
        file_u8 (np.ndarray): The mapped file as a uint8 array.
    """

    __slots__ = ("file_u8", "_buffer", "_views")

    def __init__(self, file_u8: np.ndarray) -> None:
        self.file_u8 = file_u8
        # Views are made over file_u8 (np.frombuffer's array, whose memoryview holds a
        # buffer export of the mmap) and not over the mmap object itself: an array
        # over the mmap keeps no export, so closing the reader would unmap the file
        # under the records handed out. With the export, mmap.close() refuses while
        # any record array lives, and the mapping goes with the last of them.
        self._buffer = file_u8
        self._views: dict[tuple[np.dtype, tuple[int, ...]], np.ndarray] = {}

    def get(self, elem: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The file as values of ``shape`` and dtype ``elem``, row ``b`` starting at byte ``b``.

        Args:
            elem (np.dtype): Element dtype.
            shape (tuple[int, ...]): Shape of one value (e.g. ``(n, 3)``, ``(3, 3)``, ``(k,)``).

        Returns:
            A view over the mapping (read-only over a read-only mapping).
        """
        view = self._views.get((elem, shape))
        if view is None:
            inner = []
            stride = elem.itemsize
            for dim in reversed(shape):
                inner.insert(0, stride)
                stride *= dim
            rows = max(len(self.file_u8) - stride + 1, 0)  # stride: bytes of one value
            view = np.ndarray((rows, *shape), elem, self._buffer, 0, (1, *inner))
            self._views[(elem, shape)] = view
        return view


class MappedPlan:
    """Per-layout recipe turning a record's file offset into a :class:`Molecule`.

    ``plan.decode(buf, base, name, index)`` decodes the record at file offset
    ``base`` of the mapping ``buf`` (already checked against the file size; ``name``
    and ``index`` only name it in errors) into a molecule whose arrays are zero-copy
    views of the mapping. ``plan.checked(buf, base, name, index)`` is the same for a
    record not checked before: it first compares the record's structural bytes
    with the layout's, in place, and returns :obj:`None` when they differ.

    Args:
        layout (Layout): The checked layout the plan decodes.
        views (WholeFileViews): The mapping's shared whole-file views.
    """

    # no reference to the layout: the layout caches its plan, and a cycle through the
    # plan would keep the file's buffer alive until a full garbage collection
    __slots__ = ("decode", "checked")

    def __init__(self, layout: Layout, views: WholeFileViews) -> None:
        recipe = layout.shared.get("mapped")
        if recipe is None:  # once per structure in this process, whichever reader
            recipe = layout.shared["mapped"] = _recipe(layout)
        factory, args, wanted = recipe
        args = list(args)
        for position, elem, shape in wanted:
            args[position] = views.get(elem, shape)
        # positional: a call with ~30 keyword arguments cost 4x more (~6 us per plan)
        self.decode, self.checked = factory(*args)


def _recipe(layout: Layout) -> tuple[Callable, tuple, list[tuple]]:
    """What :class:`MappedPlan` needs of a layout, less the mapping's views.

    Args:
        layout (Layout): A checked layout.

    Returns:
        tuple[Callable, tuple, list[tuple]]: ``(factory, args, wanted)``: the
        decoder factory, its positional arguments (:obj:`None` where a view goes),
        and ``(position, elem, shape)`` of each view.
    """
    n = layout.n_atoms
    arrays = [("positions", layout.pos_dtype, (n, 3), 4),
              ("atomic_numbers", _U8, (n,), layout.z_offset)]
    scalar_slots = []
    others = []
    for slot in layout.builtins:
        if slot.op == OP_ARRAY:
            arrays.append((slot.key, slot.elem, slot.value_shape, slot.offset))
        elif slot.op in _SCALAR_CODES:
            scalar_slots.append(slot)
        else:
            others.append(slot)
    unpack, scalar_offset, scalar_keys = _scalar_reader(scalar_slots)
    check_unpack, order = _checked_reader(layout.spans, scalar_slots)
    values: dict[str, Any] = {"new": _new_molecule, "Molecule": Molecule, "unpack": unpack,
                              "scalar_offset": scalar_offset, "sections": _decode_sections,
                              "n_atoms": n, "others": tuple(others),
                              "customs": layout.customs, "check_unpack": check_unpack,
                              "expected": layout.expected}
    wanted = []
    for j, (key, elem, shape, offset) in enumerate(arrays):
        values.update({f"k{j}": key, f"o{j}": offset})
        wanted.append((f"v{j}", elem, shape))
    for j, (key, _) in enumerate(scalar_keys):
        values[f"q{j}"] = key
    widths = tuple(width for _, width in scalar_keys)
    factory = _decoder(len(arrays), widths, order, bool(others or layout.customs))
    names = _parameters(len(arrays), len(widths))
    args = tuple(values.get(name) for name in names)
    return factory, args, [(names.index(name), elem, shape) for name, elem, shape in wanted]


def _parameters(n_arrays: int, n_scalars: int) -> list[str]:
    """Returns the parameter names of a decoder factory, in order (:func:`_decoder`).

    Args:
        n_arrays (int): Number of array fields.
        n_scalars (int): Number of scalar fields.
    """
    names = ["new", "Molecule", "unpack", "scalar_offset", "sections", "n_atoms", "others",
             "customs", "check_unpack", "expected"]
    names += [f"{c}{j}" for j in range(n_arrays) for c in "kvo"]
    return names + [f"q{j}" for j in range(n_scalars)]


_DECODER_FACTORIES: dict[tuple, Callable] = {}


def _decoder(n_arrays: int, widths: tuple[int, ...], order: tuple[int, ...],
             sections: bool) -> Callable:
    """The factory of straight-line decoders for one pattern of fields (compiled once).

    Args:
        n_arrays (int): Number of array fields (positions and atomic numbers included).
        widths (tuple[int, ...]): Number of struct values of each scalar field (1, or 3 for pbc).
        order (tuple[int, ...]): What ``check_unpack`` returns, in record order: 0 for a structural
            span, else the width of a scalar field.
        sections (bool): Whether strings, tensors or custom sections follow.

    Returns:
        ``factory(*args)`` (parameters in :func:`_parameters` order) returning
        ``(decode, checked)``, both called as ``(buf, base, name, index)``; the
        arguments bind ``k<j>`` / ``v<j>`` /
        ``o<j>`` (key, view, record offset of array ``j``), ``q<j>`` (key of
        scalar ``j``), ``check_unpack`` / ``expected`` (the structural bytes and
        scalars in one read, the layout's structural bytes) and the helpers below.
    """
    pattern = (n_arrays, widths, order, sections)
    factory = _DECODER_FACTORIES.get(pattern)
    if factory is None:
        names = _parameters(n_arrays, len(widths))
        head = ["mol = new(Molecule)", "d = mol.__dict__"]
        head += [f"d[k{j}] = v{j}[base + o{j}]" for j in range(n_arrays)]
        parts = [f"s{j}" for j in range(sum(widths))]
        scalars = []
        pos = 0
        for j, width in enumerate(widths):
            value = parts[pos] if width == 1 else f"({', '.join(parts[pos:pos + width])})"
            scalars.append(f"d[q{j}] = {value}")
            pos += width
        tail = ["sections(d, buf, base, (name, index), n_atoms, others, customs)"] \
            if sections else []
        tail.append("return mol")
        decode = head[:]
        if widths:
            decode.append(f"{', '.join(parts)}, = unpack(buf, base + scalar_offset)")
        decode += scalars + tail
        # checked: the structural bytes and the scalars in one unpack, compared first
        spans, got, scalar = [], [], iter(parts)
        for width in order:
            if width:
                got += [next(scalar) for _ in range(width)]
            else:
                spans.append(f"c{len(spans)}")
                got.append(spans[-1])
        checked = [f"{', '.join(got)}, = check_unpack(buf, base)",
                   f"if ({', '.join(spans)},) != expected:", "    return None"]
        checked += head + scalars + tail
        source = (f"def factory({', '.join(names)}):\n"
                  "    def decode(buf, base, name, index):\n" +
                  "".join(f"        {line}\n" for line in decode) +
                  "    def checked(buf, base, name, index):\n" +
                  "".join(f"        {line}\n" for line in checked) +
                  "    return decode, checked\n")
        namespace: dict[str, Any] = {}
        exec(compile(source, "<atp mapped decoder>", "exec"), namespace)
        factory = _DECODER_FACTORIES[pattern] = namespace["factory"]
    return factory


def _decode_sections(d: dict, buf, base: int, where: tuple, n: int, others: tuple,
                     customs: tuple) -> None:
    """Strings, tensors and custom sections: decoded one by one, checked as they go."""
    for slot in others:
        d[slot.key] = decode_slot(buf, base, slot, n, where)
    if customs:
        props: dict[str, Any] = {}
        atom_props: dict[str, Any] = {}
        for slot in customs:
            target = atom_props if slot.kind == KIND_ATOM else props
            target[slot.key] = decode_slot(buf, base, slot, n, where)
        d["properties"] = props
        d["atom_properties"] = atom_props


def _scalar_reader(slots: list) -> tuple[Callable | None, int, tuple]:
    """One struct reading every fixed-size scalar of a record, pad bytes over the gaps.

    Returns:
        ``(unpack_from or None, record offset of the first scalar, ((key, width), ...))``
        where ``width`` is 1 for a number and 3 for a pbc triple.
    """
    if not slots:
        return None, 0, ()
    slots = sorted(slots, key=lambda s: s.offset)
    fmt = ["<"]
    keys = []
    first = slots[0].offset
    pos = first
    for slot in slots:
        code, size = _SCALAR_CODES[slot.op]
        if slot.offset > pos:
            fmt.append(f"{slot.offset - pos}x")
        fmt.append(code)
        keys.append((slot.key, 3 if slot.op == OP_PBC else 1))
        pos = slot.offset + size
    return struct.Struct("".join(fmt)).unpack_from, first, tuple(keys)


def _checked_reader(spans: tuple, slots: list) -> tuple[Callable, tuple[int, ...]]:
    """One struct reading a record's structural bytes and its fixed-size scalars.

    Args:
        spans (tuple): ``(start, end)`` of the layout's structural byte runs.
        slots (list): The scalar slots (:data:`_SCALAR_CODES`).

    Returns:
        tuple[Callable, tuple[int, ...]]: ``(unpack_from, order)``, where ``order``
        says, item by item in record order, 0 for a structural run (one ``bytes``)
        or the number of values of a scalar field.
    """
    items = [(a, b - a, 0) for a, b in spans]
    items += [(slot.offset, _SCALAR_CODES[slot.op][1], slot.op) for slot in slots]
    fmt, order, pos = ["<"], [], 0
    for offset, size, op in sorted(items):
        if offset > pos:
            fmt.append(f"{offset - pos}x")
        fmt.append(_SCALAR_CODES[op][0] if op else f"{size}s")
        order.append((3 if op == OP_PBC else 1) if op else 0)
        pos = offset + size
    return struct.Struct("".join(fmt)).unpack_from, tuple(order)
