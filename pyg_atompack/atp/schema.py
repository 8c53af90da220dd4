"""The schema block ("schema lock"): encode, decode and the merge rule (spec §4)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .errors import SchemaConflictError, SchemaError
from .types import KIND_NAMES, POSITIONS_DTYPE_BY_TAG, POSITIONS_UNKNOWN

SCHEMA_VERSION = 1
_HEAD = struct.Struct("<IBI")
_ENTRY = struct.Struct("<BBBHII")


@dataclass(frozen=True)
class SchemaEntry:
    """One section key of the schema lock.

    Args:
        kind (int): 0 builtin, 1 per-atom custom, 2 per-molecule custom.
        key (str): Section key.
        tag (int): Type tag.
        per_atom (int): 0 or 1.
        elem_bytes (int): Element size of the tag.
        slot_bytes (int): Fixed payload size (see spec §4), 0 for variable ones.
    """

    kind: int
    key: str
    tag: int
    per_atom: int
    elem_bytes: int
    slot_bytes: int

    @property
    def signature(self) -> tuple[int, int, int, int]:
        """What must stay identical for the key across records."""
        return (self.tag, self.per_atom, self.elem_bytes, self.slot_bytes)


@dataclass
class Schema:
    """Positions type plus every section key ever written.

    Args:
        positions_tag (int, optional): 4 (f32), 7 (f64), 255 (unknown) or None (not yet known).
            (default: :obj:`None`)
        entries (dict[tuple[int, str], SchemaEntry], optional): ``(kind, key) -> SchemaEntry``.
            (default: :obj:`{}`)
    """

    positions_tag: int | None = None
    entries: dict[tuple[int, str], SchemaEntry] = field(default_factory=dict)

    def copy(self) -> Schema:
        """A shallow copy that can be merged into without touching this one."""
        return Schema(self.positions_tag, dict(self.entries))

    def merge(self, entry: SchemaEntry, where: str) -> None:
        """Add ``entry`` or check it against the lock.

        Args:
            entry (SchemaEntry): The section as written in one record.
            where (str): Context for the error message (file, record).

        Raises:
            SchemaConflictError: The key exists with a different type or size.
        """
        old = self.entries.get((entry.kind, entry.key))
        if old is None:
            self.entries[(entry.kind, entry.key)] = entry
        elif old.signature != entry.signature:
            raise SchemaConflictError(
                f"{where}: {KIND_NAMES.get(entry.kind, entry.kind)} field {entry.key!r} "
                f"conflicts with the file's schema (stored tag {old.tag}, per_atom {old.per_atom}, "
                f"elem_bytes {old.elem_bytes}, slot_bytes {old.slot_bytes}; new tag {entry.tag}, "
                f"per_atom {entry.per_atom}, elem_bytes {entry.elem_bytes}, "
                f"slot_bytes {entry.slot_bytes})")

    def sorted_entries(self) -> list[SchemaEntry]:
        """Entries in on-disk order: by kind, then key bytes."""
        return sorted(self.entries.values(), key=lambda e: (e.kind, e.key.encode("utf-8")))


def encode_schema(schema: Schema) -> bytes:
    """Encode a schema block."""
    tag = POSITIONS_UNKNOWN if schema.positions_tag is None else schema.positions_tag
    entries = schema.sorted_entries()
    parts = [_HEAD.pack(SCHEMA_VERSION, tag, len(entries))]
    for e in entries:
        key = e.key.encode("utf-8")
        parts.append(_ENTRY.pack(e.kind, e.tag, e.per_atom, len(key), e.elem_bytes, e.slot_bytes))
        parts.append(key)
    return b"".join(parts)


def decode_schema(buf, name: str) -> Schema:
    """Decode a schema block; it must be consumed exactly.

    Args:
        buf (bytes-like): The block's bytes.
        name (str): File name for error messages.

    Returns:
        The decoded :class:`Schema`.

    Raises:
        SchemaError: Any malformation listed in spec §10.
    """
    buf = bytes(buf)
    if len(buf) < _HEAD.size:
        raise SchemaError(f"{name}: schema block is {len(buf)} bytes, shorter than its header")
    version, pos_tag, count = _HEAD.unpack_from(buf, 0)
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{name}: unsupported schema version {version}")
    if pos_tag not in POSITIONS_DTYPE_BY_TAG and pos_tag != POSITIONS_UNKNOWN:
        raise SchemaError(f"{name}: schema positions type tag {pos_tag} is not 4, 7 or 255")
    if count * _ENTRY.size > len(buf) - _HEAD.size:
        raise SchemaError(f"{name}: schema claims {count} entries but holds {len(buf)} bytes")
    schema = Schema(pos_tag)
    pos = _HEAD.size
    for i in range(count):
        if pos + _ENTRY.size > len(buf):
            raise SchemaError(f"{name}: schema entry {i} is truncated")
        kind, tag, per_atom, key_len, elem, slot = _ENTRY.unpack_from(buf, pos)
        pos += _ENTRY.size
        if pos + key_len > len(buf):
            raise SchemaError(f"{name}: schema entry {i} key is truncated")
        try:
            key = buf[pos:pos + key_len].decode("utf-8")
        except UnicodeDecodeError:
            raise SchemaError(f"{name}: schema entry {i} key is not valid UTF-8") from None
        pos += key_len
        if per_atom not in (0, 1):
            raise SchemaError(f"{name}: schema entry {key!r} has per_atom flag {per_atom}")
        schema.entries[(kind, key)] = SchemaEntry(kind, key, tag, per_atom, elem, slot)
    if pos != len(buf):
        raise SchemaError(f"{name}: {len(buf) - pos} trailing bytes after the schema entries")
    return schema
