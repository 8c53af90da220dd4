"""Tests of `AtompackDataset` against the golden files and files written by atompack-db."""

from __future__ import annotations

import pickle
from pathlib import Path

import atompack
import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader

from pyg_atompack import AtompackDataset
from pyg_atompack.pyg import FieldSelectionError, record_to_data

# --------------------------------------------------------------------------- oracle


def _tensor(value, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(value, dtype=np.dtype(dtype)))


def expected_data(molecule: dict) -> dict:
    """The attributes the architecture table promises, built from expected.json."""
    n_atoms = molecule["n_atoms"]
    out = {
        "z": torch.tensor(molecule["atomic_numbers"], dtype=torch.int64),
        "pos": _tensor(molecule["positions"], molecule["positions_dtype"]).reshape(n_atoms, 3),
        "natoms": torch.tensor([n_atoms]),
    }
    if molecule.get("energy") is not None:
        out["energy"] = torch.tensor([molecule["energy"]], dtype=torch.float64)
    for name in ("forces", "velocities"):
        if molecule.get(name) is not None:
            out[name] = _tensor(molecule[name], molecule[f"{name}_dtype"]).reshape(n_atoms, 3)
    if molecule.get("charges") is not None:
        out["charges"] = _tensor(molecule["charges"], molecule["charges_dtype"])
    for name in ("cell", "stress"):
        if molecule.get(name) is not None:
            out[name] = _tensor(molecule[name], molecule[f"{name}_dtype"]).reshape(1, 3, 3)
    if molecule.get("pbc") is not None:
        out["pbc"] = torch.tensor([molecule["pbc"]], dtype=torch.bool)
    if molecule.get("name") is not None:
        out["name"] = molecule["name"]
    builtins = {"z", "pos", "natoms", "energy", "forces", "charges", "velocities", "cell",
                "stress", "pbc", "name"}
    for scope, prefix in (("properties", "prop_"), ("atom_properties", "atom_")):
        for key, prop in (molecule.get(scope) or {}).items():
            attr = prefix + key if key in builtins else key
            kind = prop["kind"]
            if kind == "none":
                continue
            if kind == "str":
                out[attr] = prop["value"]
            elif kind == "int":
                out[attr] = torch.tensor([prop["value"]], dtype=torch.int64)
            elif kind == "float":
                out[attr] = torch.tensor([prop["value"]], dtype=torch.float64)
            else:
                value = _tensor(prop["value"], prop["dtype"]).reshape(prop["shape"])
                out[attr] = value if scope == "atom_properties" else value[None]
    return out


