"""Type tags, dtypes and the builtin-section table of the `.atp` format (spec §4, §5).

Everything here is a constant or a tiny pure function; the record codec and the
schema lock both build on these rules so that they cannot drift apart.
"""

from __future__ import annotations

import numpy as np

# section kinds (spec §5.2)
KIND_BUILTIN = 0
KIND_ATOM = 1
KIND_MOLECULE = 2
KIND_NAMES = {KIND_BUILTIN: "builtin", KIND_ATOM: "atom", KIND_MOLECULE: "molecule"}

# type tags (spec §5.3)
TAG_F64 = 0
TAG_I64 = 1
TAG_STR = 2
TAG_F64_ARRAY = 3
TAG_VEC3_F32 = 4
TAG_I64_ARRAY = 5
TAG_F32_ARRAY = 6
TAG_VEC3_F64 = 7
TAG_I32_ARRAY = 8
TAG_BOOL3 = 9
TAG_MAT3_F64 = 10
TAG_F32 = 11
TAG_MAT3_F32 = 12
TAG_NONE = 13
TAG_TENSOR_F32 = 14
TAG_TENSOR_F64 = 15
TAG_TENSOR_I32 = 16
TAG_TENSOR_I64 = 17
POSITIONS_UNKNOWN = 255

ELEM_BYTES = {
    0: 8, 1: 8, 2: 0, 3: 8, 4: 12, 5: 8, 6: 4, 7: 24, 8: 4,
    9: 3, 10: 72, 11: 4, 12: 36, 13: 0, 14: 4, 15: 8, 16: 4, 17: 8,
}

# numpy dtype of the elements each tag stores (little-endian, as on disk)
TAG_DTYPE: dict[int, np.dtype] = {
    TAG_F64: np.dtype("<f8"),
    TAG_I64: np.dtype("<i8"),
    TAG_F64_ARRAY: np.dtype("<f8"),
    TAG_VEC3_F32: np.dtype("<f4"),
    TAG_I64_ARRAY: np.dtype("<i8"),
    TAG_F32_ARRAY: np.dtype("<f4"),
    TAG_VEC3_F64: np.dtype("<f8"),
    TAG_I32_ARRAY: np.dtype("<i4"),
    TAG_BOOL3: np.dtype("bool"),
    TAG_MAT3_F64: np.dtype("<f8"),
    TAG_F32: np.dtype("<f4"),
    TAG_MAT3_F32: np.dtype("<f4"),
    TAG_TENSOR_F32: np.dtype("<f4"),
    TAG_TENSOR_F64: np.dtype("<f8"),
    TAG_TENSOR_I32: np.dtype("<i4"),
    TAG_TENSOR_I64: np.dtype("<i8"),
}

SCALAR_TAGS = frozenset({TAG_F64, TAG_I64, TAG_F32})
FLAT_ARRAY_TAGS = frozenset({TAG_F64_ARRAY, TAG_I64_ARRAY, TAG_F32_ARRAY, TAG_I32_ARRAY})
VEC3_TAGS = frozenset({TAG_VEC3_F32, TAG_VEC3_F64})
MAT3_TAGS = frozenset({TAG_MAT3_F64, TAG_MAT3_F32})
ARRAY_TAGS = FLAT_ARRAY_TAGS | VEC3_TAGS
TENSOR_TAGS = frozenset({TAG_TENSOR_F32, TAG_TENSOR_F64, TAG_TENSOR_I32, TAG_TENSOR_I64})
# tags a custom (kind 1/2) section may carry; 9-12 exist only for builtins
CUSTOM_TAGS = frozenset(range(0, 9)) | {TAG_NONE} | TENSOR_TAGS
ATOM_SCOPE_TAGS = ARRAY_TAGS | TENSOR_TAGS

POSITIONS_TAG_BY_DTYPE = {np.dtype("<f4"): TAG_VEC3_F32, np.dtype("<f8"): TAG_VEC3_F64}
POSITIONS_DTYPE_BY_TAG = {TAG_VEC3_F32: np.dtype("<f4"), TAG_VEC3_F64: np.dtype("<f8")}

