"""Permute the molecules of a ``read_batch`` result.

A batch spanning several shards is read with one ``read_batch`` call per shard
(:meth:`pyg_atompack.atp.ShardedReader.read_batch`)
(so each shard decodes its records in one go, however the indices interleave);
the joined result is in shard order and is put back into the requested order
here, with one vectorised gather per array.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# builtin arrays whose leading axis runs over atoms (N); other arrays run over molecules (B)
from .types import ATOM_AXIS_BUILTINS as _ATOM_KEYS


def _take(value: Any, index: np.ndarray) -> Any:
    if isinstance(value, np.ndarray):
        return value[index]
    return [value[int(i)] for i in index]


def reorder_flat(flat: dict, order: np.ndarray) -> dict:
    """Reorder molecules: molecule ``j`` of the result is molecule ``order[j]`` of ``flat``.

    Arrays of per-atom fields are gathered atom range by atom range; lists
    (strings, ragged values) hold one entry per molecule whatever the field.

    Args:
        flat (dict): A ``read_batch`` result over ``B`` molecules.
        order (np.ndarray): Integer array of length ``B`` (repeats allowed).

    Returns:
        The reordered dict (new arrays).
    """
    order = np.asarray(order, dtype=np.int64)
    n_atoms = np.asarray(flat["n_atoms"], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(n_atoms)[:-1]]).astype(np.int64)
    counts = n_atoms[order]
    first_out = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    # for output atom t of chosen molecule j: source atom = starts[order[j]] + (t - first_out[j])
    atom_index = np.repeat(starts[order] - first_out, counts) + np.arange(int(counts.sum()))

    def per_atom(value: Any) -> Any:
        return value[atom_index] if isinstance(value, np.ndarray) else _take(value, order)

    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key in ("properties", "mask"):
            out[key] = {k: _take(v, order) for k, v in value.items()}
        elif key == "atom_properties":
            out[key] = {k: per_atom(v) for k, v in value.items()}
        elif key in _ATOM_KEYS:
            out[key] = per_atom(value)
        else:
            out[key] = _take(value, order)
    return out
