"""Groups: named groupings of record indices (the framed layout's first extension).

A group references related records by index, e.g. an adsorbate+slab record with its
clean slab and gas references; records are stored once and may belong to any number of
groups. A *grouping* is a named sequence of groups sharing one role table and one set of
per-group columns. Each ``add_groups`` call is stored as one groups frame (kind 3, a
*chunk*); a grouping is the concatenation of its chunks in file order. The chunk payload,
byte for byte as upstream's ``extensions.rs`` (LeMaterial/atompack at
90da9bd35904a3625ab143eeb5cdd8d532a22c78) writes it, all little-endian::

    [version:u32 = 1][n_groupings:u32]
    per grouping:
      [name:str][n_roles:u32][roles:str × n_roles]
      [n_groups:u64][n_members:u64]
      [offsets:u64 × (n_groups + 1)]     CSR: group g = records[offsets[g]:offsets[g + 1]]
      [records:u64 × n_members]
      [member_roles:u16 × n_members]     only when n_roles > 0
      [n_props:u32] per column: [key:str][type_tag:u8][values × n_groups]
    str = [len:u32][utf8 bytes]; type tags: 0 float64, 1 int64, 2 str

This module holds the codec (:func:`encode_groups`, :func:`decode_groups`), the checks
upstream makes (:meth:`Grouping.validate`, :meth:`Grouping.check_append`), the chunk
merge and the read-only mapping a reader exposes (:class:`Groups`); ``add_groups.py``
parses what a user passes to ``add_groups``. Where the frames live (the metadata
directory) is the frame layer's business: this module takes and gives payloads.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import AtpIndexError, AtpValueError
from .frames import FRAME_GROUPS
from .types import TAG_F64, TAG_I64, TAG_STR

GROUPS_VERSION = 1
MAX_ROLES = 0xFFFF  # role ids are u16
COLUMN_TAGS = {TAG_F64: "float64", TAG_I64: "int64", TAG_STR: "str"}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

Column = np.ndarray | list  # float64 / int64 arrays, or a list of str


class GroupsError(AtpValueError):
    """Groups that break a rule of the format: a damaged groups frame in a file, or an
    ``add_groups`` call the file cannot take. The message names the file, the grouping
    and the field."""


def _column_tag(values: Column) -> int:
    if isinstance(values, list):
        return TAG_STR
    return TAG_I64 if values.dtype.kind == "i" else TAG_F64


@dataclass
class Grouping:
    """Groups of record indices in CSR layout, as upstream's ``Grouping``.

    Members of group ``g`` are ``records[offsets[g]:offsets[g + 1]]``. With named roles,
    ``member_roles[m]`` indexes ``roles``; ordered groups leave both empty.

    Args:
        roles (list[str], optional): Role names (empty for ordered groups). (default: :obj:`[]`)
        offsets (np.ndarray, optional): ``n_groups + 1`` member offsets (int64).
            (default: :obj:`[0]`)
        records (np.ndarray, optional): Record index of every member (int64). (default: empty)
        member_roles (np.ndarray, optional): Role id of every member (uint16; empty for
            ordered groups). (default: empty)
        properties (dict[str, np.ndarray | list[str]], optional): One column per key, one
            value per group: float64 or int64 arrays, or lists of str. (default: :obj:`{}`)
    """

    roles: list[str] = field(default_factory=list)
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    records: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    member_roles: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint16))
    properties: dict[str, Column] = field(default_factory=dict)

    def __len__(self) -> int:
        return max(len(self.offsets) - 1, 0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Grouping):
            return NotImplemented
        same = (self.roles == other.roles and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.records, other.records)
                and np.array_equal(self.member_roles, other.member_roles)
                and list(self.properties) == list(other.properties))
        return same and all(
            _column_tag(v) == _column_tag(other.properties[k])
            and (v == other.properties[k] if isinstance(v, list)
                 else np.array_equal(v, other.properties[k]))
            for k, v in self.properties.items())

    def validate(self, num_records: int, where: str) -> None:
        """Check every invariant upstream checks; ``num_records`` bounds the indices.

        Args:
            num_records (int): Records in the file (members must be below it).
            where (str): How the message names the file and grouping.

        Raises:
            GroupsError: The first rule broken, naming the group and field.
        """
        offsets, records, n = self.offsets, self.records, len(self)

        def bad(message: str) -> GroupsError:
            return GroupsError(f"{where}: {message}")

        if len(offsets) == 0 or offsets[0] != 0:
            raise bad("offsets must start at 0")
        steps = np.flatnonzero(offsets[1:] <= offsets[:-1])
        if len(steps):
            g = int(steps[0])
            raise bad(f"group {g} has no members (offsets[{g}] = {int(offsets[g])}, "
                      f"offsets[{g + 1}] = {int(offsets[g + 1])}; offsets must increase)")
        if int(offsets[-1]) != len(records):
            raise bad(f"offsets end at {int(offsets[-1])} but there are {len(records)} "
                      "member records")
        out = np.flatnonzero((records >= num_records) | (records < 0))
        if len(out):
            m = int(out[0])
            g = int(np.searchsorted(offsets, m, side="right")) - 1
            raise bad(f"group {g}: member record {int(records[m])} is out of range "
                      f"(the file has {num_records} records)")
        if not self.roles:
            if len(self.member_roles):
                raise bad("ordered groups (no roles) cannot have member roles")
        else:
            if len(self.roles) > MAX_ROLES:
                raise bad(f"{len(self.roles)} roles; at most {MAX_ROLES}")
            if len(self.member_roles) != len(records):
                raise bad(f"{len(self.member_roles)} member roles for {len(records)} "
                          "members: every member needs a role")
            roles = self.member_roles.astype(np.int64)
            out = np.flatnonzero(roles >= len(self.roles))
            if len(out):
                raise bad(f"member {int(out[0])}: role id {int(roles[out[0]])} is out of "
                          f"range ({len(self.roles)} roles)")
            group_of = np.repeat(np.arange(n), np.diff(offsets))
            pairs = group_of * len(self.roles) + roles
            if len(np.unique(pairs)) != len(pairs):
                seen, first = np.unique(pairs, return_counts=True)
                dup = int(seen[first > 1][0])
                raise bad(f"group {dup // len(self.roles)} has role "
                          f"{self.roles[dup % len(self.roles)]!r} more than once")
        _check_unique(self.roles, "role", bad)
        for key, values in self.properties.items():
            if len(values) != n:
                raise bad(f"column {key!r} has {len(values)} values for {n} groups")

    def check_append(self, other: Grouping, where: str) -> None:
        """Check that ``other`` can follow these groups (upstream's ``check_append``).

        Raises:
            GroupsError: Named-role and ordered groups mixed, different column keys or
                types, or too many roles.
        """
        if bool(self.roles) != bool(other.roles):
            raise GroupsError(f"{where}: cannot mix named-role and ordered groups in one "
                              "grouping")
        own = sorted((k, _column_tag(v)) for k, v in self.properties.items())
        new = sorted((k, _column_tag(v)) for k, v in other.properties.items())
        if own != new:
            def show(keys: list[tuple[str, int]]) -> str:
                return ", ".join(f"{k}: {COLUMN_TAGS[t]}" for k, t in keys) or "none"
            raise GroupsError(f"{where}: group properties ({show(new)}) do not match the "
                              f"existing grouping's ({show(own)})")
        added = sum(role not in self.roles for role in other.roles)
        if len(self.roles) + added > MAX_ROLES:
            raise GroupsError(f"{where}: more than {MAX_ROLES} roles")

    def appended(self, other: Grouping, where: str) -> Grouping:
        """These groups followed by ``other``, its roles mapped onto this role table.

        Returns:
            A new :class:`Grouping` (neither input changes).
        """
        self.check_append(other, where)
        roles = list(self.roles)
        mapping = np.zeros(len(other.roles), np.uint16)
        for i, role in enumerate(other.roles):
            if role not in roles:
                roles.append(role)
            mapping[i] = roles.index(role)
        properties: dict[str, Column] = {}
        for key, own in self.properties.items():
            more = other.properties[key]
            properties[key] = (own + more if isinstance(own, list)
                               else np.concatenate([own, more]))
        return Grouping(
            roles=roles,
            offsets=np.concatenate([self.offsets, other.offsets[1:] + len(self.records)]),
            records=np.concatenate([self.records, other.records]),
            member_roles=np.concatenate([self.member_roles, mapping[other.member_roles]])
            if roles else np.zeros(0, np.uint16),
            properties=properties,
        )


def _check_unique(names: Sequence[str], what: str, bad: Callable[[str], Exception]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise bad(f"duplicate {what} {name!r}")
        seen.add(name)


# ---------------------------------------------------------------------------- encoding
def _put_str(out: list[bytes], text: str) -> None:
    raw = text.encode("utf-8")
    out += [_U32.pack(len(raw)), raw]


def encode_groups(groupings: Sequence[tuple[str, Grouping]]) -> bytes:
    """One groups frame payload (a chunk), byte for byte as upstream's ``encode_groups``.

    Args:
        groupings (Sequence[tuple[str, Grouping]]): ``(name, groups)`` pairs, in order.

    Returns:
        The payload.
    """
    out: list[bytes] = [_U32.pack(GROUPS_VERSION), _U32.pack(len(groupings))]
    for name, g in groupings:
        _put_str(out, name)
        out.append(_U32.pack(len(g.roles)))
        for role in g.roles:
            _put_str(out, role)
        out += [_U64.pack(len(g)), _U64.pack(len(g.records)),
                np.asarray(g.offsets, "<u8").tobytes(), np.asarray(g.records, "<u8").tobytes(),
                np.asarray(g.member_roles, "<u2").tobytes(), _U32.pack(len(g.properties))]
        for key, values in g.properties.items():
            _put_str(out, key)
            tag = _column_tag(values)
            out.append(bytes((tag,)))
            if tag == TAG_STR:
                for text in values:
                    _put_str(out, text)
            else:
                out.append(np.asarray(values, "<i8" if tag == TAG_I64 else "<f8").tobytes())
    return b"".join(out)


# ---------------------------------------------------------------------------- decoding
class _Cursor:
    """Bounds-checked reads: every count is checked against the bytes left before
    anything is allocated, so an inflated count fails instead of exhausting memory."""

    def __init__(self, data: bytes | memoryview, where: str) -> None:
        self.data = memoryview(data).cast("B")
        self.pos = 0
        self.where = where

    def fail(self, message: str) -> GroupsError:
        return GroupsError(f"{self.where}: {message}")

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.fail(f"truncated in {what} (needs {n} bytes at byte {self.pos}, "
                            f"{len(self.data) - self.pos} left)")
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def u32(self, what: str) -> int:
        return _U32.unpack(self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def text(self, what: str) -> str:
        raw = self.take(self.u32(what), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def array(self, count: int, dtype: str, what: str) -> np.ndarray:
        width = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(count * width, what), dtype)


def decode_groups(payload: bytes | memoryview, num_records: int, where: str
                  ) -> list[tuple[str, Grouping]]:
    """Decode one groups frame payload and check every grouping in it.

    Args:
        payload (bytes | memoryview): The frame payload.
        num_records (int): Records in the file (members must be below it).
        where (str): How messages name the file and frame, e.g. ``"data.atp: groups
            frame at byte 8192"``.

    Returns:
        ``(name, Grouping)`` pairs in stored order; arrays are owned int64 / uint16 copies.

    Raises:
        GroupsError: Truncated or trailing bytes, an unknown version or column type, a
            duplicate name, or groups that break a rule (:meth:`Grouping.validate`).
    """
    r = _Cursor(payload, where)
    version = r.u32("version")
    if version != GROUPS_VERSION:
        raise r.fail(f"unsupported groups version {version} (this reader knows "
                     f"{GROUPS_VERSION})")
    out: list[tuple[str, Grouping]] = []
    names: set[str] = set()
    for _ in range(r.u32("grouping count")):
        name = r.text("grouping name")
        here = f"grouping {name!r}"
        roles = [r.text(f"{here} role name") for _ in range(r.u32(f"{here} role count"))]
        n_groups = r.u64(f"{here} group count")
        n_members = r.u64(f"{here} member count")
        offsets = r.array(n_groups + 1, "<u8", f"{here} offsets")
        records = r.array(n_members, "<u8", f"{here} records")
        member_roles = (r.array(n_members, "<u2", f"{here} member roles") if roles
                        else np.zeros(0, np.uint16))
        properties: dict[str, Column] = {}
        for _ in range(r.u32(f"{here} column count")):
            key = r.text(f"{here} column name")
            if key in properties:
                raise r.fail(f"{here}: duplicate group property {key!r}")
            what = f"{here} column {key!r}"
            tag = r.take(1, what)[0]
            if tag == TAG_F64:
                properties[key] = r.array(n_groups, "<f8", what).astype(np.float64)
            elif tag == TAG_I64:
                properties[key] = r.array(n_groups, "<i8", what).astype(np.int64)
            elif tag == TAG_STR:
                if n_groups * 4 > len(r.data) - r.pos:  # each string takes 4 bytes at least
                    raise r.fail(f"truncated in {what} ({n_groups} strings cannot fit)")
                properties[key] = [r.text(what) for _ in range(n_groups)]
            else:
                raise r.fail(f"{what}: unsupported type tag {tag}")
        grouping = Grouping(roles, _as_int64(offsets, r, f"{here} offsets"),
                            _as_int64(records, r, f"{here} records"),
                            member_roles.astype(np.uint16), properties)
        grouping.validate(num_records, f"{where}: {here}")
        if name in names:
            raise r.fail(f"duplicate grouping {name!r}")
        names.add(name)
        out.append((name, grouping))
    if r.pos != len(r.data):
        raise r.fail(f"{len(r.data) - r.pos} trailing bytes after the last grouping")
    return out


def _as_int64(values: np.ndarray, r: _Cursor, what: str) -> np.ndarray:
    # u64 values past int64 cannot be record indices or offsets of a real file
    if len(values) and int(values.max()) > np.iinfo(np.int64).max:
        raise r.fail(f"{what}: value {int(values.max())} is out of range")
    return values.astype(np.int64)


def merge_chunks(payloads: Sequence[tuple[str, bytes | memoryview]], num_records: int,
                 offset: int = 0, into: dict[str, Grouping] | None = None
                 ) -> dict[str, Grouping]:
    """The groupings of a file: its groups chunks concatenated in file order.

    Args:
        payloads (Sequence[tuple[str, bytes]]): ``(where, payload)`` of every groups frame
            in file order; ``where`` names the file and frame in messages.
        num_records (int): Records in the file.
        offset (int, optional): Added to every record index: where the file's records
            start in a dataset of several files (its shards). (default: :obj:`0`)
        into (dict[str, Grouping], optional): Groupings of the files before, which these
            chunks extend (a sharded dataset's groupings are its shards' in order).
            (default: :obj:`None`)

    Returns:
        ``name -> Grouping``, sorted by name (upstream's order).

    Raises:
        GroupsError: A chunk is damaged or does not fit the chunks before it.
    """
    merged: dict[str, Grouping] = dict(into or {})
    for where, payload in payloads:
        for name, chunk in decode_groups(payload, num_records, where):
            if offset:
                chunk.records = chunk.records + int(offset)
            old = merged.get(name)
            merged[name] = chunk if old is None else old.appended(
                chunk, f"{where}: grouping {name!r}")
    return dict(sorted(merged.items()))


# ---------------------------------------------------------------------------- reading
Fetch = Callable[[Sequence[int]], Sequence[Any]]


class Groups(Mapping[str, "GroupingView"]):
    """The groupings of a file, read-only: ``groups[name][i]`` is one :class:`Group`.

    Mirrors upstream's ``Database.groups``: names in sorted order, ``KeyError`` for a
    missing one.

    Args:
        groupings (dict[str, Grouping]): The decoded groupings.
        fetch (Callable[[Sequence[int]], Sequence[Any]]): Reads molecules by record index
            (e.g. ``lambda ids: [reader[i] for i in ids]``).
        name (str): How messages name the file.
    """

    def __init__(self, groupings: dict[str, Grouping], fetch: Fetch, name: str) -> None:
        self._groupings = dict(sorted(groupings.items()))
        self._fetch = fetch
        self._name = name

    def __getitem__(self, key: str) -> GroupingView:
        grouping = self._groupings.get(key)
        if grouping is None:
            raise KeyError(f"{self._name}: no grouping named {key!r} "
                           f"(groupings: {sorted(self._groupings) or 'none'})")
        return GroupingView(key, grouping, self._fetch, self._name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._groupings)

    def __len__(self) -> int:
        return len(self._groupings)

    def __repr__(self) -> str:
        return f"Groups({list(self._groupings)})"


class GroupingView(Sequence["Group"]):
    """One named grouping: a sequence of groups sharing roles and property keys.

    ``grouping[i]`` is a :class:`Group`; a slice, a list or an integer array gives a list
    of them, reading each record shared between them once.
    """

    def __init__(self, name: str, grouping: Grouping, fetch: Fetch, file: str) -> None:
        self.name = name
        self.grouping = grouping
        self._fetch = fetch
        self._file = file

    @property
    def roles(self) -> list[str]:
        """Role names (empty for ordered groups)."""
        return list(self.grouping.roles)

    @property
    def properties(self) -> dict[str, Column]:
        """Columns: float64 / int64 arrays, lists of str (copies)."""
        return {k: list(v) if isinstance(v, list) else v.copy()
                for k, v in self.grouping.properties.items()}

    def __len__(self) -> int:
        return len(self.grouping)

    def _position(self, index: Any) -> int:
        n = len(self.grouping)
        if isinstance(index, (bool, np.bool_)) or not hasattr(index, "__index__"):
            raise TypeError(f"{self._file}: grouping {self.name!r}: group index must be an "
                            f"integer, a slice or a list of integers, got {index!r}")
        i = int(index)
        if not -n <= i < n:
            raise AtpIndexError(f"{self._file}: grouping {self.name!r}: group index {i} is "
                                f"out of range for {n} groups")
        return i % n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.load(range(*index.indices(len(self))))
        if isinstance(index, (list, tuple, np.ndarray)):
            return self.load([self._position(i) for i in np.asarray(index).reshape(-1)])
        return self.load([self._position(index)])[0]

    def __iter__(self) -> Iterator[Group]:
        for i in range(len(self)):
            yield self.load([i])[0]

    def load(self, positions: Sequence[int]) -> list[Group]:
        """The groups at ``positions``, each shared record read once."""
        g = self.grouping
        spans = [(int(g.offsets[p]), int(g.offsets[p + 1])) for p in positions]
        wanted = list(dict.fromkeys(int(r) for a, b in spans for r in g.records[a:b]))
        molecules = dict(zip(wanted, self._fetch(wanted))) if wanted else {}
        out = []
        for p, (a, b) in zip(positions, spans):
            ids = [int(r) for r in g.records[a:b]]
            values = {k: (v[p] if isinstance(v, list) else v[p].item())
                      for k, v in g.properties.items()}
            if g.roles:
                names = [g.roles[int(r)] for r in g.member_roles[a:b]]
                out.append(Group(dict(zip(names, ids)),
                                 {n: molecules[i] for n, i in zip(names, ids)}, values))
            else:
                out.append(Group(ids, [molecules[i] for i in ids], values))
        return out

    def __repr__(self) -> str:
        return (f"Grouping({self.name!r}, len={len(self)}, roles={self.roles}, "
                f"properties={list(self.grouping.properties)})")


class Group:
    """One group: ``group[role]`` (or ``group[i]`` for ordered groups) is a molecule.

    Attributes:
        indices: ``{role: record}`` for named roles, ``[record, ...]`` for ordered groups.
        members: The molecules, shaped like ``indices``.
        properties: ``{key: value}`` of this group's columns (float, int or str).
    """

    __slots__ = ("indices", "members", "properties")

    def __init__(self, indices: dict[str, int] | list[int],
                 members: dict[str, Any] | list[Any], properties: dict[str, Any]) -> None:
        self.indices = indices
        self.members = members
        self.properties = properties

    def __getitem__(self, key: Any) -> Any:
        return self.members[key]

    def __contains__(self, key: Any) -> bool:
        return key in self.members

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.members)

    def __repr__(self) -> str:
        return f"Group(indices={self.indices!r}, properties={self.properties!r})"


def read_groups(reader: Any, shards: Sequence[tuple[Any, int]] | None = None) -> Groups:
    """The groupings of an open reader, from the groups frames its directory lists.

    Args:
        reader (Any): The reader members are read through (``reader[i]``, ``name``).
        shards (Sequence[tuple[Any, int]], optional): For a dataset of several files:
            each file's reader and where its records start, in order. A file's groups
            point at its own records; here they are moved to the dataset's numbering and
            the groupings of one name concatenated file after file. Each reader needs
            ``metadata_frames`` (entries with ``kind``, ``offset``, ``length``),
            ``read_metadata(entry)`` (the payload, CRC checked), ``name`` and ``len()``.
            (default: :obj:`None`: ``reader`` is one file)

    Returns:
        The :class:`Groups` mapping.

    Raises:
        GroupsError: A groups frame is damaged or does not fit the chunks before it.
    """
    merged: dict[str, Grouping] = {}
    for part, start in [(reader, 0)] if shards is None else shards:
        payloads = [(f"{part.name}: groups frame at byte {f.offset}", part.read_metadata(f))
                    for f in part.metadata_frames if f.kind == FRAME_GROUPS]
        merged = merge_chunks(payloads, len(part), start, merged)
    name = getattr(reader, "name", None) or getattr(reader, "path", None)
    return Groups(merged, _Members(reader), str(name or type(reader).__name__))


class _Members:
    """Reads member molecules through a reader (picklable, unlike a lambda)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __call__(self, ids: Sequence[int]) -> list[Any]:
        return [self.reader[i] for i in ids]


def shift_chunk(payload: bytes | memoryview, offset: int, num_records: int, where: str
                ) -> bytes:
    """A groups chunk with every record index moved by ``offset``, for a merge.

    Files merged one after another renumber their records: a groups frame of a file
    whose records start at ``offset`` in the output must point ``offset`` further on
    (frames of unknown kinds are carried as they are; these cannot be).

    Args:
        payload (bytes | memoryview): A groups frame payload of the input file.
        offset (int): Where the input file's records start in the output.
        num_records (int): Records of the input file (its chunks are checked against it).
        where (str): How messages name the input file and frame.

    Returns:
        The payload to write into the output.
    """
    chunk = decode_groups(payload, num_records, where)
    for _, grouping in chunk:
        grouping.records = grouping.records + int(offset)
    return encode_groups(chunk)
