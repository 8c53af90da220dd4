"""PyG .pt files in, .pt shards out: InMemoryDataset -> shards -> back, self-contained shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch_geometric.data import Data, InMemoryDataset

from pyg_atompack.convert import (
    ConvertError,
    ReadOptions,
    WriteOptions,
    check_manifest,
    convert,
    open_reader,
    shard,
)
from pyg_atompack.pyg.pt import pyg_safe_globals


class TinyMolecules(InMemoryDataset):
    """An InMemoryDataset in PyG's processed-file format, MD17-like attribute names."""

    def __init__(self, root, count=40, atoms=9, seed=0):
        self.count, self.atoms, self.seed = count, atoms, seed
        super().__init__(root)
        self.load(self.processed_paths[0])

    @property
    def raw_file_names(self):
        return []

    @property
    def processed_file_names(self):
        return ["data.pt"]

    def download(self):
        pass

    def process(self):
        rng = np.random.default_rng(self.seed)
        data_list = [
            Data(
                z=torch.from_numpy(rng.integers(1, 9, self.atoms)),
                pos=torch.from_numpy(rng.normal(size=(self.atoms, 3)).astype(np.float32)),
                energy=torch.tensor([float(rng.normal())]),
                force=torch.from_numpy(rng.normal(size=(self.atoms, 3)).astype(np.float32)),
                y=torch.from_numpy(rng.normal(size=(1, 4)).astype(np.float32)),
                name=f"mol-{i}",
            )
            for i in range(self.count)
        ]
        self.save(data_list, self.processed_paths[0])


def _load(path):
    with pyg_safe_globals():
        return torch.load(path, weights_only=True)


def test_in_memory_dataset_to_shards_and_back(tmp_path):
    dataset = TinyMolecules(tmp_path / "md")
    processed = tmp_path / "md" / "processed" / "data.pt"
    options = ReadOptions(key_map={"force": "forces"})
    count = convert(processed, tmp_path / "shards", src_format="pt", dst_format="pt-shards",
                    read_options=options, write_options=WriteOptions(shard_size=16))
    assert count == len(dataset) == 40
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["format"] == "pyg_atompack-shards/1"
    assert [s["records"] for s in manifest["shards"]] == [16, 16, 8]
    assert manifest["total_records"] == 40
    assert check_manifest(tmp_path / "shards") == []

    loaded = [d for entry in manifest["shards"] for d in _load(tmp_path / "shards" / entry["name"])]
    assert len(loaded) == 40
    for original, data in zip(dataset, loaded):
        assert torch.equal(data.z, original.z) and data.z.dtype == torch.int64
        assert torch.equal(data.pos, original.pos)
        assert torch.equal(data.energy, original.energy)
        assert torch.equal(data.forces, original.force)
        assert torch.equal(data.y, original.y)
        assert data.name == original.name
        assert data.natoms.tolist() == [9]

    back = list(open_reader(tmp_path / "shards"))
    for original, structure in zip(dataset, back):
        np.testing.assert_array_equal(structure.forces, original.force.numpy())
        np.testing.assert_array_equal(structure.properties["y"], original.y[0].numpy())
        assert structure.name == original.name


def test_shard_size_is_proportional_to_content(tmp_path):
    """Views into the collated storage must not drag the whole dataset into each shard."""
    small = TinyMolecules(tmp_path / "small", count=20, atoms=50)
    large = TinyMolecules(tmp_path / "large", count=400, atoms=50)
    assert len(small) == 20 and len(large) == 400
    for name in ("small", "large"):
        convert(tmp_path / name / "processed" / "data.pt", tmp_path / f"{name}_shards",
                dst_format="pt-shards", write_options=WriteOptions(shard_size=10))
    small_bytes = (tmp_path / "small_shards" / "shard_00000.pt").stat().st_size
    large_bytes = (tmp_path / "large_shards" / "shard_00000.pt").stat().st_size
    assert large_bytes == pytest.approx(small_bytes, rel=0.05)
    payload = 10 * 50 * (3 + 3) * 4  # positions + forces of ten molecules, float32
    assert large_bytes < 3 * payload
    # the collated source is ~40x bigger than one shard
    assert (tmp_path / "large" / "processed" / "data.pt").stat().st_size > 20 * large_bytes


def test_list_of_data_file_and_explicit_missing_key(tmp_path):
    data_list = [Data(z=torch.tensor([1, 8]), pos=torch.zeros(2, 3), energy=torch.tensor([2.0]))]
    torch.save(data_list, tmp_path / "list.pt")
    (structure,) = list(open_reader(tmp_path / "list.pt"))
    assert structure.energy == 2.0 and structure.n_atoms == 2
    with pytest.raises(ConvertError, match=r"list\.pt \(structure 0\): key 'force'"):
        list(open_reader(tmp_path / "list.pt", options=ReadOptions(forces_key="force")))


def test_unsafe_pickle_is_refused(tmp_path):
    torch.save({"model": object()}, tmp_path / "evil.pt")
    with pytest.raises(ConvertError, match=r"evil\.pt: torch\.load\(weights_only=True\) refused"):
        list(open_reader(tmp_path / "evil.pt"))


def test_atp_to_pt_shards(tmp_path):
    from pyg_atompack import AtompackDataset

    dataset = TinyMolecules(tmp_path / "md", count=12)
    convert(tmp_path / "md" / "processed" / "data.pt", tmp_path / "mols.atp",
            read_options=ReadOptions(key_map={"force": "forces"}))
    assert shard(tmp_path / "mols.atp", tmp_path / "pt", 5) == 12
    loaded = [d for i in range(3) for d in _load(tmp_path / "pt" / f"shard_{i:05d}.pt")]
    reference = AtompackDataset(tmp_path / "mols.atp")
    for i, data in enumerate(loaded):
        want = reference[i]
        assert sorted(data.keys()) == sorted(want.keys())
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(data[key], value), key
            else:
                assert data[key] == value
    assert torch.equal(loaded[3].forces, dataset[3].force)


def test_views_are_cloned_before_saving(tmp_path):
    from pyg_atompack.convert import Structure
    from pyg_atompack.convert.pt import structure_to_data

    backing = np.random.default_rng(0).normal(size=(100_000, 3))
    structure = Structure(positions=backing[10:14], atomic_numbers=np.ones(4, dtype=np.int64),
                          forces=backing[20:24])
    data = structure_to_data(structure)
    torch.save([data], tmp_path / "one.pt")
    assert (tmp_path / "one.pt").stat().st_size < 10_000  # the backing array is 2.4 MB
    assert torch.equal(_load(tmp_path / "one.pt")[0].pos, torch.from_numpy(backing[10:14]))
