"""Which `.atp` fields exist as which ``Data`` attributes, and ``fields=`` selections."""

from __future__ import annotations

from collections.abc import Iterable

from pyg_atompack.atp.types import ATOM_AXIS_BUILTINS, BUILTINS

from .errors import FieldSelectionError

__all__ = ["BUILTIN_FIELDS", "attribute_name", "resolve_fields"]

#: Each builtin `.atp` field and the ``Data`` attribute it becomes, in the order the
#: attributes are set on a ``Data`` (derived from the one table,
#: :data:`pyg_atompack.atp.types.BUILTINS`).
BUILTIN_FIELDS: dict[str, str] = {name: field.attribute for name, field in BUILTINS.items()}
_ALWAYS_READ = ("atomic_numbers", "positions")
# node-level builtins (atomic numbers become ``z`` apart, as int64)
_NODE_BUILTINS = ATOM_AXIS_BUILTINS - {"atomic_numbers"}
# per-molecule arrays, stored (3, 3) / (3,): graph attributes of shape [1, ...]
_GRAPH_ARRAY_BUILTINS = frozenset(name for name, field in BUILTINS.items()
                                  if not field.per_atom and field.shape)
_RESERVED_ATTRIBUTES = frozenset(BUILTIN_FIELDS.values()) | {"natoms"}
_PROPERTIES = "properties/"
_ATOM_PROPERTIES = "atom_properties/"
# The Data attribute aliases a user may pass in `fields=` for the builtins.
_ATTRIBUTE_ALIASES = {attr: field for field, attr in BUILTIN_FIELDS.items()}


def attribute_name(field: str) -> str:
    """Returns the ``Data`` attribute name under which a `.atp` field is exposed.

    Args:
        field (str): A builtin field name (``"positions"``, ``"energy"``, ...) or a
            custom key written as ``"properties/<key>"`` / ``"atom_properties/<key>"``.

    Returns:
        str: The attribute name (``"pos"``, ``"energy"``, ``"prop_energy"``, ...).
    """
    if field in BUILTIN_FIELDS:
        return BUILTIN_FIELDS[field]
    if field.startswith(_PROPERTIES):
        key = field[len(_PROPERTIES):]
        return f"prop_{key}" if key in _RESERVED_ATTRIBUTES else key
    if field.startswith(_ATOM_PROPERTIES):
        key = field[len(_ATOM_PROPERTIES):]
        return f"atom_{key}" if key in _RESERVED_ATTRIBUTES else key
    raise FieldSelectionError(f"{field!r} is not a builtin field or a custom property path")


def resolve_fields(
    requested: Iterable[str] | None,
    available: Iterable[str],
    *,
    source: str = "the dataset",
) -> tuple[str, ...] | None:
    """Normalises a user's ``fields=`` selection into `.atp` field names.

    Accepted spellings: builtin field names (``"positions"``, ``"forces"``), their
    ``Data`` attribute names (``"pos"``, ``"z"``), ``"natoms"`` (always present),
    custom keys as ``"properties/<key>"`` / ``"atom_properties/<key>"``, their
    attribute names (``"prop_energy"``), or a bare custom key when it is unambiguous.
    Positions and atomic numbers are always included.

    Args:
        requested (Iterable[str]): The selection, or :obj:`None` for all.
        available (Iterable[str]): The optional fields the source can hold, in
            `.atp` naming (builtins by name, customs with their scope prefix).
        source (str, optional): How to name the source in error messages.
            (default: :obj:`"the dataset"`)

    Returns:
        tuple[str, ...] | None: The selected `.atp` field names in a stable order,
        or :obj:`None` when ``requested`` is :obj:`None`.

    Raises:
        FieldSelectionError: If a requested field is unknown or ambiguous.
    """
    if requested is None:
        return None
    if isinstance(requested, str):
        requested = [requested]
    available = [name for name in available if name not in _ALWAYS_READ]
    by_attribute = {attribute_name(name): name for name in available}
    bare: dict[str, list[str]] = {}
    for name in available:
        if name.startswith((_PROPERTIES, _ATOM_PROPERTIES)):
            bare.setdefault(name.split("/", 1)[1], []).append(name)

    selected: set[str] = set(_ALWAYS_READ)
    for raw in requested:
        name = _ATTRIBUTE_ALIASES.get(raw, raw)
        if name in _ALWAYS_READ or name == "natoms":
            continue
        if name in available:
            selected.add(name)
        elif name in by_attribute:
            selected.add(by_attribute[name])
        elif len(bare.get(name, ())) == 1:
            selected.add(bare[name][0])
        elif len(bare.get(name, ())) > 1:
            raise FieldSelectionError(
                f"field {raw!r} is ambiguous in {source}: it is both "
                f"{' and '.join(sorted(bare[name]))}; ask for one of them"
            )
        else:
            existing = ", ".join(["positions", "atomic_numbers", *sorted(available)])
            raise FieldSelectionError(
                f"no record in {source} has a field {raw!r}; the fields that exist are: "
                f"{existing}"
            )
    ordered = [name for name in BUILTIN_FIELDS if name in selected]
    ordered += sorted(name for name in selected if name not in BUILTIN_FIELDS)
    return tuple(ordered)
