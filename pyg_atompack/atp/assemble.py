"""Put per-field batch values into the ``read_batch`` dict, zero-filling what is missing."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .fields import FieldInfo


@functools.lru_cache(maxsize=64)
def all_present(count: int) -> np.ndarray:
    """The read-only all-true mask of ``count`` records (one per batch size, shared).

    Args:
        count (int): The batch size.

    Returns:
        np.ndarray: ``np.ones(count, bool)``, not writeable.
    """
    mask = np.ones(count, bool)
    mask.flags.writeable = False
    return mask


def store(out: dict, info: FieldInfo, values: Any, mask: np.ndarray) -> None:
    """Put one field's values and presence mask where ``read_batch`` promises them."""
    if info.kind == "builtin":
        out[info.name] = values
    else:
        group = "atom_properties" if info.kind == "atom" else "properties"
        out.setdefault(group, {})[info.key] = values
    out.setdefault("mask", {})[info.name] = mask
    out.setdefault("properties", {})
    out.setdefault("atom_properties", {})


def assemble(out: dict, info: FieldInfo, values: list, present: list,
              n_atoms: np.ndarray) -> None:
    """Combine per-molecule values, zero-filling the missing ones where shapes allow."""
    mask = np.array(present, dtype=bool)
    arrays = [v for v, p in zip(values, present) if p]
    if info.per_atom or info.kind == "atom":
        store(out, info, stack_atoms(info, values, present, arrays, n_atoms), mask)
        return
    if arrays and all(isinstance(v, np.ndarray) for v in arrays):
        shapes = {v.shape for v in arrays}
        dtypes = {v.dtype for v in arrays}
        if len(shapes) == 1 and len(dtypes) == 1:
            result = np.zeros((len(values), *arrays[0].shape), arrays[0].dtype)
            for j, (v, p) in enumerate(zip(values, present)):
                if p:
                    result[j] = v
            store(out, info, result, mask)
            return
        store(out, info, list(values), mask)
        return
    if arrays and all(isinstance(v, tuple) for v in arrays):  # pbc
        result = np.zeros((len(values), 3), bool)
        for j, (v, p) in enumerate(zip(values, present)):
            if p:
                result[j] = v
        store(out, info, result, mask)
        return
    if info.shape == () and info.dtype is not None and \
            all(isinstance(v, (int, float)) for v in arrays):
        result = np.array([v if p else 0 for v, p in zip(values, present)], dtype=info.dtype)
        store(out, info, result, mask)
        return
    if not arrays and info.shape is not None and info.dtype is not None:
        store(out, info, info.zeros(len(values)), mask)
        return
    store(out, info, list(values), mask)


def stack_atoms(info: FieldInfo, values, present, arrays, n_atoms) -> Any:
    """Concatenate per-atom values, zero rows for molecules lacking the field."""
    total = int(n_atoms.sum())
    if arrays and all(isinstance(v, np.ndarray) for v in arrays):
        trailing = {v.shape[1:] for v in arrays}
        dtypes = {v.dtype for v in arrays}
        if len(trailing) == 1 and len(dtypes) == 1:
            result = np.zeros((total, *next(iter(trailing))), next(iter(dtypes)))
            start = 0
            for v, p, n in zip(values, present, n_atoms.tolist()):
                if p:
                    result[start:start + n] = v
                start += n
            return result
        return list(values)
    if not arrays:
        zeros = info.zeros(total)
        return zeros if zeros is not None else np.zeros(total, info.dtype or np.float64)
    return list(values)
