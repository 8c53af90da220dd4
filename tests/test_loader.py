"""Tests of the batch-level path: `flat_to_batch` and `AtompackLoader`.

The reference for every batch is PyG's own collate
(`Batch.from_data_list` / `torch_geometric.loader.DataLoader`) over the
per-sample `Data` objects of the same records.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch, Data

from pyg_atompack import AtompackDataset, AtompackLoader
from pyg_atompack.pyg import (
    BatchAssemblyError,
    flat_to_batch,
    flat_to_data_list,
    record_to_data,
)

# --------------------------------------------------------------------------- helpers


def assert_same_value(left, right, where: str) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor), f"{where}: {type(right)} is not a tensor"
        assert left.dtype == right.dtype, f"{where}: dtype {left.dtype} != {right.dtype}"
        assert left.shape == right.shape, f"{where}: shape {left.shape} != {right.shape}"
        assert torch.equal(left, right), f"{where}: values differ"
    elif isinstance(left, dict):
        assert isinstance(right, dict) and left.keys() == right.keys(), where
        for key in left:
            assert_same_value(left[key], right[key], f"{where}[{key!r}]")
    else:
        assert left == right, f"{where}: {left!r} != {right!r}"


def assert_data_equal(left: Data, right: Data, where: str = "data") -> None:
    assert list(left.keys()) == list(right.keys()), f"{where}: keys differ"
    for key in left.keys():  # noqa: SIM118 (iterating a Data yields pairs)
        assert_same_value(left[key], right[key], f"{where}.{key}")


def assert_batches_equal(ours: Batch, reference: Batch) -> None:
    """Attribute by attribute, plus what get_example/to_data_list rely on."""
    assert type(ours).__name__ == type(reference).__name__
    assert_data_equal(ours, reference, "batch")
    assert ours.num_graphs == reference.num_graphs
    assert_same_value(ours._slice_dict, reference._slice_dict, "_slice_dict")
    assert ours._inc_dict.keys() == reference._inc_dict.keys()
    for key, incs in reference._inc_dict.items():
        assert_same_value(ours._inc_dict[key], incs, f"_inc_dict[{key!r}]")
    for index, (mine, theirs) in enumerate(zip(ours.to_data_list(), reference.to_data_list())):
        assert_data_equal(mine, theirs, f"to_data_list()[{index}]")


def make_record(rng: np.random.Generator, n_atoms: int, **overrides):
    record = SimpleNamespace(
        positions=rng.normal(size=(n_atoms, 3)).astype(np.float32),
        atomic_numbers=rng.integers(1, 90, size=n_atoms).astype(np.uint8),
        energy=float(rng.normal()),
        forces=rng.normal(size=(n_atoms, 3)).astype(np.float32),
        charges=rng.normal(size=n_atoms),
        velocities=None,
        cell=rng.normal(size=(3, 3)),
        stress=rng.normal(size=(3, 3)),
        pbc=np.array([True, False, True]),
        name=f"mol-{n_atoms}-ä",
        properties={
            "bandgap": float(rng.normal()),
            "spin": int(rng.integers(0, 3)),
            "desc": rng.normal(size=4).astype(np.float32),
            "tens": rng.normal(size=(2, 2)),
            "label": "x" * n_atoms,
            "energy": float(rng.normal()),  # collides with the builtin
        },
        atom_properties={
            "q": rng.normal(size=n_atoms).astype(np.float32),
            "mag": rng.normal(size=(n_atoms, 3)),
            "tag": rng.integers(0, 5, size=n_atoms).astype(np.int32),
        },
    )
    for key, value in overrides.items():
        setattr(record, key, value)
    return record


def flat_from_records(records) -> dict:
    """A flat batch built the obvious way (what `read_batch` documents)."""
    n_atoms = np.array([len(r.atomic_numbers) for r in records], dtype=np.int64)
    flat: dict = {
        "n_atoms": n_atoms,
        "positions": np.concatenate([r.positions for r in records]),
        "atomic_numbers": np.concatenate([r.atomic_numbers for r in records]),
        "mask": {},
    }
    per_atom = {"forces": 3, "charges": 0, "velocities": 3}
    for name in ("energy", "forces", "charges", "velocities", "cell", "stress", "pbc", "name"):
        values = [getattr(r, name) for r in records]
        if all(v is None for v in values):
            continue
        flat["mask"][name] = np.array([v is not None for v in values])
        if name == "name":
            flat[name] = values
        elif name in per_atom:
            width = (per_atom[name],) if per_atom[name] else ()
            kind = next(np.asarray(v).dtype for v in values if v is not None)
            flat[name] = np.concatenate([
                np.asarray(v) if v is not None else np.zeros((n,) + width, kind)
                for v, n in zip(values, n_atoms)
            ])
        else:
            example = np.asarray(next(v for v in values if v is not None))
            flat[name] = np.stack([np.asarray(v) if v is not None else np.zeros_like(example)
                                   for v in values])
    for scope, per in (("properties", False), ("atom_properties", True)):
        keys = sorted({k for r in records for k in getattr(r, scope)})
        columns = {}
        for key in keys:
            values = [getattr(r, scope).get(key) for r in records]
            flat["mask"][f"{scope}/{key}"] = np.array([v is not None for v in values])
            ragged = len({np.shape(v) for v in values}) > 1
            if not per and (ragged or any(isinstance(v, str) or v is None for v in values)):
                columns[key] = values
            elif per:
                columns[key] = np.concatenate([np.asarray(v) for v in values])
            else:
                columns[key] = np.stack([np.asarray(v) for v in values])
        flat[scope] = columns
    return flat


def reference_batch(records, **kwargs) -> Batch:
    return Batch.from_data_list([record_to_data(r) for r in records], **kwargs)


# --------------------------------------------------------------------------- flat_to_batch


@pytest.fixture()
def records():
    rng = np.random.default_rng(0)
    return [make_record(rng, n) for n in (3, 1, 7, 0, 5)]


def test_flat_to_batch_equals_pyg_collate(records):
    ours = flat_to_batch(flat_from_records(records))
    reference = reference_batch(records)
    assert_batches_equal(ours, reference)
    assert ours.z.dtype == torch.int64 and ours.pos.dtype == torch.float32
    assert ours.energy.shape == (5,) and ours.cell.shape == (5, 3, 3)
    assert ours.pbc.dtype == torch.bool and ours.pbc.shape == (5, 3)
    assert ours.prop_energy.shape == (5,) and ours.desc.shape == (5, 4)
    assert ours.name == [r.name for r in records]
    assert ours.ptr.tolist() == [0, 3, 4, 11, 11, 16]


def test_get_example_roundtrips_each_record(records):
    batch = flat_to_batch(flat_from_records(records))
    for index, record in enumerate(records):
        assert_data_equal(batch.get_example(index), record_to_data(record), f"example {index}")
    assert batch[2].natoms.tolist() == [7]


def test_follow_batch_and_exclude_keys(records):
    kwargs = {"follow_batch": ["forces", "energy", "name", "desc"],
              "exclude_keys": ["charges", "label", "stress"]}
    ours = flat_to_batch(flat_from_records(records), **kwargs)
    assert_batches_equal(ours, reference_batch(records, **kwargs))
    assert "charges" not in ours and "label" not in ours
    assert ours.forces_batch.tolist() == ours.batch.tolist()
    assert ours.energy_ptr.tolist() == [0, 1, 2, 3, 4, 5]


def test_dtype_casts_floating_fields_only(records):
    ours = flat_to_batch(flat_from_records(records), dtype=torch.float64)
    reference = Batch.from_data_list([record_to_data(r, dtype=torch.float64) for r in records])
    assert_batches_equal(ours, reference)
    assert ours.pos.dtype == torch.float64 and ours.q.dtype == torch.float64
    assert ours.tag.dtype == torch.int32 and ours.z.dtype == torch.int64
    assert ours.spin.dtype == torch.int64 and ours.pbc.dtype == torch.bool


def test_field_missing_in_every_molecule_is_absent(records):
    for record in records:
        record.forces = None
        record.properties.pop("spin")
    batch = flat_to_batch(flat_from_records(records))
    assert "forces" not in batch and "spin" not in batch
    assert_batches_equal(batch, reference_batch(records))


def test_field_missing_in_some_molecules_names_field_and_records(records):
    records[1].forces = None
    records[3].properties.pop("desc")
    flat = flat_from_records(records)
    with pytest.raises(BatchAssemblyError, match=r"'forces'.*record\(s\) 11\b"):
        flat_to_batch(flat, record_ids=[10, 11, 12, 13, 14])
    # excluding the sparse fields makes the batch valid again
    batch = flat_to_batch(flat, exclude_keys=["forces", "desc"])
    assert_batches_equal(batch, reference_batch(records, exclude_keys=["forces", "desc"]))


def test_ragged_property_is_a_clear_error(records):
    records[2].properties["tens"] = np.zeros((3, 2))
    flat = flat_from_records(records)
    assert isinstance(flat["properties"]["tens"], list)
    with pytest.raises(BatchAssemblyError, match="'tens'.*different shapes"):
        flat_to_batch(flat)


def test_pyg_special_attribute_names_follow_pyg(records):
    # PyG increments attributes named *index* by the node count and
    # concatenates them along the last dimension: stay equal to it.
    for record in records:
        n = len(record.atomic_numbers)
        record.atom_properties["site_index"] = np.arange(n, dtype=np.int64)
        record.properties["bond_index"] = np.zeros(2, dtype=np.int64)
    ours = flat_to_batch(flat_from_records(records))
    assert_batches_equal(ours, reference_batch(records))
    assert ours.site_index.tolist()[-5:] == [11, 12, 13, 14, 15]


def test_flat_to_data_list_matches_record_to_data(records):
    records[1].forces = None
    records[2].name = None
    for index, data in enumerate(flat_to_data_list(flat_from_records(records))):
        assert_data_equal(data, record_to_data(records[index]), f"molecule {index}")


def test_read_only_inputs_give_writable_tensors(records):
    flat = flat_from_records(records)
    for key in ("positions", "forces"):
        flat[key].setflags(write=False)
    batch = flat_to_batch(flat)
    batch.pos += 1.0  # must not touch (or crash on) the read-only source
    assert np.array_equal(flat["positions"] + 1.0, batch.pos.numpy())


def test_zero_molecules_is_an_error():
    flat = {"n_atoms": np.zeros(0, np.int64), "positions": np.zeros((0, 3), np.float32),
            "atomic_numbers": np.zeros(0, np.uint8)}
    with pytest.raises(BatchAssemblyError, match="zero molecules"):
        flat_to_batch(flat)


# --------------------------------------------------------------------------- AtompackLoader


GOLDEN_CASES = {
    # file: (batch size, keys PyG itself could not batch for that file)
    "append_reopen_zstd.atp": (4, []),
    "batch_canonical_lz4.atp": (3, []),
    "batch_v3_zstd.atp": (2, []),
    "builtins_none.atp": (2, []),
    "builtins_zstd19.atp": (5, []),
    "custom_props_none.atp": (2, ["p_ragged", "p_int"]),  # ragged tensor; p_int deleted in #2
    "custom_props_zstd.atp": (3, ["p_ragged", "p_int"]),
    "f64_positions.atp": (2, []),
    "legacy/v021_zstd.atp": (2, []),
    "legacy/v031_batch_lz4.atp": (3, []),
    "legacy_noschema.atp": (2, []),
    "rf3_f32pos.atp": (2, []),
    "sparse_builtins.atp": (3, ["forces", "charges", "velocities", "cell", "stress", "pbc",
                                "name"]),
    "zero_atoms.atp": (2, []),
    "sharded": (4, []),
}


def loaders(dataset, batch_size, **kwargs):
    from torch_geometric.loader import DataLoader

    return (AtompackLoader(dataset, batch_size=batch_size, **kwargs),
            DataLoader(dataset, batch_size=batch_size, **kwargs))


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_loader_equals_pyg_dataloader_on_golden_files(golden_dir, name):
    batch_size, unbatchable = GOLDEN_CASES[name]
    dataset = AtompackDataset(golden_dir / name)
    ours, reference = loaders(dataset, batch_size, exclude_keys=unbatchable)
    assert len(ours) == len(reference)
    count = 0
    for mine, theirs in zip(ours, reference, strict=True):
        assert_batches_equal(mine, theirs)
        count += mine.num_graphs
    assert count == len(dataset)


def test_loader_follow_batch_and_exclude_keys_on_custom_properties(golden_dir):
    dataset = AtompackDataset(golden_dir / "batch_canonical_lz4.atp")
    kwargs = {"follow_batch": ["mag", "desc", "label", "forces"],
              "exclude_keys": ["velocities", "tens", "q"]}
    ours, reference = loaders(dataset, 3, **kwargs)
    for mine, theirs in zip(ours, reference, strict=True):
        assert_batches_equal(mine, theirs)
        assert "q" not in mine and mine.mag_batch.shape == (mine.num_nodes,)


def test_loader_reports_fields_only_some_records_carry(golden_dir):
    dataset = AtompackDataset(golden_dir / "sparse_builtins.atp")
    with pytest.raises(BatchAssemblyError, match=r"record\(s\) 1 .*exclude_keys"):
        next(iter(AtompackLoader(dataset, batch_size=3)))
    geometry_only = AtompackDataset(golden_dir / "sparse_builtins.atp", fields=["energy"])
    batch = next(iter(AtompackLoader(geometry_only, batch_size=3)))
    assert batch.energy.shape == (3,) and "forces" not in batch


def test_excluded_fields_are_not_decoded(golden_dir):
    dataset = AtompackDataset(golden_dir / "custom_props_none.atp")
    loader = AtompackLoader(dataset, batch_size=3, exclude_keys=["p_ragged", "p_int"])
    read = loader.dataset.read_fields
    assert "properties/p_ragged" not in read and "properties/p_int" not in read
    assert "atom_properties/a_f32" in read


def test_loader_respects_dataset_subsets_and_pre_filter(golden_dir):
    base = AtompackDataset(golden_dir / "append_reopen_zstd.atp",
                           pre_filter=lambda data: float(data.energy) != 0.0)
    for dataset in (base, base[1:], base.index_select([4, 0, 2, 2]), base.shuffle()):
        ours, reference = loaders(dataset, 2)
        for mine, theirs in zip(ours, reference, strict=True):
            assert_batches_equal(mine, theirs)


def test_loader_shuffles_like_pyg_with_the_same_sampler(tmp_path):
    from pyg_atompack.pyg.resume import ResumableSampler

    dataset = AtompackDataset(_atompack_file(tmp_path / "shuffle.atp", 50))
    from torch_geometric.loader import DataLoader

    # shuffle=True samples through a ResumableSampler seeded with `seed`
    ours = AtompackLoader(dataset, batch_size=8, shuffle=True, drop_last=True, seed=5)
    reference = DataLoader(dataset, batch_size=8, drop_last=True,
                           sampler=ResumableSampler(dataset, seed=5, drop_last=True))
    for _ in range(2):  # both advance to a new permutation in the second epoch
        batches = list(zip(ours, reference, strict=True))
        assert len(batches) == 6
        for mine, theirs in batches:
            assert_batches_equal(mine, theirs)
    assert sorted(e for b, _ in batches for e in b.energy.tolist()) != [
        float(i) for i in range(48)]
    # without a seed, one is drawn from the generator: the same generator, the same order
    orders = [[b.energy.tolist() for b in AtompackLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))]
        for _ in range(2)]
    assert orders[0] == orders[1]


def test_loader_falls_back_to_per_sample_path_with_a_transform(golden_dir):
    def center(data: Data) -> Data:
        data.pos = data.pos - data.pos.mean(dim=0, keepdim=True)
        return data

    dataset = AtompackDataset(golden_dir / "builtins_zstd.atp", transform=center)
    ours, reference = loaders(dataset, 2)
    for mine, theirs in zip(ours, reference, strict=True):
        assert_batches_equal(mine, theirs)
    assert torch.allclose(mine.pos.mean(dim=0), torch.zeros(3), atol=1e-5)


def _atompack_file(path, count: int):
    import atompack

    rng = np.random.default_rng(11)
    db = atompack.Database(str(path), compression="lz4", overwrite=True)
    db.add_molecules([
        atompack.Molecule.from_arrays(
            rng.normal(size=(2 + i % 7, 3)).astype(np.float32),
            rng.integers(1, 50, 2 + i % 7).astype(np.uint8), energy=float(i),
            forces=rng.normal(size=(2 + i % 7, 3)).astype(np.float32))
        for i in range(count)
    ])
    db.flush()
    return path


def test_loader_with_workers_and_distributed_sampler(tmp_path):
    from torch.utils.data import DistributedSampler

    dataset = AtompackDataset(_atompack_file(tmp_path / "dist.atp", 45))
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=1)
        ours, reference = loaders(dataset, 4, sampler=sampler, num_workers=2)
        for mine, theirs in zip(ours, reference, strict=True):
            assert_batches_equal(mine, theirs)
            seen += mine.energy.tolist()
    assert sorted(seen) == [float(i) for i in range(45)]


def test_batches_from_workers_leave_them_packed_in_one_buffer(tmp_path):
    """Both loaders' batches cross from a worker as one buffer (pyg.handoff): one
    shared-memory round trip a batch instead of one per tensor; equal to those made in
    the main process, where nothing is registered."""
    from multiprocessing.reduction import ForkingPickler

    dataset = AtompackDataset(_atompack_file(tmp_path / "w.atp", 40))
    for in_process, in_workers in zip(loaders(dataset, 8), loaders(dataset, 8, num_workers=2),
                                      strict=True):
        for mine, theirs in zip(in_workers, in_process, strict=True):
            assert_batches_equal(mine, theirs)
            tensors = [value for _, value in mine if isinstance(value, torch.Tensor)]
            assert len({t.untyped_storage().data_ptr() for t in tensors if t.numel()}) == 1
            assert len({t.untyped_storage().data_ptr() for t in theirs.to_dict().values()
                        if isinstance(t, torch.Tensor) and t.numel()}) > 1
    assert Data not in ForkingPickler._extra_reducers  # the main process pickles as before


def test_loader_arguments_are_checked(golden_dir):
    dataset = AtompackDataset(golden_dir / "builtins_none.atp")
    with pytest.raises(ValueError, match="mutually exclusive"):
        AtompackLoader(dataset, batch_size=2, shuffle=True, sampler=range(5))
    with pytest.raises(TypeError, match="collate_fn"):
        AtompackLoader(dataset, collate_fn=list)
    with pytest.raises(TypeError, match="AtompackDataset"):
        AtompackLoader([Data()], batch_size=1)
    loader = AtompackLoader(dataset, batch_size=2, drop_last=True)
    assert len(loader) == 2 and "batch_size=2" in repr(loader)


def test_loader_reads_only_selected_fields(golden_dir):
    dataset = AtompackDataset(golden_dir / "builtins_zstd.atp", fields=["pos", "z"])
    loader = AtompackLoader(dataset, batch_size=5)
    assert loader.dataset.read_fields == ("atomic_numbers", "positions")
    batch = next(iter(loader))
    assert set(batch.keys()) == {"z", "pos", "natoms", "batch", "ptr"}
