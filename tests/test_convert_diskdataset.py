"""metatrain DiskDataset zips (built here to the documented layout, and by metatrain) -> .atp."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from pyg_atompack import atp
from pyg_atompack.convert import ConvertError, ReadOptions, convert, open_reader


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    """A stored zip of .npy members, like metatensor's and metatomic's buffers."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            member = io.BytesIO()
            np.save(member, array)
            archive.writestr(f"{name}.npy", member.getvalue())
    return buffer.getvalue()


def _labels(names: list[str], rows: list[list[int]]) -> np.ndarray:
    dtype = [(name, "<i4") for name in names]
    return np.array([tuple(row) for row in rows], dtype=dtype)


def _mts(values: np.ndarray, samples: np.ndarray, components: list[np.ndarray],
         gradients: dict[str, tuple[np.ndarray, np.ndarray, list[np.ndarray]]] | None = None
         ) -> bytes:
    """A metatensor TensorMap buffer wrapped as metatrain stores it (np.save of uint8)."""
    arrays = {
        "keys": _labels(["_"], [[0]]),
        "blocks/0/values": values,
        "blocks/0/samples": samples,
        "blocks/0/properties": _labels(["energy"], [[j] for j in range(values.shape[-1])]),
    }
    for j, component in enumerate(components):
        arrays[f"blocks/0/components/{j}"] = component
    for parameter, (g_values, g_samples, g_components) in (gradients or {}).items():
        prefix = f"blocks/0/gradients/{parameter}"
        arrays[f"{prefix}/values"] = g_values
        arrays[f"{prefix}/samples"] = g_samples
        for j, component in enumerate(g_components):
            arrays[f"{prefix}/components/{j}"] = component
    member = io.BytesIO()
    np.save(member, np.frombuffer(_npz(arrays), dtype=np.uint8))
    return member.getvalue()


def build_disk_zip(path, count: int = 3, seed: int = 3, skip: int | None = None):
    """A DiskDataset zip with energy (+ position and strain gradients) and a per-atom target."""
    rng = np.random.default_rng(seed)
    xyz = _labels(["xyz"], [[0], [1], [2]])
    expected = []
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for i in range(count):
            n = 2 + i
            positions = rng.normal(size=(n, 3))
            cell = np.diag([4.0 + i, 5.0, 6.0])
            types = rng.integers(1, 20, n).astype(np.int32)
            energy = float(rng.normal())
            forces = rng.normal(size=(n, 3))
            stress = rng.normal(size=(3, 3))
            charges = rng.normal(size=n)
            expected.append(dict(positions=positions, cell=cell, types=types, energy=energy,
                                 forces=forces, stress=stress, charges=charges))
            if i == skip:
                continue
            system = _npz({"positions": positions, "cell": cell, "types": types,
                           "pbc": np.array([True, True, True])})
            volume = abs(np.linalg.det(cell))
            energy_mts = _mts(
                np.array([[energy]]), _labels(["system"], [[i]]), [],
                gradients={
                    "positions": ((-forces)[:, :, None],
                                  _labels(["sample", "atom"], [[0, j] for j in range(n)]),
                                  [xyz]),
                    "strain": ((stress * volume)[None, :, :, None], _labels(["sample"], [[0]]),
                               [_labels(["xyz_1"], [[0], [1], [2]]),
                                _labels(["xyz_2"], [[0], [1], [2]])]),
                },
            )
            # atoms listed in reverse order: the reader must sort by the atom label
            order = list(range(n))[::-1]
            charges_mts = _mts(charges[order][:, None],
                               _labels(["system", "atom"], [[i, j] for j in order]), [])
            archive.writestr(f"{i}/system.mta", system)
            archive.writestr(f"{i}/energy.mts", energy_mts)
            archive.writestr(f"{i}/mtt::charges.mts", charges_mts)
    return expected


def test_built_zip_to_atp_every_value(tmp_path):
    expected = build_disk_zip(tmp_path / "data.zip")
    options = ReadOptions(key_map={"mtt::charges": "charges"})
    assert convert(tmp_path / "data.zip", tmp_path / "out.atp", read_options=options) == 3
    with atp.open(tmp_path / "out.atp") as reader:
        for i, want in enumerate(expected):
            mol = reader[i]
            np.testing.assert_array_equal(mol.positions, want["positions"])
            np.testing.assert_array_equal(mol.atomic_numbers, want["types"])
            np.testing.assert_array_equal(mol.cell, want["cell"])
            assert mol.energy == want["energy"]
            np.testing.assert_array_equal(mol.forces, want["forces"])
            np.testing.assert_allclose(mol.stress, want["stress"], rtol=1e-14)
            np.testing.assert_array_equal(mol.charges, want["charges"])
            assert tuple(mol.pbc) == (True, True, True)


