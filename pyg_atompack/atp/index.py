"""The index block: a u64 count followed by packed 20-byte entries (spec §6)."""

from __future__ import annotations

import operator
import struct
from typing import Any

import numpy as np

from .errors import AtpIndexError, AtpValueError, IndexBlockError

INDEX_DTYPE = np.dtype([("offset", "<u8"), ("stored", "<u4"), ("raw", "<u4"), ("n_atoms", "<u4")])
ENTRY_STRUCT = struct.Struct("<QIII")


def decode_index(buf, num_molecules: int, name: str) -> np.ndarray:
    """View the entries of an index block without copying.

    Args:
        buf (bytes-like): The index block's bytes (any buffer; e.g. a memoryview of an mmap).
        num_molecules (int): The molecule count the header promises.
        name (str): File name for error messages.

    Returns:
        A structured array with fields ``offset``, ``stored``, ``raw``, ``n_atoms``.

    Raises:
        IndexBlockError: The block is short or its count disagrees with the header.
    """
    expected = 8 + ENTRY_STRUCT.size * num_molecules
    if len(buf) < expected:
        raise IndexBlockError(f"{name}: index block is {len(buf)} bytes, expected {expected}")
    (count,) = struct.unpack_from("<Q", buf, 0)
    if count != num_molecules:
        raise IndexBlockError(
            f"{name}: index block counts {count} molecules but the header says {num_molecules}")
    return np.frombuffer(buf, dtype=INDEX_DTYPE, count=num_molecules, offset=8)


def encode_index(entries: np.ndarray) -> bytes:
    """Encode index entries (a structured array of :data:`INDEX_DTYPE`) as an index block."""
    entries = np.ascontiguousarray(entries, dtype=INDEX_DTYPE)
    return struct.pack("<Q", len(entries)) + entries.tobytes()


def empty_index() -> np.ndarray:
    """An index with no entries."""
    return np.zeros(0, dtype=INDEX_DTYPE)


def molecule_index(i: Any, count: int, name: str) -> int:
    """Check one molecule index the way ``reader[i]`` accepts it.

    Integers (Python or numpy, negative counting from the end) are accepted; bools
    are rejected even though Python treats them as integers, matching
    ``read_batch``, which refuses boolean index arrays.

    Args:
        i (Any): The index.
        count (int): Number of molecules.
        name (str): File or dataset name for error messages.

    Returns:
        The index in ``range(count)``.

    Raises:
        AtpValueError: ``i`` is not an integer (or is a bool).
        AtpIndexError: ``i`` is out of range.
    """
    try:
        if isinstance(i, bool):
            raise TypeError
        i = operator.index(i)  # numpy bools already refuse __index__
    except TypeError:
        raise AtpValueError(f"{name}: molecule index must be an integer, "
                            f"got {type(i).__name__}") from None
    if i < 0:
        i += count
    if not 0 <= i < count:
        raise AtpIndexError(f"{name}: molecule index out of range for {count} molecules")
    return i
