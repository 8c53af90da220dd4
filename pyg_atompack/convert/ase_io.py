"""ASE-readable files (extxyz, traj, ...) and ASE databases, in and out.

Values come from three places in an ``ase.Atoms``: ``atoms.info`` (per
structure), ``atoms.arrays`` (per atom) and an attached calculator's
``results``. A key named in the options is looked up in ``info``/``arrays``
first and in the calculator second, and must exist. Without one, energy,
forces, stress and charges come from the calculator (which is where ASE's
extxyz reader puts the standard ``energy``/``forces``/``stress`` columns) and
then from ``info``/``arrays`` under their plain names. Everything else becomes
a custom property; a calculator result whose key ``info``/``arrays`` also
hold is kept as ``calc_<key>``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .base import StructureReader, StructureWriter
from .errors import ConvertError
from .options import ReadOptions, WriteOptions
from .structure import Structure, as_stress_matrix, normalise_property

# arrays that are the structure itself, not custom properties
_STRUCTURAL_ARRAYS = {"numbers", "positions", "momenta"}
_DEFAULT_KEYS = {"energy": "energy", "forces": "forces", "stress": "stress", "charges": "charges"}


def ase_extensions() -> set[str]:
    """File suffixes (with the dot, lower case) that ASE can read."""
    from ase.io.formats import extension2format, ioformats

    suffixes = {f".{ext}" for ext in extension2format}
    for fmt in ioformats.values():
        suffixes.update(f".{ext}" for ext in fmt.extensions)
    suffixes.update({".extxyz", ".db"})
    # formats this package reads itself
    return suffixes - {".atp", ".pt", ".zip", ".npy", ".bin"}


class AseReader(StructureReader):
    """Streams structures from any ASE-readable file or an ASE database.

    Args:
        path (str | os.PathLike): The file (``.xyz``, ``.extxyz``, ``.traj``, ``.db``, ...).
        options (ReadOptions, optional): Key mapping and units. (default: :obj:`None`)
        format (str, optional): ASE format name, when the suffix does not tell.
            (default: :obj:`None`)
    """

    format_name = "ase"

    def __init__(
        self,
        path: str | os.PathLike,
        options: ReadOptions | None = None,
        format: str | None = None,
    ) -> None:
        super().__init__(path, options)
        if not self.path.is_file():
            raise self.error("no such file")
        self.ase_format = format
        self._length: int | None = None
        if self._is_database():
            import ase.db

            with ase.db.connect(str(self.path)) as db:
                self._length = db.count()

    def _is_database(self) -> bool:
        return self.ase_format == "db" or (
            self.ase_format is None and self.path.suffix.lower() == ".db"
        )

    @property
    def length(self) -> int | None:
        return self._length

    def _iter_atoms(self) -> Iterator[Any]:
        if self._is_database():
            import ase.db

            with ase.db.connect(str(self.path)) as db:
                for row in db.select():
                    atoms = row.toatoms()
                    atoms.info.update(row.key_value_pairs)
                    atoms.info.update(row.data)
                    yield atoms
            return
        import ase.io

        try:
            yield from ase.io.iread(str(self.path), index=":", format=self.ase_format)
        except ConvertError:
            raise
        except Exception as exc:  # ASE raises many kinds for unparsable files
            raise self.error(f"ASE cannot read it: {exc}") from exc

    def _iter_raw(self) -> Iterator[Structure]:
        for index, atoms in enumerate(self._iter_atoms()):
            yield self.structure_from_atoms(atoms, index)

    def structure_from_atoms(self, atoms: Any, index: int = 0) -> Structure:
        """Turn one ``ase.Atoms`` into a :class:`Structure` (key mapping applied).

        Args:
            atoms (Any): The ASE atoms object.
            index (int, optional): Its position in the source, for error messages.
                (default: :obj:`0`)

        Returns:
            The structure, in the source's units.
        """
        info = dict(atoms.info)
        arrays = {k: v for k, v in atoms.arrays.items() if k not in _STRUCTURAL_ARRAYS}
        results = dict(atoms.calc.results) if atoms.calc is not None else {}
        n_atoms = len(atoms)

        builtins: dict[str, Any] = {}
        pinned = self.options.explicit_builtin_keys()
        for builtin, key in pinned.items():
            found = False
            for store in (info, arrays, results):
                if key in store:
                    builtins[builtin] = store.pop(key)
                    found = True
                    break
            if not found:
                raise self.error(f"key {key!r} (for {builtin}) is not present", index)
        for builtin, key in _DEFAULT_KEYS.items():
            if builtin in pinned:
                continue
            for store in (results, info, arrays):
                if key in store:
                    builtins[builtin] = store.pop(key)
                    break

        cell = None
        pbc = None
        if atoms.cell.rank > 0 or atoms.pbc.any():
            cell = np.array(atoms.cell.array, dtype=np.float64)
            pbc = np.array(atoms.pbc, dtype=bool)
        velocities = atoms.get_velocities() if "momenta" in atoms.arrays else None

        properties: dict[str, Any] = {}
        atom_properties: dict[str, np.ndarray] = {}
        renames = self.options.custom_renames()
        try:
            for key, value in info.items():
                properties[renames.get(key, key)] = normalise_property(value)
            for key, value in arrays.items():
                atom_properties[renames.get(key, key)] = np.ascontiguousarray(value)
            # calculator results beyond the builtins (free_energy, magmoms, ...)
            for key, value in results.items():
                target = renames.get(key, key)
                value = normalise_property(value)
                if target in properties or target in atom_properties:
                    # info/arrays hold the same key: keep both, never drop one
                    target = f"calc_{target}"
                if _is_per_atom_result(key, value, n_atoms):
                    atom_properties[target] = value
                else:
                    properties[target] = value
        except TypeError as exc:
            raise self.error(f"property {key!r}: {exc}", index) from exc

        try:
            return Structure(
                positions=np.ascontiguousarray(atoms.positions),
                atomic_numbers=np.asarray(atoms.numbers),
                energy=_as_energy(builtins.get("energy")),
                forces=_as_per_atom(builtins.get("forces"), n_atoms, (3,), "forces"),
                charges=_as_per_atom(builtins.get("charges"), n_atoms, (), "charges"),
                velocities=velocities,
                cell=cell,
                stress=None if "stress" not in builtins else as_stress_matrix(builtins["stress"]),
                pbc=pbc,
                name=None if builtins.get("name") is None else str(builtins["name"]),
                properties=properties,
                atom_properties=atom_properties,
            )
        except (TypeError, ValueError) as exc:
            raise self.error(str(exc), index) from exc


def _is_per_atom_result(key: str, value: Any, n_atoms: int) -> bool:
    """Whether a calculator result is per atom (ASE's output table decides when it knows)."""
    from ase.outputs import all_outputs

    known = all_outputs.get(key)
    if known is not None:
        return getattr(known, "shapespec", ())[:1] == ("natoms",)
    return isinstance(value, np.ndarray) and value.ndim >= 1 and len(value) == n_atoms


def _as_energy(value: Any) -> float | None:
    if value is None:
        return None
    array = np.asarray(value, dtype=np.float64)
    if array.size != 1:
        raise ValueError(f"energy must be one number, got shape {array.shape}")
    return float(array.reshape(()))


def _as_per_atom(value: Any, n_atoms: int, tail: tuple[int, ...], what: str) -> np.ndarray | None:
    if value is None:
        return None
    array = np.asarray(value)
    if array.shape != (n_atoms, *tail):
        raise ValueError(f"{what} must have shape {(n_atoms, *tail)}, got {array.shape}")
    return array


def structure_to_atoms(structure: Structure) -> Any:
    """Build an ``ase.Atoms`` (with a single-point calculator) from a structure.

    Args:
        structure (Structure): The structure.

    Returns:
        ``ase.Atoms`` with energy, forces and stress on a
        ``SinglePointCalculator``, custom values in ``info``/``arrays``.
    """
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = Atoms(
        numbers=np.asarray(structure.atomic_numbers, dtype=np.int64),
        positions=np.asarray(structure.positions, dtype=np.float64),
        cell=structure.cell,
        pbc=structure.pbc if structure.pbc is not None else False,
    )
    if structure.velocities is not None:
        atoms.set_velocities(structure.velocities)
    for key, value in structure.properties.items():
        atoms.info[key] = value
    for key, value in structure.atom_properties.items():
        atoms.arrays[key] = np.asarray(value)
    if structure.name is not None:
        atoms.info.setdefault("name", structure.name)
    results: dict[str, Any] = {}
    if structure.energy is not None:
        results["energy"] = structure.energy
    if structure.forces is not None:
        results["forces"] = np.asarray(structure.forces, dtype=np.float64)
    if structure.stress is not None:
        results["stress"] = np.asarray(structure.stress, dtype=np.float64)
    if structure.charges is not None:
        results["charges"] = np.asarray(structure.charges, dtype=np.float64)
    if results:
        atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms


class ExtxyzWriter(StructureWriter):
    """Writes structures to one extended-XYZ file.

    Args:
        path (str | os.PathLike): The ``.xyz``/``.extxyz`` destination.
        options (WriteOptions, optional): Only ``overwrite`` applies. (default: :obj:`None`)
    """

    format_name = "extxyz"

    def __init__(self, path: str | os.PathLike, options: WriteOptions | None = None) -> None:
        super().__init__(path, options)
        self._handle = open(self.tmp_path, "w", encoding="utf-8")  # noqa: SIM115

    def _add(self, structure: Structure) -> None:
        from ase.io.extxyz import write_xyz

        write_xyz(self._handle, [structure_to_atoms(structure)])

    def _finish(self) -> None:
        self._handle.close()

    def _discard(self) -> None:
        self._handle.close()


def is_ase_path(path: Path) -> bool:
    """Whether ``path`` is a file whose suffix ASE reads."""
    return path.suffix.lower() in ase_extensions()