def test_custom_target_keeps_its_name(tmp_path):
    expected = build_disk_zip(tmp_path / "data.zip", count=2)
    structures = list(open_reader(tmp_path / "data.zip"))
    np.testing.assert_array_equal(structures[1].atom_properties["mtt::charges"],
                                  expected[1]["charges"])


def test_missing_structure_folder(tmp_path):
    build_disk_zip(tmp_path / "holes.zip", count=4, skip=2)
    with pytest.raises(ConvertError, match=r"holes\.zip: structure folder\(s\) missing.*2/system"):
        open_reader(tmp_path / "holes.zip")


def test_missing_energy_key(tmp_path):
    build_disk_zip(tmp_path / "data.zip", count=1)
    with pytest.raises(ConvertError, match=r"key 'free_energy' \(for energy\) is not present"):
        open_reader(tmp_path / "data.zip", options=ReadOptions(energy_key="free_energy"))


def test_not_a_zip(tmp_path):
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    with pytest.raises(ConvertError, match=r"junk\.zip: not a readable zip"):
        open_reader(tmp_path / "junk.zip")


_METATRAIN_WRITER = """
import sys
import numpy as np
import torch
import metatomic.torch as mta
from metatensor.torch import Labels, TensorBlock, TensorMap
from metatrain.utils.data.writers.diskdataset import DiskDatasetWriter

out, expected_path = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(5)
writer = DiskDatasetWriter(out)
expected = {}
for i in range(3):
    n = 3 + i
    positions = torch.tensor(rng.normal(size=(n, 3)))
    cell = torch.diag(torch.tensor([5.0, 6.0, 7.0 + i], dtype=torch.float64))
    types = torch.tensor(rng.integers(1, 9, n), dtype=torch.int32)
    system = mta.System(positions=positions, types=types, cell=cell, pbc=torch.tensor([True] * 3))
    energy = float(rng.normal())
    forces = torch.tensor(rng.normal(size=(n, 3)))
    stress = torch.tensor(rng.normal(size=(3, 3)))
    block = TensorBlock(values=torch.tensor([[energy]], dtype=torch.float64),
                        samples=Labels(["system"], torch.tensor([[0]], dtype=torch.int32)),
                        components=[], properties=Labels.range("energy", 1))
    block.add_gradient("positions", TensorBlock(
        values=(-forces)[:, :, None],
        samples=Labels(["sample", "atom"],
                       torch.tensor([[0, j] for j in range(n)], dtype=torch.int32)),
        components=[Labels.range("xyz", 3)], properties=Labels.range("energy", 1)))
    block.add_gradient("strain", TensorBlock(
        values=(stress * torch.det(cell))[None, :, :, None],
        samples=Labels(["sample"], torch.tensor([[0]], dtype=torch.int32)),
        components=[Labels.range("xyz_1", 3), Labels.range("xyz_2", 3)],
        properties=Labels.range("energy", 1)))
    writer.write([system], {"energy": TensorMap(Labels.single(), [block])})
    energy_tensor = torch.tensor(energy, dtype=torch.float64)
    for name, value in (("positions", positions), ("types", types), ("cell", cell),
                        ("energy", energy_tensor), ("forces", forces), ("stress", stress)):
        expected[f"{i}_{name}"] = value.numpy()
writer.finish()
np.savez(expected_path, **expected)
"""


def test_zip_written_by_metatrain(tmp_path):
    """A DiskDataset written by metatrain itself.

    metatrain runs in a subprocess: importing torch_geometric first patches
    ``torch.index_select``, which breaks metatensor's TorchScript compilation.
    """
    import subprocess
    import sys

    # metatrain is part of the `test` extra: a missing install must fail, not skip.
    script = tmp_path / "write.py"
    script.write_text(_METATRAIN_WRITER)
    subprocess.run([sys.executable, str(script), str(tmp_path / "mtt.zip"),
                    str(tmp_path / "expected.npz")], check=True, timeout=300)
    expected = np.load(tmp_path / "expected.npz")

    structures = list(open_reader(tmp_path / "mtt.zip"))
    assert len(structures) == 3
    for i, structure in enumerate(structures):
        np.testing.assert_array_equal(structure.positions, expected[f"{i}_positions"])
        np.testing.assert_array_equal(structure.atomic_numbers, expected[f"{i}_types"])
        np.testing.assert_array_equal(structure.cell, expected[f"{i}_cell"])
        assert structure.energy == float(expected[f"{i}_energy"])
        np.testing.assert_array_equal(structure.forces, expected[f"{i}_forces"])
        np.testing.assert_allclose(structure.stress, expected[f"{i}_stress"], rtol=1e-13)
