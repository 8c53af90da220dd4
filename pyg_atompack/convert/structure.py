"""A plain in-memory structure record shared by every reader and writer.

Readers yield :class:`Structure` objects, writers consume them; nothing else
crosses the boundary between two formats. Values use the `.atp` conventions
(docs/architecture.md): positions in Å with rows per atom, cell rows are
lattice vectors, stress is the full 3×3 tensor in eV/Å³ with ASE's sign.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

BUILTIN_NAMES = (
    "energy",
    "forces",
    "charges",
    "velocities",
    "cell",
    "stress",
    "pbc",
    "name",
)

PropertyValue = float | int | str | None | np.ndarray


@dataclass
class Structure:
    """One atomic structure with its labels.

    Args:
        positions: Cartesian positions, shape ``(n, 3)``, float32 or float64.
        atomic_numbers: Atomic numbers, shape ``(n,)``.
        energy: Total energy (eV), or ``None``.
        forces: Forces ``(n, 3)`` (eV/Å), or ``None``.
        charges: Per-atom charges ``(n,)``, or ``None``.
        velocities: Velocities ``(n, 3)``, or ``None``.
        cell: Cell ``(3, 3)``, rows are lattice vectors (Å), or ``None``.
        stress: Full stress tensor ``(3, 3)`` (eV/Å³), or ``None``.
        pbc: Periodic axes ``(3,)`` bool, or ``None``.
        name: A free-form name, or ``None``.
        properties: Per-structure custom values.
        atom_properties: Per-atom custom arrays, first dimension ``n``.
    """

    positions: np.ndarray
    atomic_numbers: np.ndarray
    energy: float | None = None
    forces: np.ndarray | None = None
    charges: np.ndarray | None = None
    velocities: np.ndarray | None = None
    cell: np.ndarray | None = None
    stress: np.ndarray | None = None
    pbc: np.ndarray | None = None
    name: str | None = None
    properties: dict[str, PropertyValue] = field(default_factory=dict)
    atom_properties: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n_atoms(self) -> int:
        """Number of atoms."""
        return int(len(self.atomic_numbers))

    def copy_with(self, **changes: Any) -> Structure:
        """Return a shallow copy with some fields replaced."""
        return replace(self, **changes)

    def present_fields(self) -> list[str]:
        """Names of the builtin fields that are set, in a fixed order."""
        return [name for name in BUILTIN_NAMES if getattr(self, name) is not None]


def voigt_to_matrix(voigt: np.ndarray) -> np.ndarray:
    """Expand a Voigt 6-vector into a symmetric 3×3 tensor.

    The order is ASE's: ``xx, yy, zz, yz, xz, xy``.

    Args:
        voigt: Array of shape ``(6,)``.

    Returns:
        The symmetric ``(3, 3)`` tensor, same dtype.
    """
    xx, yy, zz, yz, xz, xy = np.asarray(voigt).reshape(6)
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]], dtype=np.asarray(voigt).dtype)


def as_stress_matrix(value: Any) -> np.ndarray:
    """Turn a stress given as Voigt-6 or 3×3 into a 3×3 tensor.

    Args:
        value: A 6-vector (Voigt, ASE order) or anything with 9 elements.

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
        value: The raw value from a source file.

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
