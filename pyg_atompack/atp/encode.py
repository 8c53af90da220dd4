"""Turn Python/numpy values into sections, choosing type tags like atompack-db (spec §5.5).

Two paths mirror the reference library's two write APIs, whose tag rules differ:
:func:`molecule_sections` (``Molecule.set_property`` + ``add_molecule``) and
:func:`batch_columns` (``add_arrays_batch``; one section per column, built for
all molecules of the batch at once).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import AtpValueError
from .types import (
    BUILTIN_ORDER,
    BUILTIN_TAG_BY_DTYPE,
    BUILTINS,
    KIND_ATOM,
    KIND_BUILTIN,
    KIND_MOLECULE,
    TAG_BOOL3,
    TAG_F32_ARRAY,
    TAG_F64,
    TAG_F64_ARRAY,
    TAG_I32_ARRAY,
    TAG_I64,
    TAG_I64_ARRAY,
    TAG_NONE,
    TAG_STR,
    TAG_VEC3_F32,
    TAG_VEC3_F64,
    slot_bytes,
    tensor_tag_for,
)

_ARRAY_TAG = {np.dtype("<f4"): TAG_F32_ARRAY, np.dtype("<f8"): TAG_F64_ARRAY,
              np.dtype("<i4"): TAG_I32_ARRAY, np.dtype("<i8"): TAG_I64_ARRAY}
_VEC3_TAG = {np.dtype("<f4"): TAG_VEC3_F32, np.dtype("<f8"): TAG_VEC3_F64}
_STORABLE = tuple(_ARRAY_TAG)


@dataclass
class Section:
    """One section of one molecule (or of every molecule of a batch).

    Args:
        kind (int): 0 builtin, 1 per-atom custom, 2 per-molecule custom.
        key (str): Section key.
        tag (int): Type tag.
        payload (Any): Bytes for one molecule, a ``(B, L)`` uint8 matrix for a batch column, or a
            list of B bytes objects when lengths vary.
        slot_bytes (int): The schema's slot_bytes for this section.
    """

    kind: int
    key: str
    tag: int
    payload: Any
    slot_bytes: int

    def key_bytes(self) -> bytes:
        """UTF-8 key, checked to fit the u8 length field."""
        raw = self.key.encode("utf-8")
        if len(raw) > 255:
            raise AtpValueError(f"field {self.key[:40]!r}...: key is {len(raw)} UTF-8 bytes; "
                                f"the format allows at most 255")
        return raw


def tensor_payload(arr: np.ndarray) -> bytes:
    """Tensor payload: rank, dims, then the elements in C order."""
    return bytes((arr.ndim,)) + struct.pack(f"<{arr.ndim}I", *arr.shape) + arr.tobytes()


def encode_section(section: Section) -> bytes:
    """One section's bytes for one molecule: kind, key, tag, payload length, payload."""
    key = section.key_bytes()
    payload = section.payload
    return b"".join((bytes((section.kind, len(key))), key, bytes((section.tag,)),
                     struct.pack("<I", len(payload)), payload))


