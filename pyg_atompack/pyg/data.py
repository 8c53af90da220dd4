"""One ``Data`` per molecule: from a record, or split out of a flat ``read_batch`` dict."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.data.storage import GlobalStorage

from .fields import (
    _ALWAYS_READ,
    _ATOM_PROPERTIES,
    _GRAPH_ARRAY_BUILTINS,
    _NODE_BUILTINS,
    _PROPERTIES,
    BUILTIN_FIELDS,
    attribute_name,
)

__all__ = ["data_from_mapping", "flat_to_data_list", "record_to_data"]


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
        record (Any): A molecule as returned by ``reader[i]`` (``positions``,
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
    return data_from_mapping(mapping)


def _instance_state() -> tuple[dict[str, Any], dict[str, Any]]:
    # what Data() puts in an instance and in its store besides the mapping and the
    # parent link, read off a real instance so that state a PyG release adds follows
    proto = Data()
    store = proto._store
    return ({key: value for key, value in proto.__dict__.items() if key != "_store"},
            {key: value for key, value in store.__dict__.items()
             if key not in ("_mapping", "_parent")})


_DATA_STATE, _STORE_STATE = _instance_state()
_new = object.__new__


def data_from_mapping(mapping: dict[str, Any]) -> Data:
    r"""Builds a :class:`~torch_geometric.data.Data` holding ``mapping`` as its attributes.

    The instance is filled the way unpickling restores one (``__setstate__``: the
    instance and store dictionaries set directly), which is what ``torch.load`` hands
    out for a pickled ``Data``. ``Data()`` followed by attribute assignment gives the
    same object for plain values but costs ~10-14 us (the constructors of ``Data``,
    its store and its feature/graph store bases) against ~2 us here: the build cost of
    every lazily decoded sample.

    Args:
        mapping (dict[str, Any]): Attribute name -> value (tensors, strings, numbers).
            Taken over, not copied: the caller must not reuse it.

    Returns:
        torch_geometric.data.Data: The sample.
    """
    data = _new(Data)
    store = _new(GlobalStorage)
    state = store.__dict__
    state.update(_STORE_STATE)
    state["_mapping"] = mapping
    state["_parent"] = weakref.ref(data)
    state = data.__dict__
    state.update(_DATA_STATE)
    state["_store"] = store
    return data


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
        data_list.append(data_from_mapping(mapping))
    return data_list
