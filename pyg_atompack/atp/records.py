"""Decode and encode single records (spec §5), with a reusable per-layout plan.

Records of one file almost always share their section layout, so the byte
offsets of every section are worked out once per ``(raw size, n_atoms)`` and
stored in a :class:`Layout`. Reusing a layout costs one comparison of the
section-header bytes (kind, key, tag, payload length) at the cached offsets; if
they differ the record is parsed from scratch.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import RecordDecodeError
from .molecule import Molecule
from .types import (
    BUILTIN_CANONICAL_TAG,
    CUSTOM_TAGS,
    ELEM_BYTES,
    KIND_ATOM,
    KIND_BUILTIN,
    KIND_MOLECULE,
    MAT3_TAGS,
    PER_ATOM_BUILTINS,
    TAG_BOOL3,
    TAG_DTYPE,
    TAG_F32,
    TAG_F64,
    TAG_I64,
    TAG_NONE,
    TAG_STR,
    TENSOR_TAGS,
    VEC3_TAGS,
    builtin_tag_allowed,
)

# how a section's payload turns into a value
OP_ARRAY, OP_F64, OP_I64, OP_F32, OP_STR, OP_NONE, OP_PBC, OP_TENSOR = range(8)
_SCALAR_OPS = {TAG_F64: OP_F64, TAG_I64: OP_I64, TAG_F32: OP_F32}
# element dtype of the fixed-size scalar payloads
SCALAR_DTYPES = {OP_F64: np.dtype("<f8"), OP_I64: np.dtype("<i8"), OP_F32: np.dtype("<f4")}
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")
_F32 = struct.Struct("<f")
_U8 = np.dtype("u1")
_PBC_VALUES = {bytes((a, b, c)): (bool(a), bool(b), bool(c))
               for a in (0, 1) for b in (0, 1) for c in (0, 1)}


class Slot:
    """Where one section's payload lies in a record and how to decode it.

    Besides what the decode needs (``op``, ``dtype``, ``count``, ``single``), a slot
    carries the facts every batch path reads: ``elem`` (element dtype, None for
    strings and None values), ``value_shape`` (shape of one record's value, None
    when it is not fixed: strings, None values, tensors), ``per_atom`` and
    ``to_bool`` (pbc bytes become booleans).

    Args:
        kind (int): Section kind (0 builtin, 1 atom, 2 molecule).
        key (str): Section key.
        tag (int): Type tag.
        offset (int): Payload offset from the record start.
        length (int): Payload length in bytes.
        op (int): Decode operation (``OP_*``).
        dtype (np.dtype, optional): numpy dtype for array/tensor payloads. (default: :obj:`None`)
        count (int, optional): Element count for ``OP_ARRAY`` (rows for vec3 / mat3 subarray
            dtypes). (default: :obj:`0`)
        single (bool, optional): The value is one element of a subarray ``dtype`` (3x3 cell/stress).
            (default: :obj:`False`)
    """

    __slots__ = ("kind", "key", "tag", "offset", "length", "op", "dtype", "count", "single",
                 "field", "elem", "value_shape", "per_atom", "to_bool")

    def __init__(self, kind: int, key: str, tag: int, offset: int, length: int, op: int,
                 dtype: np.dtype | None = None, count: int = 0, single: bool = False) -> None:
        self.kind = kind
        self.key = key
        self.tag = tag
        self.offset = offset
        self.length = length
        self.op = op
        self.dtype = dtype
        self.count = count
        self.single = single
        self.field = field_name(kind, key)
        self.per_atom = kind == KIND_ATOM or (kind == KIND_BUILTIN and key in PER_ATOM_BUILTINS)
        self.to_bool = op == OP_PBC
        self.elem = dtype.base if dtype is not None else SCALAR_DTYPES.get(op)
        if op == OP_ARRAY:
            self.value_shape = dtype.shape if single else (count, *dtype.shape)
        elif op in SCALAR_DTYPES:
            self.value_shape = ()
        elif op == OP_PBC:
            self.elem, self.value_shape = _U8, (3,)
        else:
            self.value_shape = None  # strings, None values, tensors: decoded per record


def field_name(kind: int, key: str) -> str:
    """Public field name: builtin key, ``properties/<key>`` or ``atom_properties/<key>``."""
    if kind == KIND_BUILTIN:
        return key
    return ("atom_properties/" if kind == KIND_ATOM else "properties/") + key


class Layout:
    """Section offsets shared by records with the same size and atom count.

    Args:
        n_atoms (int): Atom count.
        pos_dtype (np.dtype): Positions element dtype (``<f4`` / ``<f8``).
        z_offset (int): Offset of the atomic numbers.
        spans (tuple[tuple[int, int], ...]): ``(start, end)`` byte ranges holding the structural
            bytes.
        expected (tuple[bytes, ...]): The structural bytes of the record the layout was built from.
        slots (Sequence[Slot]): Decodable sections in record order.
        trailing (int): Bytes after the last section (writers never leave any).
    """

    __slots__ = ("n_atoms", "pos_dtype", "pos_rows", "z_offset", "spans", "check", "expected",
                 "slots", "memo_id", "plan", "gather", "by_field", "trailing", "builtins",
                 "customs", "_check_arrays", "check_at", "shared")

    def __init__(self, n_atoms: int, pos_dtype: np.dtype, z_offset: int,
                 spans: tuple[tuple[int, int], ...], expected: tuple[bytes, ...],
                 slots: Sequence[Slot],
                 trailing: int) -> None:
        self.n_atoms = n_atoms
        self.pos_dtype = pos_dtype
        self.pos_rows = np.dtype((pos_dtype, (3,)))  # one (x, y, z) row per element
        self.z_offset = z_offset
        self.spans = spans
        # itemgetter over >=2 slices returns a tuple in one C call: the cheap re-check
        self.check = operator.itemgetter(*(slice(a, b) for a, b in spans))
        # the same bytes read in place at a record's offset in a larger buffer (the
        # mapping): one C call and no copy of the record, for a record's first touch
        fmt, pos = ["<"], 0
        for a, b in spans:
            fmt.append(f"{a - pos}x{b - a}s" if a > pos else f"{b - a}s")
            pos = b
        self.check_at = struct.Struct("".join(fmt)).unpack_from
        self.expected = expected
        self.slots = tuple(slots)
        self.by_field = {s.field: s for s in slots}
        self.trailing = trailing
        self.builtins = tuple(s for s in slots if s.kind == KIND_BUILTIN)
        self.customs = tuple(s for s in slots if s.kind != KIND_BUILTIN)
        self._check_arrays = None
        # what any reader derives from the structure alone (the mapped decode recipe,
        # mapped.py): one dict shared by reference with every unbound() copy
        self.shared: dict[str, Any] = {}
        self.memo_id = None
        # decoders bound to one reader's mapping, built on first use (mapped.py, gather.py)
        self.plan = None
        self.gather = None

    def unbound(self) -> Layout:
        """A copy without the reader-bound parts (memo id, decode plans), sharing the rest.

        Everything else is the parse of the record's structure, the same for every
        record whose structural bytes equal ``expected``, in any file.
        """
        copy = Layout.__new__(Layout)
        for name in self.__slots__:
            setattr(copy, name, getattr(self, name))
        copy.memo_id = copy.plan = copy.gather = None
        return copy

    def matches(self, rec) -> bool:
        """Whether ``rec`` (the record's bytes) has this layout's structure."""
        return self.check(rec) == self.expected

    def check_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Column indices and expected values of the structural bytes, for batch checks."""
        if self._check_arrays is None:
            cols = np.concatenate([np.arange(a, b) for a, b in self.spans])
            expected = np.frombuffer(b"".join(self.expected), np.uint8)
            self._check_arrays = (cols, expected)
        return self._check_arrays


def describe_where(where) -> str:
    """Format an error location: ``(file, record)`` tuples are formatted lazily."""
    if isinstance(where, tuple):
        return f"{where[0]}: record {where[1]}"
    return str(where)


def _fail(where, msg: str) -> RecordDecodeError:
    return RecordDecodeError(f"{describe_where(where)}: {msg}")


def build_layout(rec: memoryview, n_atoms: int, pos_dtype: np.dtype, record_format: int,
                 where: str) -> Layout:
    """Parse one record's structure (slow path, run once per layout).

    Args:
        rec (memoryview): The uncompressed record bytes.
        n_atoms (int): The atom count the index gives.
        pos_dtype (np.dtype): Positions element dtype.
        record_format (int): 2 or 3 (which builtin tags are allowed).
        where (str): ``"file: record i"`` for error messages.

    Returns:
        The record's :class:`Layout`.

    Raises:
        RecordDecodeError: Any malformation of spec §10.
    """
    size = len(rec)
    if size < 4:
        raise _fail(where, f"record is {size} bytes, too short for its atom count")
    (n,) = _U32.unpack_from(rec, 0)
    if n != n_atoms:
        raise _fail(where, f"record holds {n} atoms but the index says {n_atoms}")
    z_offset = 4 + 3 * pos_dtype.itemsize * n
    head_end = z_offset + n
    if head_end + 2 > size:
        raise _fail(where, f"record of {size} bytes is truncated in positions/atomic_numbers "
                           f"({n} atoms)")
    (n_sections,) = _U16.unpack_from(rec, head_end)
    spans = [[0, 4], [head_end, head_end + 2]]
    slots: list[Slot] = []
    pos = head_end + 2
    for i in range(n_sections):
        if pos + 2 > size:
            raise _fail(where, f"section {i} header is truncated")
        kind, key_len = rec[pos], rec[pos + 1]
        payload = pos + 2 + key_len + 5
        if payload > size:
            raise _fail(where, f"section {i} header is truncated")
        try:
            key = bytes(rec[pos + 2:pos + 2 + key_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(where, f"section {i} key is not valid UTF-8") from None
        tag = rec[payload - 5]
        (length,) = _U32.unpack_from(rec, payload - 4)
        if payload + length > size:
            raise _fail(where, f"field {key!r}: payload of {length} bytes runs past the end "
                               f"of the {size}-byte record")
        if spans[-1][1] == pos:
            spans[-1][1] = payload
        else:
            spans.append([pos, payload])
        slot = _make_slot(kind, key, tag, payload, length, n, record_format, where)
        if slot is not None:
            slots.append(slot)
        pos = payload + length
    spans_t = tuple((a, b) for a, b in spans)
    expected = tuple(bytes(rec[a:b]) for a, b in spans_t)
    return Layout(n, pos_dtype, z_offset, spans_t, expected, slots, size - pos)


def _make_slot(kind, key, tag, offset, length, n, record_format, where) -> Slot | None:
    field = f"field {field_name(kind, key)!r}"
    if kind == KIND_BUILTIN:
        if key not in BUILTIN_CANONICAL_TAG:
            return None  # unknown builtin keys are ignored, as the reference reader does
        if not builtin_tag_allowed(key, tag, record_format):
            raise _fail(where, f"{field} has type tag {tag}, not allowed for this builtin "
                               f"under record format {record_format}")
    elif kind in (KIND_ATOM, KIND_MOLECULE):
        if tag not in CUSTOM_TAGS:
            raise _fail(where, f"{field} has unknown type tag {tag}")
    else:
        return None  # unknown section kinds are ignored
    if tag == TAG_STR:
        return Slot(kind, key, tag, offset, length, OP_STR)
    if tag == TAG_NONE:
        if length:
            raise _fail(where, f"{field} is None but carries {length} payload bytes")
        return Slot(kind, key, tag, offset, length, OP_NONE)
    if tag in TENSOR_TAGS:
        if length < 1:
            raise _fail(where, f"{field} tensor payload is empty")
        return Slot(kind, key, tag, offset, length, OP_TENSOR, TAG_DTYPE[tag])
    if tag == TAG_BOOL3:
        if length < 3:
            raise _fail(where, f"{field} pbc payload is {length} bytes, expected 3")
        return Slot(kind, key, tag, offset, length, OP_PBC)
    elem = ELEM_BYTES[tag]
    if tag in _SCALAR_OPS:
        if length != elem:
            raise _fail(where, f"{field} scalar payload is {length} bytes, expected {elem}")
        return Slot(kind, key, tag, offset, length, _SCALAR_OPS[tag])
    if tag in MAT3_TAGS:
        if length != elem:
            raise _fail(where, f"{field} 3x3 payload is {length} bytes, expected {elem}")
        dtype = np.dtype((TAG_DTYPE[tag], (3, 3)))
        return Slot(kind, key, tag, offset, length, OP_ARRAY, dtype, 1, True)
    if length % elem:
        raise _fail(where, f"{field} payload of {length} bytes is not a multiple of {elem}")
    count = length // elem
    per_atom = kind == KIND_ATOM or (kind == KIND_BUILTIN and key in PER_ATOM_BUILTINS)
    if per_atom and count != n:
        raise _fail(where, f"{field} has {count} rows for {n} atoms")
    if tag in VEC3_TAGS:
        dtype = np.dtype((TAG_DTYPE[tag], (3,)))
        return Slot(kind, key, tag, offset, length, OP_ARRAY, dtype, count)
    return Slot(kind, key, tag, offset, length, OP_ARRAY, TAG_DTYPE[tag], count)


def decode_slot(buf, base: int, slot: Slot, n_atoms: int, where: str) -> Any:
    """Decode one section's value from ``buf`` (record starting at ``base``)."""
    op = slot.op
    start = base + slot.offset
    if op == OP_ARRAY:
        arr = np.frombuffer(buf, slot.dtype, slot.count, start)
        return arr[0] if slot.single else arr
    if op == OP_F64:
        return _F64.unpack_from(buf, start)[0]
    if op == OP_PBC:
        raw = bytes(buf[start:start + 3])
        return _PBC_VALUES.get(raw) or tuple(b != 0 for b in raw)
    if op == OP_STR:
        try:
            return bytes(buf[start:start + slot.length]).decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(where, f"field {slot.field!r} is not valid UTF-8") from None
    if op == OP_I64:
        return _I64.unpack_from(buf, start)[0]
    if op == OP_F32:
        return float(_F32.unpack_from(buf, start)[0])
    if op == OP_NONE:
        return None
    return _decode_tensor(buf, start, slot, n_atoms, where)


def _decode_tensor(buf, start: int, slot: Slot, n_atoms: int, where: str) -> np.ndarray:
    length = slot.length
    rank = buf[start]
    head = 1 + 4 * rank
    if head > length:
        raise _fail(where, f"field {slot.field!r} tensor of rank {rank} is truncated")
    dims = struct.unpack_from(f"<{rank}I", buf, start + 1)
    count = 1
    for d in dims:
        count *= d
    if count * slot.dtype.itemsize != length - head:
        raise _fail(where, f"field {slot.field!r} tensor of shape {dims} needs "
                           f"{count * slot.dtype.itemsize} bytes, payload holds {length - head}")
    if slot.kind == KIND_ATOM and (rank == 0 or dims[0] != n_atoms):
        raise _fail(where, f"field {slot.field!r} tensor of shape {dims} does not have "
                           f"{n_atoms} rows")
    return np.frombuffer(buf, slot.dtype, count, start + head).reshape(dims)


def decode_molecule(buf: memoryview, base: int, layout: Layout, where: str) -> Molecule:
    """Build a :class:`Molecule` from a record at ``buf[base:]`` using its layout.

    Args:
        buf (memoryview): Buffer holding the record (mmap, bytes or bytearray).
        base (int): Offset of the record in ``buf``.
        layout (Layout): The record's layout (already checked with :meth:`Layout.matches`).
        where (str): ``"file: record i"`` for error messages.

    Returns:
        The molecule; arrays are views of ``buf``.
    """
    mol = Molecule.__new__(Molecule)
    d = mol.__dict__
    n = layout.n_atoms
    d["positions"] = np.frombuffer(buf, layout.pos_rows, n, base + 4)
    d["atomic_numbers"] = np.frombuffer(buf, _U8, n, base + layout.z_offset)
    for slot in layout.builtins:
        if slot.op == OP_ARRAY:
            arr = np.frombuffer(buf, slot.dtype, slot.count, base + slot.offset)
            d[slot.key] = arr[0] if slot.single else arr
        else:
            d[slot.key] = decode_slot(buf, base, slot, n, where)
    props: dict[str, Any] = {}
    atom_props: dict[str, Any] = {}
    for slot in layout.customs:
        target = atom_props if slot.kind == KIND_ATOM else props
        target[slot.key] = decode_slot(buf, base, slot, n, where)
    d["properties"] = props
    d["atom_properties"] = atom_props
    return mol
