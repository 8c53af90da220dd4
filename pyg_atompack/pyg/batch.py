"""``flat_to_batch``: a ``Batch`` straight from the concatenated arrays of ``read_batch``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Batch, Data

from .data import _as_tensor, _scalar_array, flat_to_data_list
from .errors import BatchAssemblyError
from .fields import (
    _ALWAYS_READ,
    _ATOM_PROPERTIES,
    _NODE_BUILTINS,
    _PROPERTIES,
    BUILTIN_FIELDS,
    attribute_name,
)

__all__ = ["flat_to_batch"]


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
        # count_nonzero skips the ufunc-reduce machinery of all()/any(): ~5x cheaper
        carried = np.count_nonzero(mask)
        if carried == len(mask):
            return True
        if not carried:
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

    # The bookkeeping vectors are built in numpy and wrapped: torch ops on tiny
    # tensors pay dispatcher (and, for repeat_interleave, thread-pool) overheads of
    # several microseconds each, numpy ones a fraction of that.
    node_slices_np = np.zeros(n_molecules + 1, dtype=np.int64)
    np.cumsum(n_atoms_np, out=node_slices_np[1:])
    node_slices = torch.from_numpy(node_slices_np)
    graph_slices = torch.from_numpy(np.arange(n_molecules + 1, dtype=np.int64))
    no_increment = torch.from_numpy(np.zeros(n_molecules, dtype=np.int64))

    values: list[tuple[str, Any, torch.Tensor, bool]] = [
        ("z", torch.from_numpy(np.asarray(flat["atomic_numbers"]).astype(np.int64)),
         node_slices, True),
        ("pos", _as_tensor(np.asarray(flat["positions"]), dtype), node_slices, True),
        ("natoms", torch.from_numpy(n_atoms_np), graph_slices, True),
    ]
    for field, level, column in columns:
        attr = attribute_name(field)
        if level == "list":
            values.append((attr, column, graph_slices, False))
        elif level == "node":
            values.append((attr, _as_tensor(np.asarray(column), dtype), node_slices, True))
        else:
            values.append((attr, _as_tensor(np.asarray(column), dtype), graph_slices, True))

    molecule_numbers = np.arange(n_molecules, dtype=np.int64)
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
            counts = np.diff(slices.numpy())
            mapping[f"{attr}_batch"] = torch.from_numpy(np.repeat(molecule_numbers, counts))
            mapping[f"{attr}_ptr"] = slices.clone()
    mapping["batch"] = torch.from_numpy(np.repeat(molecule_numbers, n_atoms_np))
    mapping["ptr"] = node_slices.clone()

    batch = type.__call__(_data_batch_class())
    batch._store._mapping.update(mapping)
    batch._num_graphs = n_molecules
    batch._slice_dict = slice_dict
    batch._inc_dict = inc_dict
    return batch
