"""metatrain memmap directories: our writer and hand-built numpy files -> Structure / .atp."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pyg_atompack import atp
from pyg_atompack.convert import (
    ConvertError,
    ReadOptions,
    Structure,
    UnitConversion,
    convert,
    open_reader,
    open_writer,
)


def make_structures(count: int = 5, seed: int = 1) -> list[Structure]:
    rng = np.random.default_rng(seed)
    structures = []
    for i in range(count):
        n = 1 + i % 4
        cell = np.diag(rng.uniform(4, 6, 3)).astype(np.float32)
        pbc = np.array([True, True, i % 2 == 0])
        cell[~pbc] = 0.0  # the layout encodes pbc as non-zero rows
        structures.append(Structure(
            positions=rng.normal(size=(n, 3)).astype(np.float32),
            atomic_numbers=rng.integers(1, 90, n).astype(np.int32),
            energy=float(np.float32(rng.normal())),
            forces=rng.normal(size=(n, 3)).astype(np.float32),
            cell=cell,
            stress=rng.normal(size=(3, 3)).astype(np.float32),
            pbc=pbc,
            properties={"dipole": rng.normal(size=3).astype(np.float32),
                        "charge": float(np.float32(i))},
            atom_properties={"spin": rng.normal(size=n).astype(np.float32)},
        ))
    return structures


def write_memmap(path, structures):
    with open_writer(path, "memmap") as writer:
        for structure in structures:
            writer.add(structure)


def hand_built(path, ns=4, seed=2, cell=True, ns_shape=()):
    """A memmap directory written with plain numpy, like metatrain's tutorial."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 5, ns)
    na = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    path.mkdir()
    np.save(path / "ns.npy", np.array(ns).reshape(ns_shape))
    np.save(path / "na.npy", na)
    arrays = {
        "x": rng.normal(size=(na[-1], 3)).astype(np.float32),
        "a": rng.integers(1, 10, na[-1]).astype(np.int32),
        "e": rng.normal(size=(ns, 1)).astype(np.float32),
        "f": rng.normal(size=(na[-1], 3, 1)).astype(np.float32),
        "s": rng.normal(size=(ns, 3, 3, 1)).astype(np.float32),
        "q": rng.normal(size=(na[-1], 1)).astype(np.float32),
    }
    if cell:
        cells = np.stack([np.diag([3.0, 4.0, 0.0 if i % 2 else 5.0]) for i in range(ns)])
        arrays["c"] = cells.astype(np.float32)
    for stem, array in arrays.items():
        array.tofile(path / f"{stem}.bin")
    return na, arrays


def test_writer_round_trip_every_value(tmp_path):
    structures = make_structures()
    write_memmap(tmp_path / "mm", structures)
    sidecar = json.loads((tmp_path / "mm" / "pyg_atompack_memmap.json").read_text())
    assert sidecar["keys"]["forces"] == {"stem": "energy_forces", "per_atom": True, "shape": [3]}
    assert int(np.load(tmp_path / "mm" / "ns.npy")) == len(structures)
    assert np.load(tmp_path / "mm" / "na.npy").dtype == np.int64
    back = list(open_reader(tmp_path / "mm"))
    assert len(back) == len(structures)
    for got, want in zip(back, structures):
        np.testing.assert_array_equal(got.positions, want.positions)
        np.testing.assert_array_equal(got.atomic_numbers, want.atomic_numbers)
        assert got.energy == want.energy
        np.testing.assert_array_equal(got.forces, want.forces)
        np.testing.assert_array_equal(got.stress, want.stress)
        np.testing.assert_array_equal(got.cell, want.cell)
        np.testing.assert_array_equal(got.pbc, want.pbc)
        np.testing.assert_array_equal(got.properties["dipole"], want.properties["dipole"])
        assert got.properties["charge"] == want.properties["charge"]
        np.testing.assert_array_equal(got.atom_properties["spin"], want.atom_properties["spin"])


