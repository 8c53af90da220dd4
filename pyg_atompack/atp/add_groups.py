"""``add_groups``' arguments: upstream's Python forms parsed into checked groups.

:func:`parse_grouping` turns what a user passes (dicts of role -> record, lists of
records, or a ``(n_groups, n_roles)`` array with ``-1`` for absent members; columns of
ints, floats or str) into a :class:`~pyg_atompack.atp.groups.Grouping`;
:class:`GroupsState` is what a writer holds between calls: the groupings already in the
file (decoded only when groups are added) and the check that new groups fit them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .groups import Column, Grouping, GroupsError, encode_groups

__all__ = ["GroupsState", "parse_grouping"]

def parse_grouping(members: Any, properties: Mapping[str, Any] | None = None,
                   roles: Sequence[str] | None = None, where: str = "add_groups"
                   ) -> Grouping:
    """Build groups from upstream's Python forms of ``add_groups`` (not yet validated).

    Args:
        members (Any): Without ``roles``: a sequence of dicts ``{role: record}`` (named
            roles, ids in order of first appearance) or of sequences of records (ordered
            groups). With ``roles``: a ``(n_groups, len(roles))`` integer array or list of
            rows, ``-1`` marking an absent member.
        properties (Mapping[str, Any], optional): One value per group for each key: ints
            (int64), real numbers (float64) or str. (default: :obj:`None`)
        roles (Sequence[str], optional): Role names of the columns of ``members``.
            (default: :obj:`None`)
        where (str, optional): How messages name the call. (default: :obj:`"add_groups"`)

    Returns:
        The :class:`Grouping`; :meth:`Grouping.validate` checks it against a file.

    Raises:
        TypeError: Dicts mixed with sequences, or values of an unsupported type.
        GroupsError: A negative record index or a row of the wrong length.
    """
    records: list[int] = []
    member_roles: list[int] = []
    offsets = [0]
    if roles is not None:
        role_names = [_role_name(r, where) for r in roles]
        rows = members.tolist() if isinstance(members, np.ndarray) else members
        for g, row in enumerate(rows):
            row = list(row)
            if len(row) != len(role_names):
                raise GroupsError(f"{where}: members row {g} needs {len(role_names)} entries "
                                  f"(one per role), got {len(row)}")
            for role, value in enumerate(row):
                index = _record_index(value, where, g, absent_ok=True)
                if index != -1:
                    records.append(index)
                    member_roles.append(role)
            offsets.append(len(records))
    else:
        role_names = []
        named: bool | None = None
        for g, item in enumerate(members):
            is_dict = isinstance(item, Mapping)
            if named is None:
                named = is_dict
            elif named != is_dict:
                raise TypeError(f"{where}: members must be all dicts (named roles) or all "
                                f"sequences (ordered groups); group {g} differs")
            if is_dict:
                for role, value in item.items():
                    role = _role_name(role, where)
                    if role not in role_names:
                        role_names.append(role)
                    records.append(_record_index(value, where, g))
                    member_roles.append(role_names.index(role))
            else:
                if isinstance(item, (str, bytes)) or not hasattr(item, "__iter__"):
                    raise TypeError(f"{where}: group {g} must be a dict or a sequence of "
                                    f"record indices, got {type(item).__name__}")
                records.extend(_record_index(value, where, g) for value in item)
            offsets.append(len(records))
    columns = {str(key): _column(key, values, where)
               for key, values in (properties or {}).items()}
    return Grouping(role_names, np.array(offsets, np.int64), np.array(records, np.int64),
                    np.array(member_roles if role_names else [], np.uint16), columns)


def _role_name(role: Any, where: str) -> str:
    if not isinstance(role, str):
        raise TypeError(f"{where}: role names must be str, got {type(role).__name__}")
    return role


def _record_index(value: Any, where: str, group: int, absent_ok: bool = False) -> int:
    if isinstance(value, (float, np.floating)) or not hasattr(value, "__index__"):
        raise TypeError(f"{where}: group {group}: record indices must be integers, got "
                        f"{value!r}")
    index = int(value)
    if index < 0 and not (absent_ok and index == -1):
        raise GroupsError(f"{where}: group {group}: record index {index} is negative")
    return index


def _column(key: Any, values: Any, where: str) -> Column:
    if not isinstance(key, str):
        raise TypeError(f"{where}: group property names must be str, got {key!r}")
    what = f"{where}: group property {key!r}"
    if isinstance(values, np.ndarray) and values.dtype.kind in "iubf":
        if values.ndim != 1:
            raise TypeError(f"{what} must be one value per group (1-D), got shape "
                            f"{values.shape}")
        if values.dtype.kind == "f":
            return values.astype(np.float64)
        if values.dtype.kind == "u" and len(values) and int(values.max()) > 2**63 - 1:
            raise GroupsError(f"{what}: {int(values.max())} does not fit int64")
        return values.astype(np.int64)
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what} must be a sequence of ints, floats or strings, got "
                        f"{type(values).__name__}")
    items = list(values.tolist() if isinstance(values, np.ndarray) else values)
    if all(isinstance(v, (int, np.integer)) for v in items):
        try:
            return np.array(items, np.int64)
        except OverflowError:
            raise GroupsError(f"{what}: a value does not fit int64") from None
    if all(isinstance(v, (int, float, np.integer, np.floating)) for v in items):
        return np.array(items, np.float64)
    if all(isinstance(v, str) for v in items):
        return list(items)
    odd = next(v for v in items if not isinstance(v, (int, float, str, np.number)))
    raise TypeError(f"{what} must be a sequence of ints, floats or strings, got a "
                    f"{type(odd).__name__}")


class GroupsState:
    """A writer's view of a file's groupings: the committed ones and those added since.

    The committed groupings are decoded on the first :meth:`prepare`, so a session that
    only appends records never decodes them (upstream keeps their frames as they are).

    Args:
        load (Callable[[], dict[str, Grouping]]): Returns the groupings already in the file.
    """

    def __init__(self, load: Callable[[], dict[str, Grouping]]) -> None:
        self._load = load
        self._groupings: dict[str, Grouping] | None = None

    @property
    def groupings(self) -> dict[str, Grouping]:
        """Every grouping, committed or pending, by name."""
        if self._groupings is None:
            self._groupings = dict(self._load())
        return self._groupings

    def prepare(self, name: str, members: Any, properties: Mapping[str, Any] | None,
                roles: Sequence[str] | None, num_records: int, where: str
                ) -> tuple[Grouping, bytes]:
        """Parse and check one ``add_groups`` call and encode its chunk.

        Nothing changes until :meth:`push`: a call that raises leaves no trace.

        Args:
            name (str): The grouping to create or extend.
            members (Any): See :func:`parse_grouping`.
            properties (Mapping[str, Any] | None): See :func:`parse_grouping`.
            roles (Sequence[str] | None): See :func:`parse_grouping`.
            num_records (int): Records in the file, pending ones included.
            where (str): How messages name the file.

        Returns:
            The groups and the frame payload to write.
        """
        if not isinstance(name, str):
            raise TypeError(f"{where}: add_groups: the grouping name must be str, got "
                            f"{type(name).__name__}")
        here = f"{where}: add_groups({name!r})"
        grouping = parse_grouping(members, properties, roles, here)
        grouping.validate(num_records, here)
        existing = self.groupings.get(name)
        if existing is not None:
            existing.check_append(grouping, here)
        return grouping, encode_groups([(name, grouping)])

    def push(self, name: str, grouping: Grouping) -> None:
        """Record groups whose chunk was written (see :meth:`prepare`)."""
        old = self.groupings.get(name)
        self.groupings[name] = grouping if old is None else old.appended(grouping, name)
