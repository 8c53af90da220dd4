"""The record object returned by ``reader[i]``."""

from __future__ import annotations

from typing import Any

import numpy as np


class Molecule:
    """One decoded molecule, holding exactly what the file stores.

    Arrays keep their stored dtype (float32 stays float32). Fields a record does not
    carry are None; ``properties`` / ``atom_properties`` hold the custom sections.
    Arrays read through an mmap reader are read-only zero-copy views; the pread
    path gives writable arrays.

    Attributes:
        positions: ``(n, 3)`` float32 or float64.
        atomic_numbers: ``(n,)`` uint8.
        energy: float or None.
        forces: ``(n, 3)`` or None.
        charges: ``(n,)`` or None.
        velocities: ``(n, 3)`` or None.
        cell: ``(3, 3)`` (rows are lattice vectors) or None.
        stress: ``(3, 3)`` or None.
        pbc: tuple of three bools or None.
        name: str or None.
        properties: per-molecule custom values (float, int, str, None or ndarray).
        atom_properties: per-atom custom arrays with first dimension n.
    """

    # class-level defaults: a decoded record only sets the fields it carries
    positions: np.ndarray
    atomic_numbers: np.ndarray
    energy: float | None = None
    forces: np.ndarray | None = None
    charges: np.ndarray | None = None
    velocities: np.ndarray | None = None
    cell: np.ndarray | None = None
    stress: np.ndarray | None = None
    pbc: tuple[bool, bool, bool] | None = None
    name: str | None = None
    properties: dict[str, Any]
    atom_properties: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes the instance lacks: a record without custom
        # sections gets its empty dicts on first use instead of on every decode
        if name in ("properties", "atom_properties"):
            value = self.__dict__[name] = {}
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def n_atoms(self) -> int:
        """Number of atoms."""
        return len(self.atomic_numbers)

    def __len__(self) -> int:
        return len(self.atomic_numbers)

    def __repr__(self) -> str:
        present = [k for k in ("energy", "forces", "charges", "velocities", "cell", "stress",
                               "pbc", "name") if getattr(self, k) is not None]
        extra = ""
        if self.properties:
            extra += f", properties={sorted(self.properties)}"
        if self.atom_properties:
            extra += f", atom_properties={sorted(self.atom_properties)}"
        return (f"Molecule(n_atoms={self.n_atoms}, positions={self.positions.dtype}, "
                f"fields={present}{extra})")
