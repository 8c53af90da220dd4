"""The pyg-atompack command line, run as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import ase.io
import numpy as np
import pytest
from test_convert_ase import make_frames
from test_convert_diskdataset import build_disk_zip
from test_convert_memmap import hand_built


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyg_atompack.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def assert_bad_input(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pyg-atompack: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("command", [[], ["convert"], ["info"], ["verify"], ["shard"], ["head"]])
def test_help_everywhere(command):
    result = run(*command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: pyg-atompack")


@pytest.fixture()
def extxyz(tmp_path):
    path = tmp_path / "frames.extxyz"
    ase.io.write(path, make_frames(5))
    return path


def test_convert_info_verify_head_shard(extxyz, tmp_path):
    out = tmp_path / "frames.atp"
    result = run("convert", extxyz, out, "--compression", "zstd", "--level", "5")
    assert result.returncode == 0, result.stderr
    assert "wrote 5 structures" in result.stdout
    assert result.stderr == ""  # no progress bar when stderr is not a terminal

    info = run("info", out)
    assert info.returncode == 0, info.stderr
    assert "codec: zstd (level 5)" in info.stdout
    assert "structures: 5" in info.stdout
    assert "forces: float64[n,3] (per atom)" in info.stdout
    assert "properties/dipole: float64[3] (per structure)" in info.stdout

    verify = run("verify", out)
    assert verify.returncode == 0 and verify.stdout.startswith("OK"), verify.stdout

    head = run("head", out, "-n", "2")
    assert head.returncode == 0
    lines = head.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[0] ") and "energy=" in lines[0]

    shard = run("shard", out, tmp_path / "pt", "--shard-size", "2", "--quiet")
    assert shard.returncode == 0 and shard.stdout == ""
    manifest = json.loads((tmp_path / "pt" / "manifest.json").read_text())
    assert [s["records"] for s in manifest["shards"]] == [2, 2, 1]


def write_every_property_kind(path, first: int, count: int) -> None:
    """An .atp file written by the reference library with one property of each kind."""
    import atompack

    molecules = []
    for i in range(first, first + count):
        n = 2 + i % 2
        molecule = atompack.Molecule.from_arrays(
            np.zeros((n, 3), np.float32), np.full(n, 6, np.uint8), energy=float(i))
        molecule.set_property("label", f"mol{i}")
        molecule.set_property("nothing", None)
        molecule.set_property("step", i)
        molecule.set_property("temperature", 300.0 + i)
        molecule.set_property("dipole", np.arange(3, dtype=np.float64))
        molecule.set_property("polarisability", np.eye(2, dtype=np.float32))
        molecule.set_property("ragged", np.zeros((i + 1, 2), np.float64))
        molecule.set_property("spin", np.zeros(n, np.float32), scope="atom")
        molecule.set_property("multipole", np.zeros((n, 2, 2), np.float64), scope="atom")
        molecules.append(molecule)
    db = atompack.Database(str(path))
    db.add_molecules(molecules)
    db.flush()


def test_info_names_the_type_of_every_property_kind(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    # the ragged tensor is (1, 2) in the first shard and (2, 2) in the second: the shapes
    # of all shards are merged
    write_every_property_kind(shards / "a.atp", first=0, count=1)
    write_every_property_kind(shards / "b.atp", first=1, count=1)
    info = run("info", shards)
    assert info.returncode == 0, info.stderr
    fields = info.stdout.split("fields:\n", 1)[1].splitlines()
    assert sorted(line.strip() for line in fields) == sorted([
        "positions: float32[n,3] (per atom)",
        "atomic_numbers: uint8[n] (per atom)",
        "energy: float64 (per structure)",
        "properties/label: str (per structure)",
        "properties/nothing: None (per structure)",
        "properties/step: int64 (per structure)",
        "properties/temperature: float64 (per structure)",
        "properties/dipole: float64[3] (per structure)",
        "properties/polarisability: float32[2,2] (per structure)",
        "properties/ragged: float64[?,2] ragged (per structure)",
        "atom_properties/spin: float32[n] (per atom)",
        "atom_properties/multipole: float64[n,2,2] (per atom)",
    ])
    one_shard = run("info", shards / "a.atp")
    assert "properties/ragged: float64[1,2] (per structure)" in one_shard.stdout


def test_verify_reports_checksum_mismatch(extxyz, tmp_path):
    out = tmp_path / "shards"
    assert run("convert", extxyz, out, "--shard-size", "3", "-q").returncode == 0
    shard = out / "shard_00001.atp"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF  # inside the index block
    shard.write_bytes(bytes(data))
    result = run("verify", out)
    assert result.returncode == 1
    assert "FAIL" in result.stdout and "shard_00001.atp: sha256" in result.stdout


def test_memmap_convert_with_keys_and_units(tmp_path):
    _, arrays = hand_built(tmp_path / "mm")
    result = run("convert", tmp_path / "mm", tmp_path / "mm.atp", "--energy-key", "e",
                 "--forces-key", "f", "--key-map", "q=charges", "--energy-unit", "kcal/mol",
                 "--skip-target", "s")  # s.bin (a stress) is left out on purpose
    assert result.returncode == 0, result.stderr
    from pyg_atompack import atp

    with atp.open(tmp_path / "mm.atp") as reader:
        assert reader[0].energy == pytest.approx(float(arrays["e"][0, 0]) * 0.0433641042418)
        assert reader[0].charges is not None


def test_bad_unknown_extension(tmp_path):
    (tmp_path / "data.foo").write_text("x")
    assert_bad_input(run("convert", tmp_path / "data.foo", tmp_path / "o.atp"),
                     "data.foo", "unknown extension '.foo'")
    assert not (tmp_path / "o.atp").exists()


def test_bad_output_extension(extxyz, tmp_path):
    assert_bad_input(run("convert", extxyz, tmp_path / "out.bin"), "out.bin", "unknown extension")


def test_bad_directory(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "readme.txt").write_text("hi")
    assert_bad_input(run("convert", tmp_path / "stuff", tmp_path / "o.atp"),
                     "stuff", "neither a shard directory", "memmap")


def test_bad_memmap_sizes(tmp_path):
    hand_built(tmp_path / "mm")
    np.zeros(3, dtype=np.float32).tofile(tmp_path / "mm" / "x.bin")
    assert_bad_input(run("convert", tmp_path / "mm", tmp_path / "o.atp"),
                     "x.bin", "but na.npy/ns.npy imply")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mm"]


def test_bad_zip_missing_folder_and_missing_key(tmp_path):
    build_disk_zip(tmp_path / "holes.zip", count=3, skip=1)
    assert_bad_input(run("convert", tmp_path / "holes.zip", tmp_path / "o.atp"),
                     "holes.zip", "1/system.mta")
    build_disk_zip(tmp_path / "ok.zip", count=2)
    assert_bad_input(run("convert", tmp_path / "ok.zip", tmp_path / "o.atp",
                         "--energy-key", "nothere"), "ok.zip", "'nothere'", "not present")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["holes.zip", "ok.zip"]


def test_bad_key_in_extxyz_leaves_nothing(extxyz, tmp_path):
    assert_bad_input(run("convert", extxyz, tmp_path / "o.atp", "--stress-key", "virial"),
                     "frames.extxyz (structure 0)", "'virial'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames.extxyz"]


def test_bad_unit_and_missing_source(tmp_path):
    (tmp_path / "a.xyz").write_text("")
    assert_bad_input(run("convert", tmp_path / "a.xyz", tmp_path / "o.atp",
                         "--energy-unit", "erg"), "unknown energy unit 'erg'")
    assert_bad_input(run("info", tmp_path / "nothing.atp"), "nothing.atp", "no such file")
