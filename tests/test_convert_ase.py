"""ASE sources: extxyz (info/arrays/calculator values), ASE databases, key mapping, units."""

from __future__ import annotations

import ase.db
import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator

from pyg_atompack.convert import (
    ConvertError,
    ReadOptions,
    UnitConversion,
    convert,
    open_reader,
)
from pyg_atompack.convert.ase_io import structure_to_atoms


def make_frames(count: int = 4, seed: int = 0, voigt: bool = True) -> list[Atoms]:
    """Periodic frames with calculator energy/forces/stress and custom info/arrays."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        n = 2 + i
        atoms = Atoms(
            numbers=rng.integers(1, 30, n),
            positions=rng.normal(size=(n, 3)) * 2,
            cell=np.diag([5.0, 6.0, 7.0]) + rng.normal(size=(3, 3)) * 0.1,
            pbc=[True, True, i % 2 == 0],
        )
        stress = rng.normal(size=6) if voigt else _sym(rng.normal(size=(3, 3)))
        atoms.calc = SinglePointCalculator(
            atoms, energy=float(rng.normal()), forces=rng.normal(size=(n, 3)), stress=stress
        )
        atoms.info["REF_energy"] = float(rng.normal())
        atoms.info["step"] = i
        atoms.info["label"] = f"frame-{i}"
        atoms.info["dipole"] = rng.normal(size=3)
        atoms.arrays["REF_forces"] = rng.normal(size=(n, 3))
        atoms.arrays["spin"] = rng.normal(size=n)
        frames.append(atoms)
    return frames


def _sym(matrix: np.ndarray) -> np.ndarray:
    return (matrix + matrix.T) / 2


@pytest.fixture()
def extxyz(tmp_path):
    frames = make_frames()
    path = tmp_path / "frames.extxyz"
    ase.io.write(path, frames)
    return path, list(ase.io.iread(path, index=":"))


def test_extxyz_values_from_calculator_info_and_arrays(extxyz):
    path, frames = extxyz
    structures = list(open_reader(path))
    assert len(structures) == len(frames)
    for structure, atoms in zip(structures, frames):
        np.testing.assert_array_equal(structure.positions, atoms.positions)
        np.testing.assert_array_equal(structure.atomic_numbers, atoms.numbers)
        np.testing.assert_array_equal(structure.cell, atoms.cell.array)
        np.testing.assert_array_equal(structure.pbc, atoms.pbc)
        assert structure.energy == atoms.get_potential_energy()
        np.testing.assert_array_equal(structure.forces, atoms.get_forces())
        # Voigt expanded in ASE order xx, yy, zz, yz, xz, xy
        np.testing.assert_array_equal(structure.stress, atoms.get_stress(voigt=False))
        assert structure.properties["REF_energy"] == atoms.info["REF_energy"]
        assert structure.properties["step"] == atoms.info["step"]
        assert structure.properties["label"] == atoms.info["label"]
        # ASE's extxyz reader moves a "dipole" column onto the calculator
        np.testing.assert_array_equal(structure.properties["dipole"], atoms.calc.results["dipole"])
        np.testing.assert_array_equal(structure.atom_properties["spin"], atoms.arrays["spin"])
        np.testing.assert_array_equal(
            structure.atom_properties["REF_forces"], atoms.arrays["REF_forces"]
        )


def test_voigt_expansion_order():
    from pyg_atompack.convert import voigt_to_matrix

    got = voigt_to_matrix(np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    np.testing.assert_array_equal(got, [[1, 6, 5], [6, 2, 4], [5, 4, 3]])


def test_explicit_keys_take_info_and_arrays(extxyz):
    path, frames = extxyz
    options = ReadOptions(energy_key="REF_energy", forces_key="REF_forces",
                          key_map={"spin": "charges", "label": "name", "step": "md_step"})
    for structure, atoms in zip(open_reader(path, options=options), frames):
        assert structure.energy == atoms.info["REF_energy"]
        np.testing.assert_array_equal(structure.forces, atoms.arrays["REF_forces"])
        np.testing.assert_array_equal(structure.charges, atoms.arrays["spin"])
        assert structure.name == atoms.info["label"]
        assert structure.properties["md_step"] == atoms.info["step"]
        assert "REF_energy" not in structure.properties
        assert "spin" not in structure.atom_properties


def test_missing_explicit_key_names_file_and_structure(extxyz):
    path, _ = extxyz
    with pytest.raises(ConvertError, match=r"frames\.extxyz \(structure 0\).*'nope'"):
        list(open_reader(path, options=ReadOptions(energy_key="nope")))


def test_units_kcal_per_mol_and_bohr(extxyz):
    path, frames = extxyz
    units = UnitConversion("kcal/mol", "Bohr")
    options = ReadOptions(units=units)
    kcal = 4184.0 / (6.02214076e23 * 1.602176634e-19)
    assert units.energy_factor == pytest.approx(0.0433641042418, rel=1e-12)
    assert units.energy_factor == kcal
    bohr = 0.529177210903
    for structure, atoms in zip(open_reader(path, options=options), frames):
        np.testing.assert_allclose(structure.positions, atoms.positions * bohr, rtol=1e-15)
        np.testing.assert_allclose(structure.cell, atoms.cell.array * bohr, rtol=1e-15)
        assert structure.energy == pytest.approx(atoms.get_potential_energy() * kcal, rel=1e-15)
        np.testing.assert_allclose(structure.forces, atoms.get_forces() * kcal / bohr, rtol=1e-14)
        np.testing.assert_allclose(
            structure.stress, atoms.get_stress(voigt=False) * kcal / bohr**3, rtol=1e-14
        )


def test_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="unknown energy unit 'furlong'"):
        UnitConversion("furlong")


def test_full_stress_and_molecule_without_cell(tmp_path):
    frames = make_frames(2, voigt=False)
    molecule = Atoms("H2O", positions=[[0, 0, 0], [0, 0, 1], [0, 1, 0]])
    molecule.calc = SinglePointCalculator(molecule, energy=-3.0)
    path = tmp_path / "mixed.xyz"
    ase.io.write(path, [*frames, molecule])
    structures = list(open_reader(path))
    np.testing.assert_allclose(structures[0].stress, frames[0].get_stress(voigt=False))
    assert structures[2].cell is None and structures[2].pbc is None
    assert structures[2].energy == -3.0 and structures[2].forces is None


def test_ase_database_with_key_value_pairs_and_data(tmp_path):
    frames = make_frames(3)
    path = tmp_path / "frames.db"
    with ase.db.connect(path) as db:
        for i, atoms in enumerate(frames):
            db.write(atoms, key_value_pairs={"temperature": 300.0 + i},
                     data={"weights": np.arange(3.0) + i})
    reader = open_reader(path)
    assert reader.length == 3
    structures = list(reader)
    for i, (structure, atoms) in enumerate(zip(structures, frames)):
        assert structure.energy == atoms.get_potential_energy()
        np.testing.assert_allclose(structure.forces, atoms.get_forces())
        assert structure.properties["temperature"] == 300.0 + i
        np.testing.assert_array_equal(structure.properties["weights"], np.arange(3.0) + i)


def test_extxyz_writer_round_trip(extxyz, tmp_path):
    path, frames = extxyz
    out = tmp_path / "again.xyz"
    assert convert(path, out) == len(frames)
    again = list(ase.io.iread(out, index=":"))
    for atoms, back in zip(frames, again):
        np.testing.assert_allclose(back.positions, atoms.positions)
        assert back.get_potential_energy() == pytest.approx(atoms.get_potential_energy())
        np.testing.assert_allclose(back.get_forces(), atoms.get_forces())
        np.testing.assert_allclose(back.calc.results["dipole"], atoms.calc.results["dipole"])


def test_structure_to_atoms_keeps_labels():
    frames = make_frames(1)
    from pyg_atompack.convert.ase_io import AseReader  # noqa: F401  (module import check)

    structure = next(iter([_read_one(frames[0])]))
    atoms = structure_to_atoms(structure)
    np.testing.assert_allclose(atoms.get_stress(voigt=False), frames[0].get_stress(voigt=False))


def _read_one(atoms: Atoms):
    from pyg_atompack.convert.ase_io import AseReader

    reader = AseReader.__new__(AseReader)
    reader.options = ReadOptions()
    reader.path = "memory"
    return reader.structure_from_atoms(atoms)
