"""Type tags, dtypes and the one table of builtin fields of the `.atp` format (spec §4, §5).

Everything here is a constant or a tiny pure function (numpy only). :data:`BUILTINS`
is the single source of the builtin fields' facts (name, per-atom, shape, tags,
``Data`` attribute, unit): the record codec, the schema lock, ``read_batch``, the
PyG conversion and the converters all derive their tables from it, so that they
cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

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

@dataclass(frozen=True)
class BuiltinField:
    """The facts of one builtin field: every other table of builtins derives from these.

    Args:
        name (str): The field's name: the record attribute (``mol.forces``), the
            section key on disk and the ``read_batch`` key.
        attribute (str): The ``torch_geometric.data.Data`` attribute it becomes.
        per_atom (bool): Whether the value has one row per atom.
        shape (tuple[int, ...]): Shape of one value (of one atom's, for a
            per-atom field); :obj:`None` for a string.
        tag (int): The canonical type tag of its section; :obj:`None` for
            positions and atomic numbers, which are part of every record's head.
        alternate_tag (int, optional): The second tag record format 3 allows
            (the other float width). (default: :obj:`None`)
        geometry (bool, optional): Whether it describes the structure itself rather
            than a label a source key can be mapped onto. (default: :obj:`False`)
        unit (str, optional): The unit the project stores it in. (default: :obj:`None`)
    """

    name: str
    attribute: str
    per_atom: bool
    shape: tuple[int, ...] | None
    tag: int | None
    alternate_tag: int | None = None
    geometry: bool = False
    unit: str | None = None

    @property
    def dtypes(self) -> tuple[np.dtype, ...]:
        """The numpy dtypes a value may have on disk (the canonical one first)."""
        if self.name == "positions":
            return tuple(POSITIONS_TAG_BY_DTYPE)
        if self.name == "atomic_numbers":
            return (np.dtype("u1"),)
        tags = (self.tag, self.alternate_tag)
        return tuple(TAG_DTYPE[tag] for tag in tags if tag is not None and tag in TAG_DTYPE)


# every builtin, in record order (the order of Molecule attributes and Data attributes)
BUILTINS: dict[str, BuiltinField] = {field.name: field for field in (
    BuiltinField("atomic_numbers", "z", True, (), None, geometry=True),
    BuiltinField("positions", "pos", True, (3,), None, geometry=True, unit="Å"),
    BuiltinField("energy", "energy", False, (), TAG_F64, TAG_F32, unit="eV"),
    BuiltinField("forces", "forces", True, (3,), TAG_VEC3_F32, TAG_VEC3_F64, unit="eV/Å"),
    BuiltinField("charges", "charges", True, (), TAG_F64_ARRAY, TAG_F32_ARRAY, unit="e"),
    BuiltinField("velocities", "velocities", True, (3,), TAG_VEC3_F32, TAG_VEC3_F64,
                 unit="Å·(eV/u)^½ (ASE units)"),
    BuiltinField("cell", "cell", False, (3, 3), TAG_MAT3_F64, TAG_MAT3_F32, geometry=True,
                 unit="Å"),
    BuiltinField("stress", "stress", False, (3, 3), TAG_MAT3_F64, TAG_MAT3_F32, unit="eV/Å³"),
    BuiltinField("pbc", "pbc", False, (3,), TAG_BOOL3, geometry=True),
    BuiltinField("name", "name", False, None, TAG_STR),
)}
# the builtins stored as sections (all but positions and atomic numbers), in record order
SECTION_BUILTINS = tuple(name for name, field in BUILTINS.items() if field.tag is not None)
# builtins whose leading axis runs over atoms
ATOM_AXIS_BUILTINS = frozenset(name for name, field in BUILTINS.items() if field.per_atom)
PER_ATOM_BUILTINS = ATOM_AXIS_BUILTINS & frozenset(SECTION_BUILTINS)
# the fixed on-disk order of builtin sections (spec §5.6): atompack-db's, not record order
BUILTIN_ORDER = ("charges", "cell", "energy", "forces", "name", "pbc", "stress", "velocities")
# record format 2 allows only the canonical tag; format 3 adds the alternate (spec §5.1)
BUILTIN_CANONICAL_TAG = {name: BUILTINS[name].tag for name in BUILTIN_ORDER}
BUILTIN_ALTERNATE_TAG = {name: BUILTINS[name].alternate_tag for name in BUILTIN_ORDER
                         if BUILTINS[name].alternate_tag is not None}
# builtin name -> tag for each numpy dtype a writer accepts (the float fields of two widths)
BUILTIN_TAG_BY_DTYPE = {
    name: {TAG_DTYPE[tag]: tag for tag in (BUILTINS[name].tag, alternate)}
    for name, alternate in BUILTIN_ALTERNATE_TAG.items()
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
        kind (int): Section kind.
        key (str): Section key.
        tag (int): Type tag.
        payload_len (int): Payload length of the section in bytes.
        n_atoms (int): Atom count of the molecule holding it.

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
