"""Read-side attribute names: ``rename={"forces": "force"}`` and presets such as ``"pyg-md17"``.

The project's table (``docs/architecture.md``) fixes one name per field.
Existing training scripts often expect another convention, e.g. PyG's
``torch_geometric.datasets.MD17`` (``force``, float32 ``energy``). Every dataset
and loader of the project accepts ``rename=`` / ``names=``, resolved here into
one :class:`AttributeNames`, which renames the attributes of each produced
``Data`` or ``Batch`` (including PyG's collation bookkeeping, so that
``Batch.to_data_list()`` and ``follow_batch`` vectors keep working) and casts
the attributes a preset asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import FieldSelectionError

__all__ = ["NAME_PRESETS", "AttributeNames", "resolve_names"]


@dataclass(frozen=True)
class AttributeNames:
    """Renames and dtype casts applied to every ``Data``/``Batch`` a dataset produces.

    Args:
        rename (Mapping[str, str], optional): ``project attribute -> attribute in the output``.
            (default: :obj:`{}`)
        float32 (frozenset[str], optional): Project attributes cast to ``torch.float32``.
            (default: empty)
    """

    rename: Mapping[str, str] = field(default_factory=dict)
    float32: frozenset[str] = frozenset()

    def output_name(self, attribute: str) -> str:
        """The name ``attribute`` of the project's table has in the output.

        Args:
            attribute (str): A name of the project's attribute table (e.g. ``forces``).

        Returns:
            The name the produced ``Data`` carries it under.
        """
        return self.rename.get(attribute, attribute)

    def stored_name(self, attribute: str) -> str:
        """The project's name of an output attribute (the inverse of :meth:`output_name`).

        Args:
            attribute (str): A name the produced ``Data`` carries.

        Returns:
            The project's name for it (itself when it is not renamed).
        """
        for stored, shown in self.rename.items():
            if shown == attribute:
                return stored
        return attribute

    def then(self, other: AttributeNames | None) -> AttributeNames:
        """These names followed by ``other`` (applied to this output) as one mapping.

        Args:
            other (AttributeNames): Names applied after these (:obj:`None`: these alone).

        Returns:
            AttributeNames: One mapping from the project's names to the final ones.
        """
        if other is None:
            return self
        stored = set(self.rename) | {self.stored_name(a) for a in other.rename}
        rename = {}
        for attribute in stored:
            final = other.output_name(self.output_name(attribute))
            if final != attribute:
                rename[attribute] = final
        float32 = set(self.float32) | {self.stored_name(a) for a in other.float32}
        return AttributeNames(rename, frozenset(float32))

    def apply(self, data: Any) -> Any:
        """Rename and cast the attributes of ``data`` in place.

        Args:
            data (Data or Batch): A graph or a batch built by the project.

        Returns:
            The same object.
        """
        store = data._store._mapping
        for attribute in self.float32:
            value = store.get(attribute)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                store[attribute] = value.to(torch.float32)
        if not self.rename:
            return data
        moved = {new: store.pop(old) for old, new in self.rename.items() if old in store}
        if isinstance(getattr(data, "_slice_dict", None), dict):
            # follow_batch vectors of a Batch follow their attribute
            for old, new in self.rename.items():
                for suffix in ("_batch", "_ptr"):
                    if old + suffix in store:
                        moved[new + suffix] = store.pop(old + suffix)
        store.update(moved)
        for bookkeeping in ("_slice_dict", "_inc_dict"):
            table = getattr(data, bookkeeping, None)
            if isinstance(table, dict):
                for old, new in self.rename.items():
                    if old in table:
                        table[new] = table.pop(old)
        return data

    def __call__(self, data: Any) -> Any:
        return self.apply(data)


#: Named conventions for ``names=``.
NAME_PRESETS: dict[str, AttributeNames] = {
    # torch_geometric.datasets.MD17: Data(z, pos, energy (float32), force)
    "pyg-md17": AttributeNames({"forces": "force"}, frozenset({"energy"})),
}


def resolve_names(
    rename: Mapping[str, str] | None = None,
    names: str | None = None,
) -> AttributeNames | None:
    """Builds the :class:`AttributeNames` of a dataset's ``rename=`` and ``names=``.

    Args:
        rename (Mapping[str, str], optional): ``project attribute -> new name``,
            e.g. ``{"forces": "force"}``. Applied after the preset.
            (default: :obj:`None`)
        names (str, optional): A preset of :data:`NAME_PRESETS`, e.g.
            ``"pyg-md17"`` (``force`` and a float32 ``energy``, as PyG's
            ``MD17``). (default: :obj:`None`)

    Returns:
        AttributeNames or None: :obj:`None` when nothing is renamed or cast.

    Raises:
        FieldSelectionError: An unknown preset, or two attributes renamed onto
            one name.
    """
    if names is None and not rename:
        return None
    base = AttributeNames()
    if names is not None:
        if names not in NAME_PRESETS:
            raise FieldSelectionError(
                f"unknown names preset {names!r}; known: {', '.join(NAME_PRESETS)}"
            )
        base = NAME_PRESETS[names]
    merged = {**base.rename, **dict(rename or {})}
    for old, new in merged.items():
        if not isinstance(old, str) or not isinstance(new, str) or not new:
            raise FieldSelectionError(f"rename entries must be str -> str, got {old!r}: {new!r}")
    targets = [new for old, new in merged.items() if old != new]
    if len(set(targets)) != len(targets):
        raise FieldSelectionError(f"rename {merged} gives two attributes the same name")
    clashes = sorted(set(targets) & (_PROJECT_ATTRIBUTES - set(merged)))
    if clashes:
        raise FieldSelectionError(
            f"rename {merged} would hide the attribute(s) {', '.join(clashes)}; rename "
            "those too"
        )
    return AttributeNames({o: n for o, n in merged.items() if o != n}, base.float32)


def names_transform(
    names: AttributeNames | None, transform: Callable[[Any], Any] | None
) -> Callable[[Any], Any] | None:
    """One picklable callable: rename first, then the user's ``transform``.

    Args:
        names (AttributeNames): The renaming (:obj:`None`: none).
        transform (Callable): The user's transform (:obj:`None`: none).

    Returns:
        The callable, or ``transform`` itself when there is nothing to rename.
    """
    if names is None:
        return transform
    return _Renamed(names, transform)


@dataclass(frozen=True)
class _Renamed:
    names: AttributeNames
    transform: Callable[[Any], Any] | None

    def __call__(self, data: Any) -> Any:
        data = self.names.apply(data)
        return data if self.transform is None else self.transform(data)


def _project_attributes() -> frozenset[str]:
    from .fields import BUILTIN_FIELDS

    return frozenset(BUILTIN_FIELDS.values()) | {"natoms"}


_PROJECT_ATTRIBUTES = _project_attributes()
