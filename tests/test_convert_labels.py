"""No silent loss of labels: targets named other than ``energy``, gradients, virials, and
targets that cannot be represented, in zips and memmap directories written by metatrain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ase.io
import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from pyg_atompack import atp
from pyg_atompack.cli import main
from pyg_atompack.convert import ConvertError, ReadOptions, convert, open_reader

# metatrain writes the fixtures in a subprocess: in this process torch_geometric is
# already imported, which breaks metatrain's writers (see docs/guides/converting.md,
# "Using it next to metatrain"). Three structures, target U0 with position and strain gradients (as
# metatrain's own training test names it), a plain target "gap", and in a second zip a
# two-block spherical target "dipole".
_METATRAIN_FIXTURES = """
import sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np
import torch
import metatomic.torch as mta
from metatensor.torch import Labels, TensorBlock, TensorMap
from metatrain.utils.data.writers.diskdataset import DiskDatasetWriter
from metatrain.utils.data.writers.memmap import MemmapWriter

out = Path(sys.argv[1])
rng = np.random.default_rng(11)
writers = {"u0": DiskDatasetWriter(str(out / "u0.zip")),
           "spherical": DiskDatasetWriter(str(out / "spherical.zip")),
           "memmap": MemmapWriter(out / "memmap")}
expected = {}
sample0 = Labels(["system"], torch.tensor([[0]], dtype=torch.int32))
for i in range(3):
    n = 3 + i
    positions = torch.tensor(rng.normal(size=(n, 3)) * 1.5)
    cell = torch.diag(torch.tensor([5.0, 6.0, 7.0 + i], dtype=torch.float64))
    types = torch.tensor(rng.integers(1, 9, n), dtype=torch.int32)
    system = mta.System(positions=positions, types=types, cell=cell,
                        pbc=torch.tensor([True] * 3))
    energy, gap = float(rng.normal()), float(rng.normal())
    forces = torch.tensor(rng.normal(size=(n, 3)))
    stress = torch.tensor(rng.normal(size=(3, 3)))
    block = TensorBlock(values=torch.tensor([[energy]], dtype=torch.float64),
                        samples=sample0, components=[], properties=Labels.range("energy", 1))
    block.add_gradient("positions", TensorBlock(
        values=(-forces)[:, :, None],
        samples=Labels(["sample", "atom"],
                       torch.tensor([[0, j] for j in range(n)], dtype=torch.int32)),
        components=[Labels.range("xyz", 3)], properties=Labels.range("energy", 1)))
    block.add_gradient("strain", TensorBlock(
        values=(stress * torch.det(cell))[None, :, :, None], samples=Labels.range("sample", 1),
        components=[Labels.range("xyz_1", 3), Labels.range("xyz_2", 3)],
        properties=Labels.range("energy", 1)))
    u0 = TensorMap(Labels.single(), [block])
    gap_map = TensorMap(Labels.single(), [TensorBlock(
        values=torch.tensor([[gap]], dtype=torch.float64), samples=sample0, components=[],
        properties=Labels.range("gap", 1))])
    dipole = TensorMap(
        Labels(["o3_lambda", "o3_sigma"], torch.tensor([[0, 1], [1, 1]], dtype=torch.int32)),
        [TensorBlock(values=torch.tensor(rng.normal(size=(1, 2 * lam + 1, 1))),
                     samples=sample0, components=[Labels.range("o3_mu", 2 * lam + 1)],
                     properties=Labels.range("n", 1)) for lam in (0, 1)])
    writers["u0"].write([system], {"U0": u0, "gap": gap_map})
    writers["spherical"].write([system], {"U0": u0, "dipole": dipole})
    writers["memmap"].write([system], {"U0": u0})
    for name, value in (("positions", positions), ("types", types), ("cell", cell),
                        ("energy", torch.tensor(energy, dtype=torch.float64)),
                        ("gap", torch.tensor(gap, dtype=torch.float64)),
                        ("forces", forces), ("stress", stress)):
        expected[f"{i}_{name}"] = value.numpy()
