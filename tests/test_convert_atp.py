"""extxyz -> .atp -> AtompackDataset round trips, sharded .atp output, .atp as a source."""

from __future__ import annotations

import json

import ase.io
import numpy as np
import pytest
import torch
from test_convert_ase import make_frames

from pyg_atompack import AtompackDataset, atp
from pyg_atompack.convert import (
    ConvertError,
    ReadOptions,
    WriteOptions,
    check_manifest,
    convert,
    open_reader,
)
from pyg_atompack.convert.shards import sha256_of


@pytest.fixture()
def extxyz(tmp_path):
    path = tmp_path / "frames.extxyz"
    ase.io.write(path, make_frames(6))
    return path, list(ase.io.iread(path, index=":"))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_extxyz_to_atp_to_dataset_every_value(extxyz, tmp_path, compression):
    path, frames = extxyz
    out = tmp_path / "frames.atp"
    convert(path, out, write_options=WriteOptions(compression=compression))
    dataset = AtompackDataset(out)
    assert len(dataset) == len(frames)
    for data, atoms in zip(dataset, frames):
        def same(tensor, array):
            assert torch.equal(tensor, torch.as_tensor(np.asarray(array)).to(tensor.dtype))
            assert tensor.dtype in (torch.float64, torch.int64, torch.bool)

        same(data.pos, atoms.positions)
        same(data.z, atoms.numbers)
        same(data.cell[0], atoms.cell.array)
        assert data.pbc[0].tolist() == atoms.pbc.tolist()
        assert data.energy.item() == atoms.get_potential_energy()
        same(data.forces, atoms.get_forces())
        same(data.stress[0], atoms.get_stress(voigt=False))
        assert data.REF_energy.item() == atoms.info["REF_energy"]
        assert data.step.item() == atoms.info["step"]
        assert data.label == atoms.info["label"]
        same(data.dipole[0], atoms.calc.results["dipole"])
        same(data.spin, atoms.arrays["spin"])
        same(data.REF_forces, atoms.arrays["REF_forces"])


def test_sharded_atp_output_with_manifest(extxyz, tmp_path):
    path, frames = extxyz
    out = tmp_path / "shards"
    convert(path, out, write_options=WriteOptions(shard_size=4, compression="lz4"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "pyg_atompack-shards/1"
    assert [(s["name"], s["records"]) for s in manifest["shards"]] == [
        ("shard_00000.atp", 4), ("shard_00001.atp", 2)]
    for entry in manifest["shards"]:
        assert entry["bytes"] == (out / entry["name"]).stat().st_size
        assert entry["sha256"] == sha256_of(out / entry["name"])
    assert manifest["total_records"] == 6
    assert check_manifest(out) == []
    with atp.open(out) as reader:
        assert len(reader) == 6
        assert reader[5].energy == frames[5].get_potential_energy()


def test_atp_source_with_promoted_keys(extxyz, tmp_path):
    path, frames = extxyz
    convert(path, tmp_path / "a.atp")
    options = ReadOptions(energy_key="REF_energy", key_map={"step": "md_step"})
    structures = list(open_reader(tmp_path / "a.atp", options=options))
    for structure, atoms in zip(structures, frames):
        assert structure.energy == atoms.info["REF_energy"]
        assert structure.properties["md_step"] == atoms.info["step"]
    with pytest.raises(ConvertError, match=r"a\.atp \(structure 0\): key 'absent'"):
        list(open_reader(tmp_path / "a.atp", options=ReadOptions(stress_key="absent")))


def test_failed_conversion_leaves_no_output(tmp_path):
    from test_convert_memmap import hand_built

    hand_built(tmp_path / "mm")
    types = np.fromfile(tmp_path / "mm" / "a.bin", dtype=np.int32)
    types[-1] = 300  # not representable in .atp's uint8 atomic numbers
    types.tofile(tmp_path / "mm" / "a.bin")
    options = ReadOptions(energy_key="e", forces_key="f", stress_key="s",
                          key_map={"q": "charges"})
    with pytest.raises(ConvertError, match=r"out\.atp \(structure 3\).*0\.\.255"):
        convert(tmp_path / "mm", tmp_path / "out.atp", read_options=options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mm"]


def test_existing_destination_needs_overwrite(extxyz, tmp_path):
    path, _ = extxyz
    convert(path, tmp_path / "a.atp")
    with pytest.raises(ConvertError, match="already exists"):
        convert(path, tmp_path / "a.atp")
    assert convert(path, tmp_path / "a.atp", write_options=WriteOptions(overwrite=True)) == 6