def test_hand_built_layout_with_explicit_keys_to_atp(tmp_path):
    na, arrays = hand_built(tmp_path / "mm")
    options = ReadOptions(energy_key="e", forces_key="f", stress_key="s",
                          key_map={"q": "charges"})
    count = convert(tmp_path / "mm", tmp_path / "out.atp", read_options=options)
    assert count == 4
    with atp.open(tmp_path / "out.atp") as reader:
        for i in range(4):
            mol = reader[i]
            start, stop = na[i], na[i + 1]
            np.testing.assert_array_equal(mol.positions, arrays["x"][start:stop])
            np.testing.assert_array_equal(mol.atomic_numbers, arrays["a"][start:stop])
            assert mol.energy == pytest.approx(float(arrays["e"][i, 0]), abs=0)
            np.testing.assert_array_equal(mol.forces, arrays["f"][start:stop, :, 0])
            np.testing.assert_array_equal(mol.stress, arrays["s"][i, :, :, 0])
            np.testing.assert_array_equal(mol.charges, arrays["q"][start:stop, 0])
            np.testing.assert_array_equal(mol.cell, arrays["c"][i])
            np.testing.assert_array_equal(mol.pbc, [True, True, i % 2 == 0])


def test_ns_as_one_element_array_and_no_cell(tmp_path):
    hand_built(tmp_path / "mm", cell=False, ns_shape=(1,))
    structures = list(open_reader(tmp_path / "mm", options=ReadOptions(
        energy_key="e", skip_targets=("f", "s", "q"))))
    assert len(structures) == 4
    assert all(s.cell is None and s.pbc is None for s in structures)


def test_units_apply_to_memmap(tmp_path):
    _, arrays = hand_built(tmp_path / "mm")
    options = ReadOptions(energy_key="e", forces_key="f", skip_targets=("s", "q"),
                          units=UnitConversion("Hartree", "Bohr"))
    first = next(iter(open_reader(tmp_path / "mm", options=options)))
    assert first.energy == pytest.approx(float(arrays["e"][0, 0]) * 27.211386245988)
    expected = arrays["x"][: len(first.positions)] * 0.529177210903
    np.testing.assert_allclose(first.positions, expected, rtol=1e-6)


def test_na_disagreeing_with_x_bin_is_an_error(tmp_path):
    hand_built(tmp_path / "mm")
    with open(tmp_path / "mm" / "x.bin", "ab") as handle:
        handle.write(b"\0" * 12)
    with pytest.raises(ConvertError, match=r"x\.bin: holds \d+ bytes but na\.npy"):
        open_reader(tmp_path / "mm")


def test_missing_key_file_is_an_error(tmp_path):
    hand_built(tmp_path / "mm")
    with pytest.raises(ConvertError, match=r"nope\.bin: key 'nope' is not present"):
        open_reader(tmp_path / "mm", options=ReadOptions(energy_key="nope"))


def test_ambiguous_custom_key_asks_for_rows(tmp_path):
    hand_built(tmp_path / "mm")
    # 4 structures × 6 == total atoms × 2 is possible for some counts; build one that is
    ns, na_total = 4, int(np.load(tmp_path / "mm" / "na.npy")[-1])
    np.zeros(ns * na_total, dtype=np.float32).tofile(tmp_path / "mm" / "amb.bin")
    with pytest.raises(ConvertError, match="amb@atom or amb@structure"):
        open_reader(tmp_path / "mm", options=ReadOptions(key_map={"amb": "amb"}))
    reader = open_reader(tmp_path / "mm", options=ReadOptions(
        key_map={"amb@atom": "amb"}, skip_targets=("e", "f", "s", "q")))
    first = next(iter(reader))
    assert first.atom_properties["amb"].shape == (first.n_atoms, ns)


def test_writer_refuses_inconsistent_fields_and_leaves_nothing(tmp_path):
    structures = make_structures(3)
    structures[2].energy = None
    with pytest.raises(ConvertError, match=r"structure 2\).*lacks energy"):
        write_memmap(tmp_path / "mm", structures)
    assert list(tmp_path.iterdir()) == []


def test_memmap_to_atp_imports_neither_torch_nor_pyg(tmp_path):
    """The numpy-only path: the command line converts a metatrain directory without
    loading torch or torch_geometric (metatrain's readers break after the latter)."""
    hand_built(tmp_path / "mm", ns=3)
    code = textwrap.dedent("""
        import sys
        from pyg_atompack.cli import main
        code = main(["convert", "mm", "mm.atp", "-q", "--energy-key", "e", "--forces-key", "f",
                     "--stress-key", "s", "--key-map", "q=charges"])
        loaded = sorted(m for m in sys.modules
                        if m.split(".")[0] in ("torch", "torch_geometric")
                        or m.startswith("pyg_atompack.data."))
        print(code, loaded)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "0 []", result.stdout
    with atp.open(tmp_path / "mm.atp") as f:
        assert len(f) == 3 and f[0].charges is not None and f[2].stress.shape == (3, 3)
