"""Shared torch helpers: turn `.atp` records and flat batches into PyG objects.

Both the dataset layer (:mod:`pyg_atompack.data`) and the streaming layer
(:mod:`pyg_atompack.stream`) build their :class:`~torch_geometric.data.Data`
and :class:`~torch_geometric.data.Batch` objects here, so that every dataset in
the project exposes the same attribute names (the table in
``docs/architecture.md``):

========================  ==================  =================================
attribute                 shape / dtype       source
========================  ==================  =================================
``z``                     ``[N]`` int64       atomic numbers
``pos``                   ``[N, 3]``          positions (stored float dtype)
``natoms``                ``[1]`` int64       number of atoms
``energy``                ``[1]`` float64     energy (float32 values widened)
``forces``                ``[N, 3]``          forces
``charges``               ``[N]``             charges
``velocities``            ``[N, 3]``          velocities
``cell``                  ``[1, 3, 3]``       cell (rows are lattice vectors)
``stress``                ``[1, 3, 3]``       stress
``pbc``                   ``[1, 3]`` bool     periodic axes
``name``                  ``str``             name
per-atom custom ``key``   ``[N, ...]``        atom property (node level)
per-molecule ``key``      ``[1, ...]``        molecule property (graph level)
========================  ==================  =================================

A custom key that collides with a builtin attribute is renamed ``prop_<key>``
(per molecule) or ``atom_<key>`` (per atom).

:func:`flat_to_batch` assembles a ``Batch`` straight from the concatenated
arrays of ``Reader.read_batch`` without creating one ``Data`` per molecule. It
reproduces :meth:`torch_geometric.data.Batch.from_data_list` exactly (values,
dtypes, ``batch``, ``ptr``, ``_slice_dict``, ``_inc_dict``), so
``get_example``/``to_data_list`` work on the result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Batch, Data

__all__ = [
    "BUILTIN_FIELDS",
    "FieldSelectionError",
    "BatchAssemblyError",
    "PygConversionError",
    "attribute_name",
    "record_to_data",
    "flat_to_data_list",
    "flat_to_batch",
    "resolve_fields",
]


class PygConversionError(ValueError):
    """Base class of the errors raised while turning `.atp` data into PyG objects."""


class FieldSelectionError(PygConversionError):
    """A requested field does not exist (the message lists the fields that do)."""


class BatchAssemblyError(PygConversionError):
    """The molecules of a batch cannot be concatenated into one ``Batch``."""


# `.atp` builtin field -> Data attribute, in the order attributes are set on a Data.
BUILTIN_FIELDS: dict[str, str] = {
    "atomic_numbers": "z",
    "positions": "pos",
    "energy": "energy",
    "forces": "forces",
    "charges": "charges",
    "velocities": "velocities",
    "cell": "cell",
    "stress": "stress",
    "pbc": "pbc",
    "name": "name",
}
_ALWAYS_READ = ("atomic_numbers", "positions")
_NODE_BUILTINS = frozenset({"positions", "forces", "charges", "velocities"})
_GRAPH_ARRAY_BUILTINS = frozenset({"cell", "stress", "pbc"})  # stored (3,3)/(3,) -> [1, ...]
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
        requested (Iterable[str], optional): The selection, or :obj:`None` for all.
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


# --------------------------------------------------------------------------- values


def _as_tensor(array: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
    """Wraps a numpy array as a tensor the caller may write to."""
    if not array.flags.writeable:
        # Views into a read-only memory map: a transform writing in place would
        # crash the process, so hand out an owned copy.
        array = array.copy()
    tensor = torch.from_numpy(array)
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def _scalar_array(value: Any) -> np.ndarray | None:
    """A Python/numpy scalar as a 1-element array keeping its dtype, else None."""
    if isinstance(value, bool):
        return np.array([value], dtype=np.bool_)
    if isinstance(value, int):
        return np.array([value], dtype=np.int64)
    if isinstance(value, float):
        return np.array([value], dtype=np.float64)
    if isinstance(value, np.generic):
        return np.asarray(value).reshape(1)
    return None


def _graph_value(value: Any, dtype: torch.dtype | None) -> Any:
    """A per-molecule value as a graph-level attribute (leading dimension 1)."""
    if isinstance(value, str):
        return value
    scalar = _scalar_array(value)
    if scalar is not None:
        return _as_tensor(scalar, dtype)
    array = np.asarray(value)
    if array.ndim == 0:
        return _as_tensor(array.reshape(1), dtype)
    return _as_tensor(array[None], dtype)


def _node_value(value: Any, dtype: torch.dtype | None) -> torch.Tensor:
    return _as_tensor(np.asarray(value), dtype)


def _custom_fields(record: Any, scope_prefix: str, attr: str) -> list[tuple[str, Any]]:
    values = getattr(record, attr, None) or {}
    return [(scope_prefix + key, value) for key, value in values.items()]


def record_to_data(
    record: Any,
    fields: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Data:
    """Converts one `.atp` molecule record into a :class:`~torch_geometric.data.Data`.

    Fields the record does not carry (attribute :obj:`None`, or a custom property
    whose value is :obj:`None`) are simply absent from the result.

    Args:
        record: A molecule as returned by ``reader[i]`` (``positions``,
            ``atomic_numbers``, optional builtins, ``properties`` and
            ``atom_properties`` dicts).
        fields (Iterable[str], optional): The `.atp` fields to materialise (see
            :func:`resolve_fields`); positions and atomic numbers are always
            included. :obj:`None` takes every field. (default: :obj:`None`)
        dtype (torch.dtype, optional): Cast floating-point fields to this dtype;
            :obj:`None` keeps the stored dtypes. (default: :obj:`None`)

    Returns:
        Data: The molecule as a graph without edges.
    """
    positions = np.asarray(record.positions)
    numbers = np.asarray(record.atomic_numbers)
    mapping: dict[str, Any] = {
        "z": torch.from_numpy(numbers.astype(np.int64)),
        "pos": _as_tensor(positions, dtype),
        "natoms": torch.tensor([len(numbers)], dtype=torch.int64),
    }
    if fields is None:
        builtins: Iterable[str] = BUILTIN_FIELDS
        customs = _custom_fields(record, _ATOM_PROPERTIES, "atom_properties")
        customs += _custom_fields(record, _PROPERTIES, "properties")
        customs.sort(key=lambda item: item[0])
    else:
        wanted = set(fields)
        builtins = [name for name in BUILTIN_FIELDS if name in wanted]
        customs = []
        if any(name.startswith(_ATOM_PROPERTIES) for name in wanted):
            customs += _custom_fields(record, _ATOM_PROPERTIES, "atom_properties")
        if any(name.startswith(_PROPERTIES) for name in wanted):
            customs += _custom_fields(record, _PROPERTIES, "properties")
        customs = sorted(item for item in customs if item[0] in wanted)

    for name in builtins:
        if name in _ALWAYS_READ:
            continue
        value = getattr(record, name, None)
        if value is None:
            continue
        if name in _NODE_BUILTINS:
            mapping[name] = _node_value(value, dtype)
        elif name == "energy":
            mapping[name] = _graph_value(float(value), dtype)  # float64 whatever the reader
        else:
            mapping[name] = _graph_value(value, dtype)
    for path, value in customs:
        if value is None:
            continue
        if path.startswith(_ATOM_PROPERTIES):
            mapping[attribute_name(path)] = _node_value(value, dtype)
        else:
            mapping[attribute_name(path)] = _graph_value(value, dtype)
    return _data_from_mapping(mapping)


def _data_from_mapping(mapping: dict[str, Any]) -> Data:
    """Builds a Data from ready attribute values.

    ``Data(**kwargs)`` routes every attribute through ``__setattr__`` and costs
    ~14 us for five attributes; filling the store's mapping directly is
    equivalent for plain tensor/str values (that is all ``__setattr__`` ends up
    doing for them) and ~5x cheaper, which matters at 10^5 molecules/s.
    """
    data = Data()
    data._store._mapping.update(mapping)
    return data


# --------------------------------------------------------------------------- batches


def _flat_columns(
    flat: Mapping[str, Any], record_ids: Sequence[int] | None, excluded: set[str]
) -> list[tuple[str, str, Any]]:
    """Lists ``(field, level, values)`` for every field of a flat batch.

    ``level`` is ``"node"`` (values ``(N, ...)``), ``"graph"`` (``(B, ...)``) or
    ``"list"`` (a Python list of ``B`` strings). Fields no molecule carries are
    left out; a field only some molecules carry raises a clear error, because
    a ``Batch`` cannot hold it (PyG's own collate fails or drops it depending on
    which molecule comes first). Fields whose attribute is in ``excluded`` are
    skipped before any check.
    """
    masks: Mapping[str, Any] = flat.get("mask") or {}
    n_molecules = len(flat["n_atoms"])
    columns: list[tuple[str, str, Any]] = []

    def present(field: str, values: Any) -> bool:
        if attribute_name(field) in excluded:
            return False
        mask = masks.get(field)
        if isinstance(values, list):
            # A stored None value is as good as a missing one: no tensor to make.
            carried = np.array([value is not None for value in values], dtype=bool)
            mask = carried if mask is None else carried & np.asarray(mask, dtype=bool)
        if mask is None:
            return True
        mask = np.asarray(mask, dtype=bool)
        if mask.all():
            return True
        if not mask.any():
            return False
        missing = np.flatnonzero(~mask)
        if record_ids is not None:
            missing = [int(record_ids[i]) for i in missing]
        shown = ", ".join(str(int(i)) for i in missing[:10])
        more = "" if len(missing) <= 10 else f" and {len(missing) - 10} more"
        raise BatchAssemblyError(
            f"field {field!r} (attribute {attribute_name(field)!r}) is missing from "
            f"record(s) {shown}{more} but present in others of the same batch, so it "
            f"cannot be batched; drop it with fields=... or exclude_keys=[...]"
        )

    for name in BUILTIN_FIELDS:
        if name in _ALWAYS_READ or name not in flat:
            continue
        values = flat[name]
        if not present(name, values):
            continue
        if name == "name":
            columns.append((name, "list", list(values)))
        elif name == "energy":
            # Records give the energy as a Python float; widen a float32
            # column the same way so both paths agree.
            columns.append((name, "graph", np.asarray(values, dtype=np.float64)))
        else:
            columns.append((name, "node" if name in _NODE_BUILTINS else "graph", values))

    customs: list[tuple[str, str, Any]] = []
    for scope, prefix, level in (
        ("atom_properties", _ATOM_PROPERTIES, "node"),
        ("properties", _PROPERTIES, "graph"),
    ):
        for key, values in (flat.get(scope) or {}).items():
            field = prefix + key
            if not present(field, values):
                continue
            customs.append((field, level, values))
    customs.sort(key=lambda item: item[0])
    for field, level, values in customs:
        if isinstance(values, list):
            level, values = _stack_list(field, values, n_molecules, record_ids)
        columns.append((field, level, values))
    return columns


def _stack_list(
    field: str, values: list, n_molecules: int, record_ids: Sequence[int] | None
) -> tuple[str, Any]:
    """Turns a per-molecule list (strings or ragged values) into a batchable column."""
    if all(isinstance(value, str) for value in values):
        return "list", list(values)
    arrays = []
    for value in values:
        scalar = _scalar_array(value)
        arrays.append(scalar if scalar is not None else np.asarray(value)[None])
    shapes = {array.shape for array in arrays}
    if len(shapes) != 1 or any(array.dtype != arrays[0].dtype for array in arrays):
        ids = list(record_ids) if record_ids is not None else list(range(n_molecules))
        detail = ", ".join(
            f"record {ids[i]}: {tuple(a.shape[1:])} {a.dtype}" for i, a in enumerate(arrays[:6])
        )
        raise BatchAssemblyError(
            f"property {field!r} (attribute {attribute_name(field)!r}) has different shapes "
            f"or dtypes across the batch ({detail}), so it cannot be concatenated into "
            f"one tensor; drop it with fields=... or exclude_keys=[...]"
        )
    return "graph", np.concatenate(arrays, axis=0)


def _needs_pyg_collate(attributes: Iterable[str]) -> bool:
    """Whether PyG gives one of these attribute names special batching rules.

    ``Data.__cat_dim__``/``__inc__`` treat names containing ``index`` or
    ``batch`` (and ``face``) specially, and ``ptr``/``num_nodes`` are reserved
    by ``Batch``; such custom keys go through PyG's own collate to stay equal.
    """
    return any(
        "index" in name or "batch" in name or name in ("face", "ptr", "num_nodes")
        for name in attributes
    )


def flat_to_data_list(
    flat: Mapping[str, Any],
    dtype: torch.dtype | None = None,
) -> list[Data]:
    """Splits a flat batch from ``read_batch`` into one ``Data`` per molecule.

    The per-sample counterpart of :func:`flat_to_batch` (it gives the same
    graphs as :func:`record_to_data`); molecules lacking an optional field
    simply lack the attribute.

    Args:
        flat (Mapping[str, Any]): The dict returned by ``Reader.read_batch``.
        dtype (torch.dtype, optional): Cast floating-point fields to this dtype.
            (default: :obj:`None`)

    Returns:
        list[Data]: One graph per molecule, in batch order.
    """
    n_atoms = np.asarray(flat["n_atoms"], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    masks: Mapping[str, Any] = flat.get("mask") or {}
    fields = [(name, flat[name], name in _NODE_BUILTINS) for name in BUILTIN_FIELDS
              if name not in _ALWAYS_READ and name in flat]
    if "energy" in flat:  # a Python float in records: widen float32 columns alike
        fields = [(name, np.asarray(values, np.float64) if name == "energy" else values, atom)
                  for name, values, atom in fields]
    customs = [(_ATOM_PROPERTIES + key, values, True)
               for key, values in (flat.get("atom_properties") or {}).items()]
    customs += [(_PROPERTIES + key, values, False)
                for key, values in (flat.get("properties") or {}).items()]
    fields += sorted(customs, key=lambda item: item[0])

    data_list = []
    for i, count in enumerate(n_atoms):
        start, stop = offsets[i], offsets[i + 1]
        mapping: dict[str, Any] = {
            "z": torch.from_numpy(np.asarray(flat["atomic_numbers"][start:stop], np.int64)),
            "pos": _as_tensor(np.array(flat["positions"][start:stop]), dtype),
            "natoms": torch.tensor([int(count)], dtype=torch.int64),
        }
        for field, values, per_atom in fields:
            mask = masks.get(field)
            if (mask is not None and not mask[i]) or (
                isinstance(values, list) and values[i] is None
            ):
                continue
            if per_atom:
                value = _as_tensor(np.array(values[start:stop]), dtype)
            elif field in _GRAPH_ARRAY_BUILTINS:
                value = _as_tensor(np.array(values[i : i + 1]), dtype)
            else:
                value = _graph_value(values[i], dtype)
            mapping[attribute_name(field)] = value
        data_list.append(_data_from_mapping(mapping))
    return data_list


_DATA_BATCH_CLASS: type | None = None


def _data_batch_class() -> type:
    """PyG's dynamically created ``DataBatch`` class (a ``Batch`` of ``Data``).

    ``Batch(_base_cls=Data)`` goes through a metaclass that inspects the
    signature of ``Data.__init__`` on every call (~0.5 ms); the class it
    creates is always the same, so create it once and instantiate it directly.
    """
    global _DATA_BATCH_CLASS
    if _DATA_BATCH_CLASS is None:
        _DATA_BATCH_CLASS = type(Batch(_base_cls=Data))
    return _DATA_BATCH_CLASS


def flat_to_batch(
    flat: Mapping[str, Any],
    *,
    dtype: torch.dtype | None = None,
    follow_batch: Iterable[str] | None = None,
    exclude_keys: Iterable[str] | None = None,
    record_ids: Sequence[int] | None = None,
) -> Batch:
    """Assembles a :class:`~torch_geometric.data.Batch` from a flat ``read_batch`` dict.

    The result equals ``Batch.from_data_list([record_to_data(r) for r in ...])``
    attribute by attribute (values, dtypes, ``batch``, ``ptr``, the
    ``*_batch``/``*_ptr`` vectors of ``follow_batch``), and carries the
    ``_slice_dict``/``_inc_dict`` that ``get_example``/``to_data_list`` need —
    but it is built from a handful of array operations instead of one ``Data``
    per molecule.

    Args:
        flat (Mapping[str, Any]): The dict returned by ``Reader.read_batch``
            (``n_atoms``, ``positions``, ``atomic_numbers``, optional builtins,
            ``properties``, ``atom_properties`` and ``mask``).
        dtype (torch.dtype, optional): Cast floating-point fields to this dtype;
            :obj:`None` keeps the stored dtypes. (default: :obj:`None`)
        follow_batch (Iterable[str], optional): Attributes that get their own
            ``<attr>_batch``/``<attr>_ptr`` vectors. (default: :obj:`None`)
        exclude_keys (Iterable[str], optional): Attributes to leave out.
            (default: :obj:`None`)
        record_ids (Sequence[int], optional): The record index of each molecule,
            only used to name records in error messages. (default: :obj:`None`)

    Returns:
        Batch: The mini-batch.

    Raises:
        BatchAssemblyError: If a field is carried by only some molecules of the
            batch, or a property's shape differs between molecules.
    """
    follow_batch = set(follow_batch or ())
    exclude_keys = set(exclude_keys or ())
    n_atoms_np = np.array(flat["n_atoms"], dtype=np.int64)  # owned: shared by natoms
    n_molecules = len(n_atoms_np)
    if n_molecules == 0:
        raise BatchAssemblyError("cannot assemble a Batch from zero molecules")

    columns = _flat_columns(flat, record_ids, exclude_keys)
    attributes = ["z", "pos", "natoms"] + [attribute_name(field) for field, _, _ in columns]
    if _needs_pyg_collate(attributes):
        return Batch.from_data_list(
            flat_to_data_list(flat, dtype), follow_batch=list(follow_batch),
            exclude_keys=list(exclude_keys),
        )

    n_atoms = torch.from_numpy(n_atoms_np)
    node_slices = torch.zeros(n_molecules + 1, dtype=torch.int64)
    node_slices[1:] = torch.cumsum(n_atoms, 0)
    graph_slices = torch.arange(n_molecules + 1)
    no_increment = torch.zeros(n_molecules, dtype=torch.int64)

    values: list[tuple[str, Any, torch.Tensor, bool]] = [
        ("z", torch.from_numpy(np.asarray(flat["atomic_numbers"]).astype(np.int64)),
         node_slices, True),
        ("pos", _as_tensor(np.asarray(flat["positions"]), dtype), node_slices, True),
        ("natoms", n_atoms.clone(), graph_slices, True),
    ]
    for field, level, column in columns:
        attr = attribute_name(field)
        if level == "list":
            values.append((attr, column, graph_slices, False))
        elif level == "node":
            values.append((attr, _as_tensor(np.asarray(column), dtype), node_slices, True))
        else:
            values.append((attr, _as_tensor(np.asarray(column), dtype), graph_slices, True))

    mapping: dict[str, Any] = {}
    slice_dict: dict[str, Any] = {}
    inc_dict: dict[str, Any] = {}
    for attr, value, slices, is_tensor in values:
        if attr in exclude_keys:
            continue
        mapping[attr] = value
        slice_dict[attr] = slices
        inc_dict[attr] = no_increment if is_tensor else None
        if attr in follow_batch:
            counts = slices[1:] - slices[:-1]
            mapping[f"{attr}_batch"] = torch.repeat_interleave(
                torch.arange(n_molecules), counts)
            mapping[f"{attr}_ptr"] = slices.clone()
    mapping["batch"] = torch.repeat_interleave(torch.arange(n_molecules), n_atoms)
    mapping["ptr"] = node_slices.clone()

    batch = type.__call__(_data_batch_class())
    batch._store._mapping.update(mapping)
    batch._num_graphs = n_molecules
    batch._slice_dict = slice_dict
    batch._inc_dict = inc_dict
    return batch
