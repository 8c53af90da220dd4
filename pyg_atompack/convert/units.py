"""Explicit unit conversion into the `.atp` conventions (eV and Å).

Files in the formats read here store bare numbers; their units live in the
head of whoever wrote them. Nothing is converted unless asked for.

Factors and where they come from (2019 SI, CODATA 2018):

* ``kcal/mol``: 1 kcal/mol = 4184 J/mol (thermochemical calorie, exact) divided
  by the Faraday constant F = N_A·e = 6.02214076e23 mol⁻¹ × 1.602176634e-19 C
  = 96485.33212331001 C/mol (exact), so 1 kcal/mol = 4184 / 96485.33212331001
  eV = 0.043364104241800934 eV.
* ``kJ/mol``: 1000 / 96485.33212331001 eV = 0.010364269656262175 eV.
* ``Hartree``: 27.211386245988 eV (CODATA 2018); ``Ry`` is half of it.
* ``meV``: 1e-3 eV.
* ``Bohr``: 0.529177210903 Å (CODATA 2018); ``nm``: 10 Å.

Forces are scaled by energy/length and stress by energy/length³; positions and
cells by the length factor. Velocities and custom properties are never
converted (their units are not implied by energy and length alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from .structure import Structure

FARADAY_C_PER_MOL = 6.02214076e23 * 1.602176634e-19
HARTREE_EV = 27.211386245988
BOHR_ANGSTROM = 0.529177210903

ENERGY_UNITS_EV = {
    "eV": 1.0,
    "meV": 1e-3,
    "kcal/mol": 4184.0 / FARADAY_C_PER_MOL,
    "kJ/mol": 1000.0 / FARADAY_C_PER_MOL,
    "Hartree": HARTREE_EV,
    "Ry": HARTREE_EV / 2.0,
}
LENGTH_UNITS_ANGSTROM = {
    "Angstrom": 1.0,
    "Bohr": BOHR_ANGSTROM,
    "nm": 10.0,
}
# Accepted spellings -> canonical name (compared case-insensitively).
_ALIASES = {
    "ev": "eV",
    "mev": "meV",
    "kcal/mol": "kcal/mol",
    "kcal_mol": "kcal/mol",
    "kj/mol": "kJ/mol",
    "kj_mol": "kJ/mol",
    "hartree": "Hartree",
    "ha": "Hartree",
    "ry": "Ry",
    "rydberg": "Ry",
    "angstrom": "Angstrom",
    "a": "Angstrom",
    "å": "Angstrom",
    "bohr": "Bohr",
    "nm": "nm",
}


def canonical_unit(name: str, table: dict[str, float], kind: str) -> str:
    """Return the canonical spelling of a unit name.

    Args:
        name (str): A unit as the user typed it (case-insensitive).
        table (dict[str, float]): The unit table it must belong to.
        kind (str): ``"energy"`` or ``"length"``, for the error message.

    Returns:
        The key of ``table`` for this unit.

    Raises:
        ValueError: If the unit is unknown.
    """
    canonical = _ALIASES.get(name.strip().lower())
    if canonical not in table:
        raise ValueError(f"unknown {kind} unit {name!r}; known: {', '.join(table)}")
    return canonical


@dataclass(frozen=True)
class UnitConversion:
    """Scale factors from a source's units into eV and Å.

    Args:
        energy_unit (str, optional): Unit of the source's energies (default: :obj:`"eV"`).
        length_unit (str, optional): Unit of the source's lengths (default: :obj:`"Angstrom"`).
    """

    energy_unit: str = "eV"
    length_unit: str = "Angstrom"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "energy_unit", canonical_unit(self.energy_unit, ENERGY_UNITS_EV, "energy")
        )
        object.__setattr__(
            self, "length_unit", canonical_unit(self.length_unit, LENGTH_UNITS_ANGSTROM, "length")
        )

    @property
    def energy_factor(self) -> float:
        """Multiply a source energy by this to get eV."""
        return ENERGY_UNITS_EV[self.energy_unit]

    @property
    def length_factor(self) -> float:
        """Multiply a source length by this to get Å."""
        return LENGTH_UNITS_ANGSTROM[self.length_unit]

    @property
    def is_identity(self) -> bool:
        """Whether nothing needs converting."""
        return self.energy_factor == 1.0 and self.length_factor == 1.0

    def apply(self, structure: Structure) -> Structure:
        """Return ``structure`` expressed in eV and Å.

        Array dtypes are kept (a float32 force stays float32).

        Args:
            structure (Structure): A structure in the source units.

        Returns:
            A converted copy (or ``structure`` itself when nothing changes).
        """
        if self.is_identity:
            return structure
        energy, length = self.energy_factor, self.length_factor

        def scaled(value, factor):
            if value is None:
                return None
            return (value * factor).astype(value.dtype, copy=False)

        return structure.copy_with(
            positions=scaled(structure.positions, length),
            cell=scaled(structure.cell, length),
            energy=None if structure.energy is None else structure.energy * energy,
            forces=scaled(structure.forces, energy / length),
            stress=scaled(structure.stress, energy / length**3),
        )