def _le(arr: np.ndarray, field: str) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian array of a storable dtype."""
    dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    if dtype not in _STORABLE:
        raise AtpValueError(f"field {field!r}: unsupported dtype {arr.dtype}; use float32, "
                            f"float64, int32 or int64")
    return np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<"))


def _float_array(value: Any, field: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype not in (np.float32, np.float64):
        raise AtpValueError(f"field {field!r}: expected float32 or float64, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))


def check_positions(positions: Any, atomic_numbers: Any, batch: bool) -> tuple:
    """Validate positions/atomic numbers; returns ``(positions, numbers)`` ready to write."""
    pos = _float_array(positions, "positions")
    want = 3 if batch else 2
    if pos.ndim != want or pos.shape[-1] != 3:
        shape = "(B, n, 3)" if batch else "(n, 3)"
        raise AtpValueError(f"field 'positions': expected shape {shape}, got {pos.shape}")
    z = np.asarray(atomic_numbers)
    if z.shape != pos.shape[:-1]:
        raise AtpValueError(f"field 'atomic_numbers': shape {z.shape} does not match "
                            f"positions {pos.shape}")
    if z.dtype != np.uint8:
        if z.dtype.kind not in "iu":
            raise AtpValueError(f"field 'atomic_numbers': expected integers, got {z.dtype}")
        if z.size and (z.min() < 0 or z.max() > 255):
            raise AtpValueError("field 'atomic_numbers': values must lie in 0..255 (stored as "
                                "uint8)")
    return pos, np.ascontiguousarray(z, dtype=np.uint8)


def _builtin_array(key: str, value: Any, n: int, batch: int | None) -> Section:
    arr = _float_array(value, key)
    lead = () if batch is None else (batch,)
    field = BUILTINS[key]
    expected = (n, *field.shape) if field.per_atom else field.shape
    if arr.shape != lead + expected:
        raise AtpValueError(f"field {key!r}: expected shape {lead + expected}, got {arr.shape}")
    tag = BUILTIN_TAG_BY_DTYPE[key][arr.dtype]
    nbytes = arr.dtype.itemsize * int(np.prod(expected))
    payload = arr.tobytes() if batch is None else arr.reshape(batch, -1).view(np.uint8)
    return Section(KIND_BUILTIN, key, tag, payload,
                   slot_bytes(KIND_BUILTIN, key, tag, nbytes, n))


def _pbc_bytes(value: Any, field: str = "pbc") -> np.ndarray:
    arr = np.asarray(value)
    if arr.shape[-1:] != (3,):
        raise AtpValueError(f"field {field!r}: expected three booleans, got shape {arr.shape}")
    return (arr != 0).astype(np.uint8)


def builtin_sections(n: int, values: dict[str, Any], batch: int | None) -> list[Section]:
    """Builtin sections in on-disk order for the given (non-None) values."""
    out = []
    for key in BUILTIN_ORDER:
        value = values.get(key)
        if value is None:
            continue
        if key == "energy":
            out.append(_energy(value, batch))
        elif key == "name":
            out.append(_strings(KIND_BUILTIN, key, value, batch))
        elif key == "pbc":
            flags = _pbc_bytes(value)
            if batch is not None and flags.shape != (batch, 3):
                raise AtpValueError(f"field 'pbc': expected shape ({batch}, 3), got "
                                    f"{flags.shape}")
            payload = flags.tobytes() if batch is None else flags.reshape(batch, 3)
            out.append(Section(KIND_BUILTIN, key, TAG_BOOL3, payload, 3))
        else:
            out.append(_builtin_array(key, value, n, batch))
    return out


def _energy(value: Any, batch: int | None) -> Section:
    if batch is None:
        # Molecule.from_arrays keeps the energy as a Python float: always f64
        try:
            payload = struct.pack("<d", float(value))
        except (TypeError, ValueError):
            raise AtpValueError(f"field 'energy': expected a float, got {value!r}") from None
        return Section(KIND_BUILTIN, "energy", TAG_F64, payload, 8)
    arr = np.asarray(value)
    if arr.shape != (batch,):
        raise AtpValueError(f"field 'energy': expected shape ({batch},), got {arr.shape}")
    if arr.dtype != np.float32:
        arr = arr.astype(np.float64)
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    tag = BUILTIN_TAG_BY_DTYPE["energy"][arr.dtype]
    return Section(KIND_BUILTIN, "energy", tag, arr.reshape(batch, 1).view(np.uint8),
                   arr.dtype.itemsize)


def _strings(kind: int, key: str, value: Any, batch: int | None) -> Section:
    if batch is None:
        if not isinstance(value, str):
            raise AtpValueError(f"field {key!r}: expected a str, got {type(value).__name__}")
        return Section(kind, key, TAG_STR, value.encode("utf-8"), 0)
    values = list(value)
    if len(values) != batch or not all(isinstance(v, str) for v in values):
        raise AtpValueError(f"field {key!r}: expected a list of {batch} str")
    return Section(kind, key, TAG_STR, [v.encode("utf-8") for v in values], 0)


def molecule_value(key: str, value: Any, n: int, atom_scope: bool) -> Section:
    """The section ``Molecule.set_property(key, value, scope)`` would produce.

    Args:
        key (str): Property key.
        value (Any): None, bool, int, float, str or a float32/float64/int32/int64 array.
        n (int): Atom count of the molecule.
        atom_scope (bool): Per-atom (kind 1) instead of per-molecule (kind 2).

    Returns:
        The section.

    Raises:
        AtpValueError: A value the format cannot hold.
    """
    kind = KIND_ATOM if atom_scope else KIND_MOLECULE
    field = ("atom_properties/" if atom_scope else "properties/") + key
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    scalar = not isinstance(value, (np.ndarray, list, tuple))
    if atom_scope and scalar:
        raise AtpValueError(f"field {field!r}: per-atom values must be arrays with {n} rows, "
                            f"got {type(value).__name__}")
    if value is None:
        return Section(kind, key, TAG_NONE, b"", 0)
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        if not -(2**63) <= int(value) < 2**63:
            raise AtpValueError(f"field {field!r}: integer {value} does not fit in int64")
        return Section(kind, key, TAG_I64, struct.pack("<q", int(value)), 8)
    if isinstance(value, (float, np.floating)):
        return Section(kind, key, TAG_F64, struct.pack("<d", float(value)), 8)
    if isinstance(value, str):
        return Section(kind, key, TAG_STR, value.encode("utf-8"), 0)
    if scalar:
        raise AtpValueError(f"field {field!r}: unsupported value type {type(value).__name__}")
    arr = _le(np.asarray(value), field)
    if atom_scope and (arr.ndim == 0 or arr.shape[0] != n):
        raise AtpValueError(f"field {field!r}: first dimension must be n_atoms={n}, got shape "
                            f"{arr.shape}")
    tag = _array_tag(arr.dtype, arr.shape)
    if tag is None:
        return Section(kind, key, tensor_tag_for(arr.dtype), tensor_payload(arr), 0)
    payload = arr.tobytes()
    return Section(kind, key, tag, payload, slot_bytes(kind, key, tag, len(payload), n))


def _array_tag(dtype: np.dtype, shape: tuple[int, ...]) -> int | None:
    """The tag of one molecule's array value of ``shape``, or None when it is a tensor.

    One dimension is a plain array; ``(rows, 3)`` of a float dtype is vec3 rows;
    anything else is stored as a tensor (with its shape).
    """
    if len(shape) == 1:
        return _ARRAY_TAG[dtype]
    if len(shape) == 2 and shape[1] == 3 and dtype in _VEC3_TAG:
        return _VEC3_TAG[dtype]
    return None


def molecule_sections(n: int, builtins: dict[str, Any], properties: dict[str, Any] | None,
                      atom_properties: dict[str, Any] | None) -> list[Section]:
    """All sections of one molecule in the ``add_molecule`` order (spec §5.6)."""
    sections = builtin_sections(n, builtins, None)
    properties, atom_properties = _custom_scopes(properties, atom_properties)
    for key in sorted(atom_properties, key=lambda k: k.encode("utf-8")):
        sections.append(molecule_value(key, atom_properties[key], n, True))
    for key in sorted(properties, key=lambda k: k.encode("utf-8")):
        sections.append(molecule_value(key, properties[key], n, False))
    _check_keys(sections)
    return sections


def _custom_scopes(properties: dict[str, Any] | None, atom_properties: dict[str, Any] | None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    # one key cannot live at both scopes of a molecule (spec §5.2)
    properties = properties or {}
    atom_properties = atom_properties or {}
    both = set(properties) & set(atom_properties)
    if both:
        raise AtpValueError(f"custom key(s) {sorted(both)} used in both properties and "
                            f"atom_properties")
    return properties, atom_properties


def _check_keys(sections: list[Section]) -> None:
    # before the schema merge, so a rejected key never reaches the file's schema lock
    for section in sections:
        if len(section.key) > 63:  # a shorter key cannot exceed 255 UTF-8 bytes
            section.key_bytes()


def _column(key: str, value: Any, batch: int, n: int, atom_scope: bool) -> Section:
    kind = KIND_ATOM if atom_scope else KIND_MOLECULE
    field = ("atom_properties/" if atom_scope else "properties/") + key
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value) \
            and not atom_scope:
        return _strings(kind, key, value, batch)
    arr = _le(np.asarray(value), field)
    if arr.ndim == 0 or arr.shape[0] != batch:
        raise AtpValueError(f"field {field!r}: leading dimension must be the batch size "
                            f"{batch}, got shape {arr.shape}")
    if atom_scope and (arr.ndim < 2 or arr.shape[1] != n):
        raise AtpValueError(f"field {field!r}: expected shape ({batch}, {n}, ...), got "
                            f"{arr.shape}")
    if not atom_scope and arr.ndim == 1:  # one scalar per molecule
        if arr.dtype.kind == "f":
            arr, tag = arr.astype("<f8"), TAG_F64
        else:
            arr, tag = arr.astype("<i8"), TAG_I64
    else:
        tag = _array_tag(arr.dtype, arr.shape[1:])  # the shape of one molecule's value
        if tag is None:
            return _tensor_column(kind, key, arr)
    payload = np.ascontiguousarray(arr).reshape(batch, -1).view(np.uint8)
    return Section(kind, key, tag, payload, slot_bytes(kind, key, tag, payload.shape[1], n))


def _tensor_column(kind: int, key: str, arr: np.ndarray) -> Section:
    shape = arr.shape[1:]
    prefix = bytes((len(shape),)) + struct.pack(f"<{len(shape)}I", *shape)
    data = np.ascontiguousarray(arr).reshape(arr.shape[0], -1).view(np.uint8)
    head = np.broadcast_to(np.frombuffer(prefix, np.uint8), (arr.shape[0], len(prefix)))
    return Section(kind, key, tensor_tag_for(arr.dtype), np.concatenate([head, data], axis=1), 0)


def batch_columns(batch: int, n: int, builtins: dict[str, Any],
                  properties: dict[str, Any] | None,
                  atom_properties: dict[str, Any] | None) -> list[Section]:
    """All sections of a stacked batch in the ``add_arrays_batch`` order (spec §5.6)."""
    sections = builtin_sections(n, builtins, batch)
    properties, atom_properties = _custom_scopes(properties, atom_properties)
    sections += [_column(k, v, batch, n, False) for k, v in properties.items()]
    sections += [_column(k, v, batch, n, True) for k, v in atom_properties.items()]
    _check_keys(sections)
    return sections


def assemble_batch(count: int, n: int, pos: np.ndarray, z: np.ndarray,
                    sections: list[Section]) -> list[bytes]:
    """Build B records from per-column byte matrices with numpy (no per-molecule loop
    unless a column holds strings, whose lengths vary)."""
    u8 = np.uint8
    blocks: list[Any] = [
        np.broadcast_to(np.frombuffer(struct.pack("<I", n), u8), (count, 4)),
        pos.reshape(count, -1).view(u8),
        z,
        np.broadcast_to(np.frombuffer(struct.pack("<H", len(sections)), u8), (count, 2)),
    ]
    for s in sections:
        key = s.key_bytes()
        if isinstance(s.payload, list):  # strings: the header's length varies per record
            blocks.append([bytes((s.kind, len(key))) + key + bytes((s.tag,))
                           + struct.pack("<I", len(p)) + p for p in s.payload])
            continue
        head = bytes((s.kind, len(key))) + key + bytes((s.tag,)) + \
            struct.pack("<I", s.payload.shape[1])
        blocks.append(np.broadcast_to(np.frombuffer(head, u8), (count, len(head))))
        blocks.append(s.payload)
    # merge runs of fixed-width blocks into one matrix each
    merged: list[Any] = []
    run: list[np.ndarray] = []
    for block in blocks:
        if isinstance(block, list):
            if run:
                merged.append(np.concatenate(run, axis=1))
                run = []
            merged.append(block)
        else:
            run.append(block)
    if run:
        merged.append(np.concatenate(run, axis=1))
    if len(merged) == 1:
        matrix = merged[0]
        data = matrix.tobytes()
        width = matrix.shape[1]
        return [data[j * width:(j + 1) * width] for j in range(count)]
    pieces = [[m[j].tobytes() for j in range(count)] if isinstance(m, np.ndarray) else m
              for m in merged]
    return [b"".join(parts) for parts in zip(*pieces)]