def assert_matches(data: Data, expected: dict, where: str) -> None:
    assert set(data.keys()) == set(expected), f"{where}: {sorted(data.keys())}"
    for key, value in expected.items():
        got = data[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype, f"{where}.{key}: {got.dtype} != {value.dtype}"
            assert got.shape == value.shape, f"{where}.{key}: {got.shape} != {value.shape}"
            assert torch.equal(got, value), f"{where}.{key}: values differ"
        else:
            assert got == value, f"{where}.{key}"


def readable_golden_files(expected: dict) -> list[str]:
    return sorted(name for name, info in expected["files"].items() if info["n_molecules"])


def pytest_generate_tests(metafunc):
    if "golden_name" in metafunc.fixturenames:
        import json

        from conftest import GOLDEN_DIR

        with open(GOLDEN_DIR / "expected.json", encoding="utf-8") as handle:
            names = readable_golden_files(json.load(handle))
        metafunc.parametrize("golden_name", names)


# --------------------------------------------------------------------------- golden files


def test_every_golden_molecule_matches_the_attribute_table(golden_dir, golden_expected,
                                                           golden_name):
    info = golden_expected["files"][golden_name]
    dataset = AtompackDataset(golden_dir / golden_name)
    assert len(dataset) == info["n_molecules"]
    for index, molecule in enumerate(info["molecules"]):
        assert_matches(dataset[index], expected_data(molecule), f"{golden_name}[{index}]")


def test_missing_fields_are_absent_not_zero_filled(golden_dir):
    dataset = AtompackDataset(golden_dir / "sparse_builtins.atp")
    assert "forces" in dataset[0] and "forces" in dataset[2]
    assert set(dataset[1].keys()) == {"z", "pos", "natoms", "energy"}


def test_directory_of_shards_follows_posix_path_order(golden_dir, golden_expected):
    dataset = AtompackDataset(golden_dir / "sharded")
    energies = [float(dataset[i].energy) for i in range(len(dataset))]
    assert energies == golden_expected["sharded_reader"]["energies"]


def test_list_of_files_keeps_the_given_order(golden_dir, golden_expected):
    files = [golden_dir / "sharded" / "shard_00001.atp", golden_dir / "builtins_zstd.atp"]
    dataset = AtompackDataset(files)
    assert len(dataset) == 2 + 5
    wanted = [*golden_expected["files"]["sharded/shard_00001.atp"]["molecules"],
              *golden_expected["files"]["builtins_zstd.atp"]["molecules"]]
    for index, molecule in enumerate(wanted):
        assert_matches(dataset[index], expected_data(molecule), f"list[{index}]")
    batch = dataset.reader.read_batch([6, 0, 3])
    assert batch["n_atoms"].tolist() == [5, 2, 3]


def test_empty_file_gives_an_empty_dataset(golden_dir):
    assert len(AtompackDataset(golden_dir / "empty.atp")) == 0


# --------------------------------------------------------------------------- fields and dtype


def test_fields_select_what_is_materialised(golden_dir):
    path = golden_dir / "batch_canonical_lz4.atp"
    only_geometry = AtompackDataset(path, fields=["pos", "z"])
    assert set(only_geometry[0].keys()) == {"z", "pos", "natoms"}
    chosen = AtompackDataset(path, fields=["energy", "forces", "q", "properties/desc"])
    assert set(chosen[1].keys()) == {"z", "pos", "natoms", "energy", "forces", "q", "desc"}
    full = AtompackDataset(path)
    for key in chosen[1].keys():  # noqa: SIM118 (iterating a Data yields pairs)
        assert torch.equal(chosen[1][key], full[1][key])


def test_fields_accept_prefixed_collision_names(tmp_path):
    path = tmp_path / "collide.atp"
    db = atompack.Database(str(path), overwrite=True)
    molecule = atompack.Molecule.from_arrays(
        np.zeros((2, 3), np.float32), np.array([1, 8], np.uint8), energy=1.5)
    molecule.set_property("energy", 7.0)
    molecule.set_property("forces", np.ones((2, 3)), scope="atom")
    db.add_molecules([molecule])
    db.flush()
    data = AtompackDataset(path)[0]
    assert data.energy.tolist() == [1.5] and data.prop_energy.tolist() == [7.0]
    assert data.atom_forces.shape == (2, 3) and "forces" not in data
    picked = AtompackDataset(path, fields=["prop_energy"])[0]
    assert set(picked.keys()) == {"z", "pos", "natoms", "prop_energy"}


def test_unknown_field_lists_the_fields_that_exist(golden_dir):
    with pytest.raises(FieldSelectionError) as error:
        AtompackDataset(golden_dir / "f64_positions.atp", fields=["pos", "charges"])
    message = str(error.value)
    assert "'charges'" in message and "f64_positions.atp" in message
    for existing in ("energy", "forces", "cell", "pbc"):
        assert existing in message


def test_dtype_casts_floating_fields_and_default_keeps_stored(golden_dir):
    path = golden_dir / "batch_v3_zstd.atp"
    stored = AtompackDataset(path)[0]
    assert stored.pos.dtype == torch.float64 and stored.charges.dtype == torch.float32
    cast = AtompackDataset(path, dtype=torch.float32)[0]
    for key in ("pos", "forces", "charges", "velocities", "cell", "stress", "energy"):
        assert cast[key].dtype == torch.float32, key
        assert torch.allclose(cast[key].double(), stored[key].double(), rtol=1e-6)
    assert cast.z.dtype == torch.int64 and cast.pbc.dtype == torch.bool


def test_tensors_from_a_memory_map_are_writable_copies(golden_dir):
    dataset = AtompackDataset(golden_dir / "builtins_none.atp", access="mmap")
    first = dataset[2]
    first.pos += 100.0  # a transform writing in place must not touch the file
    assert torch.equal(dataset[2].pos + 100.0, first.pos)


# --------------------------------------------------------------------------- PyG Dataset API


@pytest.fixture()
def builtins_dataset(golden_dir) -> AtompackDataset:
    return AtompackDataset(golden_dir / "builtins_lz4.atp")


def test_slicing_index_lists_shuffle_and_index_select(builtins_dataset):
    energies = [float(d.energy) for d in builtins_dataset]
    assert [float(d.energy) for d in builtins_dataset[1:4]] == energies[1:4]
    assert [float(d.energy) for d in builtins_dataset[[4, 0]]] == [energies[4], energies[0]]
    subset = builtins_dataset.index_select(torch.tensor([3, 1, 1]))
    assert len(subset) == 3 and float(subset[0].energy) == energies[3]
    assert list(subset.record_indices()) == [3, 1, 1]
    shuffled = builtins_dataset.shuffle()
    assert sorted(float(d.energy) for d in shuffled) == sorted(energies)
    nested = builtins_dataset[1:][::2]
    assert [float(d.energy) for d in nested] == energies[1::2]
    assert list(nested.record_indices([1, -1])) == [3, 3]
    with pytest.raises(IndexError, match="out of range"):
        nested.record_indices([2])


def test_transform_is_applied_per_item(builtins_dataset, golden_dir):
    def shift(data: Data) -> Data:
        data.pos = data.pos + 1.0
        return data

    transformed = AtompackDataset(golden_dir / "builtins_lz4.atp", transform=shift)
    assert torch.equal(transformed[3].pos, builtins_dataset[3].pos + 1.0)


def test_pre_filter_keeps_matching_records(golden_dir, builtins_dataset):
    kept = AtompackDataset(golden_dir / "builtins_lz4.atp",
                           pre_filter=lambda data: int(data.natoms) >= 3)
    assert len(kept) == 3  # atom counts are 1, 3, 8, 2, 5
    assert [int(d.natoms) for d in kept] == [3, 8, 5]
    assert list(kept.record_indices()) == [1, 2, 4]
    assert_matches(kept[1], dict(builtins_dataset[2].items()), "kept[1]")
    assert list(kept[1:].record_indices()) == [2, 4]
    assert "kept=3/5" in repr(kept)


def test_no_root_directory_is_used(builtins_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    AtompackDataset(builtins_dataset.reader.path)
    assert list(tmp_path.iterdir()) == []
    assert builtins_dataset.raw_file_names == [] and builtins_dataset.processed_paths == []


def test_repr_names_length_source_and_options(golden_dir):
    dataset = AtompackDataset(golden_dir / "builtins_lz4.atp", fields=["energy"],
                              dtype=torch.float64)
    text = repr(dataset)
    assert text.startswith("AtompackDataset(5, source=") and "builtins_lz4.atp" in text
    assert "fields=['atomic_numbers', 'positions', 'energy']" in text
    assert "torch.float64" in text


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.atp"):
        AtompackDataset(tmp_path / "nope.atp")
    with pytest.raises(FileNotFoundError, match="gone.atp"):
        AtompackDataset([tmp_path / "gone.atp"])
    with pytest.raises(TypeError, match="source must be"):
        AtompackDataset(42)
    junk = tmp_path / "junk.atp"
    junk.write_bytes(b"not an atp file" * 1000)
    with pytest.raises(Exception, match="junk.atp"):
        AtompackDataset(junk)


def test_pickled_dataset_reopens_its_reader(builtins_dataset):
    clone = pickle.loads(pickle.dumps(builtins_dataset[1:]))
    assert_matches(clone[0], dict(builtins_dataset[1].items()), "clone[0]")


# --------------------------------------------------------------------------- loaders and samplers


def _written_by_atompack(path: Path, count: int = 40) -> Path:
    rng = np.random.default_rng(7)
    db = atompack.Database(str(path), compression="zstd", overwrite=True)
    molecules = []
    for index in range(count):
        n = 2 + index % 5
        molecules.append(atompack.Molecule.from_arrays(
            rng.normal(size=(n, 3)).astype(np.float32), rng.integers(1, 50, n).astype(np.uint8),
            energy=float(index), forces=rng.normal(size=(n, 3)).astype(np.float32)))
    db.add_molecules(molecules)
    db.flush()
    return path


def test_pyg_dataloader_with_workers_matches_in_process(tmp_path):
    dataset = AtompackDataset(_written_by_atompack(tmp_path / "w.atp"))
    reference = [b.energy.tolist() for b in DataLoader(dataset, batch_size=8)]
    loader = DataLoader(dataset, batch_size=8, num_workers=2, persistent_workers=False)
    assert [b.energy.tolist() for b in loader] == reference
    ours = list(DataLoader(dataset, batch_size=8, num_workers=2))
    assert torch.equal(ours[-1].pos, list(DataLoader(dataset, batch_size=8))[-1].pos)


def test_dataloader_with_spawned_worker_unpickles_the_dataset(tmp_path):
    dataset = AtompackDataset(_written_by_atompack(tmp_path / "s.atp", count=10))[2:]
    loader = DataLoader(dataset, batch_size=4, num_workers=1,
                        multiprocessing_context="spawn")
    assert [e for b in loader for e in b.energy.tolist()] == [float(i) for i in range(2, 10)]


def test_distributed_sampler_partitions_the_dataset(tmp_path):
    dataset = AtompackDataset(_written_by_atompack(tmp_path / "d.atp", count=21))
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
        seen += [e for b in DataLoader(dataset, batch_size=4, sampler=sampler)
                 for e in b.energy.tolist()]
    assert len(seen) == 22  # padded to a multiple of the replica count
    assert set(seen) == {float(i) for i in range(21)}


def test_record_to_data_is_what_get_returns(golden_dir):
    dataset = AtompackDataset(golden_dir / "custom_props_zstd.atp")
    data = record_to_data(dataset.reader[2])
    assert list(data.keys()) == list(dataset[2].keys())