# builtin sections in the fixed on-disk order (spec §5.6)
BUILTIN_ORDER = ("charges", "cell", "energy", "forces", "name", "pbc", "stress", "velocities")
PER_ATOM_BUILTINS = frozenset({"forces", "charges", "velocities"})
# record format 2 allows only the canonical tag; format 3 adds the alternate (spec §5.1)
BUILTIN_CANONICAL_TAG = {
    "charges": TAG_F64_ARRAY,
    "cell": TAG_MAT3_F64,
    "energy": TAG_F64,
    "forces": TAG_VEC3_F32,
    "name": TAG_STR,
    "pbc": TAG_BOOL3,
    "stress": TAG_MAT3_F64,
    "velocities": TAG_VEC3_F32,
}
BUILTIN_ALTERNATE_TAG = {
    "charges": TAG_F32_ARRAY,
    "cell": TAG_MAT3_F32,
    "energy": TAG_F32,
    "forces": TAG_VEC3_F64,
    "stress": TAG_MAT3_F32,
    "velocities": TAG_VEC3_F64,
}
# builtin name -> tag for each numpy dtype a writer accepts
BUILTIN_TAG_BY_DTYPE = {
    "charges": {np.dtype("<f8"): TAG_F64_ARRAY, np.dtype("<f4"): TAG_F32_ARRAY},
    "cell": {np.dtype("<f8"): TAG_MAT3_F64, np.dtype("<f4"): TAG_MAT3_F32},
    "stress": {np.dtype("<f8"): TAG_MAT3_F64, np.dtype("<f4"): TAG_MAT3_F32},
    "energy": {np.dtype("<f8"): TAG_F64, np.dtype("<f4"): TAG_F32},
    "forces": {np.dtype("<f4"): TAG_VEC3_F32, np.dtype("<f8"): TAG_VEC3_F64},
    "velocities": {np.dtype("<f4"): TAG_VEC3_F32, np.dtype("<f8"): TAG_VEC3_F64},
}
RECORD_FORMATS = (2, 3)


def builtin_tag_allowed(key: str, tag: int, record_format: int) -> bool:
    """Whether a builtin section ``key`` may carry ``tag`` under ``record_format``."""
    if BUILTIN_CANONICAL_TAG.get(key) == tag:
        return True
    return record_format == 3 and BUILTIN_ALTERNATE_TAG.get(key) == tag


def per_atom_flag(kind: int, key: str) -> int:
    """The schema's per_atom flag of a section (spec §4)."""
    if kind == KIND_ATOM:
        return 1
    return int(kind == KIND_BUILTIN and key in PER_ATOM_BUILTINS)


def slot_bytes(kind: int, key: str, tag: int, payload_len: int, n_atoms: int) -> int:
    """The schema's slot_bytes of a section (spec §4).

    Args:
        kind: section kind.
        key: section key.
        tag: type tag.
        payload_len: payload length of the section in bytes.
        n_atoms: atom count of the molecule holding it.

    Returns:
        The slot size the schema lock records for this section.
    """
    if tag in (TAG_STR, TAG_NONE) or tag in TENSOR_TAGS:
        return 0
    if per_atom_flag(kind, key):
        if tag in ARRAY_TAGS:
            return ELEM_BYTES[tag]
        return payload_len // n_atoms if n_atoms else 0
    return payload_len


def tensor_tag_for(dtype: np.dtype) -> int | None:
    """The tensor tag (14-17) storing ``dtype``, or None if no tensor tag can."""
    return {
        np.dtype("<f4"): TAG_TENSOR_F32,
        np.dtype("<f8"): TAG_TENSOR_F64,
        np.dtype("<i4"): TAG_TENSOR_I32,
        np.dtype("<i8"): TAG_TENSOR_I64,
    }.get(np.dtype(dtype).newbyteorder("<"))
