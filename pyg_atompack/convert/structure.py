"""The record every reader yields and every writer consumes, and value helpers.

:class:`Structure` is :class:`pyg_atompack.atp.Molecule`: one record type for
the `.atp` layer and the converters, so nothing is copied field by field
between them. Nothing else crosses the boundary between two formats. Values use
the `.atp` conventions (docs/architecture.md): positions in Å with rows per
atom, cell rows are lattice vectors, stress is the full 3×3 tensor in eV/Å³
with ASE's sign, ``pbc`` a tuple of three bools.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pyg_atompack.atp.molecule import Molecule, PropertyValue
from pyg_atompack.atp.types import SECTION_BUILTINS

#: The record type of the converters (the same class as ``atp.Molecule``).
Structure = Molecule
# the optional builtin fields, in record order
BUILTIN_NAMES = SECTION_BUILTINS

__all__ = ["BUILTIN_NAMES", "PropertyValue", "Structure", "as_stress_matrix",
           "normalise_property", "voigt_to_matrix"]


def voigt_to_matrix(voigt: np.ndarray) -> np.ndarray:
    """Expand a Voigt 6-vector into a symmetric 3×3 tensor.

    The order is ASE's: ``xx, yy, zz, yz, xz, xy``.

    Args:
        voigt (np.ndarray): Array of shape ``(6,)``.

    Returns:
        The symmetric ``(3, 3)`` tensor, same dtype.
    """
    xx, yy, zz, yz, xz, xy = np.asarray(voigt).reshape(6)
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]], dtype=np.asarray(voigt).dtype)


def as_stress_matrix(value: Any) -> np.ndarray:
    """Turn a stress given as Voigt-6 or 3×3 into a 3×3 tensor.

    Args:
        value (Any): A 6-vector (Voigt, ASE order) or anything with 9 elements.

    Returns:
        The ``(3, 3)`` stress tensor.

    Raises:
        ValueError: If the value has neither 6 nor 9 elements.
    """
    array = np.asarray(value)
    if array.size == 6:
        return voigt_to_matrix(array)
    if array.size == 9:
        return array.reshape(3, 3)
    raise ValueError(f"stress must have 6 (Voigt) or 9 (3x3) values, got shape {array.shape}")


def normalise_property(value: Any) -> PropertyValue:
    """Bring a custom value into one of the kinds the `.atp` format stores.

    Python and numpy bools become ints, numpy scalars become Python numbers,
    lists and tuples of numbers become arrays.

    Args:
        value (Any): The raw value from a source file.

    Returns:
        A ``float``, ``int``, ``str``, ``None`` or numeric ``np.ndarray``.

    Raises:
        TypeError: If the value has no `.atp` representation.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    array = np.asarray(value)
    if array.dtype == np.bool_:
        array = array.astype(np.int32)
    if array.dtype.kind not in "iuf":
        raise TypeError(f"unsupported value of type {type(value).__name__}")
    if array.ndim == 0:
        return array.item()
    return array
