"""The one record type: what ``reader[i]`` returns and what every converter passes on."""

from __future__ import annotations

from typing import Any

import numpy as np

from .types import BUILTINS, SECTION_BUILTINS

PropertyValue = float | int | str | None | np.ndarray


class Molecule:
    """One atomic structure with its labels, holding exactly what a record stores.

    ``reader[i]`` decodes records into it (arrays keep their stored dtype: float32
    stays float32; read through an mmap reader they are read-only zero-copy views,
    the pread path gives writable arrays), and every converter reads and writes it
    (:class:`pyg_atompack.convert.Structure` is this class). Fields a record does not
    carry are :obj:`None`; ``properties`` / ``atom_properties`` hold the custom values.
    Values follow the `.atp` conventions: positions in Å with rows per atom, cell rows
    are lattice vectors, stress is the full 3×3 tensor in eV/Å³ with ASE's sign.

    Args:
        positions (np.ndarray): Cartesian positions ``(n, 3)``, float32 or float64.
        atomic_numbers (np.ndarray): Atomic numbers ``(n,)`` (uint8 when decoded).
        energy (float, optional): Total energy (eV). (default: :obj:`None`)
        forces (np.ndarray, optional): Forces ``(n, 3)`` (eV/Å). (default: :obj:`None`)
        charges (np.ndarray, optional): Per-atom charges ``(n,)``. (default: :obj:`None`)
        velocities (np.ndarray, optional): Velocities ``(n, 3)``. (default: :obj:`None`)
        cell (np.ndarray, optional): Cell ``(3, 3)``, rows are lattice vectors (Å).
            (default: :obj:`None`)
        stress (np.ndarray, optional): Full stress tensor ``(3, 3)`` (eV/Å³).
            (default: :obj:`None`)
        pbc (tuple[bool, bool, bool], optional): Periodic axes; any three truth values
            (a bool array, a list) are kept as a tuple of three bools, as atompack-db
            gives them. (default: :obj:`None`)
        name (str, optional): A free-form name. (default: :obj:`None`)
        properties (dict[str, PropertyValue], optional): Per-structure custom values
            (float, int, str, None or ndarray). (default: :obj:`None`: empty)
        atom_properties (dict[str, np.ndarray], optional): Per-atom custom arrays with
            first dimension ``n``. (default: :obj:`None`: empty)
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
    properties: dict[str, PropertyValue]
    atom_properties: dict[str, Any]

    def __init__(
        self,
        positions: np.ndarray,
        atomic_numbers: np.ndarray,
        energy: float | None = None,
        forces: np.ndarray | None = None,
        charges: np.ndarray | None = None,
        velocities: np.ndarray | None = None,
        cell: np.ndarray | None = None,
        stress: np.ndarray | None = None,
        pbc: Any = None,
        name: str | None = None,
        properties: dict[str, PropertyValue] | None = None,
        atom_properties: dict[str, np.ndarray] | None = None,
    ) -> None:
        # the decoders fill __dict__ directly (Molecule.__new__): this is for records
        # built in memory, by converters and users; unset builtins stay class defaults
        d = self.__dict__
        d["positions"] = positions
        d["atomic_numbers"] = atomic_numbers
        optional = {"energy": energy, "forces": forces, "charges": charges,
                    "velocities": velocities, "cell": cell, "stress": stress,
                    "pbc": None if pbc is None else as_pbc(pbc), "name": name}
        d.update((key, value) for key, value in optional.items() if value is not None)
        d["properties"] = {} if properties is None else properties
        d["atom_properties"] = {} if atom_properties is None else atom_properties

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "pbc" and value is not None:
            value = as_pbc(value)
        self.__dict__[name] = value

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

    def present_fields(self) -> list[str]:
        """Returns the names of the builtin sections that are set, in record order."""
        return [key for key in SECTION_BUILTINS if getattr(self, key) is not None]

    def copy_with(self, **changes: Any) -> Molecule:
        """Returns a shallow copy with some fields replaced.

        Args:
            **changes (Any): Field name -> new value (:obj:`None` unsets a builtin).
        """
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        for key, value in changes.items():
            if key not in BUILTINS and key not in ("properties", "atom_properties"):
                raise TypeError(f"{type(self).__name__} has no field {key!r}")
            setattr(copy, key, value)
        return copy

    def __repr__(self) -> str:
        extra = ""
        if self.properties:
            extra += f", properties={sorted(self.properties)}"
        if self.atom_properties:
            extra += f", atom_properties={sorted(self.atom_properties)}"
        return (f"{type(self).__name__}(n_atoms={self.n_atoms}, "
                f"positions={np.asarray(self.positions).dtype}, "
                f"fields={self.present_fields()}{extra})")


def as_pbc(value: Any) -> tuple[bool, bool, bool]:
    """Returns periodic axes as a tuple of three bools (the record's form).

    Args:
        value (Any): Three truth values (a tuple, a list, a bool array).

    Raises:
        ValueError: If ``value`` does not hold exactly three values.
    """
    flags = np.asarray(value)
    if flags.shape != (3,):
        raise ValueError(f"pbc must hold three truth values, got shape {flags.shape}")
    first, second, third = (bool(flag) for flag in flags)
    return first, second, third
