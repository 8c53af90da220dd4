"""MemmapDataset: a PyG dataset over metatrain memmap directories."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from test_convert_memmap import hand_built, make_structures, write_memmap
from torch_geometric.loader import DataLoader

from pyg_atompack import MemmapDataset
from pyg_atompack.data.memmap import MemmapLayoutError


def test_same_attributes_as_atompack_dataset(tmp_path):
    from pyg_atompack import AtompackDataset
    from pyg_atompack.convert import convert

    write_memmap(tmp_path / "mm", make_structures())
    convert(tmp_path / "mm", tmp_path / "same.atp")
    memmap, atompack = MemmapDataset(tmp_path / "mm"), AtompackDataset(tmp_path / "same.atp")
    assert len(memmap) == len(atompack) == 5
    for i in range(len(memmap)):
        got, want = memmap[i], atompack[i]
        assert sorted(got.keys()) == sorted(want.keys())
        for key, value in want.items():
            assert got[key].shape == value.shape, key
            torch.testing.assert_close(got[key].double(), value.double(), rtol=0, atol=0)


def test_hand_built_values_and_shapes(tmp_path):
    na, arrays = hand_built(tmp_path / "mm")
    dataset = MemmapDataset(tmp_path / "mm", keys={"energy": "e", "forces": "f", "stress": "s",
                                                   "charges": "q"})
    assert "MemmapDataset(4" in repr(dataset)
    for i in range(len(dataset)):
        data = dataset[i]
        start, stop = na[i], na[i + 1]
        assert data.z.dtype == torch.int64
        torch.testing.assert_close(data.pos, torch.from_numpy(arrays["x"][start:stop]))
        assert data.energy.shape == (1,) and data.energy.item() == arrays["e"][i, 0]
        torch.testing.assert_close(data.forces, torch.from_numpy(arrays["f"][start:stop, :, 0]))
        assert data.stress.shape == (1, 3, 3)
        torch.testing.assert_close(data.stress[0], torch.from_numpy(arrays["s"][i, :, :, 0]))
        torch.testing.assert_close(data.charges, torch.from_numpy(arrays["q"][start:stop, 0]))
        assert data.cell.shape == (1, 3, 3) and data.pbc.tolist() == [[True, True, i % 2 == 0]]
        assert data.natoms.item() == stop - start


def test_batches_in_a_loader_and_pickles(tmp_path):
    write_memmap(tmp_path / "mm", make_structures(6))
    dataset = MemmapDataset(tmp_path / "mm")
    dataset[0]  # maps the files; pickling must not copy them
    clone = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 4096
    batch = next(iter(DataLoader(clone, batch_size=3)))
    assert batch.num_graphs == 3
    assert batch.energy.shape == (3,)
    assert batch.dipole.shape == (3, 3)


def test_sequence_of_stems_and_missing_key(tmp_path):
    hand_built(tmp_path / "mm")
    dataset = MemmapDataset(tmp_path / "mm", keys=["q"])
    assert dataset[0].q.shape[0] == dataset[0].natoms.item()
    with pytest.raises(MemmapLayoutError, match="key 'missing' is not present"):
        MemmapDataset(tmp_path / "mm", keys=["missing"])


def test_negative_index_and_out_of_range(tmp_path):
    write_memmap(tmp_path / "mm", make_structures(3))
    dataset = MemmapDataset(tmp_path / "mm")
    np.testing.assert_array_equal(dataset.layout.structure(-1)["positions"],
                                  dataset.layout.structure(2)["positions"])
    with pytest.raises(IndexError, match="structure 3 out of range"):
        dataset.layout.structure(3)
