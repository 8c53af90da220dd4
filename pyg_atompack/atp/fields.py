"""Field descriptions (``reader.fields``) derived from the schema lock."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .records import Layout, field_name
from .schema import Schema, SchemaEntry, decode_schema
from .types import (
    BUILTINS,
    ELEM_BYTES,
    FLAT_ARRAY_TAGS,
    KIND_NAMES,
    MAT3_TAGS,
    POSITIONS_DTYPE_BY_TAG,
    POSITIONS_UNKNOWN,
    SCALAR_TAGS,
    TAG_BOOL3,
    TAG_DTYPE,
    TAG_VEC3_F32,
    TAG_VEC3_F64,
    VEC3_TAGS,
    per_atom_flag,
    slot_bytes,
)


@dataclass(frozen=True)
class FieldInfo:
    """What one field of a file holds.

    Args:
        name (str): Public name: a builtin key (``"energy"``), ``"properties/<key>"`` or
            ``"atom_properties/<key>"``.
        kind (str): ``"builtin"``, ``"atom"`` or ``"molecule"``.
        key (str): The section key.
        tag (int): Type tag (spec §5.3).
        dtype (np.dtype): Numpy dtype of the values (None for strings and None values).
        per_atom (bool): Whether the value has one row per atom.
        shape (tuple[int, ...]): Shape of one molecule's value without the atom axis
            (``()`` for scalars, ``(3,)`` for forces, ``(3, 3)`` for a cell, ``(k,)`` for a
            per-molecule array); None when it varies (strings, tensors).
    """

    name: str
    kind: str
    key: str
    tag: int
    dtype: np.dtype | None
    per_atom: bool
    shape: tuple[int, ...] | None

    def zeros(self, rows: int) -> np.ndarray | None:
        """A zero array for ``rows`` molecules (or atoms), or None if the shape varies.

        Used to fill the rows of molecules that do not carry this field.

        Args:
            rows (int): Number of molecules (per-molecule fields) or atoms (per-atom fields).

        Returns:
            An array of shape ``(rows, *shape)`` in the field's dtype, or :obj:`None` when
            the field's shape or dtype differs between records (strings, ragged arrays).
        """
        if self.shape is None or self.dtype is None:
            return None
        return np.zeros((rows, *self.shape), dtype=self.dtype)


def _shape_for(entry: SchemaEntry) -> tuple[int, ...] | None:
    tag = entry.tag
    if tag in SCALAR_TAGS:
        return ()
    if tag == TAG_BOOL3:
        return (3,)
    if tag in MAT3_TAGS:
        return (3, 3)
    if entry.per_atom:
        if tag in VEC3_TAGS:
            return (3,)
        return () if tag in FLAT_ARRAY_TAGS else None
    if tag in VEC3_TAGS or tag in FLAT_ARRAY_TAGS:
        elem = ELEM_BYTES[tag]
        rows = entry.slot_bytes // elem if elem else 0
        return (rows, 3) if tag in VEC3_TAGS else (rows,)
    return None


def info_for(entry: SchemaEntry) -> FieldInfo:
    """The :class:`FieldInfo` of one schema entry."""
    dtype = np.dtype(bool) if entry.tag == TAG_BOOL3 else TAG_DTYPE.get(entry.tag)
    return FieldInfo(field_name(entry.kind, entry.key), KIND_NAMES.get(entry.kind, "unknown"),
                     entry.key, entry.tag, dtype, bool(entry.per_atom), _shape_for(entry))


def builtin_info(name: str) -> FieldInfo:
    """Returns the :class:`FieldInfo` of a builtin section a file may not store.

    Args:
        name (str): A builtin section name (``"energy"``, ``"forces"``, ...).

    Returns:
        FieldInfo: The field with its canonical tag, as :data:`~.types.BUILTINS` describes it.
    """
    field = BUILTINS[name]
    return FieldInfo(name, "builtin", name, field.tag, TAG_DTYPE.get(field.tag),
                     field.per_atom, field.shape)


def schema_block_fields(buf, record_format: int, name: str) -> dict[str, FieldInfo] | None:
    """Returns the fields a schema block announces, for a file held in pieces.

    For readers of remote files, whose schema block is one range read.

    Args:
        buf (bytes-like): The schema block's bytes.
        record_format (int): The header's record format (2 or 3).
        name (str): How messages name the file.

    Returns:
        dict[str, FieldInfo] or None: ``name -> FieldInfo``, or :obj:`None` when the
        positions dtype is unknown (the format layer raises its own error when the file
        is opened).

    Raises:
        SchemaError: If the block is malformed.
    """
    schema = decode_schema(buf, name)
    if record_format == 2:
        pos_dtype = np.dtype("<f4")  # spec §5.1: record format 2 positions are always f32
    elif schema.positions_tag in POSITIONS_DTYPE_BY_TAG:
        pos_dtype = POSITIONS_DTYPE_BY_TAG[schema.positions_tag]
    else:
        return None
    return fields_from_schema(schema, pos_dtype)


def fields_from_schema(schema: Schema, pos_dtype: np.dtype) -> dict[str, FieldInfo]:
    """All fields of a file: positions and atomic numbers first, then the schema entries.

    Args:
        schema (Schema): The (possibly rebuilt) schema lock.
        pos_dtype (np.dtype): The positions element dtype.

    Returns:
        ``name -> FieldInfo`` in schema order.
    """
    positions, numbers = BUILTINS["positions"], BUILTINS["atomic_numbers"]
    out = {
        "positions": FieldInfo("positions", "builtin", "positions",
                               TAG_VEC3_F64 if pos_dtype.itemsize == 8 else TAG_VEC3_F32,
                               pos_dtype, positions.per_atom, positions.shape),
        "atomic_numbers": FieldInfo("atomic_numbers", "builtin", "atomic_numbers",
                                    POSITIONS_UNKNOWN, numbers.dtypes[0], numbers.per_atom,
                                    numbers.shape),
    }
    for entry in schema.sorted_entries():
        if entry.kind in KIND_NAMES:
            info = info_for(entry)
            out[info.name] = info
    return out


def merge_layout(schema: Schema, layout: Layout) -> None:
    """Add the sections of one decoded record to a schema being rebuilt (first type wins)."""
    for slot in layout.slots:
        entry = SchemaEntry(slot.kind, slot.key, slot.tag, per_atom_flag(slot.kind, slot.key),
                            ELEM_BYTES[slot.tag],
                            slot_bytes(slot.kind, slot.key, slot.tag, slot.length,
                                       layout.n_atoms))
        schema.entries.setdefault((slot.kind, slot.key), entry)