for writer in writers.values():
    writer.finish()
np.savez(out / "expected.npz", **expected)
"""


@pytest.fixture(scope="module")
def metatrain_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("metatrain")
    script = out / "write.py"
    script.write_text(_METATRAIN_FIXTURES)
    subprocess.run([sys.executable, str(script), str(out)], check=True, timeout=300)
    return out, dict(np.load(out / "expected.npz"))


@pytest.fixture
def cli(capsys):
    """The command line in this process: ``(exit code, stderr)`` of one call."""

    def run(*args: object) -> SimpleNamespace:
        code = main([str(arg) for arg in args])
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stderr=captured.err)

    return run


def _check_labels(path: Path, expected: dict, *, float32: bool = False) -> None:
    close = {"rtol": 1e-6, "atol": 1e-6} if float32 else {"rtol": 1e-12, "atol": 0}
    with atp.open(path) as reader:
        assert len(reader) == 3
        for i in range(3):
            mol = reader[i]
            np.testing.assert_allclose(mol.positions, expected[f"{i}_positions"], **close)
            np.testing.assert_array_equal(mol.atomic_numbers, expected[f"{i}_types"])
            np.testing.assert_allclose(mol.energy, expected[f"{i}_energy"], **close)
            np.testing.assert_allclose(mol.forces, expected[f"{i}_forces"], **close)
            np.testing.assert_allclose(mol.stress, expected[f"{i}_stress"], **close)


def test_zip_with_target_u0_keeps_forces_and_stress_without_energy_key(tmp_path,
                                                                       metatrain_files, cli):
    files, expected = metatrain_files
    result = cli("convert", files / "u0.zip", tmp_path / "u0.atp")
    assert result.returncode == 0, result.stderr
    assert "target 'U0' carries positions and strain gradients" in result.stderr
    assert "read as the energy" in result.stderr
    _check_labels(tmp_path / "u0.atp", expected)
    with atp.open(tmp_path / "u0.atp") as reader:
        assert [reader[i].properties["gap"] for i in range(3)] == [
            float(expected[f"{i}_gap"]) for i in range(3)]
        assert "properties/U0" not in reader.fields


def test_zip_gradients_of_a_custom_target_are_never_dropped(tmp_path, metatrain_files, cli):
    files, _ = metatrain_files
    result = cli("convert", files / "u0.zip", tmp_path / "out.atp", "--energy-key", "gap")
    assert result.returncode == 2
    assert "u0.zip" in result.stderr
    assert "target 'U0' has positions and strain gradients" in result.stderr
    assert "--skip-target" in result.stderr and "--energy-key" in result.stderr
    assert not (tmp_path / "out.atp").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_zip_with_a_multi_block_target_converts_with_skip_target(tmp_path, metatrain_files, cli):
    files, expected = metatrain_files
    result = cli("convert", files / "spherical.zip", tmp_path / "out.atp")
    assert result.returncode == 2
    assert "'dipole' has 2 blocks" in result.stderr
    assert "--skip-target dipole" in result.stderr
    result = cli("convert", files / "spherical.zip", tmp_path / "out.atp",
                  "--skip-target", "dipole")
    assert result.returncode == 0, result.stderr
    _check_labels(tmp_path / "out.atp", expected)
    with atp.open(tmp_path / "out.atp") as reader:
        assert not any("dipole" in name for name in reader.fields)
    with pytest.raises(ConvertError, match=r"--skip-target nope: no such target"):
        open_reader(files / "spherical.zip", options=ReadOptions(skip_targets=("nope",)))


def test_metatrain_memmap_with_target_u0(tmp_path, metatrain_files, cli):
    files, expected = metatrain_files
    assert (files / "memmap" / "U0_forces.bin").is_file()
    result = cli("convert", files / "memmap", tmp_path / "mm.atp")
    assert result.returncode == 0, result.stderr
    assert "target 'U0' has gradient files" in result.stderr
    _check_labels(tmp_path / "mm.atp", expected, float32=True)

    # naming only the energy would leave the gradient files unread: refused
    result = cli("convert", files / "memmap", tmp_path / "e.atp", "--energy-key", "U0")
    assert result.returncode == 2
    assert "U0_forces.bin, U0_stress.bin" in result.stderr
    assert "--skip-target" in result.stderr
    assert not (tmp_path / "e.atp").exists()
    result = cli("convert", files / "memmap", tmp_path / "e.atp", "--energy-key", "U0",
                  "--skip-target", "U0_forces", "--skip-target", "U0_stress")
    assert result.returncode == 0, result.stderr


def _periodic_frames(n: int = 3) -> list:
    frames = []
    for i in range(n):
        atoms = bulk("Cu", "fcc", a=3.6 + 0.02 * i, cubic=True)
        atoms.rattle(0.05, seed=i)
        atoms.calc = EMT()
        stress = atoms.get_stress(voigt=False)
        energy = atoms.get_potential_energy()
        atoms.calc = None
        atoms.info["energy"] = energy
        atoms.info["virial"] = -stress * atoms.get_volume()  # ASE's convention
        atoms.info["stress_ref"] = stress.reshape(9)
        frames.append(atoms)
    return frames


def test_virial_becomes_stress_and_a_memmap_gets_energy_stress_bin(tmp_path, cli):
    frames = _periodic_frames()
    ase.io.write(tmp_path / "carbon.xyz", frames, format="extxyz")
    result = cli("convert", tmp_path / "carbon.xyz", tmp_path / "mm", "--to", "memmap",
                  "--virial-key", "virial", "--energy-key", "energy")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "mm" / "energy_stress.bin").is_file()
    stored = np.fromfile(tmp_path / "mm" / "energy_stress.bin", dtype="<f4").reshape(-1, 3, 3)
    for got, atoms in zip(stored, frames):
        np.testing.assert_allclose(got, atoms.info["stress_ref"].reshape(3, 3), rtol=1e-5,
                                   atol=1e-7)
    # through the API, exact in float64, in converted units too
    convert(tmp_path / "carbon.xyz", tmp_path / "c.atp",
            read_options=ReadOptions(virial_key="virial"))
    with atp.open(tmp_path / "c.atp") as reader:
        for i, atoms in enumerate(frames):
            np.testing.assert_allclose(reader[i].stress, atoms.info["stress_ref"].reshape(3, 3),
                                       rtol=1e-12, atol=1e-15)
            assert "virial" not in reader[i].properties


def test_virial_of_a_non_periodic_structure_is_an_error(tmp_path, cli):
    frames = _periodic_frames(2)
    frames[1].pbc = False
    frames[1].cell = None
    ase.io.write(tmp_path / "mixed.xyz", frames, format="extxyz")
    result = cli("convert", tmp_path / "mixed.xyz", tmp_path / "out.atp",
                  "--virial-key", "virial")
    assert result.returncode == 2
    assert "mixed.xyz (structure 1)" in result.stderr
    assert "virial 'virial' needs a periodic structure" in result.stderr
    assert not (tmp_path / "out.atp").exists()


def test_ase_calculator_result_sharing_a_key_with_info_is_kept(tmp_path):
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    from pyg_atompack.convert.ase_io import AseReader

    atoms = Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.7]])
    atoms.info["free_energy"] = 1.0
    atoms.calc = SinglePointCalculator(atoms, energy=3.0, free_energy=2.0)
    (tmp_path / "x.xyz").write_text("")
    structure = AseReader(tmp_path / "x.xyz").structure_from_atoms(atoms)
    assert structure.energy == 3.0
    assert structure.properties["free_energy"] == 1.0
    assert structure.properties["calc_free_energy"] == 2.0
