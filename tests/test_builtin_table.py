"""The one builtin-field table (atp.types.BUILTINS) and the one record type (atp.Molecule,
which convert.Structure is): what files, read_batch, Data objects and converters hold
agrees with the table, checked against atompack-db's own files."""

from __future__ import annotations

import atompack
import numpy as np
import pytest

from pyg_atompack import atp, convert
from pyg_atompack.atp.types import BUILTINS, SECTION_BUILTINS
from pyg_atompack.pyg import BUILTIN_FIELDS, record_to_data


def _reference_file(path, n_atoms=(3, 5)) -> list[dict]:
    rng = np.random.default_rng(4)
    mols = []
    for j, n in enumerate(n_atoms):
        mols.append(dict(
            positions=rng.normal(size=(n, 3)).astype(np.float32),
            atomic_numbers=rng.integers(1, 90, n).astype(np.uint8),
            energy=float(rng.normal()), forces=rng.normal(size=(n, 3)).astype(np.float32),
            charges=rng.normal(size=n), velocities=rng.normal(size=(n, 3)).astype(np.float32),
            cell=rng.normal(size=(3, 3)), stress=rng.normal(size=(3, 3)),
            pbc=(True, j == 0, False), name=f"m{j}"))
    db = atompack.Database(str(path), compression="none", overwrite=True)
    db.add_molecules([atompack.Molecule.from_arrays(**m) for m in mols])
    db.flush()
    return mols


def test_files_read_batch_and_data_agree_with_the_table(tmp_path):
    mols = _reference_file(tmp_path / "ref.atp")
    with atp.open(tmp_path / "ref.atp") as f:
        for name, info in f.fields.items():
            field = BUILTINS[name]
            assert (info.per_atom, info.shape) == (field.per_atom, field.shape), name
            assert info.tag == field.tag or name in ("positions", "atomic_numbers")
            assert info.dtype in field.dtypes or field.shape is None, name
        assert set(f.fields) == set(BUILTINS)

        mol, n = f[1], len(mols[1]["atomic_numbers"])
        flat = f.read_batch([0, 1])
        total = sum(len(m["atomic_numbers"]) for m in mols)
        for name, field in BUILTINS.items():
            value = getattr(mol, name)
            if field.shape is None:
                assert isinstance(value, str) and flat[name] == ["m0", "m1"]
                continue
            assert np.shape(value) == ((n, *field.shape) if field.per_atom else field.shape)
            lead = total if field.per_atom else 2
            assert flat[name].shape == (lead, *field.shape), name

        data = record_to_data(mol)
        assert set(BUILTIN_FIELDS.values()) <= set(data.keys())
        assert data.pos.shape == (n, 3) and data.cell.shape == (1, 3, 3)
        assert data.pbc.tolist() == [[True, False, False]]


def test_structure_is_the_record_type(tmp_path):
    assert convert.Structure is atp.Molecule
    made = convert.Structure(positions=np.zeros((2, 3)), atomic_numbers=np.array([1, 8]),
                             energy=-1.0, pbc=np.array([1, 0, 1]))
    assert made.pbc == (True, False, True)  # the record's form, as atompack-db gives it
    assert made.present_fields() == ["energy", "pbc"]
    assert made.properties == {} and made.atom_properties == {}
    moved = made.copy_with(energy=None, pbc=[0, 0, 1])
    assert moved.present_fields() == ["pbc"] and moved.pbc == (False, False, True)
    assert made.energy == -1.0  # a copy
    with pytest.raises(TypeError, match="no field 'energies'"):
        made.copy_with(energies=1.0)
    with pytest.raises(ValueError, match="three truth values"):
        made.copy_with(pbc=[True, False])

    # a decoded record is a Structure: writers of other formats take it as it is
    mols = _reference_file(tmp_path / "ref.atp")
    with atp.open(tmp_path / "ref.atp") as f:  # mmap views: used while the file is open
        records = list(f)
        assert [r.pbc for r in records] == [m["pbc"] for m in mols]
        assert records[0].present_fields() == list(SECTION_BUILTINS)
        with convert.open_writer(tmp_path / "out.xyz") as writer:
            for record in records:
                writer.add(record)
    back = list(convert.open_reader(tmp_path / "out.xyz"))
    np.testing.assert_allclose(back[1].forces, mols[1]["forces"], rtol=1e-6)
    assert back[0].pbc == (True, True, False)
